# mypy: disable-error-code="no-untyped-def"
"""Triton kernels of the DCP merge: one launch each, fp32 math, no host synchronisation.

`combine_kernel`: `W` partial results (out, natural-log LSE) -> the exact combination.
`correct_kernel`: this rank's partial scaled by `exp(lse_rank - lse_global)`, ready to be summed
over ranks by a reduce collective (reduce-scatter / all-reduce).

Both read LSEs that are NaN or +inf as -inf (an empty share), never produce NaN from rows that
attend nothing, and zero the partials of weight 0 (a NaN there cannot leak).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rank_lse(lses_ptr, w, t, h, hmask, s_lw, s_lt, s_lh):
    """Rank `w`'s LSE of rows (t, h); NaN and +inf read as -inf (an empty share)."""
    lw = tl.load(lses_ptr + w * s_lw + t * s_lt + h * s_lh, mask=hmask, other=float("-inf")).to(tl.float32)
    return tl.where((lw == lw) & (lw < float("inf")), lw, float("-inf"))


@triton.jit
def _global_lse(lses_ptr, t, h, hmask, s_lw, s_lt, s_lh, W: tl.constexpr, BLOCK_H: tl.constexpr):
    """(m0, total): the shifted max (0 when every LSE is -inf) and sum of exp(lse_w - m0)."""
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for w in tl.static_range(W):
        m = tl.maximum(m, _rank_lse(lses_ptr, w, t, h, hmask, s_lw, s_lt, s_lh))
    m0 = tl.where(m > float("-inf"), m, 0.0)
    total = tl.zeros((BLOCK_H,), tl.float32)
    for w in tl.static_range(W):
        total += tl.exp(_rank_lse(lses_ptr, w, t, h, hmask, s_lw, s_lt, s_lh) - m0)
    return m0, total


@triton.jit
def _weight(lw, m0, total):
    """A rank's weight exp(lse_w - lse) in the combination; 0 for rows that see nothing."""
    return tl.where(total > 0, tl.exp(lw - m0) / tl.where(total > 0, total, 1.0), 0.0)


@triton.jit
def _store_lse(lse_ptr, m0, total, offsets, mask):
    """The combined natural-log LSE, -inf for rows that see nothing."""
    tl.store(lse_ptr + offsets, tl.where(total > 0, tl.log(tl.where(total > 0, total, 1.0)) + m0, float("-inf")),
             mask=mask)


@triton.jit
def combine_kernel(outs_ptr, lses_ptr, out_ptr, lse_ptr, H,
                   s_ow, s_ot, s_oh, s_lw, s_lt, s_lh, s_t, s_h, s_lse_t, s_lse_h,
                   W: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, HAS_LSE: tl.constexpr):
    """out[t, h] = sum_w exp(lse_w - lse) * outs[w, t, h]; lse = ln sum_w exp(lse_w).
    Grid: (T, cdiv(H, BLOCK_H))."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    d = tl.arange(0, D)
    m0, total = _global_lse(lses_ptr, t, h, hmask, s_lw, s_lt, s_lh, W, BLOCK_H)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    mask2 = hmask[:, None]
    for w in tl.static_range(W):
        weight = _weight(_rank_lse(lses_ptr, w, t, h, hmask, s_lw, s_lt, s_lh), m0, total)
        part = tl.load(outs_ptr + w * s_ow + t * s_ot + h[:, None] * s_oh + d[None, :], mask=mask2, other=0.0)
        acc += tl.where(weight[:, None] > 0, weight[:, None] * part.to(tl.float32), 0.0)
    tl.store(out_ptr + t * s_t + h[:, None] * s_h + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask2)
    if HAS_LSE:
        _store_lse(lse_ptr, m0, total, t * s_lse_t + h * s_lse_h, hmask)


@triton.jit
def correct_kernel(part_ptr, lses_ptr, dst_ptr, lse_ptr, H, rank, head_lo, head_hi, chunk,
                   s_pt, s_ph, s_lw, s_lt, s_lh, s_dt, s_dhi, s_dlo, s_lse_t, s_lse_h,
                   W: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, HAS_LSE: tl.constexpr):
    """dst[t, h] = exp(lse_rank - lse) * part[t, h] (0 where that weight is 0), head `h` stored
    at `(h // chunk) * s_dhi + (h % chunk) * s_dlo`; `lse[t, h - head_lo]` for heads in
    `[head_lo, head_hi)`. Grid: (T, cdiv(H, BLOCK_H))."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    d = tl.arange(0, D)
    m0, total = _global_lse(lses_ptr, t, h, hmask, s_lw, s_lt, s_lh, W, BLOCK_H)
    weight = _weight(_rank_lse(lses_ptr, rank, t, h, hmask, s_lw, s_lt, s_lh), m0, total)
    mask2 = hmask[:, None]
    part = tl.load(part_ptr + t * s_pt + h[:, None] * s_ph + d[None, :], mask=mask2, other=0.0).to(tl.float32)
    scaled = tl.where(weight[:, None] > 0, weight[:, None] * part, 0.0)
    dst = dst_ptr + t * s_dt + (h // chunk)[:, None] * s_dhi + (h % chunk)[:, None] * s_dlo + d[None, :]
    tl.store(dst, scaled.to(dst_ptr.dtype.element_ty), mask=mask2)
    if HAS_LSE:
        _store_lse(lse_ptr, m0, total, t * s_lse_t + (h - head_lo) * s_lse_h, hmask & (h >= head_lo) & (h < head_hi))
