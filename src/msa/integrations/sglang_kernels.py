"""The Triton kernel of the SGLang drop-in: msa's block table and lengths from SGLang's own
structures in one launch, reading only the blocks the step's lists select."""

from __future__ import annotations

import triton
import triton.language as tl

#: entries per program
BLOCK = 256


@triton.jit
def sglang_tables_kernel(
    topk_ptr, req_to_token_ptr, slot_ids_ptr, seq_lens_ptr, table_ptr, lens_ptr,
    num_entries, batch, topk, max_reqs, max_context, max_blocks,
    stride_th, stride_tb, stride_tk, stride_rr, stride_rt,
    BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    """For every list entry `j = topk[h, b, t]` in `[0, max_blocks)` of a row whose `slot_ids[b]`
    is a row of `req_to_token`: `table[b, j] = req_to_token[slot, j * BLOCK_SIZE] // BLOCK_SIZE`
    (the page of the block's first slot; -1 for a negative slot). Entries of programs' first
    `batch` lanes also write `lens[b] = min(seq_lens[b], max_context)`, or 0 for a row whose slot
    is not a row of `req_to_token`. Table columns no list selects are not written (msa reads a
    table entry only for the entries of a list)."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = e < num_entries
    t = e % topk
    b = (e // topk) % batch
    h = e // (topk * batch)
    j = tl.load(topk_ptr + h * stride_th + b * stride_tb + t * stride_tk, mask=mask, other=-1).to(tl.int64)
    slot = tl.load(slot_ids_ptr + b, mask=mask, other=-1).to(tl.int64)
    used = mask & (j >= 0) & (j < max_blocks) & (slot >= 0) & (slot < max_reqs)
    first = tl.load(req_to_token_ptr + slot * stride_rr + j * BLOCK_SIZE * stride_rt, mask=used, other=0).to(tl.int64)
    page = tl.where(first >= 0, first // BLOCK_SIZE, -1)
    tl.store(table_ptr + b.to(tl.int64) * max_blocks + j, page.to(tl.int32), mask=used)

    rows = e < batch
    n = tl.load(seq_lens_ptr + e, mask=rows, other=0).to(tl.int64)
    row_slot = tl.load(slot_ids_ptr + e, mask=rows, other=-1).to(tl.int64)
    valid = (row_slot >= 0) & (row_slot < max_reqs)
    tl.store(lens_ptr + e, tl.where(valid, tl.minimum(n, max_context), 0).to(tl.int32), mask=rows)
