"""The CuTe DSL NVFP4 sparse-decode kernel (Hopper and later; `mma.sync` m16n8k16, f16 operands,
f32 accumulators). Import only where `nvidia-cutlass-dsl` is installed.

What it does differently from the Triton kernel: every thread loads exactly the code bytes its
tensor-core operand registers need and decodes them in registers, so no decoded tile goes
through shared memory. Two free permutations make those loads wide and contiguous:

- the head dimension is summed over in q k^T, so its order is free: lane (g, t4) of a warp
  (g = lane / 4, t4 = lane % 4) holds elements `32 t4 .. 32 t4 + 31` of a key (16 bytes, one
  16-byte load, two block scales) and the same elements of q;
- the 16 tokens of a step are ordered so that the score fragment of lane (g, t4) covers tokens
  `4 t4 .. 4 t4 + 3`, which is exactly one quad of the value scales (interleaved by token quads
  in the layout): the value operand of lane (g, t4) is elements `16 g .. 16 g + 15` of those four
  tokens (8 bytes each, one block scale each, one 4-byte scale load for all four). The output
  columns come out permuted the same way and are put back in the epilogue.

A CTA serves one (row, KV head, chunk of 16 query heads, split) with `WARPS` warps; each warp
walks its own 16-token steps with the next `stages - 1` steps' bytes in flight (`cp.async` into
thread-private shared-memory slots), keeps its own online softmax, and the warps are
combined through shared memory at the end. One split writes the output (and LSE); several write
the same workspace partials as the Triton kernels, which the Triton merge kernel combines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from msa.backends.cute import ptx
from msa.backends.cute.config import (
    DEFAULT_MIN_CTAS,
    DEFAULT_QK_CHAINS,
    DEFAULT_STAGES,
    HOST_ARG_KINDS,
    SLOTS,
    STEP,
    WARPS,
)

__all__ = ["KernelSpec", "build", "compile_args"]

_NEG_INF = float("-inf")


@attrs.frozen
class KernelSpec:
    """The compile-time constants of one kernel (heads, GQA group and top-k are runtime values).

    Attributes:
        kind: the cache: "nvfp4" (head slots) or "fp8" (E4M3 keys and values, per-tensor scales).
        page_size: tokens per page (a multiple of 16).
        q_kind / out_kind: "bf16", "f16" or "e4m3" (q) and "bf16" / "f16" (the output).
        final: one split: the kernel writes the normalised output (else workspace partials).
        write_lse: also write the natural-log LSE (with `final`).
        head_dim: D (128).
        stages: steps each warp has in flight (asynchronous copies into shared memory).
        qk_chains: independent accumulator chains of a score tile's 8 mma k-steps (1, 2 or 4).
        min_ctas: CTAs per SM the registers must allow (launch bounds; 0 leaves it to ptxas).
    """

    kind: str
    page_size: int
    q_kind: str
    out_kind: str
    final: bool
    write_lse: bool
    head_dim: int = 128
    stages: int = DEFAULT_STAGES
    qk_chains: int = DEFAULT_QK_CHAINS
    min_ctas: int = DEFAULT_MIN_CTAS


def _flag(cond: Any) -> Any:
    """A DSL condition as an Int32 0/1 (what the PTX helpers take as a predicate)."""
    return cutlass.select_(cond, Int32(1), Int32(0))


def _step_vis(u: Any, n: Any, sm_page: Any, sm_jid: Any, P: int) -> tuple[Any, Any]:
    """(page, visible tokens of step `u`, 0..16) from the compacted entry table."""
    SPP = P // STEP
    e = Int32(ptx.min64(u // SPP, 31))
    tok0 = (u % SPP) * STEP
    vis = ptx.min64(ptx.max64(n - Int64(sm_jid[e]) * P - tok0, 0), STEP)
    return Int64(sm_page[e]), Int32(vis)


def _issue_step(slot: Any, u: Any, active: Any, n: Any, sm_page: Any, sm_jid: Any, k_head: Any, v_head: Any,
                stride_kp: Any, stride_kt: Any, stride_vp: Any, stride_vt: Any, g: Any, t4: Any, P: int,
                kind: str) -> None:
    """Start copying step `u`'s bytes (lane (g, t4)'s share) into the thread's stage `slot` (a
    shared address). Tokens past the row's length, and every token when `active` is 0, are not
    read (zeros land instead).

    nvfp4 (80-byte slot): key codes of two tokens (bytes 0-31), value codes of four (32-63), the
    two keys' scale words (64-71: the 4-byte word holding the lane's two block scales) and the
    value scale quad (72-75). fp8 (144-byte slot, 128 of data): the two keys' 32 bytes (0-63), the four
    values' 16 bytes (64-127)."""
    page, vis = _step_vis(u, n, sm_page, sm_jid, P)
    vis = vis * active
    tok0 = (u % (P // STEP)) * STEP
    k_page = k_head + page * stride_kp
    v_page = v_head + page * stride_vp
    for nb in range(2):
        tk = 4 * (g // 2) + 2 * nb + g % 2
        pk = _flag(tk < vis)
        if kind == "nvfp4":
            ptx.cp_async(slot + 16 * nb, k_page + (tok0 + tk) * 64 + 16 * t4, k_head, pk, 16)
            ptx.cp_async(slot + 64 + 4 * nb, k_page + P * 64 + (tok0 + tk) * 8 + 4 * (t4 // 2), k_head, pk, 4)
        else:
            for half in range(2):
                ptx.cp_async(slot + 32 * nb + 16 * half, k_page + (tok0 + tk) * stride_kt + 32 * t4 + 16 * half,
                             k_head, pk, 16)
    for i in range(4):
        tv = 4 * t4 + i
        pv = _flag(tv < vis)
        if kind == "nvfp4":
            ptx.cp_async(slot + 32 + 8 * i, v_page + (tok0 + tv) * 64 + 8 * g, k_head, pv, 8)
        else:
            ptx.cp_async(slot + 64 + 16 * i, v_page + (tok0 + tv) * stride_vt + 16 * g, k_head, pv, 16)
    if kind == "nvfp4":
        ptx.cp_async(slot + 72, v_page + P * 64 + (tok0 // 4 + t4) * 32 + 4 * g, k_head, _flag(4 * t4 < vis), 4)


def _key_operands(slot: Any, t4: Any, kind: str) -> list[list[tuple[Any, Any]]]:
    """The two key tokens' B-operand registers, [n-block][k-step] -> (elements 0-1, 2-3)."""
    out = []
    for nb in range(2):
        kb = []
        if kind == "nvfp4":
            words = ptx.lds(slot + 16 * nb, 4)
            sc = ptx.e4m3x2_scale(ptx.lds(slot + 64 + 4 * nb, 1)[0] >> (16 * (t4 % 2)))
            reps = (ptx.replicate_half(sc, False), ptx.replicate_half(sc, True))
            for w in range(4):
                regs = ptx.nvfp4_k_word(words[w], reps[w // 2])
                kb.append((regs[0], regs[1]))
                kb.append((regs[2], regs[3]))
        else:
            words = ptx.lds(slot + 32 * nb, 4) + ptx.lds(slot + 32 * nb + 16, 4)
            for w in range(8):
                pair = ptx.e4m3x4_to_f16x2(words[w])
                kb.append((pair[0], pair[1]))
        out.append(kb)
    return out


def _value_operands(slot: Any, vis: Any, t4: Any, kind: str) -> list[tuple[Any, Any]]:
    """The four value tokens' B-operand registers of the 16 n-blocks: n-block j is element
    16 g + j; each (tokens 4 t4, 4 t4 + 1), (tokens 4 t4 + 2, 4 t4 + 3)."""
    vb: list[tuple[Any, Any]] = [(None, None)] * 16
    if kind == "nvfp4":
        words = ptx.lds(slot + 32, 4) + ptx.lds(slot + 48, 4)  # token i, word w: 2 i + w
        sv = ptx.keep_low_bytes(ptx.lds(slot + 72, 1)[0], vis - 4 * t4)
        vscale = (ptx.e4m3x2_scale(sv), ptx.e4m3x2_scale(sv >> 16))
        for wv in range(2):
            pair0 = ptx.nvfp4_v_words(words[wv], words[2 + wv], vscale[0])
            pair1 = ptx.nvfp4_v_words(words[4 + wv], words[6 + wv], vscale[1])
            for e in range(8):
                vb[8 * wv + (2 * e if e < 4 else 2 * (e - 4) + 1)] = (pair0[e], pair1[e])
    else:
        words = [ptx.lds(slot + 64 + 16 * i, 4) for i in range(4)]  # token i: 16 elements
        for w in range(4):
            pair0 = ptx.e4m3_v_words(words[0][w], words[1][w])
            pair1 = ptx.e4m3_v_words(words[2][w], words[3][w])
            for e in range(4):
                vb[4 * w + e] = (pair0[e], pair1[e])
    return vb


def compile_args() -> list[Any]:
    """Placeholder values of the host function's arguments (`HOST_ARG_KINDS`), for `cute.compile`
    (only their types matter: every value is a runtime argument)."""
    from cutlass.runtime import make_fake_stream

    sample: dict[str, Callable[[], Any]] = {"i64": lambda: Int64(0), "i32": lambda: Int32(1),
                                            "f32": lambda: Float32(1.0), "stream": make_fake_stream}
    return [sample[kind]() for kind in HOST_ARG_KINDS]


def build(spec: KernelSpec) -> Any:  # noqa: C901 - one kernel, written out
    """The `@cute.jit` host function of `spec`'s kernel; its arguments are device addresses
    (int64), strides and sizes (int64 / int32), the two host scale factors, the grid and the
    stream."""
    if spec.head_dim != 128:
        raise ValueError("the CuTe DSL kernel is written for head_dim 128")
    D = spec.head_dim
    KIND = spec.kind
    SLOT = SLOTS[KIND]
    P = spec.page_size
    SPP = P // STEP  # steps per page
    Q_BYTES = {"bf16": 2, "f16": 2, "e4m3": 1}[spec.q_kind]
    OUT_BYTES = 2
    STAGES = spec.stages
    CHAINS = spec.qk_chains
    # ask ptxas for registers that fit MIN_CTAS CTAs per SM (0: its own choice)
    MIN_CTAS = spec.min_ctas
    ROW = D + D // 32  # shared accumulator row: one pad float per 32 (conflict-free writes)
    BUFFER_FLOATS = max(WARPS * 16 * ROW, STAGES * WARPS * 32 * SLOT // 4)
    STAGE_BYTES = WARPS * 32 * SLOT
    final, write_lse, q_kind, out_kind = spec.final, spec.write_lse, spec.q_kind, spec.out_kind

    @cute.kernel
    def kernel(q: Int64, k_base: Int64, v_base: Int64, topk: Int64, table: Int64, row_request: Int64, q_pos: Int64,
               out: Int64, lse: Int64, part_o: Int64, part_ml: Int64,
               sm_p: Int64, qs_p: Int64, ks_p: Int64, vs_p: Int64,
               qk_scale: Float32, v_scale: Float32, num_pages: Int32, max_blocks: Int32, num_splits: Int32,
               stride_qr: Int64, stride_qh: Int64, stride_kp: Int64, stride_kh: Int64, stride_kt: Int64,
               stride_vp: Int64, stride_vh: Int64, stride_vt: Int64,
               stride_th: Int64, stride_tr: Int64, stride_tk: Int64, stride_bt: Int64,
               stride_or: Int64, stride_oh: Int64, stride_lr: Int64, stride_lh: Int64,
               num_kv_heads: Int32, group: Int32, num_topk: Int32) -> None:
        tid, _, _ = cute.arch.thread_idx()
        pid, split, _ = cute.arch.block_idx()
        lane = tid % 32
        warp = tid // 32
        g = lane // 4
        t4 = lane % 4
        chunks = (group + 15) // 16
        gc = pid % chunks
        h = (pid // chunks) % num_kv_heads
        r = pid // (chunks * num_kv_heads)

        smem = SmemAllocator()
        sm_page = smem.allocate_tensor(Int32, cute.make_layout(32), 16)
        sm_jid = smem.allocate_tensor(Int32, cute.make_layout(32), 16)
        sm_count = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
        sm_m = smem.allocate_tensor(Float32, cute.make_layout(WARPS * 16), 16)
        sm_l = smem.allocate_tensor(Float32, cute.make_layout(WARPS * 16), 16)
        # the stages (thread-private slots) while walking, the warps' accumulators after
        sm_acc = smem.allocate_tensor(Float32, cute.make_layout(BUFFER_FLOATS), 16)
        stage0 = sm_acc.iterator.toint() + tid * SLOT

        b = Int64(ptx.ld_b32_plain(row_request + Int64(r) * 4, Int32(1)))
        n = ptx.max64(Int64(ptx.ld_b32_plain(q_pos + Int64(r) * 4, Int32(1))) + 1, 0)
        limit = ptx.min64((n + (P - 1)) // P, Int64(max_blocks))

        # the row's index list, resolved and compacted by warp 0 (lane e: entry e)
        if warp == 0:
            e_ok = _flag(lane < num_topk)
            j = Int64(ptx.ld_b32_plain(topk + (Int64(h) * stride_th + Int64(r) * stride_tr
                                               + Int64(lane) * stride_tk) * 4, e_ok))
            used = e_ok * _flag(j >= 0) * _flag(j < limit)
            page = ptx.ld_b32_plain(table + (b * stride_bt + j) * 4, used)
            used = used * _flag(page >= 0) * _flag(page < num_pages)
            ballot = ptx.ballot(used)
            rank = ptx.popc(ballot & ((Int32(1) << lane) - 1))
            if used != 0:
                sm_page[rank] = page
                sm_jid[rank] = Int32(j)
            if lane == 0:
                sm_count[0] = ptx.popc(ballot)
        # the scale factors: host floats times the tensor scales (a plan-owned 1.0 for a float one)
        qk = qk_scale * ptx.ld_f32(sm_p, Int32(1)) * ptx.ld_f32(qs_p, Int32(1)) * ptx.ld_f32(ks_p, Int32(1))
        vs = v_scale * ptx.ld_f32(vs_p, Int32(1))

        # q: rows g and g + 8 of this chunk, elements 32 t4 .. 32 t4 + 31, as 16 f16x2 per row
        qa = cute.make_rmem_tensor(cute.make_layout(32), Int32)
        for half in cutlass.range_constexpr(2):
            row = gc * 16 + g + 8 * half
            ok = _flag(row < group)
            base = q + (Int64(r) * stride_qr + Int64(h * group + row) * stride_qh + 32 * t4) * Q_BYTES
            for w in cutlass.range_constexpr(32 * Q_BYTES // 4):
                word = ptx.ld_b32_plain(base + 4 * w, ok)
                if cutlass.const_expr(q_kind == "bf16"):
                    qa[half * 16 + w] = ptx.bf16x2_to_f16x2(word)
                elif cutlass.const_expr(q_kind == "f16"):
                    qa[half * 16 + w] = word
                else:
                    pair = ptx.e4m3x4_to_f16x2(word)
                    qa[half * 16 + 2 * w] = pair[0]
                    qa[half * 16 + 2 * w + 1] = pair[1]
        cute.arch.sync_threads()

        count = Int64(sm_count[0])
        total = count * SPP
        per = (total + Int64(num_splits) - 1) // Int64(num_splits)
        start = Int64(split) * per
        end = ptx.min64(start + per, total)
        first = start + Int64(warp)
        iters = Int32(ptx.max64((end - first + (WARPS - 1)) // WARPS, 0))
        k_head = k_base + Int64(h) * stride_kh
        v_head = v_base + Int64(h) * stride_vh

        state = cute.make_rmem_tensor(cute.make_layout(4), Float32)  # m (rows g, g+8), l (same)
        state[0] = Float32(_NEG_INF)
        state[1] = Float32(_NEG_INF)
        state[2] = Float32(0.0)
        state[3] = Float32(0.0)
        acc = cute.make_rmem_tensor(cute.make_layout(64), Float32)  # [n-block j][c]
        for i in cutlass.range_constexpr(64):
            acc[i] = Float32(0.0)

        for i in cutlass.range_constexpr(STAGES - 1):
            u0 = first + i * WARPS
            _issue_step(stage0 + i * STAGE_BYTES, u0, _flag(u0 < end), n, sm_page, sm_jid, k_head, v_head,
                        stride_kp, stride_kt, stride_vp, stride_vt, g, t4, P, KIND)
            ptx.cp_async_commit()
        for it in cutlass.range(iters, unroll=1):
            ahead = first + Int64(it + STAGES - 1) * WARPS
            _issue_step(stage0 + ((it + STAGES - 1) % STAGES) * STAGE_BYTES, ahead, _flag(ahead < end), n, sm_page,
                        sm_jid, k_head, v_head, stride_kp, stride_kt, stride_vp, stride_vt, g, t4, P, KIND)
            ptx.cp_async_commit()
            ptx.cp_async_wait(STAGES - 1)
            slot = stage0 + (it % STAGES) * STAGE_BYTES
            _, vis = _step_vis(first + Int64(it) * WARPS, n, sm_page, sm_jid, P)
            keys = _key_operands(slot, t4, KIND)
            # scores: 2 n-blocks of 8 tokens, 8 k-steps of 16 elements
            s = []
            for nb in cutlass.range_constexpr(2):
                kb = keys[nb]
                # CHAINS independent accumulations over the k-steps (shorter dependent mma chains)
                chains = [[Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)] for _ in range(CHAINS)]
                for ks in cutlass.range_constexpr(8):
                    a = [qa[2 * ks], qa[16 + 2 * ks], qa[2 * ks + 1], qa[16 + 2 * ks + 1]]
                    chains[ks % CHAINS] = ptx.mma_f16(a, [kb[ks][0], kb[ks][1]], chains[ks % CHAINS])
                for ci in cutlass.range_constexpr(4):
                    dot = chains[0][ci]
                    for ch in cutlass.range_constexpr(1, CHAINS):
                        dot = dot + chains[ch][ci]
                    s.append(ptx.masked(dot * qk, 4 * t4 + 2 * nb + ci % 2, vis))
            # online softmax of rows g (s[0], s[1], s[4], s[5]) and g + 8 (s[2], s[3], s[6], s[7])
            p = [None] * 8
            alphas = []
            for half in cutlass.range_constexpr(2):
                idx = (2 * half, 2 * half + 1, 4 + 2 * half, 5 + 2 * half)
                mx = ptx.fmax(ptx.fmax(s[idx[0]], s[idx[1]]), ptx.fmax(s[idx[2]], s[idx[3]]))
                mx = ptx.fmax(mx, ptx.shfl_xor(mx, 1))
                mx = ptx.fmax(mx, ptx.shfl_xor(mx, 2))
                m_old = state[half]
                m_new = ptx.fmax(m_old, mx)
                m_safe = ptx.safe(m_new)
                alpha = ptx.ex2(m_old - m_safe)
                total_p = Float32(0.0)
                for k in cutlass.range_constexpr(4):
                    p[idx[k]] = ptx.ex2(s[idx[k]] - m_safe)
                    total_p = total_p + p[idx[k]]
                state[2 + half] = state[2 + half] * alpha + total_p
                state[half] = m_new
                alphas.append(alpha)
            # rescale only when some row's maximum moved (rare after the first steps): a loop of
            # 0 or 1 trips, which ptxas keeps as a branch (a plain `if` it predicates, 64 issued FMULs)
            for _ in cutlass.range(ptx.any(_flag(alphas[0] != 1.0) + _flag(alphas[1] != 1.0)), unroll=1):
                for j in cutlass.range_constexpr(16):
                    acc[4 * j] = acc[4 * j] * alphas[0]
                    acc[4 * j + 1] = acc[4 * j + 1] * alphas[0]
                    acc[4 * j + 2] = acc[4 * j + 2] * alphas[1]
                    acc[4 * j + 3] = acc[4 * j + 3] * alphas[1]
            pa = [ptx.pack_f16x2(p[0], p[1]), ptx.pack_f16x2(p[2], p[3]), ptx.pack_f16x2(p[4], p[5]),
                  ptx.pack_f16x2(p[6], p[7])]
            # values: element 16 g + j of tokens 4 t4 .. 4 t4 + 3 feeds n-block j
            vb = _value_operands(slot, vis, t4, KIND)
            for j in cutlass.range_constexpr(16):
                c = ptx.mma_f16(pa, [vb[j][0], vb[j][1]], [acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]])
                for ci in cutlass.range_constexpr(4):
                    acc[4 * j + ci] = c[ci]

        ptx.cp_async_wait(0)
        cute.arch.sync_threads()
        # the warp's sums over its quads, then its state and accumulator into shared memory
        for half in cutlass.range_constexpr(2):
            total_l = state[2 + half]
            total_l = total_l + ptx.shfl_xor(total_l, 1)
            total_l = total_l + ptx.shfl_xor(total_l, 2)
            if t4 == 0:
                sm_m[warp * 16 + g + 8 * half] = state[half]
                sm_l[warp * 16 + g + 8 * half] = total_l
        for j in cutlass.range_constexpr(16):
            for ci in cutlass.range_constexpr(4):
                row = g + 8 * (ci // 2)
                d = 32 * t4 + 16 * (ci % 2) + j
                sm_acc[(warp * 16 + row) * ROW + d + d // 32] = acc[4 * j + ci]
        cute.arch.sync_threads()

        # combine the warps: thread (row, c) owns row `row`, elements 16 c .. 16 c + 15
        row = tid // 8
        c16 = (tid % 8) * 16
        m_all = Float32(_NEG_INF)
        for w in cutlass.range_constexpr(WARPS):
            m_all = ptx.fmax(m_all, sm_m[w * 16 + row])
        m_safe = ptx.safe(m_all)
        weights = [ptx.ex2(sm_m[w * 16 + row] - m_safe) for w in range(WARPS)]
        l_all = Float32(0.0)
        for w in cutlass.range_constexpr(WARPS):
            l_all = l_all + sm_l[w * 16 + row] * weights[w]
        o = []
        for k in cutlass.range_constexpr(16):
            d = c16 + k
            v = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                v = v + sm_acc[(w * 16 + row) * ROW + d + d // 32] * weights[w]
            o.append(v)
        row_ok = _flag(gc * 16 + row < group)
        qh = Int64(h * group + gc * 16 + row)
        if cutlass.const_expr(final):
            inv = ptx.inv_or_zero(l_all, vs)
            base = out + (Int64(r) * stride_or + qh * stride_oh + c16) * OUT_BYTES
            for k in cutlass.range_constexpr(8):
                ptx.st_b32(base + 4 * k, ptx.pack_out(o[2 * k] * inv, o[2 * k + 1] * inv, out_kind), row_ok)
            if cutlass.const_expr(write_lse):
                ptx.st_f32(lse + (Int64(r) * stride_lr + qh * stride_lh) * 4, ptx.lse(m_all, l_all),
                           row_ok * _flag(c16 == 0))
        else:
            prow = (Int64(r) * Int64(num_kv_heads * group) + qh) * Int64(num_splits) + Int64(split)
            base = part_o + (prow * D + c16) * 4
            for k in cutlass.range_constexpr(4):
                ptx.st_v4(base + 16 * k, ptx.f32_bits(o[4 * k]), ptx.f32_bits(o[4 * k + 1]),
                          ptx.f32_bits(o[4 * k + 2]), ptx.f32_bits(o[4 * k + 3]), row_ok)
            ok0 = row_ok * _flag(c16 == 0)
            ptx.st_f32(part_ml + prow * 8, m_all, ok0)
            ptx.st_f32(part_ml + prow * 8 + 4, l_all, ok0)

    @cute.jit
    def host(q: Int64, k_base: Int64, v_base: Int64, topk: Int64, table: Int64, row_request: Int64, q_pos: Int64,
             out: Int64, lse: Int64, part_o: Int64, part_ml: Int64, sm_p: Int64, qs_p: Int64, ks_p: Int64,
             vs_p: Int64, qk_scale: Float32, v_scale: Float32, num_pages: Int32, max_blocks: Int32,
             num_splits: Int32, stride_qr: Int64, stride_qh: Int64, stride_kp: Int64, stride_kh: Int64,
             stride_kt: Int64, stride_vp: Int64, stride_vh: Int64, stride_vt: Int64, stride_th: Int64,
             stride_tr: Int64, stride_tk: Int64, stride_bt: Int64, stride_or: Int64, stride_oh: Int64,
             stride_lr: Int64, stride_lh: Int64, num_kv_heads: Int32, group: Int32, num_topk: Int32,
             num_rows: Int32, row_tokens: Int32, stream: cuda.CUstream) -> None:
        # (`row_tokens`, the query rows of each request of a uniform step, is the wgmma kernel's)
        grid = [num_rows * num_kv_heads * ((group + 15) // 16), num_splits, 1]
        kernel(q, k_base, v_base, topk, table, row_request, q_pos, out, lse, part_o, part_ml, sm_p, qs_p, ks_p,
               vs_p, qk_scale, v_scale, num_pages, max_blocks, num_splits, stride_qr, stride_qh, stride_kp,
               stride_kh, stride_kt, stride_vp, stride_vh, stride_vt, stride_th, stride_tr, stride_tk, stride_bt,
               stride_or, stride_oh, stride_lr, stride_lh, num_kv_heads, group, num_topk,
               ).launch(grid=grid, block=[WARPS * 32, 1, 1], stream=stream, min_blocks_per_mp=MIN_CTAS,
                        preferred_smem_carveout=100 if MIN_CTAS > 1 else None)

    return host
