"""Merging partial decode results over a process group (one-shot forms).

Every rank holds a partial result — out `[T, Hq, D]` over the tokens it holds and their
natural-log LSE `[T, Hq]` — for the same rows and heads. The merged result is exact
(`msa.distributed.combine_partials` says how). These functions allocate their communication
buffers per call; `msa.distributed.DistributedDecodePlanner` keeps them per step shape for
CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from msa.distributed.combine import combine_partials
from msa.distributed.exchange import Exchange, check_method
from msa.distributed.group import GroupInfo, ProcessGroup, group_info
from msa.errors import MSAInputError

__all__ = ["combine_partials", "merge_partials", "merge_partials_scattered", "check_same_shapes"]


def _check_partials(out: object, lse: object) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        given = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise MSAInputError("out", "a tensor [T, Hq, D] (this rank's partial output)", given)
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(out.shape[:2]):
        given = f"shape {tuple(lse.shape)}" if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise MSAInputError("lse", f"a tensor of shape {tuple(out.shape[:2])} ([T, Hq] of out)", given)
    if not lse.is_floating_point():
        raise MSAInputError("lse", "a float tensor (float32: the natural-log LSE)", lse.dtype)
    if lse.device != out.device:
        raise MSAInputError("lse", f"a tensor on {out.device} (the device of out)", lse.device)
    return out, lse


def check_same_shapes(info: GroupInfo, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Every rank of the group passes the same `shape` and `dtype` (a collective that reads the
    host: for `validate=True` only). `MSAInputError` on every rank otherwise."""
    mine = (tuple(shape), str(dtype))
    seen: list[object] = [None] * info.world_size
    dist.all_gather_object(seen, mine, group=info.group)
    if any(s != mine for s in seen):
        raise MSAInputError("out", "the same shape and dtype on every rank of the group", f"{seen} (by rank)")


def _merge(out: object, lse: object, group: ProcessGroup | None, method: str, scatter_heads: bool,
           reduce_dtype: torch.dtype | None, validate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    part, part_lse = _check_partials(out, lse)
    check_method(method, scatter_heads)
    info = group_info(group)
    if validate:
        check_same_shapes(info, tuple(part.shape), part.dtype)
    rows, heads, dim = part.shape
    exchange = Exchange(
        info, rows=rows, heads=heads, head_dim=dim, dtype=part.dtype, device=part.device, method=method,
        scatter_heads=scatter_heads, reduce_dtype=reduce_dtype,
    )
    exchange.local_out.copy_(part)
    exchange.local_lse.copy_(part_lse)
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
        validate: first check that every rank passes the same shapes (a host round trip).

    Returns:
        `(out, lse)`: `[T, Hq, D]` in `out`'s dtype and fp32 `[T, Hq]`, the same on every rank.
        Rows that attend nothing on every rank give 0 and -inf (never NaN); a rank whose share
        of a row is empty (`lse = -inf`) contributes nothing to it.

    Raises:
        MSAInputError: bad shapes, an unknown method, `Hq % W != 0` for "all_to_all", or
            torch.distributed not initialised.
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
        validate: first check that every rank passes the same shapes.

    Returns:
        `(out, lse)`: `[T, Hq/W, D]` and fp32 `[T, Hq/W]`: this rank's heads.

    Raises:
        MSAInputError: `Hq` not divisible by the group size, bad shapes, an unknown method.
    """
    return _merge(out, lse, group, method, True, reduce_dtype, validate)
