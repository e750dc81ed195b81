"""One call: decode over this rank's share of the KV cache, then merge over the group."""

from __future__ import annotations

from typing import Any, Literal, Unpack, overload

import torch

import msa.api
from msa.api import DecodeOptions
from msa.distributed.agreement import Fact, agree, dims, dtype_code, name_code
from msa.distributed.checks import check_coverage, check_outputs_apart, run_checked, shard_usage
from msa.distributed.exchange import METHODS, Exchange, check_method
from msa.distributed.group import GroupInfo, ProcessGroup, group_info
from msa.errors import check_flag, is_int
from msa.layouts import KVCache
from msa.validation import check_decode_inputs, check_dims, output_dtype, validation_requested

__all__ = ["sparse_decode"]


@overload
def sparse_decode(
    q: torch.Tensor, kv_cache: KVCache, topk_indices: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    *, group: ProcessGroup | None = ..., method: str | None = ..., scatter_heads: bool = ...,
    reduce_dtype: torch.dtype | None = ..., lse: None = ..., return_lse: Literal[False] = ...,
    **options: Unpack[DecodeOptions],
) -> torch.Tensor: ...


@overload
def sparse_decode(
    q: torch.Tensor, kv_cache: KVCache, topk_indices: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    *, group: ProcessGroup | None = ..., method: str | None = ..., scatter_heads: bool = ...,
    reduce_dtype: torch.dtype | None = ..., lse: torch.Tensor, return_lse: bool = ..., **options: Unpack[DecodeOptions],
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def sparse_decode(
    q: torch.Tensor, kv_cache: KVCache, topk_indices: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    *, group: ProcessGroup | None = ..., method: str | None = ..., scatter_heads: bool = ...,
    reduce_dtype: torch.dtype | None = ..., lse: torch.Tensor | None = ..., return_lse: Literal[True],
    **options: Unpack[DecodeOptions],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def sparse_decode(
    q: torch.Tensor,
    kv_cache: KVCache,
    topk_indices: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    group: ProcessGroup | None = None,
    method: str | None = None,
    scatter_heads: bool = False,
    reduce_dtype: torch.dtype | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    **options: Unpack[DecodeOptions],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`msa.sparse_decode` over a KV cache spread across the ranks of `group`.

    Each rank passes its own cache and its rank-local `block_table` (`-1` for the blocks other
    ranks hold: see `msa.distributed.rank_local_block_table` and `shard_cache`), and the same
    global `q`, `topk_indices`, `seq_lens` and `query_start_loc` as every other rank. The rank
    decodes the selected blocks it holds with `return_lse=True`, then the partial results are
    merged exactly over the group. A collective: every rank calls it, with the same shapes.

    Args:
        q, kv_cache, topk_indices, block_table, seq_lens, decode_query_len, kv_cache_dtype,
            sm_scale, q_scale, k_scale, v_scale, backend, query_start_loc: as for
            `msa.sparse_decode` (cache and table rank-local, the rest global).
        group: the process group (None: the default group).
        method: how to merge (see `merge_partials` / `merge_partials_scattered`); default
            "all_gather", or "reduce_scatter" with `scatter_heads`.
        scatter_heads: return only this rank's `Hq / W` heads (rank `r` gets heads
            `r*Hq/W .. (r+1)*Hq/W - 1`); `out`/`lse` then have `Hq / W` heads.
        reduce_dtype: dtype of the summed partials for "reduce_scatter" / "all_reduce" (default
            fp32; bf16/fp16 halve those bytes at one rounding per rank).
        out: optional `[B*L, Hq, D]` (`[B*L, Hq/W, D]` when scattering) output.
        lse: optional fp32 `[B*L, Hq]` (or `Hq/W`) output for the merged natural-log LSE.
        return_lse: also return the merged LSE (-inf for rows that attend nothing anywhere).
        validate: the deep checks (also on with `MSA_VALIDATE=1`; pass the same on every
            rank): msa's checks of this rank's inputs with `-1` table entries read as "held by
            another rank", block tables of the same shape on every rank, and every used block
            (selected by a row that sees it) held by exactly one rank (see
            `msa.distributed.checks`).

    Returns:
        `out`, or `(out, lse)` when `return_lse` (or `lse=`) is given.

    Raises:
        MSAInputError, MSAUnsupportedError: on every rank alike. Each rank checks its arguments
            and decodes its share, then the group agrees (`msa.distributed.agreement`: one
            all-gather of a few int64 per rank, read on the host) before the merge: a rank whose
            checks failed raises its own error, the others an error naming that rank and its
            message; shapes that differ between ranks (rows, heads, dtype, method; the tables
            when validating) raise on every rank. Inside CUDA-graph capture there is no
            agreement (no host reads): an error is raised on its rank only.
    """
    info = group_info(group)  # the same on every rank, or no group to agree in
    validate = options.get("validate", False)
    validating = isinstance(validate, bool) and validation_requested(validate)
    facts = _facts(q, block_table, seq_lens, options.get("decode_query_len", 1), method, scatter_heads, reduce_dtype,
                   validating, options.get("query_start_loc"))
    step: tuple[Exchange, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
    error: Exception | None = None
    try:  # this rank's checks and its local decode: any error is agreed on before the merge
        step = _local_step(info, q, kv_cache, topk_indices, block_table, seq_lens, method=method,
                           scatter_heads=scatter_heads, reduce_dtype=reduce_dtype, lse=lse, return_lse=return_lse,
                           validating=validating, options=options)
    except Exception as exc:  # noqa: BLE001 - raised below, on every rank alike
        error = exc
    agree(info, "msa.distributed.sparse_decode", facts, error, q.device if isinstance(q, torch.Tensor) else None)
    assert step is not None
    exchange, out_t, lse_t, usage = step
    if usage is not None:
        check_coverage(info, usage)
    exchange.merge(out_t, lse_t)
    if lse_t is not None:
        return out_t, lse_t
    return out_t


def _facts(q: object, block_table: object, seq_lens: object, decode_query_len: object, method: object,
           scatter_heads: object, reduce_dtype: object, validating: bool, query_start_loc: object) -> list[Fact]:
    """What every rank must pass alike: what the merge's buffers (and, validating, the coverage
    check's) are shaped by. Computed without raising (the local checks report bad arguments)."""
    scatter = scatter_heads is True
    chosen = method if method is not None else ("reduce_scatter" if scatter else "all_gather")
    rows, heads, dim = dims(q, 3)
    facts = [
        Fact("method", "merge method", *name_code(chosen, METHODS)),
        Fact("scatter_heads", "scatter_heads", int(scatter)),
        Fact("reduce_dtype", "reduce_dtype", *dtype_code(reduce_dtype)),
        Fact("validate", "validate (or MSA_VALIDATE)", int(validating)),
        Fact("q", "row count", rows),
        Fact("q", "head count", heads),
        Fact("q", "head dim", dim),
        Fact("q", "dtype", *dtype_code(q)) if isinstance(q, torch.Tensor) else Fact("q", "dtype", -1),
    ]
    if validating:  # the coverage check all-reduces [2, B, max_blocks]
        batch, width = dims(block_table, 2)
        facts += [
            Fact("seq_lens", "batch size", dims(seq_lens, 1)[0]),
            Fact("block_table", "row count B", batch),
            Fact("block_table", "width max_blocks (validate compares the tables block by block)", width),
            Fact("decode_query_len", "decode_query_len",
                 decode_query_len if is_int(decode_query_len)
                 else -1),
            Fact("query_start_loc", "presence of query_start_loc", int(query_start_loc is not None)),
        ]
    return facts



def _local_step(
    info: GroupInfo,
    q: torch.Tensor,
    kv_cache: KVCache,
    topk_indices: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    method: str | None,
    scatter_heads: bool,
    reduce_dtype: torch.dtype | None,
    lse: torch.Tensor | None,
    return_lse: bool,
    validating: bool,
    options: DecodeOptions,
) -> tuple[Exchange, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """This rank's part of the step, before any collective: every check of its arguments, and
    its local decode into the exchange's buffers. Returns the exchange, the outputs, and (when
    validating) this rank's block usage for the coverage check."""
    check_flag("scatter_heads", scatter_heads)
    check_flag("return_lse", return_lse)
    check_flag("validate", options.get("validate", False))
    out = options.get("out")
    chosen = check_method(method if method is not None else ("reduce_scatter" if scatter_heads else "all_gather"),
                          scatter_heads)
    rows, heads, dim = check_dims("q", q, 3, "a 3-D tensor [B*L, Hq, D]").shape
    exchange = Exchange(
        info, rows=rows, heads=heads, head_dim=dim, dtype=output_dtype(q.dtype), device=q.device, method=chosen,
        scatter_heads=scatter_heads, reduce_dtype=reduce_dtype, heads_from="q / method",
    )
    shape = (rows, exchange.out_heads, dim)
    out_t = out if out is not None else torch.empty(shape, dtype=exchange.dtype, device=q.device)
    lse_t = lse
    if lse_t is None and return_lse:
        lse_t = torch.empty(shape[:2], dtype=torch.float32, device=q.device)
    exchange.check_outputs(out_t, lse_t)
    check_outputs_apart(out_t, lse_t, (
        ("q", q), ("kv_cache", kv_cache), ("topk_indices", topk_indices), ("block_table", block_table),
        ("seq_lens", seq_lens), *((name, options.get(name)) for name in ("query_start_loc", "sm_scale", "q_scale",
                                                                         "k_scale", "v_scale")),
    ))
    local: DecodeOptions = {**options, "out": exchange.local_out}  # this rank's partial: the exchange's buffers
    usage = None
    if validating:
        # msa's single-GPU deep checks would reject the -1 entries of the rank-local table
        backend = local.pop("backend", "auto")
        local.pop("validate", None)
        checks: dict[str, Any] = dict(local)  # the options check_decode_inputs takes: all but the two above
        problem, inputs = check_decode_inputs(q, kv_cache, topk_indices, block_table, seq_lens, **checks,
                                              lse=exchange.local_lse, dcp_size=info.world_size)
        usage = shard_usage(problem, inputs, decode_query_len=options.get("decode_query_len", 1),
                            kv_cache_dtype=options.get("kv_cache_dtype"))
        run_checked(problem, inputs, backend, exchange.local_out, exchange.local_lse)
    else:
        msa.api.sparse_decode(q, kv_cache, topk_indices, block_table, seq_lens, **local, lse=exchange.local_lse,
                              dcp_size=info.world_size)
    return exchange, out_t, lse_t, usage
