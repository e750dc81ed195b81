"""Triton kernels of the sparse decode (docs/semantics.md §3).

A per-token program handles one query row `r`, one KV head `h`, a chunk of `BLOCK_G` of the
head's query heads, and one split of the row's tiles (a tile is `BLOCK_N` tokens of one selected
page). The dedup program handles up to `TOKENS` rows of one request instead and walks the union
of their pages. Tiles are converted to `COMPUTE` for the dots: bf16 or fp16 on the GPU (every
fp8 and NVFP4 value is exact in both; a bf16 query meeting fp16 dots is scaled into fp16's range
first, `_fit_q`, and an f16 query meeting bf16 dots is two bf16 terms, `_q_low`), fp32 under the
Triton interpreter. Index lists are
resolved once, up front, so the tile loop has no dependent index loads and can be
software-pipelined. Scores use base-2 exponentials: `qk_scale` carries `sm_scale * log2(e)` and
every float scale; tensor scales are read on the device (graph-safe). An entry the semantics
skip is never read: its page pointer is not formed and its tile is not loaded.

Keys and values are read through their own base pointers and (page, head, token) strides, as
the layout hands them over (`KVLayout.kv_operands`): a packed `[pages, Hkv, P, 2D]` cache is the
case `v = k` with `v_offset = D`, a pair of caches (or SGLang's token pools viewed as pages) two
tensors with `v_offset = 0`; NVFP4 reads a head slot from `k` / `v + v_offset`.

All three decode kernels take the same named arguments (`launch.decode_args` builds them). With
one split a program writes the normalised output (and the LSE); with several it writes its
unnormalised accumulator and its running (max, sum) to a workspace that `merge_kernel` combines
(or, in the per-token kernels with `IN_KERNEL_MERGE`, the last split to finish: `_merge_if_last`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from msa.layouts.kernels import e4m3_decode_bits, nvfp4_scale_offset

LOG2E = 1.4426950408889634  # host side: folded into qk_scale
LN2 = tl.constexpr(0.6931471805599453)

# Four NVFP4 code bytes ($4) and their block scales x 64 as two f16x2 ($5: elements 0-1, $6:
# elements 2-3) -> the four low-nibble (even) elements ($0, $1) and the four high-nibble (odd)
# ones ($2, $3), f16x2 each. A nibble's magnitude bits go to bits 2-4 of an E4M3 byte and its sign
# to bit 7 (exactly the E2M1 value times 2^-6); one cvt decodes two bytes, one mul applies the
# scales to two elements. The same values as the portable path, in a quarter of the instructions.
_NVFP4_DECODE_ASM = tl.constexpr("""
{
.reg .b32 rq, rlo, rhi, rt;
.reg .b16 l0, l1, h0, h1;
.reg .b32 fl0, fl1, fh0, fh1;
and.b32 rhi, $4, 0x80808080;
shr.b32 rt, $4, 2;
and.b32 rt, rt, 0x1C1C1C1C;
or.b32 rhi, rhi, rt;
shl.b32 rq, $4, 4;
and.b32 rlo, rq, 0x80808080;
shr.b32 rt, rq, 2;
and.b32 rt, rt, 0x1C1C1C1C;
or.b32 rlo, rlo, rt;
mov.b32 {l0, l1}, rlo;
mov.b32 {h0, h1}, rhi;
cvt.rn.f16x2.e4m3x2 fl0, l0;
cvt.rn.f16x2.e4m3x2 fl1, l1;
cvt.rn.f16x2.e4m3x2 fh0, h0;
cvt.rn.f16x2.e4m3x2 fh1, h1;
mul.rn.f16x2 $0, fl0, $5;
mul.rn.f16x2 $1, fl1, $6;
mul.rn.f16x2 $2, fh0, $5;
mul.rn.f16x2 $3, fh1, $6;
}
""")


# -- the step around a program ---------------------------------------------------------------

@triton.jit
def _row_context(row_request_ptr, q_pos_ptr, r, PAGE: tl.constexpr, max_blocks):
    """(request, visible tokens n, visible block limit) of row r, from the plan's row metadata.
    In int64, so that lengths near 2**31 cannot overflow the block limit."""
    b = tl.load(row_request_ptr + r).to(tl.int64)
    n = tl.maximum(tl.load(q_pos_ptr + r).to(tl.int64) + 1, 0)
    limit = tl.minimum((n + PAGE - 1) // PAGE, max_blocks)
    return b, n, limit


@triton.jit
def _program(row_request_ptr, q_pos_ptr, max_blocks, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
             PAGE: tl.constexpr, BLOCK_G: tl.constexpr, GROUP_CHUNKS: tl.constexpr):
    """What a per-token program serves: (split, KV head h, row r, request b, visible tokens n,
    visible block limit, its query heads qh [BLOCK_G], their mask)."""
    pid = tl.program_id(0)
    gc = pid % GROUP_CHUNKS
    h = (pid // GROUP_CHUNKS) % NUM_KV_HEADS
    r = pid // (GROUP_CHUNKS * NUM_KV_HEADS)
    b, n, limit = _row_context(row_request_ptr, q_pos_ptr, r, PAGE, max_blocks)
    g = gc * BLOCK_G + tl.arange(0, BLOCK_G)
    return tl.program_id(1), h, r, b, n, limit, h * GROUP + g, g < GROUP


@triton.jit
def _entries(topk_ptr, table_ptr, h, r, b, limit, num_pages, stride_th, stride_tr, stride_tk, stride_bt,
             TOPK: tl.constexpr, TOPK_PAD: tl.constexpr):
    """The row's index list resolved once and compacted: (rank, block ids, pages, count), the
    first three [TOPK_PAD]. The used entries are numbered 0..count-1 in list order (`rank`);
    skipped entries get rank -1, so the walk visits used entries only and a program whose row
    uses few pages (short contexts, `-1` padding, a context-parallel rank's share) does
    proportionally less work."""
    e = tl.arange(0, TOPK_PAD)
    j = tl.load(topk_ptr + h * stride_th + r * stride_tr + e * stride_tk, mask=e < TOPK, other=-1)
    used = (j >= 0) & (j < limit)
    j = tl.where(used, j, 0)
    page = tl.load(table_ptr + b * stride_bt + j, mask=used, other=-1)
    used = (used & (page >= 0) & (page < num_pages)).to(tl.int32)
    rank = tl.where(used > 0, tl.cumsum(used, axis=0) - 1, -1)
    return rank, j, tl.where(used > 0, page, 0), tl.sum(used, axis=0)


@triton.jit
def _steps(split, count, TILES_PER_SPLIT: tl.constexpr, CHUNKS: tl.constexpr):
    """Tiles split `split` walks when the row uses `count` entries (splits past them walk none)."""
    return tl.minimum(tl.maximum(count * CHUNKS - split * TILES_PER_SPLIT, 0), TILES_PER_SPLIT)


@triton.jit
def _pick(values, e, t):
    """values[t] for a small register vector (a masked sum: no dependent memory access)."""
    return tl.sum(tl.where(e == t, values, 0), axis=0)


@triton.jit
def _tile(split, step, rank, ids, pages, n, offs, TILES_PER_SPLIT: tl.constexpr, CHUNKS: tl.constexpr,
          BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Step `step` of a split's walk over the used entries (`_steps` bounds it): (page, token
    offsets in it [BLOCK_N], visible [BLOCK_N])."""
    tile = split * TILES_PER_SPLIT + step
    t = tile // CHUNKS
    page = _pick(pages, rank, t).to(tl.int64)
    tok = (tile % CHUNKS) * BLOCK_N + offs
    visible = tok < n - _pick(ids, rank, t).to(tl.int64) * PAGE
    return page, tok, visible


@triton.jit
def _scales(qk_scale, v_scale, sm_scale_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, SM_SCALE_PTR: tl.constexpr,
            Q_SCALE_PTR: tl.constexpr, K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr):
    """(score factor, output factor): the host's float product times the tensor scales."""
    s = qk_scale
    if SM_SCALE_PTR:
        s = s * tl.load(sm_scale_ptr)
    if Q_SCALE_PTR:
        s = s * tl.load(q_scale_ptr)
    if K_SCALE_PTR:
        s = s * tl.load(k_scale_ptr)
    v = v_scale
    if V_SCALE_PTR:
        v = v * tl.load(v_scale_ptr)
    return s, v


@triton.jit
def _opaque(x):
    """`x` as fp32 through an identity the compiler does not trace through (an inline `mov` it must
    keep). Triton sizes a dot operand's register chunks (`kWidth`) from the narrowest element type
    it can trace the operand back to through pure elementwise ops: an fp8 query converted for
    16-bit dots gave the dots the fp8 operand layout, and the 16-bit key tile was then read with
    scalar shared loads instead of `ldmatrix` (sm_90, M3 TP1 B = 64 over a bf16 cache: 507
    instructions a tile against 430 for a bf16 query; 424 with this)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x.to(tl.float32)], dtype=tl.float32,
                                     is_pure=False, pack=1)


@triton.jit
def _e4m3(x, SOFT: tl.constexpr):
    """A loaded tile as values: as it is, or with `SOFT` (`LaunchConfig.soft_e4m3`: fp8 tensors
    passed as their bytes) an integer tile's E4M3 bytes decoded (`e4m3_decode_bits`)."""
    if SOFT and x.dtype == tl.uint8:
        x = e4m3_decode_bits(x)
    return x


@triton.jit
def _e4m3_bytes(b, SOFT: tl.constexpr):
    """E4M3 bytes (uint8) as values: the hardware conversion, or with `SOFT` `e4m3_decode_bits`."""
    return e4m3_decode_bits(b) if SOFT else b.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _finite_abs_max(x, AXIS: tl.constexpr):
    """Each head's largest finite magnitude in the fp32 tile `x` (heads along `AXIS`; NaN and Inf
    count as 0)."""
    return tl.max(tl.where((x == x) & (tl.abs(x) < float("inf")), tl.abs(x), 0.0), axis=1 - AXIS)


@triton.jit
def _fit_q(q, q2, HALVES: tl.constexpr, AXIS: tl.constexpr, FIT: tl.constexpr, COMPUTE: tl.constexpr,
           SOFT: tl.constexpr):
    """The query tile(s) in `COMPUTE`, and the factor per head (heads along `AXIS`) the scores
    take back: 1.0, or with `FIT` (a bf16 query whose dots run in fp16) each head times the power
    of two that puts its largest finite magnitude in [2^14, 2^15), inside fp16's range (a bf16
    element past 65504 was inf there, its row's output NaN; one below 2^-24 flushed to 0), and the
    inverse power of two. Exact for every element from 2^-31 of its head's largest finite one; a
    head is fitted alone (one head's magnitude, Inf or NaN never moves another's), and its Inf and
    NaN elements stay what they are. `q2` is NVFP4's odd half with `HALVES`; without it `q2` is
    not read and `q` is returned in its place (no second conversion). Powers of two built
    from the exponent bits (exact), the exponent clamped to [-112, 127]. An fp8 query is converted
    through `_opaque`, and so is every query with `SOFT` (`LaunchConfig.soft_e4m3`: an fp8 query
    arrives as bytes and is decoded to fp16 in registers, which Triton traces back to the byte
    load: sm_80, M3 TP1 B = 64 over a bf16 cache, 486 instructions a tile against 406 for a bf16
    query). The fp32 round trip changes no value: a bf16 or f16 query meeting dots of its own
    dtype, or fitted (already fp32), converts back exactly; an f16 query meeting bf16 dots
    rounds to bf16 as `_q_low` rounds it, so the two terms still sum to the query."""
    down = 1.0  # (unfitted: the scores' factor is `qk` as it is, `_score_factor`)
    if FIT:
        qf = q.to(tl.float32)
        amax = _finite_abs_max(qf, AXIS)
        qf2 = qf
        if HALVES:
            qf2 = q2.to(tl.float32)
            amax = tl.maximum(amax, _finite_abs_max(qf2, AXIS))
        e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.minimum(tl.maximum(e, -112), 127)
        up = tl.expand_dims(((141 - e) << 23).to(tl.float32, bitcast=True), 1 - AXIS)
        down = ((113 + e) << 23).to(tl.float32, bitcast=True)
        q, q2 = qf * up, qf2 * up
    if (q.dtype.is_fp8() or SOFT) and tl.float32 != COMPUTE:  # (a GPU's 16-bit dots; the interpreter runs no PTX)
        q = _opaque(q)
        if HALVES:
            q2 = _opaque(q2)
    q = q.to(COMPUTE)
    return q, q2.to(COMPUTE) if HALVES else q, down


@triton.jit
def _q_low(q, SPLIT: tl.constexpr, COMPUTE: tl.constexpr):
    """The second term of a query whose dots run in a dtype of fewer significant bits (`SPLIT`: an
    f16 query, bf16 dots): q - COMPUTE(q), itself exact in bf16 (f16's 11 significant bits are
    two bf16 terms' 8 + 8, and f16's range lies inside bf16's), 0 where COMPUTE(q) is not finite
    (an Inf or NaN element stays what it is in the first term). The scores are then
    dot(COMPUTE(q), k) + dot(low, k): exact products summed in fp32, as for a query of the dots'
    own dtype. Without `SPLIT`: zeros (never used)."""
    low = tl.zeros_like(q).to(COMPUTE)
    if SPLIT:
        qf = q.to(tl.float32)
        hi = q.to(COMPUTE).to(tl.float32)
        low = tl.where(tl.abs(hi) < float("inf"), qf - hi, 0.0).to(COMPUTE)
    return low


@triton.jit
def _query_terms(q, q2, HALVES: tl.constexpr, AXIS: tl.constexpr, FIT: tl.constexpr, SPLIT: tl.constexpr,
                 COMPUTE: tl.constexpr, SOFT: tl.constexpr):
    """The query as the dots take it: (q, q2) fitted (`_fit_q`), their second terms (`_q_low`),
    and the factor per head the scores take back. With `HALVES` `q2` is NVFP4's odd half; without
    it `q2` is not read and the second and fourth results are the first and third again."""
    lo = _q_low(q, SPLIT, COMPUTE)
    lo2 = lo
    if HALVES:
        lo2 = _q_low(q2, SPLIT, COMPUTE)
    q, q2, down = _fit_q(q, q2, HALVES, AXIS, FIT, COMPUTE, SOFT)
    return q, q2, lo, lo2, down


@triton.jit
def _score_factor(qk, q_back, AXIS: tl.constexpr, FIT: tl.constexpr):
    """The scores' factor: `qk`, or for a fitted query (`_fit_q`) `qk` times each head's factor
    back (heads along `AXIS`), broadcastable against the scores: the one multiply the scores took
    anyway. Held below float32's largest finite value, so that a score of 0 stays 0 (`qk` itself
    passed the range check; its product with a large head's factor may not)."""
    if FIT:
        qk = tl.expand_dims(tl.minimum(qk * q_back, 3.4028234663852886e38), 1 - AXIS)
    return qk


@triton.jit
def _softmax_step(s, m_i, l_i, HEADS_AXIS: tl.constexpr = 0):
    """Online-softmax update for scores s (base 2): [G, N], or [N, G] with `HEADS_AXIS` 1;
    returns (p, alpha, m_new, l_new), the statistics [G]."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1 - HEADS_AXIS))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - tl.expand_dims(m_safe, 1 - HEADS_AXIS))
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1 - HEADS_AXIS)


# -- what a program writes -------------------------------------------------------------------

@triton.jit
def _store_out(acc, cols, l_i, v_scale, r, qh, mask, out_ptr, stride_or, stride_oh):
    """The normalised output of rows (r, qh) [M] at columns `cols`; 0 where nothing was seen."""
    empty = l_i == 0.0
    inv = tl.where(empty, 0.0, v_scale / tl.where(empty, 1.0, l_i))
    ptrs = out_ptr + (r * stride_or + qh * stride_oh)[:, None] + cols[None, :]  # r: scalar or per row
    tl.store(ptrs, (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=mask[:, None])


@triton.jit
def _store_lse(m_i, l_i, r, qh, mask, lse_ptr, stride_lr, stride_lh):
    """The natural-log LSE of rows (r, qh) [M] from the base-2 running (max, sum); -inf if empty."""
    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    tl.store(lse_ptr + r * stride_lr + qh * stride_lh, lse, mask=mask)


@triton.jit
def _partial_rows(r, qh, split, NUM_Q_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Workspace rows of a split's partials: one per (row, query head, split)."""
    return (r * NUM_Q_HEADS + qh) * NUM_SPLITS + split


@triton.jit
def _store_partial(acc, cols, rows, mask, part_o_ptr, HEAD_DIM: tl.constexpr):
    """A split's unnormalised accumulator [M, len(cols)] into workspace `rows`."""
    tl.store(part_o_ptr + rows[:, None] * HEAD_DIM + cols[None, :], acc, mask=mask[:, None])


@triton.jit
def _store_stats(m_i, l_i, rows, mask, part_ml_ptr):
    """A split's running (max, sum) [M] into workspace `rows`."""
    tl.store(part_ml_ptr + rows * 2, m_i, mask=mask)
    tl.store(part_ml_ptr + rows * 2 + 1, l_i, mask=mask)


@triton.jit
def _store_result(acc, cols, m_i, l_i, r, qh, mask, split, v_scale, out_ptr, lse_ptr, part_o_ptr, part_ml_ptr,
                  stride_or, stride_oh, stride_lr, stride_lh, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, WRITE_LSE: tl.constexpr):
    """A program's whole result for one column set: output and LSE (one split) or partials."""
    if NUM_SPLITS == 1:
        _store_out(acc, cols, l_i, v_scale, r, qh, mask, out_ptr, stride_or, stride_oh)
        if WRITE_LSE:
            _store_lse(m_i, l_i, r, qh, mask, lse_ptr, stride_lr, stride_lh)
    else:
        rows = _partial_rows(r, qh, split, NUM_Q_HEADS, NUM_SPLITS)
        _store_partial(acc, cols, rows, mask, part_o_ptr, HEAD_DIM)
        _store_stats(m_i, l_i, rows, mask, part_ml_ptr)


@triton.jit
def _store_odd(acc_odd, dh, l_i, v_scale, r, qh, mask, split, out_ptr, part_o_ptr, stride_or, stride_oh,
               NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """An NVFP4 program's odd output columns (`_store_result` wrote the even ones and the stats)."""
    if NUM_SPLITS == 1:
        _store_out(acc_odd, 2 * dh + 1, l_i, v_scale, r, qh, mask, out_ptr, stride_or, stride_oh)
    else:
        rows = _partial_rows(r, qh, split, NUM_Q_HEADS, NUM_SPLITS)
        _store_partial(acc_odd, 2 * dh + 1, rows, mask, part_o_ptr, HEAD_DIM)


@triton.jit
def _fence_gpu(x):
    """`fence.acq_rel.gpu` in every thread (a scalar is computed by all threads); returns `x`."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _merge_if_last(counter_ptr, r, qh, mask, v_scale, part_o_ptr, part_ml_ptr, out_ptr, lse_ptr,
                   stride_or, stride_oh, stride_lr, stride_lh, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, WRITE_LSE: tl.constexpr, FENCE: tl.constexpr):
    """Split-K without a second kernel: the `NUM_SPLITS` programs of one (row, KV head, head
    chunk) count themselves in at `counter_ptr[program_id(0)]`; the last to arrive combines every
    split's partials, out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M), and takes
    `NUM_SPLITS` off the counter, which is zero again once a launch is done. Counting modulo
    `NUM_SPLITS` and subtracting (not zeroing) keeps the counter right even if two launches of
    one plan ever overlapped (two streams): their results would be wrong, later ones not.

    The count is one atomic by one thread, so each thread first fences its own partial stores at
    GPU scope (`FENCE`; a barrier alone orders them only within the CTA, and another SM could then
    count in and read them stale). The interpreter runs programs one after another: no fence."""
    pid = tl.program_id(0)
    if FENCE:
        pid = _fence_gpu(pid)
    tl.debug_barrier()  # every thread's partials are stored (and fenced) before the count
    done = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel", scope="gpu")
    if done % NUM_SPLITS == NUM_SPLITS - 1:
        if FENCE:
            pid = _fence_gpu(pid)
        row = (r * NUM_Q_HEADS + qh) * NUM_SPLITS
        m_max = tl.full(qh.shape, float("-inf"), tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            m_s = tl.load(part_ml_ptr + (row + s) * 2, mask=mask, other=float("-inf"), cache_modifier=".cg")
            m_max = tl.maximum(m_max, m_s)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        d = tl.arange(0, HEAD_DIM)
        total = tl.zeros(qh.shape, tl.float32)
        acc = tl.zeros([qh.shape[0], HEAD_DIM], tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            ml = part_ml_ptr + (row + s) * 2
            w = tl.exp2(tl.load(ml, mask=mask, other=float("-inf"), cache_modifier=".cg") - m_safe)
            total += tl.load(ml + 1, mask=mask, other=0.0, cache_modifier=".cg") * w
            part = tl.load(part_o_ptr + (row + s)[:, None] * HEAD_DIM + d[None, :], mask=mask[:, None], other=0.0,
                           cache_modifier=".cg")
            acc += part * w[:, None]
        _store_out(acc, d, total, v_scale, r, qh, mask, out_ptr, stride_or, stride_oh)
        if WRITE_LSE:
            _store_lse(m_max, total, r, qh, mask, lse_ptr, stride_lr, stride_lh)
        tl.atomic_add(counter_ptr + pid, -NUM_SPLITS, sem="relaxed", scope="gpu")


# -- the decode kernels ----------------------------------------------------------------------

@triton.jit
def split_decode_kernel(
    q_ptr, k_ptr, v_ptr, topk_ptr, table_ptr, row_request_ptr, req_start_ptr, q_pos_ptr,
    out_ptr, lse_ptr, part_o_ptr, part_ml_ptr,
    sm_scale_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, qk_scale, v_scale,
    num_pages, max_blocks, num_rows, v_offset,
    stride_qr, stride_qh, stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt,
    stride_th, stride_tr, stride_tk, stride_bt, stride_or, stride_oh, stride_lr, stride_lh,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    SM_SCALE_PTR: tl.constexpr, Q_SCALE_PTR: tl.constexpr, K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr,
    WRITE_LSE: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    BLOCK_G: tl.constexpr, GROUP_CHUNKS: tl.constexpr, TOPK_PAD: tl.constexpr,
    counter_ptr, IN_KERNEL_MERGE: tl.constexpr, MERGE_FENCE: tl.constexpr, Q_FIT: tl.constexpr = False,
    Q_SPLIT: tl.constexpr = False, SOFT_E4M3: tl.constexpr = False,
):
    """Layouts of plain elements (bf16, fp16, fp8): K and V rows of `HEAD_DIM` elements."""
    split, h, r, b, n, limit, qh, g_mask = _program(row_request_ptr, q_pos_ptr, max_blocks, NUM_KV_HEADS, GROUP,
                                                     PAGE, BLOCK_G, GROUP_CHUNKS)
    d = tl.arange(0, HEAD_DIM)
    q = _e4m3(tl.load(q_ptr + r * stride_qr + qh[:, None] * stride_qh + d[None, :], mask=g_mask[:, None], other=0.0),
              SOFT_E4M3)
    qk, vs = _scales(qk_scale, v_scale, sm_scale_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
                     SM_SCALE_PTR, Q_SCALE_PTR, K_SCALE_PTR, V_SCALE_PTR)
    q, _, q_lo, _, q_back = _query_terms(q, q, False, 0, Q_FIT, Q_SPLIT, COMPUTE, SOFT_E4M3)
    qk = _score_factor(qk, q_back, 0, Q_FIT)

    rank, ids, pages, count = _entries(topk_ptr, table_ptr, h, r, b, limit, num_pages,
                                       stride_th, stride_tr, stride_tk, stride_bt, TOPK, TOPK_PAD)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    CHUNKS: tl.constexpr = PAGE // BLOCK_N
    offs = tl.arange(0, BLOCK_N)
    for step in tl.range(0, _steps(split, count, TILES_PER_SPLIT, CHUNKS), num_stages=NUM_STAGES):
        page, tok, visible = _tile(split, step, rank, ids, pages, n, offs, TILES_PER_SPLIT, CHUNKS, BLOCK_N, PAGE)
        k_rows = k_ptr + page * stride_kp + h * stride_kh + tok[:, None] * stride_kt
        k = _e4m3(tl.load(k_rows + d[None, :], mask=visible[:, None], other=0.0), SOFT_E4M3).to(COMPUTE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if Q_SPLIT:
            s = tl.dot(q_lo, tl.trans(k), s, input_precision=PRECISION)
        s = tl.where(visible[None, :], s * qk, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
        v_rows = v_ptr + v_offset + page * stride_vp + h * stride_vh + tok[:, None] * stride_vt
        v = _e4m3(tl.load(v_rows + d[None, :], mask=visible[:, None], other=0.0), SOFT_E4M3).to(COMPUTE)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=PRECISION)
    _store_result(acc, d, m_i, l_i, r, qh, g_mask, split, vs, out_ptr, lse_ptr, part_o_ptr, part_ml_ptr,
                  stride_or, stride_oh, stride_lr, stride_lh, NUM_KV_HEADS * GROUP, HEAD_DIM, NUM_SPLITS, WRITE_LSE)
    if IN_KERNEL_MERGE:
        _merge_if_last(counter_ptr, r, qh, g_mask, vs, part_o_ptr, part_ml_ptr, out_ptr, lse_ptr, stride_or,
                       stride_oh, stride_lr, stride_lh, NUM_KV_HEADS * GROUP, HEAD_DIM, NUM_SPLITS, WRITE_LSE,
                       MERGE_FENCE)


@triton.jit
def _nvfp4_scale_bytes(slot, tok, visible, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The E4M3 block-scale bytes of tokens `tok` [N] of a head slot, [N, D/16]; 0 (a zero scale)
    for tokens not `visible`, whatever their bytes hold (an unread scale may be NaN).

    Value scales run along tokens in quads (`INTERLEAVED`): a token mask would split every 4-byte
    quad into single bytes, which cp.async cannot copy, and the load would not be pipelined; so
    the quads are loaded whole (inside the page: in bounds) and the bytes of tokens past the
    row's length are zeroed after the load."""
    GROUPS: tl.constexpr = HEAD_DIM // 16
    gi = tl.arange(0, GROUPS)
    pos = nvfp4_scale_offset(tok[:, None], gi[None, :], GROUPS, INTERLEAVED)
    if INTERLEAVED:
        return tl.where(visible[:, None], tl.load(slot + PAGE * (HEAD_DIM // 2) + pos), 0)
    return tl.load(slot + PAGE * (HEAD_DIM // 2) + pos, mask=visible[:, None], other=0)


@triton.jit
def _nvfp4_tile(slot, tok, visible, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                INTERLEAVED: tl.constexpr, COMPUTE: tl.constexpr, DECODE_ASM: tl.constexpr, CODES_ROWS: tl.constexpr,
                SOFT: tl.constexpr):
    """Dequantize one tile of a head slot: (even elements, odd elements), each [N, D/2].

    A code's magnitude bits shifted into an E4M3 byte (`m << 2`, sign to bit 7) are exactly the
    E2M1 value times 2^-6 (codes 0 and 1 land on E4M3 zero and subnormal), so the hardware
    fp8 conversion decodes them; the block scale (x 64) is exact in fp16/bf16, and so is the
    product (at most 6 significant bits, within range). `DECODE_ASM` (a GPU with fp16 dots) does
    the same in packed PTX, two elements per instruction. `SOFT`: the E4M3 bytes decoded by bits
    (`_e4m3_bytes`)."""
    GROUPS: tl.constexpr = HEAD_DIM // 16
    gi = tl.arange(0, GROUPS)
    if CODES_ROWS:  # each token's D/2 code bytes as one contiguous row (wide loads), then grouped
        di = tl.arange(0, HEAD_DIM // 2)
        rows = tl.load(slot + tok[:, None] * (HEAD_DIM // 2) + di[None, :], mask=visible[:, None], other=0)
        codes = tl.reshape(rows, (BLOCK_N, GROUPS, 8))
    else:
        bi = tl.arange(0, 8)
        code_ptr = slot + tok[:, None, None] * (HEAD_DIM // 2) + gi[None, :, None] * 8 + bi[None, None, :]
        codes = tl.load(code_ptr, mask=visible[:, None, None], other=0)  # uint8 [N, G, 8]
    scale_bytes = _nvfp4_scale_bytes(slot, tok, visible, PAGE, HEAD_DIM, INTERLEAVED)
    scale = (_e4m3_bytes(scale_bytes, SOFT).to(tl.float32) * 64.0).to(COMPUTE)[:, :, None]
    if DECODE_ASM:
        even, odd = tl.inline_asm_elementwise(_NVFP4_DECODE_ASM, "=r,=r,=r,=r,r,r,r", [codes, scale],
                                              dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        lo = ((codes << 2) & 0x1C) | ((codes << 4) & 0x80)
        hi = ((codes >> 2) & 0x1C) | (codes & 0x80)
        even = _e4m3_bytes(lo, SOFT).to(COMPUTE) * scale
        odd = _e4m3_bytes(hi, SOFT).to(COMPUTE) * scale
    return tl.reshape(even, (BLOCK_N, HEAD_DIM // 2)), tl.reshape(odd, (BLOCK_N, HEAD_DIM // 2))


@triton.jit
def nvfp4_decode_kernel(
    q_ptr, k_ptr, v_ptr, topk_ptr, table_ptr, row_request_ptr, req_start_ptr, q_pos_ptr,
    out_ptr, lse_ptr, part_o_ptr, part_ml_ptr,
    sm_scale_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, qk_scale, v_scale,
    num_pages, max_blocks, num_rows, v_offset,
    stride_qr, stride_qh, stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt,
    stride_th, stride_tr, stride_tk, stride_bt, stride_or, stride_oh, stride_lr, stride_lh,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    SM_SCALE_PTR: tl.constexpr, Q_SCALE_PTR: tl.constexpr, K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr,
    WRITE_LSE: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    BLOCK_G: tl.constexpr, GROUP_CHUNKS: tl.constexpr, TOPK_PAD: tl.constexpr, DECODE_ASM: tl.constexpr,
    CODES_ROWS: tl.constexpr, SWAP_AB: tl.constexpr,
    counter_ptr, IN_KERNEL_MERGE: tl.constexpr, MERGE_FENCE: tl.constexpr, Q_FIT: tl.constexpr = False,
    Q_SPLIT: tl.constexpr = False, SOFT_E4M3: tl.constexpr = False,
):
    """NVFP4 head slots: `k` / `v` point at a page's K slot and V slot of head h. Even and odd
    head-dim elements are kept apart (low and high nibbles), so q is split the same way and the
    output is written back interleaved."""
    split, h, r, b, n, limit, qh, g_mask = _program(row_request_ptr, q_pos_ptr, max_blocks, NUM_KV_HEADS, GROUP,
                                                     PAGE, BLOCK_G, GROUP_CHUNKS)
    dh = tl.arange(0, HEAD_DIM // 2)
    qk, vs = _scales(qk_scale, v_scale, sm_scale_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
                     SM_SCALE_PTR, Q_SCALE_PTR, K_SCALE_PTR, V_SCALE_PTR)
    rank, ids, pages, count = _entries(topk_ptr, table_ptr, h, r, b, limit, num_pages,
                                       stride_th, stride_tr, stride_tk, stride_bt, TOPK, TOPK_PAD)
    steps = _steps(split, count, TILES_PER_SPLIT, PAGE // BLOCK_N)
    acc_even, acc_odd, m_i, l_i = _nvfp4_walk(
        q_ptr, k_ptr, v_ptr, r, h, qh, g_mask, n, split, steps, rank, ids, pages, qk, v_offset,
        stride_qr, stride_qh, stride_kp, stride_kh, stride_vp, stride_vh, HEAD_DIM, PAGE, BLOCK_N, BLOCK_G,
        TILES_PER_SPLIT, COMPUTE, PRECISION, NUM_STAGES, DECODE_ASM, CODES_ROWS, SWAP_AB, Q_FIT, Q_SPLIT, SOFT_E4M3)
    _store_result(acc_even, 2 * dh, m_i, l_i, r, qh, g_mask, split, vs, out_ptr, lse_ptr, part_o_ptr, part_ml_ptr,
                  stride_or, stride_oh, stride_lr, stride_lh, NUM_KV_HEADS * GROUP, HEAD_DIM, NUM_SPLITS, WRITE_LSE)
    # the odd columns: the statistics were written with the even ones
    _store_odd(acc_odd, dh, l_i, vs, r, qh, g_mask, split, out_ptr, part_o_ptr, stride_or, stride_oh,
               NUM_KV_HEADS * GROUP, HEAD_DIM, NUM_SPLITS)
    if IN_KERNEL_MERGE:
        _merge_if_last(counter_ptr, r, qh, g_mask, vs, part_o_ptr, part_ml_ptr, out_ptr, lse_ptr, stride_or,
                       stride_oh, stride_lr, stride_lh, NUM_KV_HEADS * GROUP, HEAD_DIM, NUM_SPLITS, WRITE_LSE,
                       MERGE_FENCE)


@triton.jit
def _nvfp4_walk(q_ptr, k_ptr, v_ptr, r, h, qh, g_mask, n, split, steps, rank, ids, pages, qk, v_offset,
                stride_qr, stride_qh, stride_kp, stride_kh, stride_vp, stride_vh,
                HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                TILES_PER_SPLIT: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
                NUM_STAGES: tl.constexpr, DECODE_ASM: tl.constexpr, CODES_ROWS: tl.constexpr, SWAP_AB: tl.constexpr,
                Q_FIT: tl.constexpr, Q_SPLIT: tl.constexpr, SOFT_E4M3: tl.constexpr):
    """A split's walk over its NVFP4 tiles. Returns (even accumulator, odd accumulator) [G, D/2]
    and the running (max, sum) [G].

    The query heads are the dots' rows (scores [G, N], acc += P V), or with `SWAP_AB` the tokens
    are (scores^T [N, G] = K q^T, acc^T [D/2, G] += V^T P^T): the decoded tiles then feed the
    tensor cores' wide M side (Hopper's wgmma needs M >= 64) and the few query heads the narrow
    N side. The results are the same."""
    dh = tl.arange(0, HEAD_DIM // 2)
    q_base = q_ptr + r * stride_qr
    if SWAP_AB:  # q^T [D/2, G], acc^T [D/2, G]
        q_even = tl.load(q_base + qh[None, :] * stride_qh + 2 * dh[:, None], mask=g_mask[None, :], other=0.0)
        q_odd = tl.load(q_base + qh[None, :] * stride_qh + 2 * dh[:, None] + 1, mask=g_mask[None, :], other=0.0)
        q_even, q_odd = _e4m3(q_even, SOFT_E4M3), _e4m3(q_odd, SOFT_E4M3)
        acc_even = tl.zeros([HEAD_DIM // 2, BLOCK_G], tl.float32)
    else:  # q [G, D/2], acc [G, D/2]
        q_even = tl.load(q_base + qh[:, None] * stride_qh + 2 * dh[None, :], mask=g_mask[:, None], other=0.0)
        q_odd = tl.load(q_base + qh[:, None] * stride_qh + 2 * dh[None, :] + 1, mask=g_mask[:, None], other=0.0)
        q_even, q_odd = _e4m3(q_even, SOFT_E4M3), _e4m3(q_odd, SOFT_E4M3)
        acc_even = tl.zeros([BLOCK_G, HEAD_DIM // 2], tl.float32)
    q_even, q_odd, lo_even, lo_odd, q_back = _query_terms(q_even, q_odd, True, 1 if SWAP_AB else 0, Q_FIT, Q_SPLIT,
                                                          COMPUTE, SOFT_E4M3)
    qk = _score_factor(qk, q_back, 1 if SWAP_AB else 0, Q_FIT)
    acc_odd = acc_even
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    CHUNKS: tl.constexpr = PAGE // BLOCK_N
    offs = tl.arange(0, BLOCK_N)
    for step in tl.range(0, steps, num_stages=NUM_STAGES):
        page, tok, visible = _tile(split, step, rank, ids, pages, n, offs, TILES_PER_SPLIT, CHUNKS, BLOCK_N, PAGE)
        k_even, k_odd = _nvfp4_tile(k_ptr + page * stride_kp + h * stride_kh, tok, visible, PAGE, HEAD_DIM,
                                    BLOCK_N, False, COMPUTE, DECODE_ASM, CODES_ROWS, SOFT_E4M3)
        v_slot = v_ptr + v_offset + page * stride_vp + h * stride_vh
        if not SWAP_AB:
            # the value tile decoded before the scores: on sm_90 the heads-as-rows walk then needs
            # 168 registers instead of 231 (3 programs per SM instead of 2; the swap-AB walk
            # gains nothing from it)
            v_even, v_odd = _nvfp4_tile(v_slot, tok, visible, PAGE, HEAD_DIM, BLOCK_N, True, COMPUTE, DECODE_ASM,
                                        CODES_ROWS, SOFT_E4M3)
        if SWAP_AB:
            s = tl.dot(k_even, q_even, input_precision=PRECISION)
            s = tl.dot(k_odd, q_odd, s, input_precision=PRECISION)
            if Q_SPLIT:
                s = tl.dot(k_even, lo_even, s, input_precision=PRECISION)
                s = tl.dot(k_odd, lo_odd, s, input_precision=PRECISION)
            s = tl.where(visible[:, None], s * qk, float("-inf"))
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, 1)
        else:
            s = tl.dot(q_even, tl.trans(k_even), input_precision=PRECISION)
            s = tl.dot(q_odd, tl.trans(k_odd), s, input_precision=PRECISION)
            if Q_SPLIT:
                s = tl.dot(lo_even, tl.trans(k_even), s, input_precision=PRECISION)
                s = tl.dot(lo_odd, tl.trans(k_odd), s, input_precision=PRECISION)
            s = tl.where(visible[None, :], s * qk, float("-inf"))
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
        p = p.to(COMPUTE)
        if SWAP_AB:
            v_even, v_odd = _nvfp4_tile(v_slot, tok, visible, PAGE, HEAD_DIM, BLOCK_N, True, COMPUTE, DECODE_ASM,
                                        CODES_ROWS, SOFT_E4M3)
            acc_even = tl.dot(tl.trans(v_even), p, acc_even * alpha[None, :], input_precision=PRECISION)
            acc_odd = tl.dot(tl.trans(v_odd), p, acc_odd * alpha[None, :], input_precision=PRECISION)
        else:
            acc_even = tl.dot(p, v_even, acc_even * alpha[:, None], input_precision=PRECISION)
            acc_odd = tl.dot(p, v_odd, acc_odd * alpha[:, None], input_precision=PRECISION)
    if SWAP_AB:
        acc_even, acc_odd = tl.trans(acc_even), tl.trans(acc_odd)
    return acc_even, acc_odd, m_i, l_i


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def split_dedup_kernel(
    q_ptr, k_ptr, v_ptr, topk_ptr, table_ptr, row_request_ptr, req_start_ptr, q_pos_ptr,
    out_ptr, lse_ptr, part_o_ptr, part_ml_ptr,
    sm_scale_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, qk_scale, v_scale,
    num_pages, max_blocks, num_rows, v_offset,
    stride_qr, stride_qh, stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt,
    stride_th, stride_tr, stride_tk, stride_bt, stride_or, stride_oh, stride_lr, stride_lh,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    SM_SCALE_PTR: tl.constexpr, Q_SCALE_PTR: tl.constexpr, K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr,
    WRITE_LSE: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    TOKENS: tl.constexpr, TOKEN_CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, ENTRIES_PAD: tl.constexpr,
    BLOCK_SCALED: tl.constexpr = False, DECODE_ASM: tl.constexpr = False, CODES_ROWS: tl.constexpr = True,
    Q_FIT: tl.constexpr = False, Q_SPLIT: tl.constexpr = False, SOFT_E4M3: tl.constexpr = False,
):
    """Page dedup for several query tokens of one request (every layout: `BLOCK_SCALED` for
    NVFP4 head slots, whose even and odd head-dim elements are kept apart as in
    `nvfp4_decode_kernel`).

    One program takes up to TOKENS consecutive tokens of request b (all their query heads of KV
    head h: BLOCK_M rows), builds the union of their index lists in registers, and walks only
    the union's tiles (a loop of dynamic length): each (request, KV head, page) is read once
    per program; every row keeps its own selection (the union entry's token bitmask) and its
    own causal limit. Results are exactly those of the per-token kernel.
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    c = pid % TOKEN_CHUNKS
    h = (pid // TOKEN_CHUNKS) % NUM_KV_HEADS
    b = pid // (TOKEN_CHUNKS * NUM_KV_HEADS)
    # the request's rows, clamped into [0, num_rows) and to the rows this grid covers: whatever
    # req_start holds, no program reads or writes a row outside q / out
    start = tl.minimum(tl.maximum(tl.load(req_start_ptr + b), 0), num_rows)
    count = tl.load(req_start_ptr + b + 1) - start
    count = tl.maximum(tl.minimum(count, tl.minimum(TOKENS * TOKEN_CHUNKS, num_rows - start)), 0)
    first_token = c * TOKENS

    # rows: token ti of the chunk, query head g
    m = tl.arange(0, BLOCK_M)
    ti = m // GROUP
    g = m % GROUP
    row_ok = (ti < TOKENS) & (first_token + ti < count)
    r = start + first_token + ti
    qh = h * GROUP + g
    n_row = tl.maximum(tl.load(q_pos_ptr + r, mask=row_ok, other=-1).to(tl.int64) + 1, 0)  # visible tokens per row
    d = tl.arange(0, HEAD_DIM)
    dh = tl.arange(0, HEAD_DIM // 2)
    q_rows = q_ptr + r[:, None] * stride_qr + qh[:, None] * stride_qh
    if BLOCK_SCALED:
        q = _e4m3(tl.load(q_rows + 2 * dh[None, :], mask=row_ok[:, None], other=0.0), SOFT_E4M3)  # the even elements
        q_odd = _e4m3(tl.load(q_rows + 2 * dh[None, :] + 1, mask=row_ok[:, None], other=0.0), SOFT_E4M3)
        q, q_odd, q_lo, lo_odd, q_back = _query_terms(q, q_odd, True, 0, Q_FIT, Q_SPLIT, COMPUTE, SOFT_E4M3)
        acc_odd = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
    else:
        q = _e4m3(tl.load(q_rows + d[None, :], mask=row_ok[:, None], other=0.0), SOFT_E4M3)
        q, _, q_lo, _, q_back = _query_terms(q, q, False, 0, Q_FIT, Q_SPLIT, COMPUTE, SOFT_E4M3)
    qk, vs = _scales(qk_scale, v_scale, sm_scale_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
                     SM_SCALE_PTR, Q_SCALE_PTR, K_SCALE_PTR, V_SCALE_PTR)
    qk = _score_factor(qk, q_back, 0, Q_FIT)

    # the chunk's entries: token ei's entry et; resolved once (no dependent loads in the loop)
    e = tl.arange(0, ENTRIES_PAD)
    ei = e // TOPK
    e_ok = (ei < TOKENS) & (first_token + ei < count)
    er = start + first_token + ei
    ids = tl.load(topk_ptr + h * stride_th + er * stride_tr + (e % TOPK) * stride_tk, mask=e_ok, other=-1)
    n_e = tl.maximum(tl.load(q_pos_ptr + er, mask=e_ok, other=-1).to(tl.int64) + 1, 0)
    used = e_ok & (ids >= 0) & (ids < tl.minimum((n_e + PAGE - 1) // PAGE, max_blocks))
    ids = tl.where(used, ids, 0)
    pages = tl.load(table_ptr + b.to(tl.int64) * stride_bt + ids, mask=used, other=-1)
    used = used & (pages >= 0) & (pages < num_pages)
    key = tl.where(used, ids, -1)
    bit = tl.where(used, tl.full([ENTRIES_PAD], 1, tl.int64) << ei.to(tl.int64), 0)

    # the union, resolved once: an entry leads if no earlier entry holds its block; a lead
    # carries the bitmask of the chunk's tokens that chose the block, and its rank in the union
    same = (key[:, None] == key[None, :]) & (key[:, None] >= 0)
    earlier = tl.sum(tl.where(same & (e[None, :] < e[:, None]), 1, 0), axis=1)
    lead = tl.where((key >= 0) & (earlier == 0), 1, 0)
    chosen_by = tl.reduce(tl.where(same, bit[None, :], 0), 1, _or)
    rank = tl.cumsum(lead, axis=0) - 1
    CHUNKS: tl.constexpr = PAGE // BLOCK_N
    total = tl.sum(lead, axis=0) * CHUNKS  # tiles of the union: only these are walked
    per_split = (total + NUM_SPLITS - 1) // NUM_SPLITS
    lo = split * per_split
    hi = tl.minimum(lo + per_split, total)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM // 2 if BLOCK_SCALED else HEAD_DIM], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for tile in tl.range(lo, hi, num_stages=NUM_STAGES):
        sel = (lead > 0) & (rank == tile // CHUNKS)
        key_t = tl.sum(tl.where(sel, key, 0), axis=0)
        tokens = tl.sum(tl.where(sel, chosen_by, 0), axis=0)
        page = tl.sum(tl.where(sel, pages, 0), axis=0).to(tl.int64)
        tok = (tile % CHUNKS) * BLOCK_N + offs
        # each row sees the tile up to its own causal limit if it chose the block, else not at
        # all; the tile is loaded up to the furthest of those limits and no further
        chose = ((tokens >> ti.to(tl.int64)) & 1) != 0
        limit_row = tl.where(chose, n_row - key_t.to(tl.int64) * PAGE, 0)
        kv_visible = tok < tl.max(limit_row, axis=0)
        if BLOCK_SCALED:
            k, k_odd = _nvfp4_tile(k_ptr + page * stride_kp + h * stride_kh, tok, kv_visible, PAGE, HEAD_DIM,
                                   BLOCK_N, False, COMPUTE, DECODE_ASM, CODES_ROWS, SOFT_E4M3)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            s = tl.dot(q_odd, tl.trans(k_odd), s, input_precision=PRECISION)
            if Q_SPLIT:
                s = tl.dot(q_lo, tl.trans(k), s, input_precision=PRECISION)
                s = tl.dot(lo_odd, tl.trans(k_odd), s, input_precision=PRECISION)
        else:
            k_rows = k_ptr + page * stride_kp + h * stride_kh + tok[:, None] * stride_kt
            k = _e4m3(tl.load(k_rows + d[None, :], mask=kv_visible[:, None], other=0.0), SOFT_E4M3).to(COMPUTE)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            if Q_SPLIT:
                s = tl.dot(q_lo, tl.trans(k), s, input_precision=PRECISION)
        s = s * qk
        s = tl.where(tok[None, :] < limit_row[:, None], s, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
        p = p.to(COMPUTE)
        if BLOCK_SCALED:
            v, v_odd = _nvfp4_tile(v_ptr + v_offset + page * stride_vp + h * stride_vh, tok, kv_visible, PAGE,
                                   HEAD_DIM, BLOCK_N, True, COMPUTE, DECODE_ASM, CODES_ROWS, SOFT_E4M3)
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd, input_precision=PRECISION)
        else:
            v_rows = v_ptr + v_offset + page * stride_vp + h * stride_vh + tok[:, None] * stride_vt
            v = _e4m3(tl.load(v_rows + d[None, :], mask=kv_visible[:, None], other=0.0), SOFT_E4M3).to(COMPUTE)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    cols = 2 * dh if BLOCK_SCALED else d
    _store_result(acc, cols, m_i, l_i, r, qh, row_ok, split, vs, out_ptr, lse_ptr, part_o_ptr, part_ml_ptr,
                  stride_or, stride_oh, stride_lr, stride_lh, NUM_KV_HEADS * GROUP, HEAD_DIM, NUM_SPLITS, WRITE_LSE)
    if BLOCK_SCALED:  # the odd columns: the statistics were written with the even ones
        _store_odd(acc_odd, dh, l_i, vs, r, qh, row_ok, split, out_ptr, part_o_ptr, stride_or, stride_oh,
                   NUM_KV_HEADS * GROUP, HEAD_DIM, NUM_SPLITS)


# -- after the decode ------------------------------------------------------------------------

@triton.jit
def merge_kernel(
    part_o_ptr, part_ml_ptr, out_ptr, lse_ptr, v_scale_ptr, v_scale, q_pos_ptr,
    stride_or, stride_oh, stride_lr, stride_lh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    V_SCALE_PTR: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Combine the splits of one (row, query head): out = sum_s acc_s 2^(m_s - M) / L.

    A row at a negative position sees nothing: it gets 0 and an LSE of -inf without reading the
    workspace (the dedup kernel writes no partials for rows owned by no request)."""
    pid = tl.program_id(0)  # r * NUM_Q_HEADS + qh
    r = pid // NUM_Q_HEADS
    qh = pid % NUM_Q_HEADS
    s = tl.arange(0, BLOCK_S)
    s_mask = s < tl.where(tl.load(q_pos_ptr + r) >= 0, NUM_SPLITS, 0)
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


@triton.jit
def pad_rows_kernel(q_pos_ptr, out_ptr, lse_ptr, stride_or, stride_oh, stride_lr, stride_lh,
                    NUM_Q_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                    WRITE_LSE: tl.constexpr):
    """Rows at a negative position attend nothing: out 0, LSE -inf. Run after a fused dedup
    kernel of a ragged step, whose programs do not cover the rows owned by no request."""
    r = tl.program_id(0)
    if tl.load(q_pos_ptr + r) < 0:
        qh = tl.arange(0, BLOCK_H)
        h_ok = qh < NUM_Q_HEADS
        d = tl.arange(0, HEAD_DIM)
        ptrs = out_ptr + r * stride_or + qh[:, None] * stride_oh + d[None, :]
        tl.store(ptrs, tl.zeros([BLOCK_H, HEAD_DIM], tl.float32).to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
        if WRITE_LSE:
            tl.store(lse_ptr + r * stride_lr + qh * stride_lh, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=h_ok)
