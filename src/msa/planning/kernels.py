"""The Triton kernel of the per-row metadata refresh (one launch, any batch)."""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def refresh_rows_kernel(seq_lens_ptr, row_request_ptr, row_shift_ptr, kv_lens_ptr, q_pos_ptr, num_rows,
                        BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = r < num_rows
    b = tl.load(row_request_ptr + r, mask=mask, other=0)
    seq = tl.load(seq_lens_ptr + b, mask=mask, other=0)
    tl.store(kv_lens_ptr + r, seq, mask=mask)
    # in int64, then at least -1: a length near -2**31 must not wrap around to a huge position
    pos = seq.to(tl.int64) - tl.load(row_shift_ptr + r, mask=mask, other=0)
    tl.store(q_pos_ptr + r, tl.maximum(pos, -1).to(tl.int32), mask=mask)
