"""The PTX the CuTe DSL NVFP4 kernel is made of, one helper per instruction group.

Every helper emits inline PTX through the DSL's LLVM dialect and returns DSL values (`Int32`
for packed registers, `Float32` for scalars). Loads are predicated: a load whose predicate is
off writes zero and touches no memory. Import only where `nvidia-cutlass-dsl` is installed.
"""

from __future__ import annotations

from typing import Any

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

__all__ = [
    "l2_policy", "cp_async", "cp_async_commit", "cp_async_wait", "lds", "lds_u16", "ldsm_t", "ld_b32_plain",
    "ld_f32", "ld_f32s", "f32_bits", "st_v4", "st_f32", "st_b32", "nvfp4_k_word", "nvfp4_v_words", "nvfp4_f16_pairs",
    "e4m3_v_words", "e4m3x2_scale", "shfl_idx_i32", "warp_rank_i32",
    "mma_f16", "pack_f16x2", "bf16x2_to_f16x2", "e4m3x4_to_f16x2", "ex2", "fmax", "shfl_xor", "keep_low_bytes",
    "replicate_half", "masked", "safe", "inv_or_zero", "lse", "pack_out", "min64", "max64", "popc",
    "ballot", "any",
]


def _asm(n: int, ty: Any, ptx: str, constraints: str, *args: Any, side: bool = False) -> list[Any]:
    values = [a.ir_value() for a in args]
    if n == 1:
        return [llvm.inline_asm(ty(), values, ptx, constraints, has_side_effects=side, is_align_stack=False,
                                asm_dialect=llvm.AsmDialect.AD_ATT)]
    struct = llvm.StructType.get_literal([ty()] * n)
    result = llvm.inline_asm(struct, values, ptx, constraints, has_side_effects=side, is_align_stack=False,
                             asm_dialect=llvm.AsmDialect.AD_ATT)
    return [llvm.extractvalue(ty(), result, [i]) for i in range(n)]


def _i32(n: int, ptx: str, constraints: str, *args: Any, side: bool = False) -> list[Int32]:
    return [Int32(v) for v in _asm(n, T.i32, ptx, constraints, *args, side=side)]


# -- global memory ---------------------------------------------------------------------------

def ld_b32_plain(addr: Any, pred: Any) -> Int32:
    """4 bytes through the coherent path (index lists, tables, row metadata; 0 when `pred` is 0)."""
    return _i32(1, "{.reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.b32 $0, [$1];}",
                "=r,l,r", addr, pred, side=True)[0]


def prefetch_l2(addr: Any, pred: Any) -> None:
    """Start bringing the 128-byte line of global `addr` into L2 when `pred` is not 0 (nothing
    comes back; `addr` must lie inside a tensor the kernel was given)."""
    _asm(1, T.i32, "{.reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p prefetch.global.L2 [$1];}",
         "=r,l,r", addr, pred, side=True)


def l2_policy(priority: str) -> Int64:
    """An L2 cache policy (`createpolicy`) that gives every line it covers the eviction priority
    `priority` ("first" or "last"), for a TMA copy's `cache_policy`."""
    if priority not in ("first", "last"):
        raise ValueError(f"L2 eviction priority {priority!r} is not 'first' or 'last'")
    return Int64(_asm(1, T.i64, f"createpolicy.fractional.L2::evict_{priority}.b64 $0, 1.0;", "=l")[0])


def ld_f32(addr: Any, pred: Any) -> Float32:
    """One float through the coherent path (0 when `pred` is 0)."""
    return Float32(_asm(1, T.f32, "{.reg .pred p; setp.ne.b32 p, $2, 0; mov.f32 $0, 0f00000000;"
                                  " @p ld.global.f32 $0, [$1];}", "=f,l,r", addr, pred, side=True)[0])


def ld_f32s(addr: Any, pred: Any, n: int) -> list[Float32]:
    """`n` (2 or 4) consecutive floats in one vector load from L2 (`.cg`: another SM's stores,
    never a stale line of this SM's L1; all 0 when `pred` is 0; `addr` aligned to 4 `n` bytes)."""
    outs = ",".join(f"${i}" for i in range(n))
    zero = " ".join(f"mov.f32 ${i}, 0f00000000;" for i in range(n))
    load = f"@p ld.global.cg.v{n}.f32 {{{outs}}}, [${n}];"
    vals = _asm(n, T.f32, f"{{.reg .pred p; setp.ne.b32 p, ${n + 1}, 0; {zero} {load}}}",
                ",".join(["=f"] * n) + ",l,r", addr, pred, side=True)
    return [Float32(v) for v in vals]


def f32_bits(x: Any) -> Int32:
    """The bits of a float as an int register."""
    return _i32(1, "mov.b32 $0, $1;", "=r,f", x)[0]


def st_v4(addr: Any, a: Any, b: Any, c: Any, d: Any, pred: Any) -> None:
    """Store 16 bytes when `pred` is not 0."""
    _asm(1, T.i32, "{.reg .pred p; setp.ne.b32 p, $6, 0; mov.b32 $0, 0;"
                   " @p st.global.v4.b32 [$1], {$2,$3,$4,$5};}", "=r,l,r,r,r,r,r",
         addr, a, b, c, d, pred, side=True)


def st_f32(addr: Any, value: Any, pred: Any) -> None:
    """Store one float when `pred` is not 0."""
    _asm(1, T.i32, "{.reg .pred p; setp.ne.b32 p, $3, 0; mov.b32 $0, 0; @p st.global.f32 [$1], $2;}",
         "=r,l,f,r", addr, value, pred, side=True)


def st_b32(addr: Any, value: Any, pred: Any) -> None:
    """Store 4 bytes when `pred` is not 0."""
    _asm(1, T.i32, "{.reg .pred p; setp.ne.b32 p, $3, 0; mov.b32 $0, 0; @p st.global.b32 [$1], $2;}",
         "=r,l,r,r", addr, value, pred, side=True)


# -- asynchronous copies into shared memory (the step pipeline) -------------------------------

def cp_async(dst: Any, src: Any, safe: Any, pred: Any, size: int) -> None:
    """Copy `size` (4, 8 or 16) bytes from global `src` to shared `dst` (a 32-bit shared address)
    without waiting; when `pred` is 0 nothing is read (the source is `safe`, zero bytes of it)
    and the destination gets zeros."""
    kind = "cg" if size == 16 else "ca"
    _asm(1, T.i32, f"{{.reg .pred p; .reg .u32 n; .reg .u64 a; setp.ne.b32 p, $4, 0; selp.u32 n, {size}, 0, p;"
                   f" selp.b64 a, $2, $3, p; mov.b32 $0, 0; cp.async.{kind}.shared.global [$1], [a], {size}, n;}}",
         "=r,r,l,l,r", dst, src, safe, pred, side=True)


def cp_async_commit() -> None:
    _asm(1, T.i32, "{mov.b32 $0, 0; cp.async.commit_group;}", "=r", side=True)


def cp_async_wait(pending: int) -> None:
    """Wait until at most `pending` committed groups of this thread are in flight."""
    _asm(1, T.i32, f"{{mov.b32 $0, 0; cp.async.wait_group {pending};}}", "=r", side=True)


def lds(addr: Any, words: int) -> list[Int32]:
    """`words` (1, 2 or 4) 32-bit words from shared address `addr`."""
    if words == 1:
        return _i32(1, "ld.shared.b32 $0, [$1];", "=r,r", addr, side=True)
    outs = ",".join(f"${i}" for i in range(words))
    return _i32(words, f"ld.shared.v{words}.b32 {{{outs}}}, [${words}];", ",".join(["=r"] * words) + ",r", addr,
                side=True)


def lds_u16(addr: Any) -> Int32:
    """The 16-bit word at shared address `addr` (2-byte aligned), zero-extended."""
    return _i32(1, "{.reg .b16 h; ld.shared.b16 h, [$1]; cvt.u32.u16 $0, h;}", "=r,r", addr, side=True)[0]


def ldsm_t(addr: Any) -> list[Int32]:
    """`ldmatrix .x4 .trans` of 16-bit elements (warp-collective): lanes 8 m .. 8 m + 7 give the
    shared addresses of matrix m's eight 16-byte rows; this thread gets, of each matrix m, one
    word: element `lane // 4` (bytes 2 (lane // 4), + 1) of rows 2 (lane % 4) (the low half) and
    2 (lane % 4) + 1 (the high half)."""
    return _i32(4, "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
                addr, side=True)


def stsm_t(addr: Any, words: list[Any]) -> None:
    """`stmatrix .x2 / .x4 .trans` of 16-bit elements (warp-collective; `words`: one register a
    matrix, 2 or 4): this thread's word of matrix m holds its elements (row `lane // 4`, columns
    2 (lane % 4) and + 1, the low half first), and lanes 8 m .. 8 m + 7 give the shared addresses
    of the eight 16-byte rows matrix m is stored to, transposed: row j holds its column j."""
    n = len(words)
    if n not in (2, 4):
        raise ValueError(f"stmatrix stores 2 or 4 matrices, not {n}")
    regs = ", ".join(f"${2 + i}" for i in range(n))
    _asm(1, T.i32, f"{{mov.b32 $0, 0; stmatrix.sync.aligned.m8n8.x{n}.trans.shared.b16 [$1], {{{regs}}};}}",
         "=r,r," + ",".join(["r"] * n), addr, *words, side=True)


# -- NVFP4 decode into mma operands ----------------------------------------------------------

# A code byte's two nibbles as E4M3 bytes: magnitude bits to bits 2-4, sign to bit 7 (the E2M1
# value times 2^-6; the block scale is taken times 64). `lo` holds the four low nibbles of a
# word, `hi` the four high ones.
_NIBBLES = ("shl.b32 t, $W, 2; and.b32 lo, t, 0x1C1C1C1C; shl.b32 t, $W, 4; and.b32 t, t, 0x80808080;"
            " or.b32 lo, lo, t; shr.b32 t, $W, 2; and.b32 hi, t, 0x1C1C1C1C; and.b32 t, $W, 0x80808080;"
            " or.b32 hi, hi, t;")


# Without conversions (Hopper issues a conversion at a quarter of the integer rate): a code's
# magnitude bits go to f16 bits 9-11 and its sign to bit 15, which is the E2M1 value times 2^-14
# exactly (the subnormal 0.5 included). `x` holds the four low nibbles of a word as the high bytes
# of such f16 (sign at bit 7, magnitude at bits 1-3), `y` the four high ones; each result takes
# two of them, from bytes 0 and 2 or 1 and 3, with zero low bytes.
_F16_PAIRS = ("shl.b32 t, $4, 1; and.b32 x, t, 0x0E0E0E0E; shl.b32 t, $4, 4; and.b32 t, t, 0x80808080;"
              " or.b32 x, x, t; shr.b32 t, $4, 3; and.b32 y, t, 0x0E0E0E0E; and.b32 t, $4, 0x80808080;"
              " or.b32 y, y, t; mov.b32 z, 0;"
              " prmt.b32 r0, x, z, 0x2404; prmt.b32 r1, y, z, 0x2404; prmt.b32 r2, x, z, 0x3414;"
              " prmt.b32 r3, y, z, 0x3414;")


def nvfp4_f16_pairs(word: Any, scale: Any) -> list[Int32]:
    """Eight codes (bytes 0-3 of `word`; byte b holds elements 2b, 2b + 1) -> four f16x2
    registers, each (element i, element i + 4) for i = 0, 1, 2, 3, times the f16x2 `scale`
    and 2^-14 (exact: an E2M1 value has two significant bits, an E4M3 scale four). With
    bytes (a0, a1, b0, b1) of two tokens a and b, register i is element i of both, a low."""
    return _i32(4, "{.reg .b32 t, x, y, z, r0, r1, r2, r3; " + _F16_PAIRS
                   + " mul.rn.f16x2 $0, r0, $5; mul.rn.f16x2 $1, r1, $5; mul.rn.f16x2 $2, r2, $5;"
                   " mul.rn.f16x2 $3, r3, $5;}",
                "=r,=r,=r,=r,r,r", word, scale)


def nvfp4_k_word(word: Any, scale: Any) -> list[Int32]:
    """Four code bytes of one token (elements 8i..8i+7 of its share) -> the f16x2 B-operand
    registers of two mma k-steps, times the f16x2 scale `scale` (both halves the same block
    scale): [(e0, e1), (e2, e3)] of the first k-step, then [(e4, e5), (e6, e7)]."""
    body = _NIBBLES.replace("$W", "$4")
    return _i32(4, "{.reg .b32 t, lo, hi, a, b; .reg .b16 x0, x1, y0, y1; .reg .b32 f0, f1, f2, f3; " + body
                   + " prmt.b32 a, lo, hi, 0x5140; prmt.b32 b, lo, hi, 0x7362;"
                   " mov.b32 {x0, x1}, a; mov.b32 {y0, y1}, b;"
                   " cvt.rn.f16x2.e4m3x2 f0, x0; cvt.rn.f16x2.e4m3x2 f1, x1;"
                   " cvt.rn.f16x2.e4m3x2 f2, y0; cvt.rn.f16x2.e4m3x2 f3, y1;"
                   " mul.rn.f16x2 $0, f0, $5; mul.rn.f16x2 $1, f1, $5; mul.rn.f16x2 $2, f2, $5;"
                   " mul.rn.f16x2 $3, f3, $5;}",
                "=r,=r,=r,=r,r,r", word, scale)


def nvfp4_v_words(word_a: Any, word_b: Any, scale: Any) -> list[Int32]:
    """Four code bytes (elements 0..7 of a share) of tokens a and b -> eight f16x2 registers,
    one per element, each (token a, token b) times `scale` (the two tokens' block scales):
    elements in the order 0, 2, 4, 6, 1, 3, 5, 7."""
    body_a = _NIBBLES.replace("$W", "$8").replace("lo", "la").replace("hi", "ha")
    body_b = _NIBBLES.replace("$W", "$9").replace("lo", "lb").replace("hi", "hb")
    cvt = []
    for k, (src, sel) in enumerate((("la, lb", "0x5140"), ("la, lb", "0x7362"), ("ha, hb", "0x5140"),
                                    ("ha, hb", "0x7362"))):
        cvt.append(f" prmt.b32 p, {src}, {sel}; mov.b32 {{x0, x1}}, p;"
                   f" cvt.rn.f16x2.e4m3x2 f0, x0; cvt.rn.f16x2.e4m3x2 f1, x1;"
                   f" mul.rn.f16x2 ${2 * k}, f0, $10; mul.rn.f16x2 ${2 * k + 1}, f1, $10;")
    return _i32(8, "{.reg .b32 t, la, ha, lb, hb, p, f0, f1; .reg .b16 x0, x1; " + body_a + " " + body_b
                   + "".join(cvt) + "}",
                "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", word_a, word_b, scale)


def e4m3_v_words(word_a: Any, word_b: Any) -> list[Int32]:
    """Four E4M3 bytes (elements 0..3) of tokens a and b -> four f16x2 registers, one per
    element, each (token a, token b)."""
    return _i32(4, "{.reg .b32 p, q; .reg .b16 x0, x1, y0, y1; prmt.b32 p, $4, $5, 0x5140; prmt.b32 q, $4, $5, 0x7362;"
                   " mov.b32 {x0, x1}, p; mov.b32 {y0, y1}, q; cvt.rn.f16x2.e4m3x2 $0, x0; cvt.rn.f16x2.e4m3x2 $1, x1;"
                   " cvt.rn.f16x2.e4m3x2 $2, y0; cvt.rn.f16x2.e4m3x2 $3, y1;}", "=r,=r,=r,=r,r,r", word_a, word_b)


#: The f16 bits of the powers of two a block scale is taken times (`e4m3x2_scale`).
_F16_POW2 = {64: 0x5400, 128: 0x5800}


def e4m3x2_scale(bits: Any, times: int = 64) -> Int32:
    """The low two E4M3 bytes of `bits` -> f16x2, each times `times` (64 or 128; exact: at most
    448 * 128). `cvt` keeps a negative or NaN scale."""
    half = _F16_POW2[times]
    return _i32(1, "{.reg .b16 x, y; .reg .b32 f, s; mov.b32 {x, y}, $1; cvt.rn.f16x2.e4m3x2 f, x;"
                   f" mov.b32 s, 0x{half:04X}{half:04X}; mul.rn.f16x2 $0, f, s;}}", "=r,r", bits)[0]


def replicate_half(pair: Any, high: bool) -> Int32:
    """(x, x) from the low (or high) half of the f16x2 `pair`."""
    sel = "0x3232" if high else "0x1010"
    return _i32(1, f"prmt.b32 $0, $1, $1, {sel};", "=r,r", pair)[0]


def keep_low_bytes(word: Any, count: Any) -> Int32:
    """`word` with only its `count` low bytes kept (count clamped to 0..4)."""
    return _i32(1, "{.reg .b32 c, s, m; .reg .pred full; max.s32 c, $2, 0; min.s32 c, c, 4;"
                   " setp.ge.s32 full, c, 4; shl.b32 s, c, 3; shl.b32 m, 1, s; sub.u32 m, m, 1;"
                   " selp.b32 m, 0xFFFFFFFF, m, full; and.b32 $0, $1, m;}", "=r,r,r", word, count)[0]


# -- query conversion ------------------------------------------------------------------------

def bf16x2_to_f16x2(word: Any) -> Int32:
    """Two bf16 -> two f16 (round to nearest)."""
    return _i32(1, "{.reg .b32 lo, hi; shl.b32 lo, $1, 16; and.b32 hi, $1, 0xFFFF0000;"
                   " cvt.rn.f16x2.f32 $0, hi, lo;}", "=r,r", word)[0]


def e4m3x4_to_f16x2(word: Any) -> list[Int32]:
    """Four E4M3 bytes -> two f16x2 (bytes 0-1, then 2-3)."""
    return _i32(2, "{.reg .b16 x, y; mov.b32 {x, y}, $2; cvt.rn.f16x2.e4m3x2 $0, x;"
                   " cvt.rn.f16x2.e4m3x2 $1, y;}", "=r,=r,r", word)


def pack_f16x2(lo: Any, hi: Any) -> Int32:
    """(f16(lo), f16(hi)) in one register, `lo` in the low half."""
    return _i32(1, "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", lo, hi)[0]


# -- math ------------------------------------------------------------------------------------

def mma_f16(a: list[Any], b: list[Any], c: list[Any]) -> list[Float32]:
    """`mma.sync.m16n8k16` with f16 operands and f32 accumulators: c + a b."""
    out = _asm(4, T.f32, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7},"
                         " {$8,$9}, {$10,$11,$12,$13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", *a, *b, *c)
    return [Float32(v) for v in out]


def ex2(x: Any) -> Float32:
    """2^x (`ex2.approx.ftz`: 2^-inf = 0)."""
    return Float32(_asm(1, T.f32, "ex2.approx.ftz.f32 $0, $1;", "=f,f", x)[0])


def fmax(a: Any, b: Any) -> Float32:
    return Float32(_asm(1, T.f32, "max.f32 $0, $1, $2;", "=f,f,f", a, b)[0])


def shfl_xor(x: Any, mask: int) -> Float32:
    """`x` of the lane `lane ^ mask` (full warp)."""
    return Float32(_asm(1, T.f32, f"shfl.sync.bfly.b32 $0, $1, {mask}, 0x1f, 0xffffffff;", "=f,f", x,
                        side=True)[0])


# -- scalar helpers ----------------------------------------------------------------------

def masked(s: Any, tok: Any, vis: Any) -> Any:
    """`s`, or -inf where token `tok` is not below the visible count `vis`."""
    return Float32(_asm(1, T.f32, "{.reg .pred p; setp.lt.s32 p, $2, $3; selp.f32 $0, $1, 0fFF800000, p;}",
                            "=f,f,r,r", s, Int32(tok), vis)[0])


def safe(m: Any) -> Any:
    """0 for -inf (nothing seen yet), else m."""
    return Float32(_asm(1, T.f32, "{.reg .pred p; setp.eq.f32 p, $1, 0fFF800000;"
                                          " selp.f32 $0, 0f00000000, $1, p;}", "=f,f", m)[0])


def inv_or_zero(total: Any, factor: Any) -> Any:
    """factor / total, or 0 where total is 0."""
    return Float32(_asm(1, T.f32, "{.reg .pred p; .reg .f32 d; setp.eq.f32 p, $1, 0f00000000;"
                                          " selp.f32 d, 0f3F800000, $1, p; div.rn.f32 d, $2, d;"
                                          " selp.f32 $0, 0f00000000, d, p;}", "=f,f,f", total, factor)[0])


def lse(m: Any, total: Any) -> Any:
    """ln(sum e^s) from the base-2 running (max, sum); -inf where the sum is 0."""
    return Float32(_asm(1, T.f32, "{.reg .pred p; .reg .f32 d; setp.eq.f32 p, $2, 0f00000000;"
                                          " selp.f32 d, 0f3F800000, $2, p; lg2.approx.f32 d, d; add.f32 d, d, $1;"
                                          " mul.f32 d, d, 0f3F317218; selp.f32 $0, 0fFF800000, d, p;}",
                            "=f,f,f", m, total)[0])


def pack_out(lo: Any, hi: Any, kind: str) -> Any:
    """(lo, hi) as bf16x2 or f16x2 (`kind`), round to nearest."""
    op = "cvt.rn.bf16x2.f32" if kind == "bf16" else "cvt.rn.f16x2.f32"
    return Int32(_asm(1, T.i32, f"{op} $0, $2, $1;", "=r,f,f", lo, hi)[0])


def min64(a: Any, b: Any) -> Any:
    """Signed 64-bit minimum."""
    return Int64(_asm(1, T.i64, "min.s64 $0, $1, $2;", "=l,l,l", Int64(a), Int64(b))[0])


def max64(a: Any, b: Any) -> Any:
    """Signed 64-bit maximum."""
    return Int64(_asm(1, T.i64, "max.s64 $0, $1, $2;", "=l,l,l", Int64(a), Int64(b))[0])


def popc(x: Any) -> Any:
    """Set bits of a 32-bit word."""
    return Int32(_asm(1, T.i32, "popc.b32 $0, $1;", "=r,r", x)[0])


def ballot(pred: Any) -> Any:
    """The warp's predicate bits."""
    return Int32(_asm(1, T.i32, "{.reg .pred p; setp.ne.b32 p, $1, 0; vote.sync.ballot.b32 $0, p, 0xffffffff;}",
                          "=r,r", pred, side=True)[0])


def any(pred: Any) -> Any:
    """1 when `pred` is not 0 in any lane of the warp."""
    return Int32(_asm(1, T.i32, "{.reg .pred p, q; setp.ne.b32 p, $1, 0; vote.sync.any.pred q, p, 0xffffffff;"
                                        " selp.b32 $0, 1, 0, q;}", "=r,r", pred, side=True)[0])


# -- the Hopper kernel's query split and warp scans -------------------------------------------

def f32_of_bits(x: Any) -> Float32:
    """The float whose bits are `x`."""
    return Float32(_asm(1, T.f32, "mov.b32 $0, $1;", "=f,r", x)[0])


def f16x2_to_f32(word: Any) -> tuple[Float32, Float32]:
    """Two f16 (low half first) as floats (exact)."""
    lo, hi = _asm(2, T.f32, "{.reg .b16 x, y; mov.b32 {x, y}, $2; cvt.f32.f16 $0, x; cvt.f32.f16 $1, y;}",
                  "=f,=f,r", word)
    return Float32(lo), Float32(hi)


def e4m3x4_to_f32(word: Any) -> list[Float32]:
    """Four E4M3 bytes (byte 0 first) as floats (exact)."""
    vals = _asm(4, T.f32, "{.reg .b16 x, y, a, b, c, d; .reg .b32 p, q; mov.b32 {x, y}, $4;"
                          " cvt.rn.f16x2.e4m3x2 p, x; cvt.rn.f16x2.e4m3x2 q, y; mov.b32 {a, b}, p; mov.b32 {c, d}, q;"
                          " cvt.f32.f16 $0, a; cvt.f32.f16 $1, b; cvt.f32.f16 $2, c; cvt.f32.f16 $3, d;}",
                "=f,=f,=f,=f,r", word)
    return [Float32(v) for v in vals]


def pow2_scale(amax: Any) -> Float32:
    """2^(7 - floor(log2 amax)) (so that amax times it lies in [128, 256)), clamped to a normal
    float; 1 where amax is 0 or subnormal."""
    return Float32(_asm(1, T.f32, "{.reg .b32 e, r; .reg .pred p; mov.b32 r, $1; shr.u32 e, r, 23;"
                                  " and.b32 e, e, 255; setp.eq.u32 p, e, 0; neg.s32 e, e; add.s32 e, e, 261;"
                                  " min.s32 e, e, 254; max.s32 e, e, 1; shl.b32 e, e, 23;"
                                  " selp.b32 $0, 0x3f800000, e, p;}", "=f,f", amax)[0])


def shfl_up_i32(x: Any, delta: int) -> Int32:
    """`x` of lane `lane - delta` (a lane below `delta` gets its own)."""
    return _i32(1, f"shfl.sync.up.b32 $0, $1, {delta}, 0, 0xffffffff;", "=r,r", x, side=True)[0]


def shfl_idx_i32(x: Any, src: int | Any) -> Int32:
    """`x` of lane `src`: a Python int (an immediate) or a run-time lane (0..31). Every lane of
    the warp must execute it (full mask)."""
    if isinstance(src, bool) or (isinstance(src, int) and not 0 <= src < 32):
        raise ValueError(f"shuffle source lane {src!r}: an int 0..31 or a run-time value")
    if isinstance(src, int):
        return _i32(1, f"shfl.sync.idx.b32 $0, $1, {src}, 0x1f, 0xffffffff;", "=r,r", x, side=True)[0]
    return _i32(1, "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r", x, Int32(src), side=True)[0]


def warp_rank_i32(key: Any) -> Int32:
    """How many of the warp's 32 keys are below this lane's (signed; distinct keys give each lane
    its place in ascending order). 32 broadcasts, independent of each other (full warp)."""
    body = "{.reg .b32 k, o, t, r; mov.b32 k, $1; mov.b32 r, 0;"
    for j in range(32):
        body += f" shfl.sync.idx.b32 o, k, {j}, 0x1f, 0xffffffff; set.lt.u32.s32 t, o, k; sub.s32 r, r, t;"
    return _i32(1, body + " mov.b32 $0, r;}", "=r,r", Int32(key), side=True)[0]


# -- split-K merged in the kernel -------------------------------------------------------------

def atom_add_acq_rel(addr: Any, value: Any) -> Int32:
    """`atom.acq_rel.gpu.global.add.u32`: the old value."""
    return _i32(1, "atom.acq_rel.gpu.global.add.u32 $0, [$1], $2;", "=r,l,r", addr, Int32(value), side=True)[0]


def atom_add_relaxed(addr: Any, value: Any) -> None:
    """`red.relaxed.gpu.global.add.u32` (no result)."""
    _asm(1, T.i32, "{red.relaxed.gpu.global.add.u32 [$1], $2; mov.b32 $0, 0;}", "=r,l,r", addr, Int32(value),
         side=True)


def bar_red_or(pred: Any, barrier: Any = 0, threads: int = 0) -> Int32:
    """`bar.red.or.pred` on barrier `barrier` (of `threads` threads; 0: the whole CTA): 1 when
    `pred` is not 0 in any of them, for all of them."""
    count = f", {threads}" if threads else ""
    return _i32(1, "{.reg .pred p, q; setp.ne.b32 p, $1, 0; bar.red.or.pred q, $2" + count
                + ", p; selp.b32 $0, 1, 0, q;}", "=r,r,r", pred, Int32(barrier), side=True)[0]


def hash_claim(table: Any, key: Any, pred: Any, slots: int) -> tuple[Int32, Int32]:
    """`key`'s slot of an open-addressing hash table at shared address `table` (`slots` 32-bit
    keys, a power of two, -1 where empty, never full; multiplicative hash, linear probing, one
    `atom.shared.cas` a probe): (the slot, 1 when this call stored `key` there, else 0); (0, 0)
    and no access when `pred` is 0. `key` must not be -1."""
    bits = slots.bit_length() - 1
    text = ("{ .reg .pred p, q; .reg .b32 s, old, a;"
            " mov.b32 $0, 0; mov.b32 $1, 0; setp.eq.b32 p, $4, 0; @p bra HC_DONE;"
            f" mul.lo.u32 s, $3, 0x9E3779B1; shr.b32 s, s, {32 - bits};"
            " HC_LOOP: shl.b32 a, s, 2; add.u32 a, a, $2; atom.shared.cas.b32 old, [a], -1, $3;"
            " setp.eq.s32 p, old, -1; setp.eq.s32 q, old, $3; selp.b32 $1, 1, 0, p; or.pred q, p, q;"
            f" @q bra HC_FOUND; add.u32 s, s, 1; and.b32 s, s, {slots - 1}; bra HC_LOOP;"
            " HC_FOUND: mov.b32 $0, s; HC_DONE: }")
    slot, claimed = _i32(2, text, "=r,=r,r,r,r", table, key, pred, side=True)
    return slot, claimed


def red_or_shared(addr: Any, bits: Any, pred: Any) -> None:
    """`red.shared.or.b32` of `bits` into shared address `addr` when `pred` is not 0."""
    _asm(1, T.i32, "{.reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p red.shared.or.b32 [$1], $3;}",
         "=r,r,r,r", addr, pred, bits, side=True)


def prmt(a: Any, b: Any, selector: Any) -> Int32:
    """`prmt.b32`: bytes of (a, b) (a: 0-3, b: 4-7) picked by the selector's nibbles (a constant,
    or a register)."""
    if isinstance(selector, int):
        return _i32(1, f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r", a, b)[0]
    return _i32(1, "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", a, b, Int32(selector))[0]


# -- split-K merged through distributed shared memory ------------------------------------------

def mapa(addr: Any, rank: Any) -> Int32:
    """The shared::cluster address of shared address `addr` in the CTA of cluster rank `rank`."""
    return _i32(1, "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r", Int32(addr), Int32(rank))[0]


def ld_cluster_f32s(addr: Any, pred: Any, n: int) -> list[Float32]:
    """`n` (2 or 4) consecutive floats of another CTA's shared memory (`addr` from `mapa`, aligned
    to 4 `n` bytes) in one vector load; all 0 and no access when `pred` is 0."""
    outs = ",".join(f"${i}" for i in range(n))
    zero = " ".join(f"mov.f32 ${i}, 0f00000000;" for i in range(n))
    load = f"@p ld.shared::cluster.v{n}.f32 {{{outs}}}, [${n}];"
    vals = _asm(n, T.f32, f"{{.reg .pred p; setp.ne.b32 p, ${n + 1}, 0; {zero} {load}}}",
                ",".join(["=f"] * n) + ",r,r", Int32(addr), pred, side=True)
    return [Float32(v) for v in vals]


# -- profiling (`Sm90Spec.trace`) -------------------------------------------------------------

def globaltimer() -> Int64:
    """The GPU's nanosecond timer (`%globaltimer`; comparable across SMs, coarser than the clock)."""
    return Int64(_asm(1, T.i64, "mov.u64 $0, %globaltimer;", "=l", side=True)[0])


def st_clock64(addr: Any, pred: Any) -> None:
    """Store the SM's cycle counter (`%clock64`: comparable within one CTA; 8 bytes), read only when
    `pred` is not 0."""
    _asm(1, T.i32, "{.reg .pred p; .reg .u64 c; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p mov.u64 c, %clock64;"
         " @p st.global.u64 [$1], c;}", "=r,l,r", addr, pred, side=True)


def st_u64(addr: Any, value: Any, pred: Any) -> None:
    """Store 8 bytes when `pred` is not 0."""
    _asm(1, T.i32, "{.reg .pred p; setp.ne.b32 p, $3, 0; mov.b32 $0, 0; @p st.global.u64 [$1], $2;}",
         "=r,l,l,r", addr, Int64(value), pred, side=True)
