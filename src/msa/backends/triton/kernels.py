"""Triton kernels of the sparse decode (SPEC §3).

One program handles one query row `r`, one KV head `h`, a chunk of `BLOCK_G` of the head's
query heads, and one split of the row's tiles (a tile is `BLOCK_N` tokens of one selected page).
Tiles are converted to `COMPUTE` (bf16 or fp16 on the GPU, where every fp8 and NVFP4 value is
exact; fp32 under the Triton interpreter) for the dots. Scores use base-2 exponentials: `qk_scale` carries `sm_scale * log2(e)` and every float scale;
tensor scales are read on the device (graph-safe). An entry SPEC §3 skips is never read: its
page pointer is not formed and its tile is not loaded.

With one split the program writes the normalised output and the LSE; with several it writes
its running max, sum and unnormalised accumulator to a workspace that `merge_kernel` combines.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _row_context(seq_lens_ptr, r, QUERY_LEN: tl.constexpr, PAGE: tl.constexpr, max_blocks):
    """(request, visible tokens n, visible block limit) of row r."""
    b = r // QUERY_LEN
    seq = tl.load(seq_lens_ptr + b)
    n = tl.maximum(seq - QUERY_LEN + (r % QUERY_LEN) + 1, 0)
    limit = tl.minimum((n + PAGE - 1) // PAGE, max_blocks)
    return b, n, limit


@triton.jit
def _tile_page(topk_ptr, table_ptr, h, r, b, tile, limit, num_pages, stride_th, stride_tr, stride_tk,
               stride_bt, CHUNKS: tl.constexpr, TOPK: tl.constexpr):
    """The tile's (block id, page, used): skipped entries give used = False and page 0."""
    t = tile // CHUNKS
    j = tl.load(topk_ptr + h * stride_th + r * stride_tr + t * stride_tk, mask=t < TOPK, other=-1)
    used = (j >= 0) & (j < limit)
    j = tl.where(used, j, 0)
    page = tl.load(table_ptr + b * stride_bt + j, mask=used, other=-1)
    used = used & (page >= 0) & (page < num_pages)
    return j, tl.where(used, page, 0).to(tl.int64), used


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online-softmax update for scores s [G, N] (base 2); returns (p, alpha, m_new, l_new)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _scales(qk_scale, v_scale, q_scale_ptr, k_scale_ptr, v_scale_ptr,
            Q_SCALE_PTR: tl.constexpr, K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr):
    s = qk_scale
    if Q_SCALE_PTR:
        s = s * tl.load(q_scale_ptr)
    if K_SCALE_PTR:
        s = s * tl.load(k_scale_ptr)
    v = v_scale
    if V_SCALE_PTR:
        v = v * tl.load(v_scale_ptr)
    return s, v


@triton.jit
def _finish(acc, cols, m_i, l_i, r, qh, g_mask, split, v_scale,
            out_ptr, lse_ptr, part_o_ptr, part_ml_ptr, stride_or, stride_oh, stride_lr, stride_lh,
            NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
            WRITE_LSE: tl.constexpr, WRITE_ML: tl.constexpr):
    """Store this program's result: final output (one split) or partials (several)."""
    if NUM_SPLITS == 1:
        empty = l_i == 0.0
        inv = tl.where(empty, 0.0, v_scale / tl.where(empty, 1.0, l_i))
        o = acc * inv[:, None]
        ptrs = out_ptr + r * stride_or + qh[:, None] * stride_oh + cols[None, :]
        tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        if WRITE_LSE & WRITE_ML:
            lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
            tl.store(lse_ptr + r * stride_lr + qh * stride_lh, lse, mask=g_mask)
    else:
        row = (r * NUM_Q_HEADS + qh) * NUM_SPLITS + split  # [G]
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + cols[None, :], acc, mask=g_mask[:, None])
        if WRITE_ML:
            tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def split_decode_kernel(
    q_ptr, cache_ptr, topk_ptr, table_ptr, seq_lens_ptr,
    out_ptr, lse_ptr, part_o_ptr, part_ml_ptr,
    q_scale_ptr, k_scale_ptr, v_scale_ptr, qk_scale, v_scale,
    num_pages, max_blocks,
    stride_qr, stride_qh, stride_cp, stride_ch, stride_ct,
    stride_th, stride_tr, stride_tk, stride_bt,
    stride_or, stride_oh, stride_lr, stride_lh,
    QUERY_LEN: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, TOPK: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_CHUNKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    Q_SCALE_PTR: tl.constexpr, K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr,
    WRITE_LSE: tl.constexpr, COMPUTE: tl.constexpr,
):
    """Split layouts: cache [pages, Hkv, P, 2D] (bf16, fp16 or fp8), K = [..., :D], V = [..., D:]."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    gc = pid % GROUP_CHUNKS
    h = (pid // GROUP_CHUNKS) % NUM_KV_HEADS
    r = pid // (GROUP_CHUNKS * NUM_KV_HEADS)
    b, n, limit = _row_context(seq_lens_ptr, r, QUERY_LEN, PAGE, max_blocks)
    g = gc * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = g < GROUP
    qh = h * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + r * stride_qr + qh[:, None] * stride_qh + d[None, :], mask=g_mask[:, None], other=0.0)
    qk, vs = _scales(qk_scale, v_scale, q_scale_ptr, k_scale_ptr, v_scale_ptr, Q_SCALE_PTR, K_SCALE_PTR, V_SCALE_PTR)
    q = q.to(COMPUTE)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    CHUNKS: tl.constexpr = PAGE // BLOCK_N
    offs = tl.arange(0, BLOCK_N)
    for step in range(TILES_PER_SPLIT):
        tile = split * TILES_PER_SPLIT + step
        j, page, used = _tile_page(topk_ptr, table_ptr, h, r, b, tile, limit, num_pages,
                                   stride_th, stride_tr, stride_tk, stride_bt, CHUNKS, TOPK)
        if used:
            tok = (tile % CHUNKS) * BLOCK_N + offs
            visible = j * PAGE + tok < n
            rows = cache_ptr + page * stride_cp + h * stride_ch + tok[:, None] * stride_ct
            k = tl.load(rows + d[None, :], mask=visible[:, None], other=0.0).to(COMPUTE)
            s = tl.dot(q, tl.trans(k)) * qk
            s = tl.where(visible[None, :], s, float("-inf"))
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
            v = tl.load(rows + HEAD_DIM + d[None, :], mask=visible[:, None], other=0.0).to(COMPUTE)
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v)
    _finish(acc, d, m_i, l_i, r, qh, g_mask, split, vs, out_ptr, lse_ptr, part_o_ptr, part_ml_ptr,
            stride_or, stride_oh, stride_lr, stride_lh, NUM_KV_HEADS * GROUP, HEAD_DIM, NUM_SPLITS,
            WRITE_LSE, True)


@triton.jit
def _e2m1(codes):
    """E2M1 codes (int32, low 4 bits) -> float32, from the bit pattern."""
    sign = (codes >> 3) & 1
    e = (codes >> 1) & 3
    f = codes & 1
    expo = tl.where(e > 0, e + 126, f * 126)
    mant = tl.where(e > 0, f << 22, 0)
    return ((sign << 31) | (expo << 23) | mant).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(byte):
    """float8_e4m3fn bytes (int32) -> float32, from the bit pattern (subnormals included)."""
    sign = tl.where((byte >> 7) != 0, -1.0, 1.0)
    e = (byte >> 3) & 15
    m = byte & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return sign * tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _nvfp4_tile(slot, tok, dh, visible, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                INTERLEAVED: tl.constexpr, dtype: tl.constexpr):
    """Dequantize one tile of a head slot: (even elements, odd elements), each [N, D/2]."""
    codes = tl.load(slot + tok[:, None] * (HEAD_DIM // 2) + dh[None, :], mask=visible[:, None], other=0)
    codes = codes.to(tl.int32)
    group = dh // 8  # elements 2dh and 2dh+1 share the 16-group dh // 8
    if INTERLEAVED:
        pos = (tok[:, None] // 4) * (4 * (HEAD_DIM // 16)) + group[None, :] * 4 + tok[:, None] % 4
    else:
        pos = tok[:, None] * (HEAD_DIM // 16) + group[None, :]
    scale = _e4m3(tl.load(slot + PAGE * (HEAD_DIM // 2) + pos, mask=visible[:, None], other=0).to(tl.int32))
    even = (_e2m1(codes & 15) * scale).to(dtype)
    odd = (_e2m1(codes >> 4) * scale).to(dtype)
    return even, odd


@triton.jit
def nvfp4_decode_kernel(
    q_ptr, cache_ptr, topk_ptr, table_ptr, seq_lens_ptr,
    out_ptr, lse_ptr, part_o_ptr, part_ml_ptr,
    q_scale_ptr, k_scale_ptr, v_scale_ptr, qk_scale, v_scale,
    num_pages, max_blocks,
    stride_qr, stride_qh, stride_cp, stride_ch, stride_ct,
    stride_th, stride_tr, stride_tk, stride_bt,
    stride_or, stride_oh, stride_lr, stride_lh,
    QUERY_LEN: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, TOPK: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_CHUNKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    Q_SCALE_PTR: tl.constexpr, K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr,
    WRITE_LSE: tl.constexpr, COMPUTE: tl.constexpr,
):
    """NVFP4 head slots: cache uint8 [pages, 2Hkv, P, D/2 + D/16]; slot 2h is K, 2h+1 is V.
    Even and odd head-dim elements are kept apart (low and high nibbles), so q is split the same
    way and the output is written back interleaved."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    gc = pid % GROUP_CHUNKS
    h = (pid // GROUP_CHUNKS) % NUM_KV_HEADS
    r = pid // (GROUP_CHUNKS * NUM_KV_HEADS)
    b, n, limit = _row_context(seq_lens_ptr, r, QUERY_LEN, PAGE, max_blocks)
    g = gc * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = g < GROUP
    qh = h * GROUP + g
    dh = tl.arange(0, HEAD_DIM // 2)
    q_row = q_ptr + r * stride_qr + qh[:, None] * stride_qh
    q_even = tl.load(q_row + 2 * dh[None, :], mask=g_mask[:, None], other=0.0).to(COMPUTE)
    q_odd = tl.load(q_row + 2 * dh[None, :] + 1, mask=g_mask[:, None], other=0.0).to(COMPUTE)
    qk, vs = _scales(qk_scale, v_scale, q_scale_ptr, k_scale_ptr, v_scale_ptr, Q_SCALE_PTR, K_SCALE_PTR, V_SCALE_PTR)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_even = tl.zeros([BLOCK_G, HEAD_DIM // 2], tl.float32)
    acc_odd = tl.zeros([BLOCK_G, HEAD_DIM // 2], tl.float32)
    CHUNKS: tl.constexpr = PAGE // BLOCK_N
    offs = tl.arange(0, BLOCK_N)
    for step in range(TILES_PER_SPLIT):
        tile = split * TILES_PER_SPLIT + step
        j, page, used = _tile_page(topk_ptr, table_ptr, h, r, b, tile, limit, num_pages,
                                   stride_th, stride_tr, stride_tk, stride_bt, CHUNKS, TOPK)
        if used:
            tok = (tile % CHUNKS) * BLOCK_N + offs
            visible = j * PAGE + tok < n
            k_slot = cache_ptr + page * stride_cp + (2 * h) * stride_ch
            k_even, k_odd = _nvfp4_tile(k_slot, tok, dh, visible, PAGE, HEAD_DIM, False, COMPUTE)
            s = tl.dot(q_even, tl.trans(k_even)) + tl.dot(q_odd, tl.trans(k_odd))
            s = tl.where(visible[None, :], s * qk, float("-inf"))
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
            v_even, v_odd = _nvfp4_tile(k_slot + stride_ch, tok, dh, visible, PAGE, HEAD_DIM, True, COMPUTE)
            p = p.to(COMPUTE)
            acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even)
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd)
    _finish(acc_even, 2 * dh, m_i, l_i, r, qh, g_mask, split, vs, out_ptr, lse_ptr, part_o_ptr, part_ml_ptr,
            stride_or, stride_oh, stride_lr, stride_lh, NUM_KV_HEADS * GROUP, HEAD_DIM, NUM_SPLITS,
            WRITE_LSE, True)
    _finish(acc_odd, 2 * dh + 1, m_i, l_i, r, qh, g_mask, split, vs, out_ptr, lse_ptr, part_o_ptr, part_ml_ptr,
            stride_or, stride_oh, stride_lr, stride_lh, NUM_KV_HEADS * GROUP, HEAD_DIM, NUM_SPLITS,
            WRITE_LSE, False)


@triton.jit
def merge_kernel(
    part_o_ptr, part_ml_ptr, out_ptr, lse_ptr, v_scale_ptr, v_scale,
    stride_or, stride_oh, stride_lr, stride_lh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    V_SCALE_PTR: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Combine the splits of one (row, query head): out = sum_s acc_s 2^(m_s - M) / L."""
    pid = tl.program_id(0)  # r * NUM_Q_HEADS + qh
    r = pid // NUM_Q_HEADS
    qh = pid % NUM_Q_HEADS
    s = tl.arange(0, BLOCK_S)
    s_mask = s < NUM_SPLITS
    base = pid * NUM_SPLITS + s
    m = tl.load(part_ml_ptr + base * 2, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + base * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)
    total = tl.sum(l_s * w, axis=0)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_o_ptr + base[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0)
    vs = v_scale
    if V_SCALE_PTR:
        vs = vs * tl.load(v_scale_ptr)
    empty = total == 0.0
    o = o * tl.where(empty, 0.0, vs / tl.where(empty, 1.0, total))
    tl.store(out_ptr + r * stride_or + qh * stride_oh + d, o.to(out_ptr.dtype.element_ty))
    if WRITE_LSE:
        lse = tl.where(empty, float("-inf"), (m_max + tl.log2(tl.where(empty, 1.0, total))) * LN2)
        tl.store(lse_ptr + r * stride_lr + qh * stride_lh, lse)
