"""Triton kernels of the cache writers: byte for byte what the torch writers store.

One program per (token, KV head[, side]); a token whose slot is negative or past the cache is
skipped on the device, so the writers need no host synchronisation (serving engines call them
once per layer per step). Division is IEEE (`div_rn`), casts round to nearest even, as in torch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def nvfp4_scale_offset(token, group, GROUPS: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Byte offset of the block scale of (`token`, `group`) inside a head slot's scale area:
    key scales in order, value scales interleaved by token quads (docs/semantics.md §4). The one
    Triton home of this rule (the torch one is `msa.layouts.nvfp4.scale_byte_index`)."""
    if INTERLEAVED:
        return (token // 4) * (4 * GROUPS) + group * 4 + token % 4
    return token * GROUPS + group


@triton.jit
def split_write_kernel(
    key_ptr, value_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, capacity,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kch, stride_kct, stride_vcp, stride_vch, stride_vct,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
):
    """Split layouts, into the K and V views of a packed cache or a pair of caches."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < capacity):
        d = tl.arange(0, HEAD_DIM)
        page, off = slot // PAGE, slot % PAGE
        k_row = k_cache_ptr + page * stride_kcp + h * stride_kch + off * stride_kct
        v_row = v_cache_ptr + page * stride_vcp + h * stride_vch + off * stride_vct
        k = tl.math.div_rn(tl.load(key_ptr + t * stride_kt + h * stride_kh + d).to(tl.float32), tl.load(k_scale_ptr))
        v = tl.math.div_rn(tl.load(value_ptr + t * stride_vt + h * stride_vh + d).to(tl.float32), tl.load(v_scale_ptr))
        if FP8:  # saturate +-Inf at +-448 and keep NaN, as torch's clamp (`min`/`max` would drop it)
            k = tl.clamp(k, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
            v = tl.clamp(v, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        tl.store(k_row + d, k.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_row + d, v.to(v_cache_ptr.dtype.element_ty))


@triton.jit
def _e2m1_encode(x):
    """float32 -> E2M1 code (int32), nearest-even, saturating; sign bit for x < 0."""
    a = tl.abs(x)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    code += (a > 5.0).to(tl.int32)
    return code | ((x < 0).to(tl.int32) << 3)


@triton.jit
def nvfp4_write_kernel(
    key_ptr, value_ptr, slot_ptr, cache_ptr, k_scale_ptr, v_scale_ptr, capacity,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cp, stride_ch,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    side = tl.program_id(2)  # 0: K (linear scales), 1: V (token-quad interleaved scales)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < capacity):
        GROUPS: tl.constexpr = HEAD_DIM // 16
        off = slot % PAGE
        base = cache_ptr + (slot // PAGE) * stride_cp + (2 * h + side) * stride_ch
        src = tl.where(side == 0, key_ptr + t * stride_kt + h * stride_kh, value_ptr + t * stride_vt + h * stride_vh)
        g_scale = tl.where(side == 0, tl.load(k_scale_ptr), tl.load(v_scale_ptr))
        x = tl.load(src + tl.arange(0, HEAD_DIM)).to(tl.float32)
        blocks = tl.reshape(x, (GROUPS, 16))
        amax = tl.max(tl.where(blocks == blocks, tl.abs(blocks), 0.0), axis=1)  # NaN sets no scale
        scale = tl.minimum(tl.math.div_rn(tl.math.div_rn(amax, 6.0), g_scale), 448.0).to(tl.float8e4nv)
        step = scale.to(tl.float32) * g_scale
        positive = step[:, None] > 0
        # (a block scale of 0: -1/8 for a negative value, stored as -0, as quantize_blocks does)
        ratio = tl.where(positive, tl.math.div_rn(blocks, tl.where(positive, step[:, None], 1.0)),
                         tl.where(blocks < 0, -0.125, 0.0))
        codes = tl.reshape(_e2m1_encode(ratio), (HEAD_DIM // 2, 2))
        lo, hi = tl.split(codes)
        tl.store(base + off * (HEAD_DIM // 2) + tl.arange(0, HEAD_DIM // 2), (lo | (hi << 4)).to(tl.uint8))
        g = tl.arange(0, GROUPS)
        pos = tl.where(side == 0, nvfp4_scale_offset(off, g, GROUPS, False), nvfp4_scale_offset(off, g, GROUPS, True))
        tl.store(base + PAGE * (HEAD_DIM // 2) + pos, scale.to(tl.uint8, bitcast=True))
