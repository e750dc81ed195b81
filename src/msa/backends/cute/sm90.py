"""The Hopper-native sparse-decode kernel (CuTe DSL; TMA + WGMMA; sm_90a), for fp8, NVFP4, bf16
and f16 caches. Import only where `nvidia-cutlass-dsl` is installed.

A CTA of one or two consumer warpgroups serves one (row, KV head, chunk of `nc` query heads,
split). Its selected pages are walked as 64-token tiles:

- **TMA ring.** Warp 0 of each warpgroup keeps `stages - 1` tiles in flight, straight from the
  cache's `[page, head, token]` strides into a shared-memory stage, completed on the stage's
  `full` mbarrier; the consumers release a stage on its `empty` mbarrier. The first warpgroup's
  first copies start before the CTA's first barrier, as soon as warp 0 has the row's tile list
  (the other warps convert the query meanwhile). An fp8 tile is two
  copies (64 keys, 64 values; 128-byte swizzle); an NVFP4 tile is four (the keys' and the
  values' E2M1 codes, 64-byte swizzle, and their E4M3 block scales: 9 KiB in all); a 16-bit
  tile is 32 KiB, each half two 64-dimension boxes (the values' in dims x tokens order: the value
  product's MN-major operand as it lands).
- **Walk order.** A program of one row walks its entries in ascending block order, whatever
  order its list has (ranked across warp 0 while their pages load), so that the rows of a
  request, which share most of their pages in speculative decoding, read a shared page at about
  the same time: once from DRAM, then from L2 (measured: benchmarks/RESULTS.md, session 21).
- **Scores on the tensor cores** (`wgmma` M = the tile's 64 tokens, N = `nc`, the GQA group).
  fp8: the keys are the A operand in shared memory and the query is split once per CTA into fp8
  terms, `q * 2^e_h = t_0 + t_1 (+ t_2)`, with a power of two per head that puts its largest
  element in [128, 256). Two terms hold every bf16 element from 2^-9 of the head's largest up
  exactly, three every f16 element from 2^-6 up (below that, within 2^-17 of the largest:
  `tests/test_cute.py`); an fp8 query is one term, as given. The terms' products are summed by
  the tensor core's fp8 accumulation, which keeps ~13 bits of the running sum on Hopper: the
  smallest term's k-steps go first (`Sm90Spec.lo_first`), while the sum is small, so that an
  f16 query's output is 3.9e-4 from the float64 oracle where the exact product's is 2.8e-4 (the
  hi term first: 1.23e-3; benchmarks/ab_terms_order.py).
  `kreg` (always for NVFP4): each thread decodes its keys from the tile straight into f16
  A-operand registers (fp8 exactly; NVFP4 codes times their block scales, exact in f16), and the
  query is one f16 term (bf16 scaled by the same power of two: exact from 2^-21 of the head's
  largest; f16 and fp8 as given), so the product is an f16 one with f32 accumulation: exact. The
  head dimensions of the key registers are a permutation (a thread's elements of a token are
  one contiguous run: 16 NVFP4 code bytes, 32 fp8 bytes), applied to the query's columns too.
  `tconv` (fp8): the tensor cores convert instead, one fp8 product per 32 head dimensions of the
  stage's keys with a 32 x 32 identity tile, whose f16 accumulators are the score product's A
  registers in place (exact: one nonzero term per sum; the query's columns in the head's order).
- **Softmax per head** (online, base 2) with the tile's exact maximum: each warp's column maxima
  meet in shared memory behind one barrier. The accumulator is rescaled only when a head's
  maximum moved. Tokens past the row's visible length score -inf and their values are zeroed
  before the product (whatever bytes they hold: an NVFP4 token's block scales are zeroed).
- **16-bit caches** (bf16, f16): both products read the ring's stages as they landed (no decode,
  no copy), the query in terms of the cache's type (`config.WIDE_Q_TERMS`: exact), the weights
  of the cache's type too (bf16 weights beside a bf16 cache: 2^-9 relative, as the Triton
  kernel's). A stage goes back to the ring once its value product has retired (the next tile,
  after the maxima barrier) and is refilled there: one tile fewer ahead than the decoded kinds.
- **Values.** `O^T += V^T P^T` (`wgmma` M = head dim, N = `nc`) with f16 probabilities in shared
  memory, issued asynchronously and overlapping the next tile's copy wait and scores. The value
  operand is either an f16 copy of the fp8 tile in shared memory, or (`vreg`; always for NVFP4)
  read from the tile with `ldmatrix .trans` (eight tokens' 16-byte chunks a matrix: each word a
  thread gets is two tokens' bytes of its dimensions, the pairs the A operand wants) and decoded
  into A-operand registers, the product's rows a permutation of the head dimensions undone in
  the epilogue.

One split writes the normalised output (and LSE); several write the Triton backend's workspace
partials, which its merge kernel combines, or (`fused`) the last split of a program to finish
merges them itself.

With `tokens` > 1 a program takes that many rows of one request: warp 0 merges their entries
through a hash table in shared memory (one `atom.cas` per entry claims its block id's slot, one
`red.or` sets its token's bit), so each selected page's tiles are copied and scored once, against
every token's columns (N = tokens x the group). A token's column reads -inf where it did not select
the page or the position is past its own length, and a token that did not select a tile skips its
softmax there (its weights 0, its maxima kept). Measured against a program per row, this pays only
where the step is bound by bytes and the tokens share most pages (benchmarks/RESULTS.md).
"""

from __future__ import annotations

from typing import Any

import attrs
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from msa.backends.cute import ptx
from msa.backends.cute.config import (
    Q_TERMS,
    WGMMA_EVICT,
    WGMMA_EVICT_DEFAULT,
    WGMMA_HASH_SLOTS,
    WGMMA_MAX_CLUSTER,
    WGMMA_REFILL,
    WGMMA_REFILL_DEFAULT,
    WGMMA_TERMS_LO_FIRST,
    WGMMA_TOKENS,
    WIDE_KINDS,
    WIDE_Q_TERMS,
)

__all__ = ["Sm90Spec", "build_sm90", "TILE", "Q_TERMS", "CACHE_KINDS", "score_mma", "store_weights", "weights_layout",
           "weights_row_at"]

#: Tokens per tile (the score product's M, a TMA box's rows).
TILE = 64
#: The caches the kernel reads.
CACHE_KINDS = ("fp8", "nvfp4", *WIDE_KINDS)
_THREADS = 128
#: Floats of a row each thread of that merge takes from every split (one vector load each).
_CLUSTER_VEC = 4
_NEG_INF = float("-inf")
#: With `lag`, the weights of a tile are 2^(s - the maximum through the previous tiles); a tile
#: with a weight above 2^_LAG_LIMIT is redone with its own maximum (the weights are stored as f16).
_LAG_LIMIT = 15.0
#: `Sm90Spec.trace`'s words of a CTA: its milestones' SM clocks (word i: milestone i; the tiles'
#: only for the first `TRACE_TILES`), then the global nanosecond timer at its start and end, the
#: clock at its end, its tile count, whether it merged the splits (1), and which tiles its first
#: warpgroup walked first (`TRACE_TILES` words, `TRACE_WALKED`: page x tiles a page + tile of the page).
TRACE_TILES = 4
#: A traced tile's milestones: its copy complete, its keys in registers, its scores retired, the
#: column maxima exchanged, its weights stored, its stage released (a 16-bit cache's stage goes
#: back later, at the next tile's maxima, once its value product retired: "done" is then the
#: tile's end).
TRACE_TILE_STEPS = ("copied", "keys", "scores", "maxima", "weights", "done")
TRACE_POINTS = ("start", "tiles listed", "prologue done",
                *(f"tile {u} {what}" for u in range(TRACE_TILES) for what in TRACE_TILE_STEPS),
                "walk done", "output staged", "split counted", "merged")
#: The first word of the walked tiles.
TRACE_WALKED = len(TRACE_POINTS) + 5
TRACE_WORDS = TRACE_WALKED + TRACE_TILES


@attrs.frozen
class Sm90Spec:
    """The compile-time constants of one kernel.

    Attributes:
        page_size: tokens per page (a multiple of 64).
        q_kind / out_kind: "bf16", "f16" or "e4m3" (q) and "bf16" / "f16" (the output).
        final: one split: the kernel writes the normalised output (else workspace partials).
        write_lse: also write the natural-log LSE (with `final`).
        nc: columns per CTA, the products' N: its query heads (8 or 16) times `tokens`.
        stages: tiles of the shared-memory ring.
        fused: with several splits, the last split of a program to finish merges them all and
            writes the output (and LSE) itself; the program counters are the int32 words after
            the `rows * 2` floats of `part_ml` (zero; each merge takes its count back off).
        lag: weigh each tile by the maximum through the previous tiles (one barrier a tile instead
            of two; a tile whose weights would pass 2^15 is redone with its own maximum).
        min_ctas: CTAs per SM the registers must allow (launch bounds; 0 leaves it to ptxas).
        wgs: consumer warpgroups per CTA (1 or 2): each walks every `wgs`-th tile of the split
            through its own ring, and the CTA merges their states at the end (twice the tiles in
            flight for one prologue).
        vreg: the values are the second product's A operand in registers, read straight from
            the TMA tile with `ldmatrix .trans` (a thread gets two tokens' bytes of its head
            dimensions in one word; the product's rows are a permutation of the head dimensions,
            undone in the epilogue) instead of an f16 copy of the tile in shared memory.
            Required for NVFP4.
        kind: the cache, "fp8" (E4M3 keys and values) or "nvfp4" (head slots of E2M1 codes and
            E4M3 block scales).
        kreg: the keys are decoded from the tile into the score product's f16 A registers and
            the query is one f16 term (an f16 product with f32 accumulation: exact for bf16 and
            f16 queries) instead of the fp8 product of the query's fp8 terms. Always for NVFP4.
        tconv: fp8 only: the keys are converted to f16 on the tensor cores, an fp8 product K . I
            with an identity tile in shared memory whose f16 accumulators are the score product's
            A registers, in place, instead of by conversion instructions (the f16 score product of
            `kreg`: exact; the query's columns in the head's order).
        tokens: query rows of one request a program takes together (1, 2 or 4; a uniform step's
            rows, the request's query length a multiple of it): their selections' union is walked
            once, each page's tiles scored against all `tokens` x `nc // tokens` columns (column c:
            token c // (nc // tokens), query head c % (nc // tokens); the GQA group exactly
            `nc // tokens`, a multiple of 8), a column's score -inf where its token did not select
            the page or the position is past its visible length.
        cluster: with `fused`, the splits of a program are one thread-block cluster of this many
            CTAs (the launch's split count, 2 .. `WGMMA_MAX_CLUSTER`): each leaves its state in its own
            shared memory and, after a cluster barrier, merges its share of the output from all of
            theirs through distributed shared memory (no partials in global memory, no counter).
            0: the last split to finish merges the partials in global memory.
        evict: the L2 eviction priority of the tiles' TMA copies: "normal", "first" (a step's
            pages, read once, are the first candidates when L2 makes room) or "last".
        refill: when warp 0 of a warpgroup starts the copy of the tile `stages - 1` ahead into the
            stage the last tile released: "top" (at the top of a tile, before its copy wait) or
            "late" (once this tile's products are issued, while they run: the warpgroup's products
            wait for all four warps, so the copy's issue is then off their path; but the copy
            starts only after this tile landed, one fewer in flight where copies are waited on).
        trace: profiling: thread 0 of each CTA writes its SM clock at the walk's milestones
            (`TRACE_POINTS`) to `TRACE_WORDS` int64 words at `lse` + (program x splits + split) x
            8 `TRACE_WORDS` instead of any LSE (benchmarks/trace_cute.py reads them).
        lo_first: the score product of several query terms takes the smallest term's k-steps
            first and the largest's last (`config.WGMMA_TERMS_LO_FIRST`), so that the small
            terms' products are summed while the accumulator is small.
    """

    page_size: int
    q_kind: str
    out_kind: str
    final: bool
    write_lse: bool
    nc: int = 16
    stages: int = 3
    fused: bool = False
    lag: bool = False
    min_ctas: int = 0
    wgs: int = 1
    vreg: bool = False
    kind: str = "fp8"
    kreg: bool = False
    tconv: bool = False
    tokens: int = 1
    cluster: int = 0
    evict: str = WGMMA_EVICT_DEFAULT
    refill: str = WGMMA_REFILL_DEFAULT
    trace: bool = False
    lo_first: bool = WGMMA_TERMS_LO_FIRST


def _flag(cond: Any) -> Any:
    return cutlass.select_(cond, Int32(1), Int32(0))


def _tile_max(colmax: Any, index: Any) -> Any:
    """The largest of the four warps' maxima of one column (one 16-byte shared load)."""
    four = cute.make_rmem_tensor(cute.make_layout(4), Float32)
    cute.autovec_copy(colmax[None, index], four)
    return ptx.fmax(ptx.fmax(four[0], four[1]), ptx.fmax(four[2], four[3]))


def _warp_column_max(sv: Any, e: int) -> Any:
    """The warp's maximum of the column of the thread's score elements `e` and `e + 2` (its rows
    g and g + 8; the warp's eight lanes of that column)."""
    m = ptx.fmax(sv[e], sv[e + 2])
    m = ptx.fmax(m, ptx.shfl_xor(m, 4))
    m = ptx.fmax(m, ptx.shfl_xor(m, 8))
    return ptx.fmax(m, ptx.shfl_xor(m, 16))


def _wg_barrier(wg: Any, wgs: int) -> None:
    """Synchronise one consumer warpgroup (named barrier 1 + wg; the whole CTA when it is the only one)."""
    if wgs == 1:
        cute.arch.barrier()
    else:
        cute.arch.barrier(barrier_id=1 + wg, number_of_threads=_THREADS)


def _f32_of_bf16_pair(word: Any) -> tuple[Any, Any]:
    """The two bf16 halves of a word as floats (low, high)."""
    lo = ptx.f32_of_bits(word << 16)
    hi = ptx.f32_of_bits(word & Int32(-65536))
    return lo, hi


def _load_split(ms: Any, ls: Any, part: Any, i: int, ml_addr: Any, o_addr: Any, ok: Any, cw: int) -> None:
    """Split `i` of a merge batch into registers: its (m, l) (m = -inf where `ok` is 0) and its
    `cw` partial floats at `o_addr` (vector loads, issued without waiting)."""
    ml = ptx.ld_f32s(ml_addr, ok, 2)
    ms[i] = cutlass.select_(ok != 0, ml[0], Float32(_NEG_INF))
    ls[i] = ml[1]
    for k4 in range(cw // 4):  # (traced: a helper's loops are plain Python)
        vals = ptx.ld_f32s(o_addr + 16 * k4, ok, 4)
        for k in range(4):
            part[4 * k4 + k, i] = vals[k]


def _fold_splits(m_top: Any, l_top: Any, acc: Any, ms: Any, ls: Any, parts: Any, n: int, cw: int,
                 running: bool) -> tuple[Any, Any]:
    """Fold `n` splits' states (maxima `ms[i]`, sums `ls[i]`, partial rows `parts(i, k)`, `cw`
    floats) into the merged state so far (`m_top`, `l_top`, the row `acc`, updated in place),
    each weighed by 2^(its maximum - the new one) (a split with nothing visible: m = -inf,
    weight 0); with `running`, what is summed so far is rescaled to the new maximum first
    (without, it must be empty). Returns the new (maximum, sum)."""
    m_new = m_top
    for i in range(n):  # (traced: a helper's loops are plain Python)
        m_new = ptx.fmax(m_new, ms[i])
    m_ok = ptx.safe(m_new)
    if running:
        keep = cute.arch.exp2(m_top - m_ok)
        l_top = l_top * keep
        for k in range(cw):
            acc[k] = acc[k] * keep
    for i in range(n):
        w_s = cute.arch.exp2(ms[i] - m_ok)
        l_top = l_top + ls[i] * w_s
        for k in range(cw):
            acc[k] = acc[k] + parts(i, k) * w_s
    return m_new, l_top


def _store_row(at: Any, vals: Any, n: int, inv: Any, kind: str, pred: Any, lse_at: Any = None, m: Any = None,
               total: Any = None, first: Any = None) -> None:
    """`n` floats of an output row (`vals` times `inv`) as bf16 / f16 pairs at `at` where `pred` is 1,
    and with `lse_at`, the row's natural-log LSE of its maximum `m` and sum `total` there by the
    thread whose `first` is true (the one holding the row's first floats)."""
    for k in range(n // 2):
        ptx.st_b32(at + 4 * k, ptx.pack_out(vals[2 * k] * inv, vals[2 * k + 1] * inv, kind), pred)
    if lse_at is not None:
        ptx.st_f32(lse_at, ptx.lse(m, total), pred * _flag(first))


def weights_row_at(base: Any, wg: Any, nc: int, lane: Any, wwarp: Any) -> Any:
    """The shared address a lane of warp `wwarp` (of warpgroup `wg`) gives the weights' first
    `stmatrix` (`store_weights`; Python ints or kernel values): row `lane % 8` (head 8 (m // 2)
    + lane % 8) of matrix m = `lane // 8`, the warp's tokens 16 wwarp + 8 (m % 2) .. + 7, in the
    weight tile at `base` (`weights_layout`: a 128-byte row of 64 tokens a head, 8-head blocks
    1024 bytes apart, a warpgroup's tile `nc` x 128 bytes on, the 128-byte swizzle of the byte
    address: 16-byte chunk ^= head % 8)."""
    return (base + wg * (nc * TILE * 2) + 1024 * (lane // 16) + 128 * (lane % 8)
            + 16 * ((2 * wwarp + (lane // 8) % 2) ^ (lane % 8)))


def weights_layout(nc: int, wgs: int) -> Any:
    """The weight tile of each consumer warpgroup (the value product's B operand, `nc` heads x
    64 tokens, K-major, 128-byte swizzle; call while tracing)."""
    return sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (128, nc, TILE), cutlass.Float16, wgs)


def score_mma(kreg: bool, nc: int, dtype: Any = None) -> Any:
    """The score product's tiled WGMMA (M = a tile's tokens, N = `nc` columns; call while
    tracing): f16 keys in registers and an f16 query (`kreg`), or the keys and query terms in
    shared memory, fp8 or (`dtype`) a 16-bit cache's type. Its accumulator fragment is the order
    of a thread's scores and weights."""
    dtype = dtype or (cutlass.Float16 if kreg else cutlass.Float8E4M3FN)
    source = warpgroup.OperandSource.RMEM if kreg else warpgroup.OperandSource.SMEM
    k_major = cute.nvgpu.OperandMajorMode.K
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, k_major, k_major, Float32, (1, 1, 1), tiler_mn=(TILE, nc),
                                             a_source=source)


def store_weights(p_at: Any, pk: Any, ns: int, dtype: Any = cutlass.Float16) -> None:
    """The thread's weights `pk` (f32, in wgmma's accumulator order: element e is token g + 8
    ((e // 2) % 2) of the warp's 16, head 8 (e // 4) + 2 t4 + e % 2) into the weight tile (f16,
    or `dtype`: bf16 beside a bf16 cache's values),
    two at a time, a warp's 16 tokens x 8 heads (two matrices) an `stmatrix .trans` pair (four a
    store; two at 8 heads), the thread's row address of the first four `p_at` (the next four's
    2048 bytes on: 16 heads on)."""
    if ns != 4 and ns % 8:
        raise ValueError(f"{ns} weights a thread: stmatrix stores 8 heads (4 weights) or multiples of 16 (8)")
    half = cute.make_rmem_tensor(cute.make_layout(ns), dtype)
    half.store(pk.load().to(dtype))
    words = cute.recast_tensor(half, Int32)
    if ns == 4:
        ptx.stsm_t(p_at, [words[0], words[1]])
    else:
        for q in range(ns // 8):  # (traced: a helper's loops are plain Python)
            ptx.stsm_t(p_at + 2048 * q, [words[4 * q + i] for i in range(4)])


def _mark(on: bool, at: Any, pred: Any, point: Any, value: Any = None) -> None:
    """`Sm90Spec.trace`: word `point` of the CTA's trace at `at` := the SM clock (read only where
    `pred` is 1) or `value`, by the thread whose `pred` is 1 (nothing unless `on`)."""
    if on and value is None:
        ptx.st_clock64(at + 8 * point, pred)
    elif on:
        ptx.st_u64(at + 8 * point, value, pred)


def _mark_tile(on: bool, at: Any, pred: Any, u: Any, step: str) -> None:
    """`_mark` of tile `u`'s milestone `step` (`TRACE_TILE_STEPS`), for the first `TRACE_TILES`
    tiles (nothing unless `on`)."""
    if on:
        _mark(on, at, pred * _flag(u < TRACE_TILES), 3 + len(TRACE_TILE_STEPS) * u + TRACE_TILE_STEPS.index(step))


def _split_tiles(total: Any, split: Any, num_splits: Any, wg: int | Any, wgs: int) -> tuple[Any, Any]:
    """(first tile, tiles) of warpgroup `wg` in split `split` of a row's `total` tiles: the split's
    even share, dealt to its `wgs` warpgroups in turn (warpgroup `wg` walks first + wgs s)."""
    t0 = (split * total) // num_splits
    nloc = ((split + 1) * total) // num_splits - t0
    return t0 + wg, (nloc - wg + (wgs - 1)) // wgs


def _issue(copies: list[tuple[Any, Any, Any]], bar: Any, slot: Any, tx_bytes: Any, tile: Any, head: Any,
           page: Any, policy: Any) -> None:
    """Start the TMA copies of one tile (tile `tile` of page `page`, KV head `head`) into ring
    stage `slot`, completing on its `full` mbarrier `bar` (warp 0 of a warpgroup issues), with the
    L2 cache policy `policy` (None: normal)."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(bar, tx_bytes)
    for atom, s_part, g_part in copies:
        cute.copy(atom, g_part[(None, tile, head, page)], s_part[(None, slot)], tma_bar_ptr=bar, cache_policy=policy)


def build_sm90(spec: Sm90Spec) -> Any:  # noqa: C901 - one kernel, written out
    """The `@cute.jit` host function of `spec`'s kernel, with the argument list of the `cute`
    backend's other kernel (`config.HOST_ARG_KINDS`)."""
    D = 128
    P = spec.page_size
    if P % TILE:
        raise ValueError(f"page size {P} is not a multiple of {TILE}")
    if spec.kind not in CACHE_KINDS:
        raise ValueError(f"cache kind {spec.kind!r} is not one of {CACHE_KINDS}")
    NVFP4 = spec.kind == "nvfp4"
    if NVFP4 and not spec.vreg:
        raise ValueError("the NVFP4 kernel decodes the values into registers (vreg)")
    WIDE = spec.kind in WIDE_KINDS  # a 16-bit cache: both products read the ring's stages as they are
    if WIDE and (spec.vreg or spec.kreg or spec.tconv or spec.lag or spec.refill == "late"):
        raise ValueError(f"a {spec.kind} cache is read by both products from the ring as it is: not with vreg, kreg, "
                         "tconv, lag or a late refill")
    CL = spec.cluster
    if CL and not (spec.fused and not spec.final and 2 <= CL <= WGMMA_MAX_CLUSTER):
        raise ValueError(f"cluster {CL}: the fused merge of 2 .. {WGMMA_MAX_CLUSTER} splits (not final)")
    if spec.trace and spec.write_lse:
        raise ValueError("trace writes its clocks where the LSE would go")
    if spec.evict not in WGMMA_EVICT:
        raise ValueError(f"L2 eviction priority {spec.evict!r}: one of {WGMMA_EVICT}")
    if spec.refill not in WGMMA_REFILL:
        raise ValueError(f"refill {spec.refill!r}: one of {WGMMA_REFILL}")
    if spec.stages < 2 or spec.wgs not in (1, 2):
        raise ValueError(f"stages {spec.stages} (>= 2) / wgs {spec.wgs} (1 or 2)")
    HALVES = P // TILE
    NC = spec.nc
    ST = spec.stages
    TCONV = spec.tconv
    CK = D // 32  # the keys' conversion products of a tile (tconv): one per 32 head dimensions
    if TCONV and NVFP4:
        raise ValueError("tconv converts fp8 keys on the tensor cores (not NVFP4 codes)")
    KREG = spec.kreg or NVFP4 or TCONV  # keys in f16 registers, one f16 query term
    TERMS = WIDE_Q_TERMS[spec.kind][spec.q_kind] if WIDE else 1 if KREG else Q_TERMS[spec.q_kind]
    LO_FIRST = spec.lo_first
    LAG = spec.lag
    LATE = spec.refill == "late"
    WGS = spec.wgs
    VREG = spec.vreg
    T = spec.tokens
    TRACE = spec.trace
    if T not in WGMMA_TOKENS or NC % T or (T > 1 and ((NC // T) % 8 or LAG)):
        raise ValueError(f"tokens {T}: one of {WGMMA_TOKENS}, dividing {NC} heads into groups of a multiple of 8 "
                         "(not with lag)")
    GC = NC // T  # the columns of one token: its query heads
    NTMAX = 32 * HALVES * T  # top-k <= 32 entries a token
    HS = WGMMA_HASH_SLOTS * T  # slots of the hash table that merges the tokens' entries
    N_TV, N_HS = (NTMAX, HS) if T > 1 else (1, 1)  # the union's tables (one word each without)
    EPT = NC * D // _THREADS  # q elements each thread splits
    LPR = D // EPT  # threads per q row
    Q_BYTES = {"bf16": 2, "f16": 2, "e4m3": 1}[spec.q_kind]
    OROW = D + 4  # staged output row (floats), padded
    CODE = D // 2  # NVFP4 code bytes a token
    STAGE_BYTES = TILE * (CODE if NVFP4 else 2 * D if WIDE else D)  # one stage of the key (or value) ring
    SCALE_BYTES = TILE * D // 16  # NVFP4 block scales of a tile
    OWN_SO = NVFP4 or NC * OROW * 4 > ST * STAGE_BYTES  # the output tile needs its own buffer (not the ring)
    SCALE_BOX = (TILE // 16, 128)  # ... as a TMA box: 4 rows of 128 bytes
    final, write_lse, q_kind, out_kind = spec.final, spec.write_lse, spec.q_kind, spec.out_kind
    fp8 = cutlass.Float8E4M3FN
    f16 = cutlass.Float16
    # the ring's element type, the query terms' and the weights' (the value product's B operand)
    wide_t = cutlass.BFloat16 if spec.kind == "bf16" else f16
    KV_T = wide_t if WIDE else fp8
    QT = wide_t if WIDE else f16 if KREG else fp8
    PT = wide_t if WIDE else f16

    built: dict[str, Any] = {}  # the shared-memory struct, made while tracing `host`

    @cute.kernel
    def kernel(tma_k: cute.CopyAtom, gK: cute.Tensor, tma_v: cute.CopyAtom, gV: cute.Tensor,
               tma_ks: cute.CopyAtom, gKs: cute.Tensor, tma_vs: cute.CopyAtom, gVs: cute.Tensor,
               qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, ck_mma: cute.TiledMma, ik_layout: cute.ComposedLayout,
               kv_layout: cute.ComposedLayout,
               vb_layout: cute.ComposedLayout, p_layout: cute.ComposedLayout, q_layout: cute.ComposedLayout,
               sc_layout: cute.Layout,
               q: Int64, topk: Int64, table: Int64, row_request: Int64, q_pos: Int64,
               out: Int64, lse: Int64, part_o: Int64, part_ml: Int64,
               sm_p: Int64, qs_p: Int64, ks_p: Int64, vs_p: Int64, qk_scale: Float32, v_scale: Float32,
               num_pages: Int32, max_blocks: Int32, num_splits: Int32, stride_qr: Int64, stride_qh: Int64,
               stride_th: Int64, stride_tr: Int64, stride_tk: Int64, stride_bt: Int64,
               stride_or: Int64, stride_oh: Int64, stride_lr: Int64, stride_lh: Int64,
               num_kv_heads: Int32, group: Int32, num_topk: Int32, num_rows: Int32, row_tokens: Int32,
               tx_bytes: Int32) -> None:
        tid, _, _ = cute.arch.thread_idx()
        pid, split, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tid % 32
        g = lane // 4
        t4 = lane % 4
        wg = tid // _THREADS  # the consumer warpgroup
        wtid = tid % _THREADS
        wwarp = warp % 4
        chunks = (group + (NC - 1)) // NC
        gc = pid % chunks
        h = (pid // chunks) % num_kv_heads
        r = pid // (chunks * num_kv_heads)
        trace_at = lse + (Int64(pid) * Int64(num_splits) + Int64(split)) * (8 * TRACE_WORDS)

        tracer = _flag(tid == 0)
        if cutlass.const_expr(TRACE):
            _mark(TRACE, trace_at, tracer, TRACE_POINTS.index("start"))
            _mark(TRACE, trace_at, tracer, len(TRACE_POINTS), ptx.globaltimer())

        smem = SmemAllocator()
        st = smem.allocate(built["storage"])
        full = st.full.data_ptr()
        empty = st.empty.data_ptr()
        tile_page = st.tile_page.get_tensor(cute.make_layout(NTMAX))
        tile_idx = st.tile_idx.get_tensor(cute.make_layout(NTMAX))  # the tile's index in its page
        tile_vis = st.tile_vis.get_tensor(cute.make_layout(NTMAX))  # the tile's visible tokens (any token's)
        tile_tvis = st.tile_tvis.get_tensor(cute.make_layout(N_TV))  # byte j: token j's
        count = st.count.get_tensor(cute.make_layout(4))
        colmax = st.colmax.get_tensor(cute.make_layout((4, 2 * NC * WGS)))  # [warp, (wg, tile % 2, head)]
        colscale = st.colscale.get_tensor(cute.make_layout(NC))
        lsum = st.lsum.get_tensor(cute.make_layout(4 * NC * WGS))
        mfin = st.mfin.get_tensor(cute.make_layout(NC * WGS))
        sQ = st.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sP = st.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        sK = st.sK.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        v_layout = vb_layout if WIDE else kv_layout  # (a 16-bit cache's values: the value product's stages)
        sV = st.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)

        # the prologue is ordered for the first TMA copy: warp 0 starts the row's index chain (its
        # entries, then their block-table pages: two dependent DRAM round trips) and opens the
        # first warpgroup's ring as soon as it ends; every thread's query words and scale factors
        # are in flight beside it, and the other warps make the query terms meanwhile
        # q: column qr of the CTA (token qr // GC of the program's rows, head qr % GC of the
        # chunk), elements k0 .. k0 + EPT - 1 (every warpgroup writes the same terms)
        qr = wtid // LPR
        k0 = (wtid % LPR) * EPT
        r0 = r * T  # the program's first row
        q_ok = _flag(gc * NC + qr % GC < group)
        qbase = q + (Int64(r0 + qr // GC) * stride_qr + Int64(h * group + gc * NC + qr % GC) * stride_qh
                     + k0) * Q_BYTES
        QW = EPT * Q_BYTES // 4
        qwords = cute.make_rmem_tensor(cute.make_layout(QW), Int32)
        for w in cutlass.range_constexpr(QW):
            qwords[w] = ptx.ld_b32_plain(qbase + 4 * w, q_ok)
        # the scale factors: host floats times the tensor scales (a plan-owned 1.0 for a float one)
        qk = qk_scale * ptx.ld_f32(sm_p, Int32(1)) * ptx.ld_f32(qs_p, Int32(1)) * ptx.ld_f32(ks_p, Int32(1))
        vs = v_scale * ptx.ld_f32(vs_p, Int32(1))
        # the decoded NVFP4 elements are the E2M1 values times the block scales times 2^-7 (codes
        # at 2^-14, scales at 2^7: `ptx.nvfp4_f16_pairs`): the scores' factor takes the 128, and the
        # values' is applied to this CTA's output (the partials are in true units)
        v_fix = Float32(128.0) if NVFP4 else Float32(1.0)
        qk = qk * v_fix

        # TMA views: (TMA, stage) in shared memory, (TMA, tile-in-page, head, page) in the cache;
        # one entry per copy of a tile: its atom, cache view, stage buffer and box
        # (a box of tokens x bytes, or with a 16-bit cache's values dims x tokens: the index of the
        # tile in the page is the divided view's third mode, or its fourth)
        box = (TILE, CODE) if NVFP4 else (TILE, D)
        tma_parts = [(tma_k, gK, sK, box, True), (tma_v, gV, sV, (D, TILE) if WIDE else box, not WIDE)]
        if cutlass.const_expr(NVFP4):
            tma_parts += [(tma_ks, gKs, st.sKs.get_tensor(sc_layout), SCALE_BOX, True),
                          (tma_vs, gVs, st.sVs.get_tensor(sc_layout), SCALE_BOX, True)]
        copies = []
        for atom, gsrc, sdst, tbox, rows_first in tma_parts:
            tiles_g = cute.flat_divide(gsrc, tbox)
            tiles_g = (tiles_g[None, None, None, 0, None, None] if rows_first
                       else tiles_g[None, None, 0, None, None, None])
            copies.append((atom, *cute.nvgpu.cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                                                   cute.group_modes(sdst, 0, 2),
                                                                   cute.group_modes(tiles_g, 0, 2))))
        sb = wg * ST  # this warpgroup's ring: stages sb .. sb + ST - 1
        policy = None if spec.evict == "normal" else ptx.l2_policy(spec.evict)  # the tiles' L2 eviction priority

        # warp 0: the row's entries (lane e: entry e) on their way, the mbarriers, then the row's
        # tiles, compacted (one row: lane e holds the entry of rank e in block order, after the
        # ranking below; several: lane e's entries, each 1..HALVES tiles), then the first
        # warpgroup's first ST - 1 copies
        if warp == 0:
            e_ok = _flag(lane < num_topk)
            sels = []
            qps = []
            for j in cutlass.range_constexpr(T):
                sels.append(Int64(ptx.ld_b32_plain(topk + (Int64(h) * stride_th + Int64(r0 + j) * stride_tr
                                                           + Int64(lane) * stride_tk) * 4, e_ok)))
                qps.append(ptx.ld_b32_plain(q_pos + Int64(r0 + j) * 4, Int32(1)))
            b = Int64(ptx.ld_b32_plain(row_request + Int64(r0) * 4, Int32(1)))
            # a uniform step's request is row // L: its block-table row starts toward L2 beside
            # the entries (lane i: entries 32 i .. 32 i + 31), so that their pages are L2 hits
            if row_tokens > 0:
                ptx.prefetch_l2(table + (Int64(r0 // row_tokens) * stride_bt + Int64(lane * 32)) * 4,
                                _flag(lane * 32 < max_blocks))
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(WGS * ST):
                    cute.arch.mbarrier_init(full + s, 1)
                    cute.arch.mbarrier_init(empty + s, 1)
            cute.arch.mbarrier_init_fence()
            cute.nvgpu.cpasync.prefetch_descriptor(tma_k)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_v)
            if cutlass.const_expr(NVFP4):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_ks)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_vs)
            # lane e: entry e of each token (one token: then the entry of rank e, below), used
            # where it names a visible block of a page that exists; with several tokens the union
            # of their used entries: each entry claims its block id's slot of a hash table in
            # shared memory (the first to claim it walks the page) and sets its token's bit there,
            # and the page's tiles go once each, with every token's visible count in a byte of
            # `tile_tvis` (0 for a token that did not select it)
            if cutlass.const_expr(T > 1):
                hkeys = st.hkeys.get_tensor(cute.make_layout(HS))
                hmask = st.hmask.get_tensor(cute.make_layout(HS))
                for i in cutlass.range_constexpr(HS // 32):
                    hkeys[lane + 32 * i] = Int32(-1)
                    hmask[lane + 32 * i] = Int32(0)
                cute.arch.sync_warp()
            ns = []
            useds = []
            slots = []
            firsts = []
            pages = []
            for j in cutlass.range_constexpr(T):
                ns.append(ptx.max64(Int64(qps[j]) + 1, 0))
                limit = ptx.min64((ns[j] + (P - 1)) // P, Int64(max_blocks))
                used = e_ok * _flag(sels[j] >= 0) * _flag(sels[j] < limit)
                page = ptx.ld_b32_plain(table + (b * stride_bt + sels[j]) * 4, used)
                if cutlass.const_expr(T == 1):
                    # the row's entries in ascending block order (the unused last), sorted while
                    # their pages are on the way: the rows of a request walk the pages they share
                    # at the same time, so that all but the first read them from L2. A key carries
                    # its lane (so the keys are distinct and their ranks a permutation); lane i
                    # takes the entries of the lane of rank i.
                    key = cutlass.select_(used != 0, (Int32(sels[0]) << 5) | lane, Int32(0x7FFFFFE0) | lane)
                    tile_idx[ptx.warp_rank_i32(key)] = lane
                    cute.arch.sync_warp()
                    src = tile_idx[lane]
                    cute.arch.sync_warp()  # (every lane's read before the tile list is written)
                    sels[0] = Int64(ptx.shfl_idx_i32(Int32(sels[0]), src))
                    used = ptx.shfl_idx_i32(used, src)
                    page = ptx.shfl_idx_i32(page, src)
                useds.append(used * _flag(page >= 0) * _flag(page < num_pages))
                pages.append(page)
                if cutlass.const_expr(T > 1):
                    slot, claimed = ptx.hash_claim(st.hkeys.data_ptr().toint(), Int32(sels[j]), useds[j], HS)
                    ptx.red_or_shared(st.hmask.data_ptr().toint() + 4 * slot, Int32(1 << j), useds[j])
                    slots.append(slot)
                    firsts.append(claimed)
            if cutlass.const_expr(T > 1):
                cute.arch.sync_warp()  # every token's bits, visible to the warp
            marks = []
            spans = []  # the page's tokens visible to any of its tokens (0: not this lane's to walk)
            cnts = []
            local = Int32(0)
            for j in cutlass.range_constexpr(T):
                if cutlass.const_expr(T > 1):
                    mark = hmask[slots[j]]
                    span = Int64(0)
                    for j2 in cutlass.range_constexpr(T):
                        seen = ptx.min64(ptx.max64(ns[j2] - sels[j] * P, 0), P) * Int64((mark >> j2) & 1)
                        span = ptx.max64(span, seen)
                    marks.append(mark)
                    spans.append(Int32(span) * firsts[j])
                else:
                    spans.append(Int32(ptx.min64(ns[0] - sels[0] * P, P)) * useds[0])
                cnts.append((spans[j] + (TILE - 1)) // TILE)
                local = local + cnts[j]
            incl = local
            for sh in cutlass.range_constexpr(5):
                other = ptx.shfl_up_i32(incl, 1 << sh)
                if lane >= (1 << sh):
                    incl = incl + other
            at = incl - local
            for j in cutlass.range_constexpr(T):
                for t in cutlass.range_constexpr(HALVES):
                    if t < cnts[j]:
                        left = spans[j] - t * TILE
                        if left > TILE:
                            left = Int32(TILE)
                        tile_page[at + t] = pages[j]
                        tile_idx[at + t] = Int32(t)
                        tile_vis[at + t] = left
                        if cutlass.const_expr(T > 1):
                            packed = Int32(0)
                            for j2 in cutlass.range_constexpr(T):
                                seen = ptx.min64(ptx.max64(ns[j2] - sels[j] * P - t * TILE, 0), TILE)
                                packed = packed | ((Int32(seen) * ((marks[j] >> j2) & 1)) << (8 * j2))
                            tile_tvis[at + t] = packed
                at = at + cnts[j]
            total_tiles = ptx.shfl_idx_i32(incl, 31)
            if lane == 0:
                count[0] = total_tiles
            cute.arch.sync_warp()  # the lanes' tile entries, visible to the warp
            _mark(TRACE, trace_at, tracer, TRACE_POINTS.index("tiles listed"))
            f0, fn = _split_tiles(total_tiles, split, num_splits, 0, WGS)
            for s in cutlass.range_constexpr(ST - 1):
                if s < fn:
                    _issue(copies, full + s, s, tx_bytes, tile_idx[f0 + WGS * s], h, tile_page[f0 + WGS * s], policy)

        # q, split into TERMS fp8 terms, or one f16 term (KREG)
        xs = cute.make_rmem_tensor(cute.make_layout(EPT), Float32)
        for w in cutlass.range_constexpr(QW):
            word = qwords[w]
            if cutlass.const_expr(q_kind == "bf16"):
                lo, hi = _f32_of_bf16_pair(word)
                xs[2 * w] = lo
                xs[2 * w + 1] = hi
            elif cutlass.const_expr(q_kind == "f16"):
                lo, hi = ptx.f16x2_to_f32(word)
                xs[2 * w] = lo
                xs[2 * w + 1] = hi
            else:
                vals = ptx.e4m3x4_to_f32(word)
                for i in cutlass.range_constexpr(4):
                    xs[4 * w + i] = vals[i]
        scale = Float32(1.0)
        if cutlass.const_expr(TERMS > 1 or (q_kind == "bf16" and (KREG or spec.kind == "f16"))):
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(EPT):
                amax = ptx.fmax(amax, ptx.fmax(xs[i], -xs[i]))
            for sh in cutlass.range_constexpr(LPR.bit_length() - 1):
                amax = ptx.fmax(amax, ptx.shfl_xor(amax, 1 << sh))
            scale = ptx.pow2_scale(amax)  # 2^(7 - floor(log2 amax)), 1 for 0
            for i in cutlass.range_constexpr(EPT):
                xs[i] = xs[i] * scale
        if cutlass.const_expr(KREG):
            # element d of the head goes to column 16 j + 2 t + d % 2 + 8 (d % 4 // 2) of the
            # product's k-steps, where t = d // 32 and j = d % 32 // 4 (the keys' register order)
            term = cute.make_rmem_tensor(cute.make_layout(EPT), f16)
            term.store(xs.load().to(f16))
            for i in cutlass.range_constexpr(EPT):
                dq = k0 + i
                if cutlass.const_expr(TCONV):  # the conversion product keeps the head's order
                    col = dq
                elif cutlass.const_expr(NVFP4):
                    # NVFP4 keys pair element e of a code word with e + 4 (`ptx.nvfp4_f16_pairs`):
                    # element e of word w = d % 32 // 8 goes to k-step 2 w + e % 4 // 2, column
                    # 2 t + 8 (e % 2) + e // 4
                    e8 = dq % 8
                    col = 16 * (2 * (dq % 32 // 8) + e8 % 4 // 2) + 2 * (dq // 32) + 8 * (e8 % 2) + e8 // 4
                else:
                    col = 16 * (dq % 32 // 4) + 2 * (dq // 32) + dq % 2 + 8 * (dq % 4 // 2)
                sQ[qr, col, 0] = term[i]
        else:
            for t in cutlass.range_constexpr(TERMS):  # fp8 terms, or a 16-bit cache's terms of its type
                term = cute.make_rmem_tensor(cute.make_layout(EPT), QT)
                term.store(xs.load().to(QT))
                if cutlass.const_expr(t + 1 < TERMS):
                    xs.store(xs.load() - term.load().to(Float32))
                for i in cutlass.range_constexpr(EPT):
                    sQ[qr, k0 + i, t] = term[i]
        if wtid % LPR == 0:
            colscale[qr] = qk / scale
        if cutlass.const_expr(TCONV):
            # the identity tile of the keys' conversion product (its B, [n, k] = (n == k), 32 x 32;
            # the first warpgroup writes it, thread: n = wtid // 4, k = 8 (wtid % 4) + i)
            sIk = st.sIk.get_tensor(ik_layout.outer, swizzle=ik_layout.inner)
            if wg == 0:
                unit = cute.make_rmem_tensor(cute.make_layout(8), Float32)
                for i in cutlass.range_constexpr(8):
                    unit[i] = cutlass.select_(wtid // 4 == 8 * (wtid % 4) + i, Float32(1.0), Float32(0.0))
                unit8 = cute.make_rmem_tensor(cute.make_layout(8), fp8)
                unit8.store(unit.load().to(fp8))
                for i in cutlass.range_constexpr(8):
                    sIk[wtid // 4, 8 * (wtid % 4) + i, 0] = unit8[i]
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier()

        # this warpgroup's tiles: t0 + WGS s, s < nloc (the first warpgroup's first copies are in
        # flight already; another's start here)
        t0, nloc = _split_tiles(count[0], split, num_splits, wg, WGS)
        _mark(TRACE, trace_at, tracer, TRACE_POINTS.index("prologue done"))
        if cutlass.const_expr(WGS > 1):  # noqa: SIM102 - a compile-time condition, then a run-time one
            if wwarp == 0 and wg > 0:
                for s in cutlass.range_constexpr(ST - 1):
                    if s < nloc:
                        _issue(copies, full + sb + s, sb + s, tx_bytes, tile_idx[t0 + WGS * s], h,
                               tile_page[t0 + WGS * s], policy)

        qk_thr = qk_mma.get_slice(wtid)
        pv_thr = pv_mma.get_slice(wtid)
        if cutlass.const_expr(KREG):
            tSrK = qk_mma.make_fragment_A(qk_thr.partition_shape_A((TILE, D)))
            tSrK32 = cute.recast_tensor(tSrK, Int32)  # f16 pairs (two elements of one token)
        if cutlass.const_expr(NVFP4):
            # the thread's shared addresses, swizzle applied: keys 16 w + g (+ 8) of a tile, its 16
            # code bytes of each (chunk t4 of the row, moved by the 64-byte swizzle: bits 4-5 ^= bits
            # 7-8, i.e. row // 2 % 4 = g // 2 for these rows) and its two block scales (one 16-bit load)
            k_row = st.sK.data_ptr().toint() + (wwarp * 16 + g) * CODE + ((t4 ^ (g // 2)) * 16)
            ks_row = st.sKs.data_ptr().toint() + (wwarp * 16 + g) * 8 + 2 * t4
            # the values' block scales of tokens (2 t4, 2 t4 + 1) of a quad row, block 2 w + g // 4
            vs_row = st.sVs.data_ptr().toint() + 4 * (2 * wwarp + g // 4) + 32 * (t4 // 2) + 2 * (t4 % 2)
        elif cutlass.const_expr(TCONV):
            # the keys' conversion: K (the stage, A) . I (B) in CK 32-dim chunks, each chunk's f16
            # accumulators (64 x 32) two k-steps of the score product's A registers, in place
            ck_thr = ck_mma.get_slice(wtid)
            tCkA = ck_mma.make_fragment_A(ck_thr.partition_A(sK))
            tCkB = ck_mma.make_fragment_B(ck_thr.partition_B(sIk))
            dK = [cute.make_tensor(tSrK.iterator + 16 * c, cute.make_layout(ck_thr.partition_shape_C((TILE, 32))))
                  for c in range(CK)]
        elif cutlass.const_expr(KREG):
            # an fp8 key row: the thread's 32 bytes are chunks 2 t4 and 2 t4 + 1, moved by the
            # 128-byte swizzle (bits 4-6 ^= bits 7-9, i.e. row % 8 = g for its rows 16 w + g (+ 8))
            k_row = st.sK.data_ptr().toint() + (wwarp * 16 + g) * D
            k_chunks = (((2 * t4) ^ g) * 16, ((2 * t4 + 1) ^ g) * 16)
        else:
            tSrK = qk_mma.make_fragment_A(qk_thr.partition_A(sK))
        tSrQ = qk_mma.make_fragment_B(qk_thr.partition_B(sQ))
        tScS = qk_thr.partition_C(cute.make_identity_tensor((TILE, NC)))
        accS = cute.make_rmem_tensor(tScS.shape, Float32)
        if cutlass.const_expr(VREG):
            tOrV = pv_mma.make_fragment_A(pv_thr.partition_shape_A((D, TILE)))
            tOrV32 = cute.recast_tensor(tOrV, Int32)  # f16 pairs (two tokens of one row)
            # the values are read with `ldmatrix .trans` (`ptx.ldsm_t`), each matrix eight tokens'
            # 16-byte chunks of the warp's 32 head dimensions: a thread gets the two bytes at
            # 2 g of tokens 2 t4 and 2 t4 + 1 (one NVFP4 word: dims 32 w + 4 g .. + 3 of both; an
            # fp8 one: dims 32 w + 16 c + 2 g, + 1 of chunk c). This lane's row address: token
            # `lane` of the first read (+ 32 a read, NVFP4: matrix m is tokens 8 m ..), or token
            # 8 ((lane // 8) % 2) + lane % 8, chunk 2 w + lane // 16 (+ 16 tokens a read, fp8),
            # the chunk moved by the swizzle (64-byte: ^= row // 2 % 4; 128-byte: ^= row % 8)
            if cutlass.const_expr(NVFP4):
                v_base = st.sV.data_ptr().toint() + lane * CODE + ((wwarp ^ (lane // 2 % 4)) * 16)
            else:
                v_row = 8 * (lane // 8 % 2) + lane % 8
                v_base = st.sV.data_ptr().toint() + v_row * D + (((2 * wwarp + lane // 16) ^ (lane % 8)) * 16)
        elif cutlass.const_expr(WIDE):
            # the value product reads the ring's stage (`tOrV[..., stage]`); the tokens of a tile past
            # its row's visible length are zeroed in the stage first, 8 elements (16 bytes) a copy
            tOrV = pv_mma.make_fragment_A(pv_thr.partition_A(sV))
            zero_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), KV_T, num_bits_per_copy=128)
            zc = cute.make_tiled_copy_tv(zero_atom, cute.make_ordered_layout((_THREADS // (D // 8), D // 8),
                                                                             order=(1, 0)),
                                         cute.make_layout((1, 8)))
            zc_thr = zc.get_slice(wtid)
            vzdst = zc_thr.partition_D(cute.make_tensor(sV.iterator, cute.select(sV.layout, mode=[1, 0, 2])))
            vcoord = zc_thr.partition_S(cute.make_identity_tensor((TILE, D)))
        else:
            sVb = st.sVb.get_tensor(vb_layout.outer, swizzle=vb_layout.inner)
            tOrV = pv_mma.make_fragment_A(pv_thr.partition_A(sVb))[(None, None, None, wg)]
            # fp8 value tile -> f16 operand: 8 elements (one token, 8 dims) per copy
            cvt_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), fp8, num_bits_per_copy=64)
            cvt = cute.make_tiled_copy_tv(cvt_atom, cute.make_ordered_layout((_THREADS // (D // 8), D // 8),
                                                                             order=(1, 0)),
                                          cute.make_layout((1, 8)))
            cvt_thr = cvt.get_slice(wtid)
            sVb_td = cute.make_tensor(sVb[None, None, wg].iterator,
                                      cute.select(sVb[None, None, wg].layout, mode=[1, 0]))
            vdst = cvt_thr.partition_D(sVb_td)
            vcoord = cvt_thr.partition_S(cute.make_identity_tensor((TILE, D)))
        tOrP = pv_mma.make_fragment_B(pv_thr.partition_B(sP))[(None, None, None, wg)]
        tOcO = pv_thr.partition_C(cute.make_identity_tensor((D, NC)))
        accO = cute.make_rmem_tensor(tOcO.shape, Float32)
        accO.fill(0.0)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        NKQ = cute.size(tSrK, mode=[2])
        NS = cute.size(accS)
        NO = cute.size(accO)
        sP_kh = cute.make_tensor(sP[None, None, wg].iterator, cute.select(sP[None, None, wg].layout, mode=[1, 0]))
        # this lane's row of the weights' first `stmatrix` (`store_weights`, `weights_row_at`)
        p_at = weights_row_at(st.sP.data_ptr().toint(), wg, NC, lane, wwarp)

        # the thread's scores are NS elements over NCOL columns (heads): element e is column
        # 2 (e // 4) + e % 2, row g or g + 8 (wgmma's accumulator layout)
        NCOL = NS // 2
        cs = cute.make_rmem_tensor(cute.make_layout(NCOL), Float32)  # the scale of each of the thread's columns
        for ci in cutlass.range_constexpr(NCOL):
            cs[ci] = colscale[tScS[4 * (ci // 2) + ci % 2][1]]
        mcol = cute.make_rmem_tensor(cute.make_layout(NCOL), Float32)  # offset of the sums so far
        lcol = cute.make_rmem_tensor(cute.make_layout(NCOL), Float32)  # the thread's sums
        moff = cute.make_rmem_tensor(cute.make_layout(NCOL), Float32)  # the maximum through the last tile
        mnew = cute.make_rmem_tensor(cute.make_layout(NCOL), Float32)
        alpha = cute.make_rmem_tensor(cute.make_layout(NCOL), Float32)
        if cutlass.const_expr(T > 1):
            mref = cute.make_rmem_tensor(cute.make_layout(NCOL), Float32)  # the maximum, 0 for -inf
        for ci in cutlass.range_constexpr(NCOL):
            mcol[ci] = Float32(_NEG_INF)
            moff[ci] = Float32(_NEG_INF)
            lcol[ci] = Float32(0.0)
        sv = cute.make_rmem_tensor(cute.make_layout(NS), Float32)
        pk = cute.make_rmem_tensor(cute.make_layout(NS), Float32)
        if cutlass.const_expr(KREG):  # the product of the "tile before the first": zeros
            if cutlass.const_expr(VREG):
                tOrV.fill(0.0)
            else:
                vzero = cute.make_rmem_tensor(cute.make_layout(cute.size(vdst, mode=[0])), f16)
                vzero.fill(0.0)
                for c in cutlass.range_constexpr(cute.size(vdst, mode=[1])):
                    cute.autovec_copy(vzero, vdst[None, c, 0])
            for e in cutlass.range_constexpr(NS):
                sP_kh[tScS[e]] = f16(0.0)
            cute.arch.fence_proxy("async.shared", space="cta")
            _wg_barrier(wg, WGS)

        for u in cutlass.range(nloc, unroll=1):
            stage = sb + u % ST

            def refill(u: Any) -> None:  # (defined in the loop: the DSL takes no closure across its loops)
                """Warp 0 of the warpgroup, at its tile `u`: tile `u + ST - 1` of its ring (if it has
                one) into the stage tile `u - 1` held, once that stage is released (its `empty`
                mbarrier)."""
                if wwarp == 0:
                    lu = u + ST - 1
                    if lu < nloc:
                        ls = sb + lu % ST
                        cute.arch.mbarrier_wait(empty + ls, ((lu // ST) + 1) % 2)
                        _issue(copies, full + ls, ls, tx_bytes, tile_idx[t0 + WGS * lu], h, tile_page[t0 + WGS * lu],
                               policy)

            def release_last(u: Any) -> None:  # (a 16-bit cache)
                """The last tile's stage back to the ring, now that its value product (the stage is
                its A operand) has retired (every warp of the warpgroup waited for it before the
                barrier this follows), and refilled with tile `u + ST - 1`."""
                if wtid == 0 and u > 0:
                    cute.arch.mbarrier_arrive(empty + sb + (u + ST - 1) % ST)
                refill(u)

            if cutlass.const_expr(not LATE and not WIDE):  # (a 16-bit stage refills once its values' product retired)
                refill(u)
            cute.arch.mbarrier_wait(full + stage, (u // ST) % 2)
            _mark_tile(TRACE, trace_at, tracer, u, "copied")
            if cutlass.const_expr(TRACE):
                _mark(TRACE, trace_at, tracer * _flag(u < TRACE_TILES), TRACE_WALKED + u,
                      Int64(tile_page[t0 + WGS * u]) * HALVES + Int64(tile_idx[t0 + WGS * u]))
            vis = tile_vis[t0 + WGS * u]
            if cutlass.const_expr(T > 1):
                tvis = tile_tvis[t0 + WGS * u]

            if cutlass.const_expr(NVFP4):
                # the keys: tokens 16 w + g (+ 8) of the tile, each 16 code bytes (one load) and two
                # block scales, decoded into the score product's f16 A registers
                k_at = k_row + stage * STAGE_BYTES
                ks_at = ks_row + stage * SCALE_BYTES
                for hh in cutlass.range_constexpr(2):
                    words = ptx.lds(k_at + hh * 8 * CODE, 4)
                    sc = ptx.e4m3x2_scale(ptx.lds_u16(ks_at + hh * 8 * 8), 128)
                    reps = (ptx.replicate_half(sc, False), ptx.replicate_half(sc, True))
                    for w in cutlass.range_constexpr(4):
                        regs = ptx.nvfp4_f16_pairs(words[w], reps[w // 2])
                        tSrK32[hh, 0, 2 * w] = regs[0]
                        tSrK32[hh + 2, 0, 2 * w] = regs[1]
                        tSrK32[hh, 0, 2 * w + 1] = regs[2]
                        tSrK32[hh + 2, 0, 2 * w + 1] = regs[3]
            elif cutlass.const_expr(TCONV):
                # the keys to f16 registers on the tensor cores
                warpgroup.fence()
                ck_mma.set(warpgroup.Field.ACCUMULATE, False)
                for c in cutlass.range_constexpr(CK):
                    cute.gemm(ck_mma, dK[c], tCkA[(None, None, c, stage)], tCkB[(None, None, 0, 0)], dK[c])
                cute.gemm(pv_mma, accO, tOrV, tOrP, accO)  # the last tile's values (zeros before the first)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
            elif cutlass.const_expr(KREG):
                # the keys: tokens 16 w + g (+ 8), each the thread's 32 bytes (two loads); word j is
                # k-step j's (elements 4 j .. 4 j + 3 of its share)
                k_at = k_row + stage * STAGE_BYTES
                for hh in cutlass.range_constexpr(2):
                    words = ptx.lds(k_at + hh * 8 * D + k_chunks[0], 4) + ptx.lds(k_at + hh * 8 * D + k_chunks[1], 4)
                    for j in cutlass.range_constexpr(8):
                        pair = ptx.e4m3x4_to_f16x2(words[j])
                        tSrK32[hh, 0, j] = pair[0]
                        tSrK32[hh + 2, 0, j] = pair[1]

            # scores: S^T = K . (sum of the q terms)^T
            _mark_tile(TRACE, trace_at, tracer, u, "keys")
            warpgroup.fence()
            if cutlass.const_expr(KREG and not TCONV):
                # the last tile's values (zeros before the first): issued here, after this tile's key
                # registers are written, so that no register a wgmma reads is written while one is
                # in flight (ptxas would serialise them all)
                cute.gemm(pv_mma, accO, tOrV, tOrP, accO)
            for n in cutlass.range_constexpr(TERMS):
                t = TERMS - 1 - n if LO_FIRST else n  # (the smallest terms first: `Sm90Spec.lo_first`)
                for kk in cutlass.range_constexpr(NKQ):
                    qk_mma.set(warpgroup.Field.ACCUMULATE, n + kk > 0)
                    if cutlass.const_expr(KREG):
                        cute.gemm(qk_mma, accS, tSrK[(None, None, kk)], tSrQ[(None, None, kk, t)], accS)
                    else:
                        cute.gemm(qk_mma, accS, tSrK[(None, None, kk, stage)], tSrQ[(None, None, kk, t)], accS)
            warpgroup.commit_group()

            if cutlass.const_expr(VREG):
                # one `ldmatrix .trans` a read (addresses: `v_base`); the words a thread gets, each
                # two tokens' bytes of its dims: NVFP4: word 4 a + m is tokens (16 kk + 8 half +
                # 2 t4, + 1), kk = 2 a + m // 2, half = m % 2; fp8: word 4 kk + m is tokens
                # (16 kk + 8 half + 2 t4, + 1) of chunk c, half = m % 2, c = m // 2
                vw = cute.make_rmem_tensor(cute.make_layout(16), Int32)
                v_at = v_base + stage * STAGE_BYTES
                for a in cutlass.range_constexpr(2 if NVFP4 else 4):
                    words = ptx.ldsm_t(v_at + a * (32 * CODE if NVFP4 else 16 * D))
                    for m in cutlass.range_constexpr(4):
                        vw[4 * a + m] = words[m]
                if cutlass.const_expr(not NVFP4):  # noqa: SIM102 - a compile-time condition, then a run-time one
                    if vis < TILE:  # the row ends inside this tile: zero the tokens past it
                        for i in cutlass.range_constexpr(16):
                            vw[i] = ptx.keep_low_bytes(vw[i], 2 * (vis - (16 * (i // 4) + 8 * (i % 2) + 2 * t4)))
                vsc = None
                if cutlass.const_expr(NVFP4):
                    # the block scales of tokens (a, a + 1), a = 16 kk + 8 half + 2 t4: interleaved by
                    # token quads; a token past the row's end gets a zero scale (so zero values)
                    vsc = cute.make_rmem_tensor(cute.make_layout(8), Int32)
                    vs_at = vs_row + stage * SCALE_BYTES
                    for kk in cutlass.range_constexpr(4):
                        for half in cutlass.range_constexpr(2):
                            bits = ptx.lds_u16(vs_at + (4 * kk + 2 * half) * 32)
                            if vis < TILE:
                                bits = ptx.keep_low_bytes(bits, vis - (16 * kk + 8 * half + 2 * t4))
                            vsc[2 * kk + half] = ptx.e4m3x2_scale(bits, 128)
            elif cutlass.const_expr(WIDE):
                vw, vsc = None, None  # (the product reads the stage)
            else:
                vsrc = cvt_thr.partition_S(sV[None, None, stage])
                NCV = cute.size(vsrc, mode=[1])
                VW = cute.size(vsrc, mode=[0])
                v8 = cute.make_rmem_tensor(cute.make_layout((VW, NCV)), fp8)
                for c in cutlass.range_constexpr(NCV):
                    cute.autovec_copy(vsrc[None, c, 0], v8[(None, c)])
                vw, vsc = v8, None  # (the fp8 registers `values` converts)
            if cutlass.const_expr(LATE):
                refill(u)
            warpgroup.wait_group(0)  # this tile's scores and the last tile's values retired
            _mark_tile(TRACE, trace_at, tracer, u, "scores")

            def values(vis: Any, words: Any, scales: Any, stage: Any) -> None:  # (once the column maxima are out)
                """This tile's values into the value product's operand, now that the last tile's
                product has retired: its `ldmatrix` words (and NVFP4 block-scale pairs) decoded into
                the A registers (`vreg`), or its fp8 registers (`words`) converted into the f16 copy
                in shared memory, the tokens past the row's visible `vis` zeroed (a 16-bit cache's
                in its ring `stage`, which the product reads)."""
                if cutlass.const_expr(VREG):
                    for kk in cutlass.range_constexpr(4):
                        for half in cutlass.range_constexpr(2):  # tokens 2 t4 (+ 1), then 2 t4 + 8 (+ 1)
                            # fragment (mma values, m-block, k-step): element 2 h + 4 half (+1) is
                            # row g + 8 h, tokens 2 t4 + 8 half (+1); row 64 mb + 16 w + 8 h + g is
                            # dim 32 w + 4 g + 2 mb + h (NVFP4), 32 w + 16 mb + 2 g + h (fp8)
                            if cutlass.const_expr(NVFP4):
                                dims = ptx.nvfp4_f16_pairs(words[4 * (kk // 2) + 2 * (kk % 2) + half],
                                                           scales[2 * kk + half])
                                for i in cutlass.range_constexpr(4):
                                    tOrV32[half * 2 + i % 2, i // 2, kk] = dims[i]
                            else:
                                for mb in cutlass.range_constexpr(2):  # chunk mb: dims 2 g, 2 g + 1 in rows g, g + 8
                                    # bytes (a0, a1, b0, b1) -> (a0, b0, a1, b1): f16 pairs of one dim
                                    word = ptx.prmt(words[4 * kk + 2 * mb + half], Int32(0), 0x3120)
                                    pair = ptx.e4m3x4_to_f16x2(word)
                                    tOrV32[half * 2, mb, kk] = pair[0]
                                    tOrV32[half * 2 + 1, mb, kk] = pair[1]
                elif cutlass.const_expr(WIDE):
                    if vis < TILE:  # the row ends inside this tile: zero the stage's tokens past it
                        vz = cute.make_rmem_tensor(cute.make_layout(cute.size(vzdst, mode=[0])), KV_T)
                        vz.fill(0.0)
                        for c in cutlass.range_constexpr(cute.size(vzdst, mode=[1])):
                            if vcoord[0, c, 0][0] >= vis:
                                cute.autovec_copy(vz, vzdst[None, c, 0, stage])
                else:
                    VW, NCV = cute.size(words, mode=[0]), cute.size(words, mode=[1])
                    vh = cute.make_rmem_tensor(cute.make_layout(VW), f16)
                    for c in cutlass.range_constexpr(NCV):
                        vh.store(words[(None, c)].load().to(f16))
                        cute.autovec_copy(vh, vdst[None, c, 0])
                    if vis < TILE:  # the row ends inside this tile: zero the values past it (a copy is one token's)
                        vh.fill(0.0)
                        for c in cutlass.range_constexpr(NCV):
                            if vcoord[0, c, 0][0] >= vis:
                                cute.autovec_copy(vh, vdst[None, c, 0])

            buf = (2 * wg + u % 2) * NC  # this tile's column maxima: colmax[warp, buf + column]
            if cutlass.const_expr(T > 1):
                # token j's columns are the thread's elements j EJ .. (j + 1) EJ - 1 (column block
                # e // 4 of 8 columns is token 8 (e // 4) // GC's); a token that did not select
                # this tile's page (a visible count of 0: the same in every thread) is skipped,
                # its weights 0 and its maxima kept
                EJ = NS // T
                vt = []
                for j in cutlass.range_constexpr(T):
                    vt.append((tvis >> (8 * j)) & 255)
                for j in cutlass.range_constexpr(T):
                    if vt[j] > 0:
                        for e in cutlass.range_constexpr(j * EJ, (j + 1) * EJ):
                            sv[e] = ptx.masked(accS[e] * cs[2 * (e // 4) + e % 2], tScS[e][0], vt[j])
                        for ci in cutlass.range_constexpr(j * EJ // 2, (j + 1) * EJ // 2):
                            e = 4 * (ci // 2) + ci % 2
                            m = _warp_column_max(sv, e)
                            if lane < 4:
                                colmax[wwarp, buf + tScS[e][1]] = m
                values(vis, vw, vsc, stage)
                _wg_barrier(wg, WGS)
                if cutlass.const_expr(WIDE):
                    release_last(u)
                _mark_tile(TRACE, trace_at, tracer, u, "maxima")
                for j in cutlass.range_constexpr(T):
                    if vt[j] > 0:
                        for ci in cutlass.range_constexpr(j * EJ // 2, (j + 1) * EJ // 2):
                            mnew[ci] = ptx.fmax(mcol[ci], _tile_max(colmax, buf + tScS[4 * (ci // 2) + ci % 2][1]))
                            mref[ci] = ptx.safe(mnew[ci])  # -inf: none of the token's tiles so far had a visible token
                        for e in cutlass.range_constexpr(j * EJ, (j + 1) * EJ):
                            pk[e] = cute.arch.exp2(sv[e] - mref[2 * (e // 4) + e % 2])
                    else:
                        for ci in cutlass.range_constexpr(j * EJ // 2, (j + 1) * EJ // 2):
                            mnew[ci] = mcol[ci]
                        for e in cutlass.range_constexpr(j * EJ, (j + 1) * EJ):
                            pk[e] = Float32(0.0)
                store_weights(p_at, pk, NS, PT)
                cute.arch.fence_proxy("async.shared", space="cta")
                _wg_barrier(wg, WGS)
                _mark_tile(TRACE, trace_at, tracer, u, "weights")
            else:
                # scaled, masked scores
                for e in cutlass.range_constexpr(NS):
                    x = accS[e] * cs[2 * (e // 4) + e % 2]
                    if vis < TILE:  # noqa: SIM102 - DSL conditions do not short-circuit
                        if tScS[e][0] >= vis:
                            x = Float32(_NEG_INF)
                    sv[e] = x
                # this warp's maximum of each of the thread's columns -> colmax[warp, tile % 2, head]
                for ci in cutlass.range_constexpr(NCOL):
                    e = 4 * (ci // 2) + ci % 2
                    m = _warp_column_max(sv, e)
                    if lane < 4:
                        colmax[wwarp, buf + tScS[e][1]] = m
                values(vis, vw, vsc, stage)
                if cutlass.const_expr(not LAG):
                    _wg_barrier(wg, WGS)
                    if cutlass.const_expr(WIDE):
                        release_last(u)
                    _mark_tile(TRACE, trace_at, tracer, u, "maxima")
                    for ci in cutlass.range_constexpr(NCOL):
                        mnew[ci] = ptx.fmax(mcol[ci], _tile_max(colmax, buf + tScS[4 * (ci // 2) + ci % 2][1]))
                else:
                    for ci in cutlass.range_constexpr(NCOL):
                        mnew[ci] = moff[ci]
                    _mark_tile(TRACE, trace_at, tracer, u, "maxima")  # (no exchange: the last tiles' maxima)
                over = Int32(0)
                for e in cutlass.range_constexpr(NS):
                    d = sv[e] - mnew[2 * (e // 4) + e % 2]
                    if cutlass.const_expr(LAG):
                        over = over | _flag(d > _LAG_LIMIT)
                    pk[e] = cute.arch.exp2(d)
                store_weights(p_at, pk, NS, PT)
                cute.arch.fence_proxy("async.shared", space="cta")
                if cutlass.const_expr(LAG):
                    # the offset (the maximum through the last tile) left some weight above 2^15 (and
                    # the first tile has none): redo this tile with its exact maximum
                    if ptx.bar_red_or(over, (1 + wg) if WGS > 1 else 0, _THREADS if WGS > 1 else 0) != 0:
                        for ci in cutlass.range_constexpr(NCOL):
                            mnew[ci] = ptx.fmax(moff[ci], _tile_max(colmax, buf + tScS[4 * (ci // 2) + ci % 2][1]))
                        for e in cutlass.range_constexpr(NS):
                            pk[e] = cute.arch.exp2(sv[e] - mnew[2 * (e // 4) + e % 2])
                        store_weights(p_at, pk, NS, PT)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        _wg_barrier(wg, WGS)
                    _mark_tile(TRACE, trace_at, tracer, u, "weights")
                else:
                    _wg_barrier(wg, WGS)
                    _mark_tile(TRACE, trace_at, tracer, u, "weights")
            if cutlass.const_expr(not WIDE):  # noqa: SIM102 - (16-bit: once its values' product retired, `release_last`)
                if wtid == 0:
                    cute.arch.mbarrier_arrive(empty + stage)
            _mark_tile(TRACE, trace_at, tracer, u, "done")
            moved = Int32(0)
            for ci in cutlass.range_constexpr(NCOL):
                e = 4 * (ci // 2) + ci % 2
                alpha[ci] = cute.arch.exp2(mcol[ci] - mnew[ci])
                if cutlass.const_expr(T > 1):  # nothing summed yet (maybe still nothing: -inf - -inf)
                    alpha[ci] = cutlass.select_(mcol[ci] == Float32(_NEG_INF), Float32(1.0), alpha[ci])
                lcol[ci] = lcol[ci] * alpha[ci] + pk[e] + pk[e + 2]
                moved = moved | _flag(alpha[ci] != 1.0)
                mcol[ci] = mnew[ci]
                if cutlass.const_expr(LAG):  # the next tile's offset: the maximum through this one
                    moff[ci] = ptx.fmax(mnew[ci], _tile_max(colmax, buf + tScS[e][1]))
            if ptx.any(moved) != 0:
                for e in cutlass.range_constexpr(NO):
                    a = alpha[0]
                    for ci in cutlass.range_constexpr(1, NCOL):
                        if tOcO[e][1] == tScS[4 * (ci // 2) + ci % 2][1]:
                            a = alpha[ci]
                    accO[e] = accO[e] * a
            if cutlass.const_expr(not KREG):
                warpgroup.fence()
                cute.gemm(pv_mma, accO, tOrV[(None, None, None, stage)] if WIDE else tOrV, tOrP, accO)
                warpgroup.commit_group()

        if cutlass.const_expr(KREG):  # the last tile's values
            warpgroup.fence()
            cute.gemm(pv_mma, accO, tOrV, tOrP, accO)
            warpgroup.commit_group()
        warpgroup.wait_group(0)
        _mark(TRACE, trace_at, tracer, TRACE_POINTS.index("walk done"))

        # per-head sums: the thread's two rows, the warp's eight lanes, then the four warps
        for ci in cutlass.range_constexpr(NCOL):
            e = 4 * (ci // 2) + ci % 2
            part = lcol[ci]
            part = part + ptx.shfl_xor(part, 4)
            part = part + ptx.shfl_xor(part, 8)
            part = part + ptx.shfl_xor(part, 16)
            if lane < 4:
                lsum[warp * NC + tScS[e][1]] = part
            if wtid < 4:
                mfin[wg * NC + tScS[e][1]] = mcol[ci]
        # each warpgroup's output tile through shared memory (its own ring is idle now): rows = heads
        if cutlass.const_expr(OWN_SO):  # a buffer of its own (a warpgroup's ring is smaller than its tile)
            sO = st.sO.get_tensor(cute.make_layout((NC, OROW, WGS), stride=(OROW, 1, NC * OROW)))
        else:  # the warpgroup's own ring
            sO = cute.make_tensor(cute.recast_ptr(st.sK.data_ptr(), None, Float32),
                                  cute.make_layout((NC, OROW, WGS), stride=(OROW, 1, ST * STAGE_BYTES // 4)))
        for e in cutlass.range_constexpr(NO):
            d = tOcO[e][0]
            if cutlass.const_expr(VREG and NVFP4):  # product row 64 mb + 16 w + 8 h + g: dim 32 w + 4 g + 2 mb + h
                d = 32 * (d % 64 // 16) + 4 * (d % 8) + 2 * (d // 64) + d % 16 // 8
            elif cutlass.const_expr(VREG):  # fp8: dim 32 w + 16 mb + 2 g + h
                d = 32 * (d % 64 // 16) + 16 * (d // 64) + 2 * (d % 8) + d % 16 // 8
            sO[tOcO[e][1], d, wg] = accO[e]
        cute.arch.barrier()
        _mark(TRACE, trace_at, tracer, TRACE_POINTS.index("output staged"))

        # thread (row, c) of the first warpgroup: head `row`, elements c .. c + CW - 1, the
        # warpgroups' states merged
        CW = NC * D // _THREADS
        MERGE = 64 // CW  # splits the fused merge reads at a time (4 at 16 heads a CTA, 8 at 8)
        row = wtid // (D // CW)
        c0 = (wtid % (D // CW)) * CW
        ov = cute.make_rmem_tensor(cute.make_layout(CW), Float32)
        if cutlass.const_expr(WGS == 1):
            l_all = lsum[row] + lsum[NC + row] + lsum[2 * NC + row] + lsum[3 * NC + row]
            m_all = mfin[row]
            for k in cutlass.range_constexpr(CW):
                ov[k] = sO[row, c0 + k, 0]
        else:
            m_all = Float32(_NEG_INF)
            for w in cutlass.range_constexpr(WGS):
                m_all = ptx.fmax(m_all, mfin[w * NC + row])
            m_safe = ptx.safe(m_all)
            l_all = Float32(0.0)
            for k in cutlass.range_constexpr(CW):
                ov[k] = Float32(0.0)
            for w in cutlass.range_constexpr(WGS):
                wt = cute.arch.exp2(mfin[w * NC + row] - m_safe)
                lw = Float32(0.0)
                for k4 in cutlass.range_constexpr(4):
                    lw = lw + lsum[(4 * w + k4) * NC + row]
                l_all = l_all + lw * wt
                for k in cutlass.range_constexpr(CW):
                    ov[k] = ov[k] + sO[row, c0 + k, w] * wt
        row_ok = _flag(gc * NC + row % GC < group) * _flag(wg == 0)
        qh = Int64(h * group + gc * NC + row % GC)
        ro = r0 + row // GC  # the column's query row
        row_lse = lse + (Int64(ro) * stride_lr + qh * stride_lh) * 4 if write_lse else None  # its LSE word
        if cutlass.const_expr(final):
            inv = ptx.inv_or_zero(l_all, vs * v_fix)
            _store_row(out + (Int64(ro) * stride_or + qh * stride_oh + c0) * 2, ov, CW, inv, out_kind, row_ok,
                       row_lse, m_all, l_all, c0 == 0)
        elif cutlass.const_expr(CL > 0):
            # this split's state stays in its shared memory: the first warpgroup's rows of the
            # staged tile (its merged state with two warpgroups), (m, l) in the row's padding
            if wg == 0:
                if cutlass.const_expr(WGS > 1):
                    for k in cutlass.range_constexpr(CW):
                        sO[row, c0 + k, 0] = ov[k]
                if c0 == 0:
                    sO[row, D, 0] = m_all
                    sO[row, D + 1, 0] = l_all
            cute.arch.cluster_arrive()  # (release: the cluster's CTAs see it after their wait)
            cute.arch.cluster_wait()
            _mark(TRACE, trace_at, tracer, TRACE_POINTS.index("split counted"))
            # thread i of the first warpgroup of split k: vectors i + 128 (k + CL n) of the
            # program's NC x D outputs, each _CLUSTER_VEC floats of a row from every split's
            # shared memory (all loads in flight together), merged and written
            so_at = sO.iterator.toint()
            NV = NC * D // _CLUSTER_VEC
            for n in cutlass.range_constexpr(-(-NV // (CL * _THREADS))):
                v = wtid + _THREADS * (split + CL * n)
                vrow = v // (D // _CLUSTER_VEC)
                vc = (v % (D // _CLUSTER_VEC)) * _CLUSTER_VEC
                v_ok = _flag(v < NV) * _flag(wg == 0) * _flag(gc * NC + vrow % GC < group)
                mls = []
                parts_c = []
                for k in cutlass.range_constexpr(CL):
                    mls.append(ptx.ld_cluster_f32s(ptx.mapa(so_at + (vrow * OROW + D) * 4, k), v_ok, 2))
                    parts_c.append(ptx.ld_cluster_f32s(ptx.mapa(so_at + (vrow * OROW + vc) * 4, k), v_ok,
                                                       _CLUSTER_VEC))
                acc = [Float32(0.0)] * _CLUSTER_VEC
                m_top, l_top = _fold_splits(Float32(_NEG_INF), Float32(0.0), acc, [ml[0] for ml in mls],
                                            [ml[1] for ml in mls], lambda i, k, p=parts_c: p[i][k], CL, _CLUSTER_VEC,
                                            running=False)
                inv = ptx.inv_or_zero(l_top, vs * v_fix)
                v_qh = Int64(h * group + gc * NC + vrow % GC)
                v_ro = r0 + vrow // GC
                v_lse = lse + (Int64(v_ro) * stride_lr + v_qh * stride_lh) * 4 if write_lse else None
                _store_row(out + (Int64(v_ro) * stride_or + v_qh * stride_oh + vc) * 2, acc, _CLUSTER_VEC, inv,
                           out_kind, v_ok, v_lse, m_top, l_top, vc == 0)
            _mark(TRACE, trace_at, tracer, TRACE_POINTS.index("merged"))
            _mark(TRACE, trace_at, tracer, len(TRACE_POINTS) + 4, Int64(1))
            cute.arch.cluster_arrive()  # no CTA leaves while another reads its shared memory
            cute.arch.cluster_wait()
        else:
                if cutlass.const_expr(NVFP4):
                    for k in cutlass.range_constexpr(CW):
                        ov[k] = ov[k] * v_fix
                prow = (Int64(ro) * Int64(num_kv_heads * group) + qh) * Int64(num_splits) + Int64(split)
                base = part_o + (prow * D + c0) * 4
                for k in cutlass.range_constexpr(CW // 4):
                    ptx.st_v4(base + 16 * k, ptx.f32_bits(ov[4 * k]), ptx.f32_bits(ov[4 * k + 1]),
                              ptx.f32_bits(ov[4 * k + 2]), ptx.f32_bits(ov[4 * k + 3]), row_ok)
                ok0 = row_ok * _flag(c0 == 0)
                ptx.st_f32(part_ml + prow * 8, m_all, ok0)
                ptx.st_f32(part_ml + prow * 8 + 4, l_all, ok0)
                if cutlass.const_expr(spec.fused):
                    # count this split in: the CTA's barrier orders every thread's partials before
                    # thread 0's acquire-release count (cumulative at GPU scope, as a grid barrier's
                    # fence by one thread is); the last of the program's splits merges them all, its
                    # loads after the count its thread 0 acquired and the barrier after it
                    cute.arch.barrier()
                    n_part = Int64(num_rows) * Int64(num_kv_heads * group) * Int64(num_splits) * 8
                    counter = part_ml + n_part + Int64(pid) * 4
                    if tid == 0:
                        done = ptx.atom_add_acq_rel(counter, 1)
                        count[1] = done
                    cute.arch.barrier()
                    _mark(TRACE, trace_at, tracer, TRACE_POINTS.index("split counted"))
                    if count[1] % num_splits == num_splits - 1:
                        prow0 = (Int64(ro) * Int64(num_kv_heads * group) + qh) * Int64(num_splits)
                        # the splits MERGE at a time, each one vector load of its (m, l) and CW // 4 of
                        # its partial row, all in flight together; the running maximum rescales what is
                        # summed so far (a split past the last, or with no visible token, weighs 0)
                        m_top = Float32(_NEG_INF)
                        l_top = Float32(0.0)
                        acc = cute.make_rmem_tensor(cute.make_layout(CW), Float32)
                        acc.fill(0.0)
                        parts = cute.make_rmem_tensor(cute.make_layout((CW, MERGE)), Float32)
                        ms = cute.make_rmem_tensor(cute.make_layout(MERGE), Float32)
                        ls = cute.make_rmem_tensor(cute.make_layout(MERGE), Float32)
                        for c in cutlass.range((num_splits + (MERGE - 1)) // MERGE, unroll=1):
                            for i in cutlass.range_constexpr(MERGE):
                                s_i = c * MERGE + i
                                s_ok = row_ok * _flag(s_i < num_splits)
                                _load_split(ms, ls, parts, i, part_ml + (prow0 + Int64(s_i)) * 8,
                                            part_o + ((prow0 + Int64(s_i)) * D + c0) * 4, s_ok, CW)
                            m_top, l_top = _fold_splits(m_top, l_top, acc, ms, ls, lambda i, k: parts[k, i], MERGE,
                                                        CW, running=True)
                        inv = ptx.inv_or_zero(l_top, vs)
                        _store_row(out + (Int64(ro) * stride_or + qh * stride_oh + c0) * 2, acc, CW, inv, out_kind,
                                   row_ok, row_lse, m_top, l_top, c0 == 0)
                        if tid == 0:
                            ptx.atom_add_relaxed(counter, -num_splits)
                        _mark(TRACE, trace_at, tracer, TRACE_POINTS.index("merged"))
                        _mark(TRACE, trace_at, tracer, len(TRACE_POINTS) + 4, Int64(1))
        if cutlass.const_expr(TRACE):
            _mark(TRACE, trace_at, tracer, len(TRACE_POINTS) + 1, ptx.globaltimer())
            _mark(TRACE, trace_at, tracer, len(TRACE_POINTS) + 2)
            _mark(TRACE, trace_at, tracer, len(TRACE_POINTS) + 3, Int64(nloc))

    @cute.jit
    def host(q: Int64, k_base: Int64, v_base: Int64, topk: Int64, table: Int64, row_request: Int64, q_pos: Int64,
             out: Int64, lse: Int64, part_o: Int64, part_ml: Int64, sm_p: Int64, qs_p: Int64, ks_p: Int64,
             vs_p: Int64, qk_scale: Float32, v_scale: Float32, num_pages: Int32, max_blocks: Int32,
             num_splits: Int32, stride_qr: Int64, stride_qh: Int64, stride_kp: Int64, stride_kh: Int64,
             stride_kt: Int64, stride_vp: Int64, stride_vh: Int64, stride_vt: Int64, stride_th: Int64,
             stride_tr: Int64, stride_tk: Int64, stride_bt: Int64, stride_or: Int64, stride_oh: Int64,
             stride_lr: Int64, stride_lh: Int64, num_kv_heads: Int32, group: Int32, num_topk: Int32,
             num_rows: Int32, row_tokens: Int32, stream: cuda.CUstream) -> None:
        gmem = cute.AddressSpace.gmem
        # a stage of keys (values): fp8 rows of D bytes, NVFP4 rows of D / 2 code bytes, or 16-bit
        # rows of D elements (the score product's A operand, K-major)
        kv_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE, NC, CODE if NVFP4 else D), KV_T,
                                                  WGS * ST)
        # the NVFP4 block scales of a tile: 512 contiguous bytes, as the box's rows
        sc_layout = cute.make_layout((*SCALE_BOX, WGS * ST), stride=(SCALE_BOX[1], 1, SCALE_BYTES))
        # the value product's A operand in shared memory (D x 64 tokens, MN-major): a warpgroup's f16
        # copy of its fp8 tile, or with a 16-bit cache the ring's value stages themselves (the TMA
        # copies write the tokens' rows into it)
        vb_layout = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (D, NC, TILE), wide_t if WIDE else f16,
                                                  WGS * ST if WIDE else WGS)
        p_layout = weights_layout(NC, WGS)
        q_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE, NC, D), QT, TERMS)
        # the identity tile of the keys' conversion product (tconv: its B, 32 x 32)
        ik_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE, 32, 32), fp8, 1)

        n_st, n_tiles, n_c = WGS * ST, NTMAX, NC * WGS
        n_vb = 8 if VREG or WIDE else cute.cosize(vb_layout)
        n_v = cute.cosize(vb_layout) if WIDE else cute.cosize(kv_layout)
        n_sc = WGS * ST * SCALE_BYTES if NVFP4 else 16
        n_o = WGS * NC * OROW if OWN_SO else 4
        n_ik = cute.cosize(ik_layout) if TCONV else 16
        n_tv, n_hs = N_TV, N_HS

        @cute.struct
        class Storage:  # the 1024-aligned operand buffers first, the small fields after (no padding between)
            sK: cute.struct.Align[cute.struct.MemRange[KV_T, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[KV_T, n_v], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[QT, cute.cosize(q_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[PT, cute.cosize(p_layout)], 1024]
            sVb: cute.struct.Align[cute.struct.MemRange[f16, n_vb], 16 if VREG or WIDE else 1024]
            sKs: cute.struct.Align[cute.struct.MemRange[fp8, n_sc], 128]
            sVs: cute.struct.Align[cute.struct.MemRange[fp8, n_sc], 128]
            sO: cute.struct.Align[cute.struct.MemRange[Float32, n_o], 16]
            sIk: cute.struct.Align[cute.struct.MemRange[fp8, n_ik], 1024 if TCONV else 16]
            full: cute.struct.MemRange[Int64, n_st]
            empty: cute.struct.MemRange[Int64, n_st]
            tile_page: cute.struct.MemRange[Int32, n_tiles]
            tile_idx: cute.struct.MemRange[Int32, n_tiles]
            tile_vis: cute.struct.MemRange[Int32, n_tiles]
            tile_tvis: cute.struct.MemRange[Int32, n_tv]
            hkeys: cute.struct.MemRange[Int32, n_hs]
            hmask: cute.struct.MemRange[Int32, n_hs]
            count: cute.struct.MemRange[Int32, 4]
            colmax: cute.struct.Align[cute.struct.MemRange[Float32, 2 * 4 * n_c], 16]
            colscale: cute.struct.MemRange[Float32, n_c]
            lsum: cute.struct.MemRange[Float32, 4 * n_c]
            mfin: cute.struct.MemRange[Float32, n_c]
        built["storage"] = Storage

        op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        one = cute.slice_(kv_layout, (None, None, 0))
        if cutlass.const_expr(NVFP4):
            # a head slot: P rows of D / 2 code bytes, then the P * D / 16 block-scale bytes
            views = [cute.make_tensor(cute.make_ptr(fp8, base + offset, gmem, assumed_align=16),
                                      cute.make_layout(shape, stride=(row, 1, sh, sp)))
                     for base, sh, sp in ((k_base, stride_kh, stride_kp), (v_base, stride_vh, stride_vp))
                     for offset, shape, row in ((0, (P, CODE, num_kv_heads, num_pages), CODE),
                                                (P * CODE, (P // 16, 128, num_kv_heads, num_pages), 128))]
            one_sc = cute.slice_(sc_layout, (None, None, 0))
            tma_k, gK = cute.nvgpu.cpasync.make_tiled_tma_atom(op, views[0], one, (TILE, CODE))
            tma_ks, gKs = cute.nvgpu.cpasync.make_tiled_tma_atom(op, views[1], one_sc, SCALE_BOX)
            tma_v, gV = cute.nvgpu.cpasync.make_tiled_tma_atom(op, views[2], one, (TILE, CODE))
            tma_vs, gVs = cute.nvgpu.cpasync.make_tiled_tma_atom(op, views[3], one_sc, SCALE_BOX)
            tx_bytes = 2 * (cute.size_in_bytes(fp8, one) + cute.size_in_bytes(fp8, one_sc))
        else:
            k_view = cute.make_tensor(cute.make_ptr(KV_T, k_base, gmem, assumed_align=16),
                                      cute.make_layout((P, D, num_kv_heads, num_pages),
                                                       stride=(stride_kt, 1, stride_kh, stride_kp)))
            tma_k, gK = cute.nvgpu.cpasync.make_tiled_tma_atom(op, k_view, one, (TILE, D))
            if cutlass.const_expr(WIDE):  # the values as the value product's MN-major stages: (dim, token) order
                v_view = cute.make_tensor(cute.make_ptr(KV_T, v_base, gmem, assumed_align=16),
                                          cute.make_layout((D, P, num_kv_heads, num_pages),
                                                           stride=(1, stride_vt, stride_vh, stride_vp)))
                tma_v, gV = cute.nvgpu.cpasync.make_tiled_tma_atom(op, v_view, cute.slice_(vb_layout, (None, None, 0)),
                                                                   (D, TILE))
            else:
                v_view = cute.make_tensor(cute.make_ptr(fp8, v_base, gmem, assumed_align=16),
                                          cute.make_layout((P, D, num_kv_heads, num_pages),
                                                           stride=(stride_vt, 1, stride_vh, stride_vp)))
                tma_v, gV = cute.nvgpu.cpasync.make_tiled_tma_atom(op, v_view, one, (TILE, D))
            tma_ks, gKs, tma_vs, gVs = tma_k, gK, tma_v, gV  # (no scales: never copied)
            tx_bytes = 2 * cute.size_in_bytes(KV_T, one)
        qk_mma = score_mma(KREG, NC, QT)
        pv_mma = sm90_utils.make_trivial_tiled_mma(PT, PT, cute.nvgpu.OperandMajorMode.K if VREG
                                                   else cute.nvgpu.OperandMajorMode.MN,
                                                   cute.nvgpu.OperandMajorMode.K, Float32, (1, 1, 1),
                                                   tiler_mn=(64, NC),
                                                   a_source=warpgroup.OperandSource.RMEM if VREG
                                                   else warpgroup.OperandSource.SMEM)
        # the keys' conversion product (tconv): fp8 with f16 accumulators, both operands in shared memory
        ck_mma = sm90_utils.make_trivial_tiled_mma(fp8, fp8, cute.nvgpu.OperandMajorMode.K,
                                                   cute.nvgpu.OperandMajorMode.K, f16, (1, 1, 1), tiler_mn=(TILE, 32))
        grid = [num_rows // T * num_kv_heads * ((group + (NC - 1)) // NC), num_splits, 1]
        launch_cluster = {"cluster": [1, CL, 1]} if CL else {}
        kernel(tma_k, gK, tma_v, gV, tma_ks, gKs, tma_vs, gVs, qk_mma, pv_mma, ck_mma, ik_layout, kv_layout, vb_layout,
               p_layout,
               q_layout, sc_layout, q, topk, table, row_request, q_pos, out, lse, part_o, part_ml,
               sm_p, qs_p, ks_p, vs_p, qk_scale, v_scale, num_pages, max_blocks, num_splits, stride_qr, stride_qh,
               stride_th, stride_tr, stride_tk, stride_bt, stride_or, stride_oh, stride_lr, stride_lh,
               num_kv_heads, group, num_topk, num_rows, row_tokens, Int32(tx_bytes)).launch(
            grid=grid, block=[_THREADS * WGS, 1, 1], stream=stream,
            min_blocks_per_mp=spec.min_ctas, **launch_cluster)

    host.built = built  # type: ignore[attr-defined]  # the shared-memory struct, once traced (tests size it)
    return host
