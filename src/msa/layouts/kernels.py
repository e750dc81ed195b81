"""Triton kernels of the cache writers: byte for byte what the torch writers store.

One program per (token, KV head[, side]); a token whose slot is negative or past the cache is
skipped on the device, so the writers need no host synchronisation (serving engines call them
once per layer per step). Division is IEEE (`div_rn`), casts round to nearest even, as in torch.
On GPUs without E4M3 in hardware (`SOFT`: compute capability below 8.9) E4M3 is encoded and
decoded by bits (`e4m3_encode_bits`, `e4m3_decode_bits`, also the decode kernels' one home of it).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_decode_bits(b):
    """E4M3 bytes (uint8) as their fp16 values, by bits, for GPUs without E4M3 in hardware: the sign
    moved to bit 15 and the 7 exponent and mantissa bits to bits 13..7 make an fp16 of the same
    bits whose exponent bias is 8 more (15 against 7), so it is the value times 2^-8 exactly,
    subnormals included; times 256 (exact) it is the value. S.1111.111 is NaN (E4M3 has no Inf)."""
    w = b.to(tl.uint16)
    v = (((w & 0x80) << 8) | ((w & 0x7F) << 7)).to(tl.float16, bitcast=True) * 256.0
    return tl.where((w & 0x7F) == 0x7F, float("nan"), v).to(tl.float16)


@triton.jit
def e4m3_encode_bits(x):
    """float32 -> E4M3 byte (uint8) by bits, rounding to nearest even, for GPUs without E4M3 in
    hardware: what torch's conversion stores. Normal results (from 2^-6) rebias the exponent (127
    -> 7) and round the 20 dropped mantissa bits; smaller magnitudes are rounded to a multiple of
    2^-9 by an fp32 add of 2^14 (whose ulp that is); larger magnitudes than 448, Inf included,
    saturate at 448 (as the hardware's `satfinite` and torch 2.13's conversion do; torch 2.11's
    gives NaN from 464 on, but the writers clamp to +-448 first), NaN gives S.1111.111."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    normal = tl.minimum((a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20, 0x7E)
    small = (tl.abs(x) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    code = tl.where(a > 0x7F800000, 0x7F, tl.where(a < (121 << 23), small, normal))
    return (code | sign).to(tl.uint8)


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
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr, SOFT: tl.constexpr = False,
):
    """Split layouts, into the K and V views of a packed cache or a pair of caches (with `SOFT`
    the fp8 caches as their bytes, encoded by bits)."""
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
        if SOFT:
            tl.store(k_row + d, e4m3_encode_bits(k))
            tl.store(v_row + d, e4m3_encode_bits(v))
        else:
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
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, SOFT: tl.constexpr = False,
):
    """NVFP4 head slots; with `SOFT` the E4M3 block scales encoded and read back by bits."""
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
        scale_f = tl.minimum(tl.math.div_rn(tl.math.div_rn(amax, 6.0), g_scale), 448.0)
        if SOFT:
            scale_byte = e4m3_encode_bits(scale_f)
            step = e4m3_decode_bits(scale_byte).to(tl.float32) * g_scale
        else:
            scale = scale_f.to(tl.float8e4nv)
            scale_byte = scale.to(tl.uint8, bitcast=True)
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
        tl.store(base + PAGE * (HEAD_DIM // 2) + pos, scale_byte)
