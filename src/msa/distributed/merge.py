"""Merging partial decode results over a process group (one-shot forms).

Every rank holds a partial result — out `[T, Hq, D]` over the tokens it holds and their
natural-log LSE `[T, Hq]` — for the same rows and heads. The merged result is exact
(`msa.distributed.combine_partials` says how). These functions allocate their communication
buffers per call; `msa.distributed.DistributedDecodePlanner` keeps them per step shape for
CUDA graphs.
"""

from __future__ import annotations

import torch

from msa.distributed.agreement import Fact, agree, dims, dtype_code, name_code
from msa.distributed.combine import combine_partials
from msa.distributed.exchange import METHODS, Exchange, check_method
from msa.distributed.group import ProcessGroup, group_info
from msa.errors import MSAInputError, check_flag
from msa.validation import check_dims

__all__ = ["combine_partials", "merge_partials", "merge_partials_scattered"]


def _check_partials(out: object, lse: object) -> tuple[torch.Tensor, torch.Tensor]:
    out = check_dims("out", out, 3, "a tensor [T, Hq, D] (this rank's partial output)")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(out.shape[:2]):
        given = f"shape {tuple(lse.shape)}" if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise MSAInputError("lse", f"a tensor of shape {tuple(out.shape[:2])} ([T, Hq] of out)", given)
    if not lse.is_floating_point():
        raise MSAInputError("lse", "a float tensor (float32: the natural-log LSE)", lse.dtype)
    if lse.device != out.device:
        raise MSAInputError("lse", f"a tensor on {out.device} (the device of out)", lse.device)
    return out, lse


def _merge(out: object, lse: object, group: ProcessGroup | None, method: str, scatter_heads: bool,
           reduce_dtype: torch.dtype | None, validate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    info = group_info(group)  # the same on every rank, or no group to agree in
    rows, heads, dim = dims(out, 3)
    facts = [
        Fact("method", "merge method", *name_code(method, METHODS)),
        Fact("reduce_dtype", "reduce_dtype", *dtype_code(reduce_dtype)),
        Fact("out", "row count", rows),
        Fact("out", "head count", heads),
        Fact("out", "head dim", dim),
        Fact("out", "dtype", *dtype_code(out)) if isinstance(out, torch.Tensor) else Fact("out", "dtype", -1),
    ]
    prepared: tuple[Exchange, torch.Tensor] | None = None
    error: Exception | None = None
    try:  # this rank's checks: any error is agreed on before the merge's collectives
        check_flag("validate", validate)
        part, part_lse = _check_partials(out, lse)
        check_method(method, scatter_heads)
        exchange = Exchange(
            info, rows=rows, heads=heads, head_dim=dim, dtype=part.dtype, device=part.device, method=method,
            scatter_heads=scatter_heads, reduce_dtype=reduce_dtype,
        )
        exchange.local_out.copy_(part)
        exchange.local_lse.copy_(part_lse)
        prepared = exchange, part
    except Exception as exc:  # noqa: BLE001 - raised below, on every rank alike
        error = exc
    call = "merge_partials_scattered" if scatter_heads else "merge_partials"
    agree(info, call, facts, error, out.device if isinstance(out, torch.Tensor) else None)
    assert prepared is not None
    exchange, part = prepared
    merged = torch.empty((rows, exchange.out_heads, dim), dtype=part.dtype, device=part.device)
    merged_lse = torch.empty((rows, exchange.out_heads), dtype=torch.float32, device=part.device)
    exchange.merge(merged, merged_lse)
    return merged, merged_lse



def merge_partials(
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    group: ProcessGroup | None = None,
    method: str = "all_gather",
    reduce_dtype: torch.dtype | None = None,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every rank's partial result; every rank gets the whole result.

    A collective: every rank of `group` calls it with the same shapes, in the same order as its
    other collectives.

    Args:
        out: `[T, Hq, D]` this rank's partial output (bf16, fp16 or fp32).
        lse: `[T, Hq]` its natural-log LSE (-inf for rows this rank's share does not reach).
        group: the process group (None: the default group). gloo for CPU tensors, NCCL for CUDA.
        method: "all_gather" (one collective; default), "all_to_all" (all-to-all of head chunks,
            then an all-gather of the combined heads; needs `Hq % W == 0`) or "all_reduce"
            (all-gather of LSEs, local correction, all-reduce). See docs/distributed.md.
        reduce_dtype: dtype of the all-reduce of "all_reduce" (default fp32).
        validate: kept for compatibility: every call checks that every rank passes the same
            shapes (see Raises).

    Returns:
        `(out, lse)`: `[T, Hq, D]` in `out`'s dtype and fp32 `[T, Hq]`, the same on every rank.
        Rows that attend nothing on every rank give 0 and -inf (never NaN); a rank whose share
        of a row is empty (`lse = -inf`) contributes nothing to it.

    Raises:
        MSAInputError: bad shapes, an unknown method, `Hq % W != 0` for "all_to_all", shapes
            that differ between ranks, or torch.distributed not initialised. On every rank
            alike: the group agrees on each rank's checks first (one all-gather of a few int64
            per rank, read on the host; none inside CUDA-graph capture), and a rank whose checks
            failed raises its own error, the others one naming that rank.
    """
    return _merge(out, lse, group, method, False, reduce_dtype, validate)


def merge_partials_scattered(
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    group: ProcessGroup | None = None,
    method: str = "reduce_scatter",
    reduce_dtype: torch.dtype | None = None,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every rank's partial result; rank `r` gets heads `r*Hq/W .. (r+1)*Hq/W - 1`.

    The form engines use with tensor parallelism: the query of the whole DCP group's heads is
    attended on every rank over its KV share, and each rank keeps its own heads of the result.

    Args:
        out: `[T, Hq, D]` this rank's partial output, all `Hq` heads.
        lse: `[T, Hq]` its natural-log LSE.
        group: the process group (None: the default group).
        method: "reduce_scatter" (all-gather of LSEs, local correction, reduce-scatter: vLLM's
            default; default here), "all_to_all" (one all-to-all of head chunks) or "all_gather".
        reduce_dtype: dtype of the reduce-scatter (default fp32, exact to the partials'
            rounding; `out`'s dtype halves the bytes, as vLLM does, at one rounding per rank).
        validate: kept for compatibility: every call checks that every rank passes the same
            shapes.

    Returns:
        `(out, lse)`: `[T, Hq/W, D]` and fp32 `[T, Hq/W]`: this rank's heads.

    Raises:
        MSAInputError: `Hq` not divisible by the group size, bad shapes, an unknown method,
            shapes that differ between ranks; on every rank alike (see `merge_partials`).
    """
    return _merge(out, lse, group, method, True, reduce_dtype, validate)
