"""One call: decode over this rank's share of the KV cache, then merge over the group."""

from __future__ import annotations

from typing import Literal, overload

import torch

import msa.api
from msa.distributed.checks import check_shard, run_checked
from msa.distributed.exchange import Exchange, check_method
from msa.distributed.group import ProcessGroup, group_info
from msa.distributed.merge import check_same_shapes
from msa.errors import MSAInputError
from msa.layouts import KVCache
from msa.scales import Scale
from msa.validation import check_decode_inputs, check_flag, output_dtype, validation_requested

__all__ = ["sparse_decode"]


@overload
def sparse_decode(
    q: torch.Tensor,
    kv_cache: KVCache,
    topk_indices: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    decode_query_len: int,
    group: ProcessGroup | None = ...,
    method: str | None = ...,
    scatter_heads: bool = ...,
    reduce_dtype: torch.dtype | None = ...,
    kv_cache_dtype: str | None = ...,
    sm_scale: Scale | None = ...,
    q_scale: Scale = ...,
    k_scale: Scale = ...,
    v_scale: Scale = ...,
    out: torch.Tensor | None = ...,
    lse: None = ...,
    return_lse: Literal[False] = ...,
    backend: str = ...,
    validate: bool = ...,
    query_start_loc: torch.Tensor | None = ...,
) -> torch.Tensor: ...


@overload
def sparse_decode(
    q: torch.Tensor,
    kv_cache: KVCache,
    topk_indices: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    decode_query_len: int,
    group: ProcessGroup | None = ...,
    method: str | None = ...,
    scatter_heads: bool = ...,
    reduce_dtype: torch.dtype | None = ...,
    kv_cache_dtype: str | None = ...,
    sm_scale: Scale | None = ...,
    q_scale: Scale = ...,
    k_scale: Scale = ...,
    v_scale: Scale = ...,
    out: torch.Tensor | None = ...,
    lse: torch.Tensor,
    return_lse: bool = ...,
    backend: str = ...,
    validate: bool = ...,
    query_start_loc: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def sparse_decode(
    q: torch.Tensor,
    kv_cache: KVCache,
    topk_indices: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    decode_query_len: int,
    group: ProcessGroup | None = ...,
    method: str | None = ...,
    scatter_heads: bool = ...,
    reduce_dtype: torch.dtype | None = ...,
    kv_cache_dtype: str | None = ...,
    sm_scale: Scale | None = ...,
    q_scale: Scale = ...,
    k_scale: Scale = ...,
    v_scale: Scale = ...,
    out: torch.Tensor | None = ...,
    lse: torch.Tensor | None = ...,
    return_lse: Literal[True],
    backend: str = ...,
    validate: bool = ...,
    query_start_loc: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def sparse_decode(
    q: torch.Tensor,
    kv_cache: KVCache,
    topk_indices: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    decode_query_len: int,
    group: ProcessGroup | None = None,
    method: str | None = None,
    scatter_heads: bool = False,
    reduce_dtype: torch.dtype | None = None,
    kv_cache_dtype: str | None = None,
    sm_scale: Scale | None = None,
    q_scale: Scale = 1.0,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    validate: bool = False,
    query_start_loc: torch.Tensor | None = None,
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
        validate: the deep checks (also on with `MSA_VALIDATE=1`; on every rank alike: they
            make collectives): msa's checks of this rank's inputs with `-1` table entries read
            as "held by another rank", every rank passing the same shapes, and every selected
            visible block held by exactly one rank (see `msa.distributed.checks`).

    Returns:
        `out`, or `(out, lse)` when `return_lse` (or `lse=`) is given.
    """
    check_flag("scatter_heads", scatter_heads)
    check_flag("return_lse", return_lse)
    check_flag("validate", validate)
    chosen = check_method(method if method is not None else ("reduce_scatter" if scatter_heads else "all_gather"),
                          scatter_heads)
    info = group_info(group)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        given = f"shape {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise MSAInputError("q", "a 3-D tensor [B*L, Hq, D]", given)
    rows, heads, dim = q.shape
    exchange = Exchange(
        info, rows=rows, heads=heads, head_dim=dim, dtype=output_dtype(q.dtype), device=q.device, method=chosen,
        scatter_heads=scatter_heads, reduce_dtype=reduce_dtype,
    )
    shape = (rows, exchange.out_heads, dim)
    out_t = out if out is not None else torch.empty(shape, dtype=exchange.dtype, device=q.device)
    lse_t = lse
    if lse_t is None and return_lse:
        lse_t = torch.empty(shape[:2], dtype=torch.float32, device=q.device)
    exchange.check_outputs(out_t, lse_t)  # before the local decode: every rank fails alike
    if validation_requested(validate):
        # msa's single-GPU deep checks would reject the -1 entries of the rank-local table
        check_same_shapes(info, tuple(q.shape), q.dtype)
        problem, inputs = check_decode_inputs(
            q, kv_cache, topk_indices, block_table, seq_lens, decode_query_len=decode_query_len,
            kv_cache_dtype=kv_cache_dtype, sm_scale=sm_scale, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
            out=exchange.local_out, lse=exchange.local_lse, query_start_loc=query_start_loc,
        )
        check_shard(info, problem, inputs, decode_query_len=decode_query_len, kv_cache_dtype=kv_cache_dtype)
        run_checked(problem, inputs, backend, exchange.local_out, exchange.local_lse)
    else:
        msa.api.sparse_decode(
            q, kv_cache, topk_indices, block_table, seq_lens, decode_query_len=decode_query_len,
            kv_cache_dtype=kv_cache_dtype, sm_scale=sm_scale, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
            out=exchange.local_out, lse=exchange.local_lse, backend=backend, query_start_loc=query_start_loc,
        )
    exchange.merge(out_t, lse_t)
    if lse_t is not None:
        return out_t, lse_t
    return out_t
