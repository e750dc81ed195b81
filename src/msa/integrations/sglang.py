"""A drop-in for SGLang 0.5.23's MiniMax-M3 Hopper decode entry, running msa's kernels on SGLang's
own KV pools — no copy of the cache into msa's packed layout.

    # sglang/srt/layers/attention/minimax_sparse_ops/minimax_sparse.py, step 3 of
    # minimax_sparse_decode: replace the call to flash_decode_with_gqa_share_sparse by
    from msa.integrations.sglang import flash_decode_with_gqa_share_sparse

The contract, as SGLang's `flash_decode_with_gqa_share_sparse` (in
`sglang/kernels/ops/attention/minimax_sparse/decode/topk_sparse.py`) defines it:

- `q` `[B, Hq, D]`: one query token per row (bf16/fp16, or fp8 e4m3 with `q_scale`).
- `k_cache`, `v_cache` `[slots, Hkv, D]`: the layer's token pools (bf16/fp16 or fp8 e4m3); slot
  `page * page_size + offset`. Pages of `page_size` contiguous slots (a multiple of
  `block_size`), so every 128-token sparse block is `block_size` consecutive slots.
- `req_to_token` int32 `[max_reqs, max_context]`: request slot -> position -> KV slot.
- `seq_lens` `[B]`: KV length of each request including the current token (clamped to
  `max_context`).
- `slot_ids` `[B]`: each row's `req_to_token` row (SGLang's `req_pool_indices`).
- `block_size`: the sparse block (128 for M3), a power of two.
- `topk_idx` int32 `[Hkv, B, K]`: selected block ids, front-packed, `-1` at the tail.
- `sm_scale` (default `D**-0.5`), `q_scale`, `k_scale`, `v_scale`: python floats or None (1.0).
- returns a new `[B, Hq, D]` tensor (q's dtype, bf16 for fp8 q).

msa computes the same attention with its own semantics, a superset of SGLang's: `-1` or an
out-of-range id anywhere in a list is skipped (SGLang's kernel reads garbage for an interior
`-1`), and a row that attends nothing gives zeros (SGLang's gives NaN); a row whose `slot_ids`
entry is not a row of `req_to_token` attends nothing. Refused with `MSAUnsupportedError`: an
attention sink (`sink`), HiSparse slots, and `page_size` that is not a multiple of
`block_size` (SGLang's per-token gather mode, `page_size=0`), whose blocks are not contiguous.
"""

from __future__ import annotations

import threading

import torch

from msa.api import sparse_decode
from msa.errors import MSAInputError, MSAUnsupportedError
from msa.integrations.sglang_kernels import BLOCK, sglang_tables_kernel
from msa.launcher import DirectKernel, direct_launch_enabled, interpreting, unit_stride
from msa.planning import tensor_versions
from msa.platform import current_stream_key
from msa.semantics import INT32_MAX
from msa.validation import check_tensor

__all__ = ["flash_decode_with_gqa_share_sparse", "sglang_block_table", "step_tables", "pools_as_pages"]


def pools_as_pages(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's `[slots, Hkv, D]` pools as msa's `[pages, Hkv, block_size, D]` K and V views (no
    copy, one `as_strided` each; slots past the last whole page are not addressable)."""
    views = []
    for name, pool in (("k_cache", k_cache), ("v_cache", v_cache)):
        strides = check_tensor(name, pool).stride()
        if len(strides) != 3 or strides[2] != 1:
            expected = "a [slots, Hkv, D] token pool with unit last stride"
            raise MSAInputError(name, expected, f"shape {tuple(pool.shape)}, strides {strides}")
        slots, heads, dim = pool.shape
        views.append(pool.as_strided((slots // block_size, heads, block_size, dim),
                                     (block_size * strides[0], strides[1], strides[0], 1)))
    return views[0], views[1]


def sglang_block_table(req_to_token: torch.Tensor, slot_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """msa's int32 block table `[B, ceil(max_context / block_size)]`: the page of each request's
    logical block, read from the first slot of the block (`req_to_token[slot, j*bs] // bs`; an
    int64 slot's page outside int32 kept outside every cache, not wrapped onto a real page)."""
    firsts = req_to_token.index_select(0, slot_ids.long())[:, ::block_size]
    pages = torch.div(firsts, block_size, rounding_mode="floor")
    return pages.clamp(-1, INT32_MAX).to(torch.int32)


def step_tables(
    req_to_token: torch.Tensor, slot_ids: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """msa's `(block_table, seq_lens)` for a step on SGLang's structures: the table `[B,
    ceil(max_context / block_size)]` (the page of each block a request's length reaches, -1
    beyond) and the lengths clamped to `max_context`, 0 for a row whose `slot_ids` entry is not a
    row of `req_to_token`. `device`: where they must be (q's), when given.

    One kernel launch on a GPU, launched directly after the first call of a shape, reading one
    slot per visible block; torch ops over whole rows elsewhere. The layers of a step share it:
    called again, on the same thread and stream, with the very tensors of the previous call,
    unchanged through torch since (their version counters; under `torch.inference_mode()`,
    where torch keeps none, the same objects — SGLang passes each batch's as new tensors), it
    returns the previous call's tables (checked then), which msa's own step-sharing reuses too.

    Raises:
        MSAInputError: a tensor that is not one, is on another device, or has the wrong rank.
    """
    last = getattr(_LOCAL, "step", None)
    if last is not None and last[0] is req_to_token and last[1] is slot_ids and last[2] is seq_lens:
        where = req_to_token.device
        if (last[3] == (current_stream_key(where.index if where.type == "cuda" else -1), block_size, device)
                and last[4] == tensor_versions(req_to_token, slot_ids, seq_lens)):
            shared: tuple[torch.Tensor, torch.Tensor] = last[5]
            return shared
    for name, t in (("req_to_token", req_to_token), ("seq_lens", seq_lens), ("slot_ids", slot_ids)):
        check_tensor(name, t, device)
    if req_to_token.dim() != 2:
        raise MSAInputError("req_to_token", "[max_reqs, max_context]", f"shape {tuple(req_to_token.shape)}")
    if seq_lens.dim() != 1 or slot_ids.shape != seq_lens.shape:
        raise MSAInputError("slot_ids / seq_lens", "two [B] tensors", f"shapes {tuple(slot_ids.shape)} / "
                            f"{tuple(seq_lens.shape)}")
    where = req_to_token.device
    key = (current_stream_key(where.index if where.type == "cuda" else -1), block_size, device)
    tables = _tables(req_to_token, slot_ids, seq_lens, block_size)
    _LOCAL.step = (req_to_token, slot_ids, seq_lens, key, tensor_versions(req_to_token, slot_ids, seq_lens), tables)
    return tables


def _tables(
    req_to_token: torch.Tensor, slot_ids: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    max_reqs, max_context = req_to_token.shape
    batch = seq_lens.shape[0]
    max_blocks = -(-max_context // block_size)
    if not (req_to_token.is_cuda or interpreting()):
        valid = (slot_ids >= 0) & (slot_ids < max_reqs)
        lens = torch.where(valid, seq_lens.clamp(max=max_context), 0).to(torch.int32)
        table = sglang_block_table(req_to_token, torch.where(valid, slot_ids, 0), block_size)
        visible = torch.arange(max_blocks, device=lens.device).view(1, -1) * block_size < lens.view(-1, 1)
        return torch.where(visible, table, -1), lens
    table = torch.empty((batch, max_blocks), dtype=torch.int32, device=req_to_token.device)
    lens = torch.empty((batch,), dtype=torch.int32, device=req_to_token.device)
    signature = (batch, max_reqs, max_context, req_to_token.stride(), req_to_token.dtype, slot_ids.dtype,
                 seq_lens.dtype, block_size, req_to_token.device)
    kernel = _KERNELS.get(signature)
    if kernel is None:
        if len(_KERNELS) >= 64:
            _KERNELS.clear()
        kernel = _KERNELS[signature] = DirectKernel(sglang_tables_kernel, (-(-max(batch * max_blocks, 1) // BLOCK),))
    kernel(dict(req_to_token_ptr=req_to_token, slot_ids_ptr=unit_stride(slot_ids), seq_lens_ptr=unit_stride(seq_lens),
                table_ptr=table, lens_ptr=lens, batch=batch, max_reqs=max_reqs, max_context=max_context,
                max_blocks=max_blocks, stride_rr=req_to_token.stride(0), stride_rt=req_to_token.stride(1),
                BLOCK_SIZE=block_size, BLOCK=BLOCK), direct_launch_enabled())
    return table, lens


#: The table kernel's launchers, per call signature (integer arguments, dtypes, device).
_KERNELS: dict[tuple[object, ...], DirectKernel] = {}
#: This thread's last step: (req_to_token, slot_ids, seq_lens, (stream, block size, device), their
#: versions, (table, lens)).
_LOCAL = threading.local()


def flash_decode_with_gqa_share_sparse(
    q: torch.Tensor,
    sink: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_ids: torch.Tensor,
    block_size: int,
    topk_idx: torch.Tensor,
    sm_scale: float | None = None,
    use_tma: bool = True,
    page_size: int = 0,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    hisparse_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """SGLang's Hopper sparse decode entry on msa (see the module docstring for the contract).

    `use_tma` is accepted and ignored (SGLang ignores it too).

    Raises:
        MSAUnsupportedError: a sink, HiSparse slots, pages that are not whole sparse blocks, or
            fp8 pools in a format msa does not read (e5m2, fnuz: SGLang's kernel takes them).
        MSAInputError: anything msa's own checks refuse, naming the argument.
    """
    if sink is not None:
        raise MSAUnsupportedError(
            "sink: msa has no attention sinks (a per-head logit added to the softmax); "
            "keep SGLang's kernel for models that use them (MiniMax-M3 passes None)"
        )
    if hisparse_slots is not None:
        raise MSAUnsupportedError("hisparse_slots: msa reads the KV pools directly, not HiSparse offload slots")
    if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        raise MSAInputError("block_size", "a power of two >= 16 (the sparse block, 128 for M3)", repr(block_size))
    if not isinstance(page_size, int) or page_size <= 0 or page_size % block_size:
        raise MSAUnsupportedError(
            f"page_size: msa reads each sparse block as {block_size} consecutive slots, so SGLang's pages must "
            f"be a positive multiple of block_size={block_size} (--page-size); got {page_size!r}"
        )
    table, lens = step_tables(req_to_token, slot_ids, seq_lens, block_size, q.device)
    out = sparse_decode(
        q,
        pools_as_pages(k_cache, v_cache, block_size),
        topk_idx,
        table,
        lens,
        decode_query_len=1,
        sm_scale=sm_scale,
        q_scale=1.0 if q_scale is None else q_scale,
        k_scale=1.0 if k_scale is None else k_scale,
        v_scale=1.0 if v_scale is None else v_scale,
    )
    return out
