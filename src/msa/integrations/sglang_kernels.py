"""The Triton kernel of the SGLang drop-in: msa's block table and lengths from SGLang's own
structures in one launch."""

from __future__ import annotations

import triton
import triton.language as tl

#: table entries per program
BLOCK = 256


@triton.jit
def sglang_tables_kernel(
    req_to_token_ptr, slot_ids_ptr, seq_lens_ptr, table_ptr, lens_ptr,
    batch, max_reqs, max_context, max_blocks, stride_rr, stride_rt,
    BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Entry `e = b * max_blocks + j` of the table: for a row whose `slot_ids[b]` is a row of
    `req_to_token` and a block `j` its length `n = min(seq_lens[b], max_context)` reaches,
    `table[b, j] = req_to_token[slot, j * BLOCK_SIZE] // BLOCK_SIZE` (the page of the block's
    first slot, at most 2^31 - 1 so that an int64 slot past every cache stays past it; -1 for a
    negative slot), else -1. Entry `j = 0` also writes `lens[b]`: `n`, or 0
    for a row whose slot is not a row of `req_to_token`. Only the first slot of each visible
    block is read."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < batch * max_blocks
    b = e // max_blocks
    j = e % max_blocks
    slot = tl.load(slot_ids_ptr + b, mask=mask, other=-1).to(tl.int64)
    valid = (slot >= 0) & (slot < max_reqs)
    n = tl.minimum(tl.load(seq_lens_ptr + b, mask=mask, other=0).to(tl.int64), max_context)
    n = tl.where(valid, n, 0)
    used = mask & valid & (j * BLOCK_SIZE < n)
    first = tl.load(req_to_token_ptr + slot * stride_rr + j * BLOCK_SIZE * stride_rt, mask=used, other=-1)
    first = first.to(tl.int64)
    # (an int64 slot's page past int32 is kept past every cache, never wrapped onto a real page)
    page = tl.where(used & (first >= 0), tl.minimum(first // BLOCK_SIZE, 2147483647), -1)
    tl.store(table_ptr + e, page.to(tl.int32), mask=mask)
    tl.store(lens_ptr + b, n.to(tl.int32), mask=mask & (j == 0))
