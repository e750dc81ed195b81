"""Launch configuration of the CuTe DSL kernel (no DSL import here): the kernel's fixed shape
and how many splits a row's tokens get."""

from __future__ import annotations

import attrs
import torch

from msa.problem import DecodeProblem

__all__ = [
    "CuteConfig", "choose_splits", "choose_min_ctas", "max_stages", "programs", "CTAS_PER_SM", "WARPS", "STEP",
    "DEFAULT_STAGES", "SLOTS", "KINDS", "AUTO_MIN_PROGRAMS", "DEFAULT_QK_CHAINS",
    "DEFAULT_MIN_CTAS", "WIDE_MIN_CTAS", "HOST_ARG_KINDS", "VERIFIED_DSL_VERSIONS", "KERNELS", "WGMMA_KINDS",
    "WGMMA_DEFAULT_LAYOUTS", "WGMMA_ONLY_LAYOUTS", "WGMMA_FP8_KREG", "Q_KINDS", "Q_TERMS", "WIDE_Q_TERMS",
    "WIDE_KINDS", "wgmma_q_bytes",
    "WGMMA_FUSED_MERGE", "WGMMA_LAG",
    "WGMMA_EVICT", "WGMMA_EVICT_DEFAULT", "WGMMA_EVICT_FIRST_CTAS_PER_SM", "SM90_SMEM", "wgmma_serves", "wgmma_evict",
    "wgmma_heads", "wgmma_programs", "wgmma_slots", "wgmma_tiles", "wgmma_smem_bytes", "choose_wgmma_splits",
    "wgmma_ctas_per_sm",
    "WgmmaShape", "choose_wgmma_shape", "WGMMA_AUTO_MIN_PROGRAMS",
    "WGMMA_AUTO_16_BIT", "WGMMA_TWO_WG_MIN_PROGRAMS", "WGMMA_TCONV_HEADS",
    "WGMMA_TWO_WG_STAGES", "WGMMA_SHARED_ROWS_WGS", "WGMMA_WIDE_8HEAD_STAGES", "WGMMA_HALF_SPLIT_PROGRAMS",
    "WGMMA_HALF_SPLIT_FP8_DEVICES",
    "wgmma_auto_min_programs", "WGMMA_TOKENS", "WGMMA_TOKEN_COLUMNS", "wgmma_tokens_serve",
    "WGMMA_DEFAULT_TOKENS", "WGMMA_HASH_SLOTS", "WGMMA_CLUSTER_MERGE", "WGMMA_MAX_CLUSTER", "wgmma_cluster",
    "WGMMA_VREG_BELOW_WAVE", "wgmma_cluster_default", "WGMMA_CLUSTER_MAX_WIDE", "WGMMA_REFILL", "WGMMA_REFILL_DEFAULT",
]

#: Warps per CTA, tokens per warp step, steps each warp has in flight.
WARPS = 4
STEP = 16
DEFAULT_STAGES = 4
#: The kernel's cache kind per layout.
KINDS = {"nvfp4": "nvfp4", "fp8_e4m3": "fp8"}
#: Bytes of a thread's stage slot per cache kind (its share of a step's keys, values and scales),
#: padded so that 8 consecutive threads' 16-byte accesses hit distinct banks (slot / 4 = 4 mod 8
#: words: NVFP4 76 -> 80, fp8 128 -> 144; a 128-byte fp8 slot was an 8-way conflict).
SLOTS = {"nvfp4": 80, "fp8": 144}
#: Shared memory a CTA may use without opting in (the stages must fit beside the rest).
SMEM_BUDGET = 48 * 1024 - 2048
#: Independent accumulator chains of a score tile's 8 mma k-steps.
DEFAULT_QK_CHAINS = 1
#: CTAs per SM the kernel's registers must allow (0: ptxas decides; 160 registers, 3 CTAs).
DEFAULT_MIN_CTAS = 0
#: Launch bounds for steps of more than one wave: 128 registers, 4 CTAs per SM (656 instead of
#: 631 instructions per step). H200, NVFP4, benchmarks/bench_cute.py --min-ctas 4: B=256 168.9 ->
#: 162.2 us; B=64 (one wave) 51.0 -> 52.1, so only past one wave.
WIDE_MIN_CTAS = 4
#: CTAs of the kernel that fit on one SM (160 registers x 128 threads on sm_90).
CTAS_PER_SM = 3
#: Fewer (row, KV head, 16-head chunk) programs than this and `auto` leaves the step to the Triton
#: kernel: H200, M3 TP1, 64K contexts, benchmarks/bench_cute.py: B=1 (4 programs) Triton 13.3 us,
#: cute 16.2; B=8 (32) Triton 24.6, cute 22.3.
AUTO_MIN_PROGRAMS = 32
#: The compiled host function's arguments, in order (`kernel.build`'s `host`): 15 addresses, the
#: two host scale factors, 3 sizes, 16 strides, 5 sizes (the row count, then the query rows of
#: each request: L, or 0 for a ragged step), the stream.
HOST_ARG_KINDS = ("i64",) * 15 + ("f32",) * 2 + ("i32",) * 3 + ("i64",) * 16 + ("i32",) * 5 + ("stream",)
#: nvidia-cutlass-dsl versions whose host argument adaptation `fastcall` was verified against (on
#: the H200: eager calls at graph-replay cost). Elsewhere a launch may take the DSL's own path
#: (~150-300 us a call), so `auto` takes only steps that will be captured in graphs.
VERIFIED_DSL_VERSIONS = frozenset({"4.8.1"})
#: Each warp walks at least this many steps of a split (the prologue is paid per CTA).
_MIN_STEPS_PER_WARP = 4


#: The backend's kernels: "mma" (`kernel.py`: `mma.sync`, each thread decoding its operands in
#: registers; NVFP4 and fp8, any page size of a multiple of 16) and "wgmma" (`sm90.py`: TMA ring
#: and WGMMA; fp8, NVFP4, bf16 and f16 on compute capability 9.x, pages of a multiple of 64 tokens).
KERNELS = ("mma", "wgmma")
#: The wgmma kernel's score product of several query terms issues the smallest term's k-steps
#: first. Hopper's fp8 products keep about 13 significant bits of each k-step's running sum, so
#: every k-step's rounding is relative to the accumulator as it then stands: the lo terms (2^-4
#: of the hi term's size and less) summed into a still small accumulator lose almost nothing,
#: where after the hi term they each lost as much as one of its k-steps. H100, M3 fp8 at 16K,
#: against the float64 oracle, same run (benchmarks/ab_terms_order.py, 2026-12-06): f16 q 3.9e-4
#: Frobenius (max / max 0.63-1.23e-3) against 1.23e-3 (2.1-4.5e-3) hi first, where the exact f16
#: product reads 2.8e-4; bf16 q 1.69e-3 against 1.97e-3 (Triton 1.67e-3, the bf16 output's own
#: rounding). Free: the same instructions, timed level (TP1 B = 128 / 256 104.4 / 191.1 us
#: against 105.0 / 191.0; L = 4 at 80% overlap within 0.6 us).
WGMMA_TERMS_LO_FIRST = True
#: The wgmma kernel's cache kind per layout.
WGMMA_KINDS = {"fp8_e4m3": "fp8", "nvfp4": "nvfp4", "bfloat16": "bf16", "float16": "f16"}
#: fp8 steps of at most 3 CTAs per SM take the wgmma kernel's exact f16 score product (keys
#: decoded into registers) by default. H200, M3 fp8 at 64K (benchmarks/precision.py,
#: bench_cute.py): the fp8 product of the query's fp8 terms added ~1e-3 relative error to the
#: output against the float64 oracle with its hi term first (f16 q: 1.24e-3 where the f16 product
#: holds 2.7e-4, as Triton does; bf16 q: 1.99e-3 against 1.68e-3; lo first, 1.4x the f16
#: product's: `WGMMA_TERMS_LO_FIRST`) and is 0-2% faster there (TP1 B = 16 / 64:
#: 25.0 / 49.3 us against 25.4 / 50.0; TP8 B = 64 / 256: 23.4 / 48.5 against 23.5 / 48.4).
#: Wider steps keep the fp8 product (`choose_wgmma_shape`), as do the fp8 steps of several rows a
#: request that take two warpgroups a CTA (`WGMMA_SHARED_ROWS_WGS`: two 128-thread warpgroups twice
#: an SM) and fp8 queries (`_keys_in_registers`). `kreg` asks for either.
WGMMA_FP8_KREG = True
#: fp8 steps below one wave of one-warpgroup CTAs take their values into registers (`vreg`),
#: at either head count a CTA (`wgmma_heads`: 8 or 16). 8 heads (TP8), with the keys decoded
#: into f16 registers rather than converted on the tensor cores (`tconv`, which chains a second
#: product round trip before each tile's scores): H200, M3 fp8 at 64K, same-run A/B
#: (benchmarks/bench_cute.py, 2026-12-04, session 19), TP8 B = 16 / 64 12.9 / 20.7 us against
#: `tconv`'s 13.5 / 21.4 (`trace_cute.py`: a tile's keys 0.09 us against 0.41). 16 heads (TP1
#: B < 8, TP2 B < 16, TP4 B < 32), where the values' f16 copy through shared memory was on each
#: tile's path: H100, M3 fp8 at 64K, same run (`bench_cute.py --variant '{"vreg":true}'
#: --variant '{"vreg":false}'`, 2026-12-06, session 35), with / without, us: TP1 B = 1 / 4 11.9
#: / 12.4, 14.3 / 14.8; TP2 B = 1 / 8 11.3 / 11.9, 14.4 / 15.1; TP4 B = 1 / 16 / 24 11.3 / 12.0,
#: 14.2 / 14.9, 15.9 / 16.7.
WGMMA_VREG_BELOW_WAVE = True
#: The query heads of a CTA (exactly this many, at 32 columns a program) whose fp8 keys
#: `_union_shape` converts on the tensor cores (ptxas serialises the products of its other shapes).
WGMMA_TCONV_HEADS = 8
#: The wgmma kernel merges its splits itself (the last split of a program to finish).
WGMMA_FUSED_MERGE = True
#: (cache kind, query heads a CTA) whose programs, one row each, merge their 2 .. `WGMMA_MAX_CLUSTER`
#: splits as one thread-block cluster through distributed shared memory by default, instead of by the
#: last split to finish from partials in global memory. H200, M3 at 64K, same-run A/B
#: (benchmarks/bench_cute.py, 2026-12-04, session 19), cluster against global: fp8 16-head CTAs
#: TP1 B = 16 21.8 / 22.8 us, TP4 B = 16 14.4 / 15.9; elsewhere level or slower (fp8 TP8 B = 16 /
#: 64 13.5 / 13.8, 21.8 / 21.5; NVFP4 TP8 B = 16 / 64 12.9 / 12.4, 19.2 / 17.8; NVFP4 TP1 B = 16
#: 21.9 / 20.6; NVFP4 TP4 B = 16 13.9 / 14.4).
WGMMA_CLUSTER_MERGE = frozenset({("fp8", 16)})
#: The most splits of two-warpgroup CTAs merged as one cluster by default. Clusters of four such
#: CTAs (one an SM) leave part of the step to a second wave: H200, M3 fp8 at 64K, 32 programs of
#: 16 heads (TP1 B = 8, TP2 B = 16), 4 splits, same run (2026-12-04, session 20,
#: `bench_cute.py --variant '{"cluster":false}'`): 24.5 / 24.7 us as clusters against 17.7 /
#: 17.7 without (Triton 21.5); two such splits still gain (TP1 B = 16: 22.1 against 22.8).
WGMMA_CLUSTER_MAX_WIDE = 2
#: The most splits such a cluster holds (the portable cluster size).
WGMMA_MAX_CLUSTER = 8
#: The wgmma kernel weighs a tile by the maximum through the previous ones (one barrier a tile).
WGMMA_LAG = False
#: The L2 eviction priorities the wgmma kernel's page copies can take (`sm90.Sm90Spec.evict`).
WGMMA_EVICT = ("normal", "first", "last")
#: The priority they take unless asked, where `wgmma_evict` does not choose "first".
WGMMA_EVICT_DEFAULT = "normal"
#: The most CTAs an SM of a step whose page copies `wgmma_evict` gives "first".
WGMMA_EVICT_FIRST_CTAS_PER_SM = 2
#: When the wgmma kernel's warp 0 starts a ring copy (`sm90.Sm90Spec.refill`): at the top of a
#: tile, or once the tile's products are issued.
WGMMA_REFILL = ("top", "late")
#: The form it takes unless asked: "late" helps 8-head steps of a few tiles a split by 0.3-0.5 us
#: and costs NVFP4's 2-stage steps 2-14 us (H200, 2026-12-04, session 23), so it is opt-in.
WGMMA_REFILL_DEFAULT = "top"
#: Each split of the wgmma kernel walks at least this many 64-token tiles.
_WGMMA_MIN_TILES = 4
#: The kernels' name of each query dtype.
Q_KINDS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float8_e4m3fn: "e4m3"}
#: fp8 terms of the query in the wgmma kernel's fp8 score product, per query kind (exact for bf16
#: with two, for f16 with three). Its NVFP4 product takes one f16 term for every query kind.
Q_TERMS = {"e4m3": 1, "bf16": 2, "f16": 3}
#: Terms of the query in the wgmma kernel's score product with a 16-bit cache, per cache and query
#: kind, each of the cache's type (the product takes both operands of one type): as given where it
#: holds the query exactly (a bf16 query, an fp8 one), an f16 query two bf16 terms (hi + lo: 11
#: significant bits in 8 + 3), a bf16 query one f16 term scaled by a power of two (its 8 bits fit;
#: exact from 2^-21 of the head's largest element, as the f16 term of `kreg`).
WIDE_Q_TERMS = {"bf16": {"bf16": 1, "f16": 2, "e4m3": 1}, "f16": {"f16": 1, "bf16": 1, "e4m3": 1}}
#: The wgmma kernel's 16-bit cache kinds, and the layouts only it reads (the products' operands as
#: stored; the mma kernel reads fp8 and NVFP4).
WIDE_KINDS = tuple(WIDE_Q_TERMS)
WGMMA_ONLY_LAYOUTS = frozenset(layout for layout, kind in WGMMA_KINDS.items() if kind in WIDE_KINDS)
#: Layouts whose steps take the wgmma kernel by default (where it serves; the mma kernel otherwise):
#: fp8 and NVFP4, measured faster than the mma kernel (`choose_wgmma_shape`), and the 16-bit ones,
#: which the mma kernel does not read.
WGMMA_DEFAULT_LAYOUTS = frozenset({"fp8_e4m3", "nvfp4"}) | WGMMA_ONLY_LAYOUTS
#: Shared memory one CTA may take on compute capability 9.x.
SM90_SMEM = 227 * 1024
#: Shared memory of one SM of compute capability 9.x, and what each resident CTA of it reserves.
SM90_SMEM_PER_SM, SM90_SMEM_RESERVED = 228 * 1024, 1024


@attrs.frozen
class CuteConfig:
    """Attributes:
    num_splits: CTAs per (row, KV head, chunk of query heads); 1 writes the output directly,
        more write partials that the merge combines.
    stages: 16-token steps each warp has in flight ("mma"), 64-token tiles of the ring ("wgmma").
    qk_chains: independent accumulator chains of the score mma k-steps ("mma").
    min_ctas: CTAs per SM the registers must allow (0: ptxas decides).
    kernel: "mma" or "wgmma" (`KERNELS`).
    fused: several splits are merged by the last one to finish, inside the kernel ("wgmma"),
        instead of by the Triton merge kernel after it.
    lag: the wgmma kernel weighs each tile by the maximum through the previous tiles (`sm90.py`).
    wgs: consumer warpgroups per CTA of the wgmma kernel (1 or 2).
    vreg: the wgmma kernel reads the values into registers (no f16 copy in shared memory; always
        for NVFP4).
    kreg: the wgmma kernel decodes the keys into f16 registers for an f16 score product (exact;
        always for NVFP4) instead of the fp8 product of the query's fp8 terms.
    tconv: fp8 keys converted into those f16 registers on the tensor cores (an fp8 product with
        an identity tile) instead of by conversion instructions (with `kreg`; "wgmma").
    tokens: query rows of one request each wgmma program takes together, walking the union of
        their selected pages once (`wgmma_tokens_serve`; 1: a program per row).
    cluster: with `fused`, a program's splits are one thread-block cluster and merge through
        distributed shared memory where there are 2 .. `WGMMA_MAX_CLUSTER` of them (`wgmma_cluster`).
    evict: the L2 eviction priority of the wgmma kernel's page copies (`WGMMA_EVICT`).
    refill: when the wgmma kernel starts a ring copy (`WGMMA_REFILL`).
    """

    num_splits: int
    stages: int = DEFAULT_STAGES
    qk_chains: int = DEFAULT_QK_CHAINS
    min_ctas: int = DEFAULT_MIN_CTAS
    kernel: str = "mma"
    fused: bool = False
    lag: bool = False
    wgs: int = 1
    vreg: bool = False
    kreg: bool = False
    tconv: bool = False
    tokens: int = 1
    cluster: bool = False
    evict: str = WGMMA_EVICT_DEFAULT
    refill: str = WGMMA_REFILL_DEFAULT


def wgmma_cluster(config: CuteConfig) -> int:
    """CTAs of the cluster a wgmma program's splits form (its split count where `config.cluster`
    merges them through distributed shared memory: the wgmma kernel's fused merge of 2 ..
    `WGMMA_MAX_CLUSTER` splits), or 0."""
    splits = config.num_splits
    wgmma = config.kernel == "wgmma" and config.fused
    return splits if config.cluster and wgmma and 2 <= splits <= WGMMA_MAX_CLUSTER else 0


def wgmma_cluster_default(problem: DecodeProblem, tokens: int, wgs: int, splits: int) -> bool:
    """Whether a wgmma step of `splits` fused splits of `wgs` warpgroups merges them in a cluster
    unless asked (`WGMMA_CLUSTER_MERGE`, `WGMMA_CLUSTER_MAX_WIDE`)."""
    kind = WGMMA_KINDS.get(problem.kv_layout, "fp8")
    wide_ok = wgs == 1 or splits <= WGMMA_CLUSTER_MAX_WIDE
    return tokens == 1 and wide_ok and (kind, wgmma_heads(problem.geometry.group_size)) in WGMMA_CLUSTER_MERGE


def max_stages(kind: str) -> int:
    """The most stages of the mma kernel whose slots fit the shared-memory budget (fp8: 2, nvfp4: 4)."""
    return max(1, SMEM_BUDGET // (WARPS * 32 * SLOTS[kind]))


def programs(problem: DecodeProblem) -> int:
    """(row, KV head, chunk of 16 query heads) programs of a step: the CTAs of one split."""
    g = problem.geometry
    return problem.num_rows * g.num_kv_heads * -(-g.group_size // 16)


def choose_splits(problem: DecodeProblem, sm_count: int) -> int:
    """As many splits as fill the SMs' CTA slots once (never more: a second partial wave cost
    more than it gave, H200 B=64: 1 split 52.3 us, 2 splits 60.9), while each warp keeps at
    least 4 steps of the row's selected tokens."""
    g = problem.geometry
    most = max(1, g.topk * g.page_size // (WARPS * STEP * _MIN_STEPS_PER_WARP))
    return max(1, min(most, CTAS_PER_SM * sm_count // max(programs(problem), 1)))


def choose_min_ctas(problem: DecodeProblem, sm_count: int, splits: int) -> int:
    """`WIDE_MIN_CTAS` when the step's CTAs fill more than one wave at `CTAS_PER_SM`, else
    `DEFAULT_MIN_CTAS`: more warps per SM pay only where they find work."""
    many = programs(problem) * splits > CTAS_PER_SM * sm_count
    return WIDE_MIN_CTAS if many else DEFAULT_MIN_CTAS


def wgmma_serves(problem: DecodeProblem, capability: tuple[int, int] | None) -> str | None:
    """Why the wgmma kernel cannot serve `problem` on a GPU of `capability`, or None."""
    if problem.kv_layout not in WGMMA_KINDS:
        return f"the wgmma kernel reads fp8, nvfp4, bf16 and f16 caches, not {problem.kv_layout}"
    if capability is None or capability[0] != 9:
        return "the wgmma kernel is compiled for sm_90a (compute capability 9.x)"
    if problem.geometry.page_size % 64:
        return f"the wgmma kernel walks 64-token tiles; page size {problem.geometry.page_size} is not a multiple of 64"
    return None


def wgmma_heads(group: int) -> int:
    """Query heads per CTA of the wgmma kernel (its products' N): 8 for GQA groups up to 8, else 16."""
    return 8 if group <= 8 else 16


def wgmma_programs(problem: DecodeProblem, tokens: int = 1) -> int:
    """(rows, KV head, chunk of query heads) programs of a step in the wgmma kernel, `tokens` rows
    of a request a program."""
    g = problem.geometry
    heads = wgmma_heads(g.group_size)
    return problem.num_rows // tokens * g.num_kv_heads * -(-g.group_size // heads)


#: The query rows of a request one wgmma program may take together (`wgmma_tokens_serve`).
WGMMA_TOKENS = (1, 2, 4)
#: The most columns (rows x query heads) of such a program: its products' N.
WGMMA_TOKEN_COLUMNS = 32
#: Slots per row of the shared-memory hash table that merges such a program's entries (a row
#: has at most 32, so the table is at most half full).
WGMMA_HASH_SLOTS = 64


def wgmma_tokens_serve(problem: DecodeProblem, tokens: int) -> str | None:
    """Why the wgmma kernel cannot take `tokens` rows of a request a program for `problem` (their
    pages' union walked once), or None: a uniform step whose query length `tokens` divides, a
    GQA group of 8 or 16 (a token's columns, `wgmma_heads`) and at most `WGMMA_TOKEN_COLUMNS`
    columns."""
    if tokens == 1:
        return None
    group = problem.geometry.group_size
    if tokens not in WGMMA_TOKENS:
        return f"{tokens} is not one of {WGMMA_TOKENS}"
    if problem.ragged or problem.query_len % tokens:
        return (f"a program takes {tokens} rows of one request: a uniform step whose query length is a multiple "
                f"of it, not {'a ragged one' if problem.ragged else f'L = {problem.query_len}'}")
    if group not in (8, 16) or tokens * group > WGMMA_TOKEN_COLUMNS:
        return (f"{tokens} tokens x a GQA group of {group}: the group must be 8 or 16 and the columns at most "
                f"{WGMMA_TOKEN_COLUMNS}")
    return None


def wgmma_tiles(problem: DecodeProblem) -> int:
    """64-token tiles of a row's selected pages (at most; fewer where pages are partly visible)."""
    g = problem.geometry
    return g.topk * g.page_size // 64


def wgmma_smem_bytes(kind: str, stages: int, wgs: int, vreg: bool, page_size: int = 128, heads: int = 16,
                     q_bytes: int = 2, tconv: bool = False, tokens: int = 1) -> int:
    """Shared memory of one CTA of the wgmma kernel: its struct (`sm90.py`'s `Storage`) laid out
    field by field with the same alignments — per warpgroup a ring of `stages` stages (a tile's
    64 keys and 64 values: fp8 2 x 8 KiB; NVFP4 2 x 4 KiB of codes and 2 x 512 bytes of block
    scales; a 16-bit cache, kind "bf16" / "f16", 2 x 16 KiB), 16-bit weights, an f16 copy of fp8
    values unless `vreg` (none for a 16-bit cache: the product reads the stage), the output
    staging tile where the ring cannot hold it (NVFP4; fp8 at 32 columns and 2 stages); per
    CTA the query (`q_bytes` a head element: its fp8 or 16-bit terms, or 2 for one f16 term), `tconv`'s
    identity tile, the tile tables of a row's 32 pages, the barriers and the
    softmax exchange; with `tokens` > 1 (`heads` the columns of all of them) the tile tables of
    their pages' union, each tile's tokens' visible counts and the hash table that merges them."""
    nvfp4 = kind == "nvfp4"
    wide = kind in WIDE_KINDS
    row = 64 if nvfp4 else 256 if wide else 128  # a token's bytes of a stage's keys (or values)
    n_st, n_tiles, n_c = wgs * stages, 32 * (page_size // 64) * tokens, heads * wgs
    slots = WGMMA_HASH_SLOTS * tokens
    union = [(4 * n_tiles, 4), (4 * slots, 4), (4 * slots, 4)] if tokens > 1 else [(4, 4)] * 3
    fields = [  # (bytes, alignment) in the struct's order
        (n_st * 64 * row, 1024), (n_st * 64 * row, 1024),  # keys, values
        (heads * 128 * (2 if nvfp4 else q_bytes), 1024), (heads * 64 * 2 * wgs, 1024),
        (16, 16) if vreg or wide else (128 * 64 * 2 * wgs, 1024),
        (n_st * 512 if nvfp4 else 16, 128), (n_st * 512 if nvfp4 else 16, 128),  # their block scales
        (4 * (wgs * heads * 132 if nvfp4 or heads * 132 * 4 > stages * 64 * row else 4), 16),
        (1024, 1024) if tconv else (16, 16),
        (8 * n_st, 8), (8 * n_st, 8), (4 * n_tiles, 4), (4 * n_tiles, 4), (4 * n_tiles, 4), *union, (16, 4),
        (32 * n_c, 16), (4 * n_c, 4), (16 * n_c, 4), (4 * n_c, 4)]
    end = 0
    for size, align in fields:
        end = -(-end // align) * align + size
    return -(-end // 1024) * 1024


def wgmma_ctas_per_sm(stages: int, wgs: int, vreg: bool = False, kind: str = "fp8", heads: int = 16,
                      q_bytes: int = 2) -> int:
    """CTAs of the wgmma kernel whose shared memory fits one SM's 228 KiB, 1 KiB reserved a CTA
    (`wgmma_smem_bytes` at 128-token pages, `heads` heads, `q_bytes` a query element: by default
    16 and 2, the measured rules' model): fp8 5 at (2 stages, 1 warpgroup, vreg), 4 at (2, 1) and
    (3, 1, vreg), 3 at (3, 1) and (2, 2, vreg; registers hold 2), 2 at (2, 2), 1 at (3, 2); a
    16-bit cache 2 at (3, 1) and 3 at (2, 1)."""
    need = wgmma_smem_bytes(kind, stages, wgs, vreg, 128, heads, q_bytes)
    return max(1, SM90_SMEM_PER_SM // (need + SM90_SMEM_RESERVED))


def wgmma_q_bytes(kind: str, q_kind: str, kreg: bool) -> int:
    """Bytes of a query element in the wgmma kernel's shared memory (`wgmma_smem_bytes`'s
    `q_bytes`) for a cache `kind` and query `q_kind`: its terms of a 16-bit cache's type
    (`WIDE_Q_TERMS`), one f16 term with `kreg`, else its fp8 terms (`Q_TERMS`)."""
    if kind in WIDE_KINDS:
        return 2 * WIDE_Q_TERMS[kind][q_kind]
    return 2 if kreg else Q_TERMS[q_kind]


def wgmma_slots(problem: DecodeProblem, sm_count: int, stages: int, wgs: int, vreg: bool) -> int:
    """CTAs of `problem`'s wgmma kernel that the GPU's `sm_count` SMs hold at once (by shared memory,
    `wgmma_ctas_per_sm`; a 16-bit cache's with its own heads and query terms): one wave."""
    kind = WGMMA_KINDS.get(problem.kv_layout, "fp8")
    heads, q_bytes = 16, 2
    if kind in WIDE_KINDS:
        heads, q_bytes = wgmma_heads(problem.geometry.group_size), wgmma_q_bytes(kind, Q_KINDS[problem.q_dtype], False)
    return sm_count * wgmma_ctas_per_sm(stages, wgs, vreg, kind, heads, q_bytes)


#: Steps of fewer (row, KV head, head chunk) programs than this `auto` leaves to the Triton kernel
#: where the wgmma kernel would take them (fp8 and NVFP4 on Hopper), by cache kind and the query
#: heads a CTA takes (`wgmma_heads`). H200, M3 at 64K, graph replays against Triton's, same run:
#: 8-head CTAs (TP8) win from 16 programs (2026-12-02, session 10: B = 16: fp8 14.4 us against
#: 15.0, NVFP4 13.8 against 14.9; B = 8, 8 programs: 13.2 / 13.1 against 12.8 / 13.0); 16-head
#: NVFP4 ones from 16 (TP4 B = 16: 15.4 against 16.8; TP4 B = 8: 15.0 against 13.5); 16-head
#: fp8 ones, since their splits merge as one cluster, from 8 (2026-12-04, session 20, `msa
#: bench --backends triton,cute`: TP2 B = 4 12.4 against 13.1, TP4 B = 8 12.5 against 13.1,
#: TP1 B = 4 (16 programs) 14.4 against 15.5, TP4 B = 16 14.3 against 15.3), and from 1 since their
#: values sit in registers below a wave (`WGMMA_VREG_BELOW_WAVE`; H100, 2026-12-06, session 36,
#: `bench_cute.py --tp 1,2,4 --batches 1,2,4,8`, two runs, us, cute / triton: TP1 B = 1 11.9 / 12.3
#: both, TP2 B = 1 11.4 / 12.0 both, TP4 B = 1 11.5 / 11.9 and 11.3 / 11.7, TP4 B = 2 11.6 / 12.1
#: and 11.4 / 11.8, TP1 B = 2 12.7 / 14.0; session 19 had TP1 B = 1 level). bf16 and f16 caches
#: (the same kernel reading both products from the ring as stored) at one query row: 8-head CTAs
#: from 16 programs (`msa bench --backends triton,cute --layouts bfloat16 --tp 8`, us, cute /
#: triton: H200 2026-12-05 session 27, B = 1 / 16 / 64 / 256: 11.6 / 11.3, 15.9 / 17.0, 30.6 /
#: 32.7, 74.7 / 77.0; H100 session 30, B = 1 / 4 / 16 / 64 / 128 / 256: 11.9 / 11.6, 13.0 / 13.3,
#: 18.1 / 19.4, 39.7 / 41.7, 63.1 / 63.7, 103.6 / 105.8); 16-head ones never: within 2% where they
#: win, up to 18% slower (`WGMMA_AUTO_16_BIT`).
WGMMA_AUTO_MIN_PROGRAMS = {("fp8", 8): 16, ("fp8", 16): 1, ("nvfp4", 8): 16, ("nvfp4", 16): 16,
                           ("bf16", 8): 16, ("f16", 8): 16}
#: What `auto` gives the wgmma kernel of a 16-bit cache: the measured band only, steps of one
#: query row, GQA groups of 8 and a query of one term of the cache's type (`WIDE_Q_TERMS`: not an
#: f16 query over a bf16 cache, whose two terms take more shared memory), from
#: `WGMMA_AUTO_MIN_PROGRAMS` programs. 16-head CTAs measured (H100, session 30, cute / triton,
#: us): TP4 B = 1 / 16 / 64 / 256 13.5 / 11.4, 19.9 / 19.5, 41.9 / 43.0, 104.8 / 106.0; TP2 13.8
#: / 12.8, 29.6 / 28.0, 64.3 / 64.1, 200.9 / 191.3; TP1 14.4 / 13.3, 41.8 / 42.1, 105.0 / 106.1,
#: 368.0 / 361.8; several rows a step, smaller groups and two-term queries were not measured.
WGMMA_AUTO_16_BIT = "one query row a step, 8 query heads a KV head and a query of one term of the cache's type"
#: 16-head fp8 steps of at least this many programs (and fewer than the SMs) take two consumer
#: warpgroups a CTA; the rest below the SMs one (`choose_wgmma_shape`).
WGMMA_TWO_WG_MIN_PROGRAMS = 32
#: The ring stages of each warpgroup of those steps: 2 (half the first burst of copies that every
#: CTA starts at once). H200, M3 fp8 at 64K, same runs (2026-12-05, session 24,
#: `bench_cute.py --variant ...`), us, 2 stages against 3: TP1 B = 16 20.6 / 21.0 (keys in
#: registers as the default, values in registers or not), TP1 B = 8 16.4 / 17.0 and TP4 B = 64
#: 20.4 / 21.3 (values in registers, the fp8 product); benchmarks/RESULTS.md has the repeat.
WGMMA_TWO_WG_STAGES = 2
#: Programs an SM (as a fraction: 3/2) up to which a one-row step past one program an SM takes two
#: splits of 2 stages with values in registers (`choose_wgmma_shape`): NVFP4 on every Hopper, fp8
#: on the devices of `WGMMA_HALF_SPLIT_FP8_DEVICES`. One split leaves some SMs two programs and the
#: rest one, so the step lasts two programs' walks; two splits of half the tiles give each SM at
#: most three halves. Past 3/2 both give two walks: one split measured faster for fp8 and level
#: for NVFP4 (TP1 B = 72). M3 at 64K, one
#: split of 3 stages against two of 2 with values in registers, us, same runs
#: (2026-12-06, session 37, `bench_cute.py --variant '{"num_splits":1,"stages":3}'` and the like):
#: - NVFP4, H200: TP1 B = 40 / 48 41.5 / 42.0 against 34.5 / 35.0, TP4 B = 160 / 192 42.3 / 42.2
#:   against 34.7 / 35.1, TP8 B = 160 / 192 37.0 / 37.1 against 30.2 / 30.9; H100: TP4 B = 136 /
#:   176 / 196 41.5 / 42.7 / 43.0 against 37.2 / 37.9 / 39.5, TP8 36.9 / 38.3 / 39.0 against 33.8
#:   / 34.7 / 36.4; past 3/2, H200 TP1 B = 72 53.8 against 53.4.
#: - fp8, H200: TP1 B = 36 / 40 / 48 43.3 / 44.1 / 44.8 against 34.4 / 37.3 / 40.3, TP4 B = 160 /
#:   192 44.6 / 45.0 against 36.6 / 40.7, TP8 B = 160 / 192 40.3 / 40.7 against 35.9 / 39.4 (past
#:   3/2: TP1 B = 56 / 64 / 72 45.6 / 46.5 / 59.6 against 46.4 / 49.1 / 69.9); but H100 (3.0 TB/s
#:   copies against the H200's 4.2): TP1 B = 34 / 40 / 48 44.1 / 45.3 / 48.2 against 41.2 / 46.4
#:   / 51.4, TP4 B = 136 / 176 / 196 37.9 / 44.3 / 47.7 against 41.3 / 49.0 / 52.1, TP8 likewise.
WGMMA_HALF_SPLIT_PROGRAMS = (3, 2)
#: Devices (a substring of the name) whose fp8 steps take `WGMMA_HALF_SPLIT_PROGRAMS`' two splits:
#: "H200" names a GH200 too, whose memory is as fast (not measured).
WGMMA_HALF_SPLIT_FP8_DEVICES = ("H200",)
#: Consumer warpgroups a CTA of an fp8 step of several rows a request (L > 1) with one to two
#: programs an SM (`choose_wgmma_shape`). In speculative decoding a request's rows share most of
#: their pages; the policy sees shapes, not indices, and benchmarks/RESULTS.md (session 25)
#: records what the shape costs where they share none (about level).
WGMMA_SHARED_ROWS_WGS = 2
#: Ring stages of fp8 steps past 3 CTAs an SM whose CTAs take 8 query heads (TP8; values in
#: registers: 4 CTAs an SM by shared memory at 3 stages). H200, M3 fp8 at 64K, same runs
#: (benchmarks/bench_cute.py `--variant '{"stages":3}'`, 2026-12-05, session 25), us, 3 stages
#: against 2: TP8 L = 4 B = 256 at 80% shared pages 81.9 / 82.4 against 86.0 / 84.7 (two runs),
#: without shared pages 128.0 against 132.5, L = 1 B = 1024 137.2 against 143.6. 16-head CTAs
#: keep 2: TP1 L = 1 B = 256 140.5 against 143.2 with 3, L = 4 B = 64 / 256 at 80% 100.0 / 364.5
#: against 100.7 / 368.2 (TP1 L = 1 B = 1024 took 505.6 with 3 against 553.9: not an issue row,
#: one run, left for a later rule).
WGMMA_WIDE_8HEAD_STAGES = 3


def wgmma_evict(problem: DecodeProblem, sm_count: int, stages: int, wgs: int, vreg: bool, splits: int,
                tokens: int = 1) -> str:
    """The L2 eviction priority of a wgmma step's page copies unless asked: "first" for fp8 steps
    of one query row a request (each page read once) whose CTAs all fit the SMs at once (by
    shared memory, `wgmma_ctas_per_sm`) and number at most `WGMMA_EVICT_FIRST_CTAS_PER_SM` an SM,
    else `WGMMA_EVICT_DEFAULT`. H200, M3 fp8 at 64K, L = 1, graph replays with L2 flushed (sessions
    22-24, 2026-12-04/05, `bench_cute.py --variant '{"evict":"first"}'` / `'{"evict":"normal"}'`),
    us, "first" against "normal": TP1 B = 64 46.2 / 49.3 and 46.0 / 48.6, TP8 B = 256 45.9 / 47.7
    and 45.5 / 47.5, TP8 B = 64 20.2 / 20.9 and 19.9 / 22.5, TP1 B = 16 21.4 / 21.7, TP8 B = 16
    13.3 / 13.6; but TP1 B = 128 (512 CTAs, one wave of ~4 an SM) loses in two sessions' runs
    (79.7 / 78.4, 81.0 / 79.3), two waves lose (TP1 B = 256 146.4 / 140.9 and 145.4 / 139.9), as
    do rows sharing pages (TP1 L = 4, 80% shared, B = 64: 106.0 / 102.3), and NVFP4 measured level
    (session 22: within 0.6 us)."""
    ctas = wgmma_programs(problem, tokens) * splits
    resident = ctas <= min(wgmma_slots(problem, sm_count, stages, wgs, vreg), WGMMA_EVICT_FIRST_CTAS_PER_SM * sm_count)
    fp8 = WGMMA_KINDS.get(problem.kv_layout, "fp8") == "fp8"
    return "first" if fp8 and problem.query_len == 1 and resident else WGMMA_EVICT_DEFAULT


def wgmma_auto_min_programs(problem: DecodeProblem) -> int | None:
    """The fewest (row, KV head, head chunk) programs `auto` gives the wgmma kernel
    (`WGMMA_AUTO_MIN_PROGRAMS`), or None where `auto` never gives it a step (a 16-bit cache's
    steps outside `WGMMA_AUTO_16_BIT`)."""
    kind = WGMMA_KINDS.get(problem.kv_layout, "fp8")
    if kind in WIDE_KINDS and (problem.query_len != 1 or problem.geometry.group_size != 8
                               or WIDE_Q_TERMS[kind][Q_KINDS[problem.q_dtype]] != 1):
        return None
    return WGMMA_AUTO_MIN_PROGRAMS.get((kind, wgmma_heads(problem.geometry.group_size)))


@attrs.frozen
class WgmmaShape:
    """How the wgmma kernel walks a step: splits, ring stages, warpgroups, values in registers,
    keys in f16 registers (the exact score product), converted there on the tensor cores."""

    num_splits: int
    stages: int
    wgs: int
    vreg: bool
    kreg: bool = False
    tconv: bool = False
    tokens: int = 1


#: Rows of a request a wgmma program takes unless asked (`CuteBackend(tokens=...)`): one. H200,
#: M3 fp8 at 64K, L = 4, same-run A/B (benchmarks/bench_cute.py, 2026-12-04, session 18): four
#: rows a program is 4-7% faster only where the step is bound by bytes and the tokens share most
#: pages (TP8 B = 256 at 80% overlap: 100.4-106.4 us against 107.3-108.1); with fewer programs
#: than that it loses (TP8 B = 16 / 64 at 80%: 42.7 / 43.8 against 18.4 / 37.0; two rows at TP1
#: B = 64: 133.6 against 105.6), and without overlap it loses everywhere (TP8 B = 64 / 256: 63.5
#: / 169.3 against 44.9 / 131.9). The policy sees shapes, not the indices' overlap.
WGMMA_DEFAULT_TOKENS = 1


def _wave_walk(programs: int, sm_count: int, tiles: int) -> tuple[int, int]:
    """(splits, stages) of a one-warpgroup walk of `programs` programs of `tiles` tiles each, by
    how many waves they fill: past 3 CTAs per SM one split of 2 stages, from one CTA per SM one
    split of 3, below that splits up to two CTAs per SM (each keeping `_WGMMA_MIN_TILES`) of 3."""
    if programs > 3 * sm_count:
        return 1, 2
    if programs >= sm_count:
        return 1, 3
    return max(1, min(2 * sm_count // programs, tiles // _WGMMA_MIN_TILES)), 3


def _keys_in_registers(problem: DecodeProblem) -> bool:
    """Whether the wgmma kernel decodes a step's keys into f16 registers by default (below 3 CTAs
    per SM: `choose_wgmma_shape`): always for NVFP4; for fp8 (`WGMMA_FP8_KREG`) with a bf16 or
    f16 query, whose exact product it is, but not with an fp8 query, whose product of the fp8
    keys with its one fp8 term is what the caller asked for and measured faster (H200, M3 fp8 at
    64K, fp8 q, same run, 2026-12-04 session 20, `bench_cute.py --q-dtype fp8`: TP1 B = 1 / 16
    / 64 11.4 / 21.6 / 48.7 us against 11.9 / 22.1 / 49.9; TP8 B = 1 / 16 / 64 / 256 10.6 /
    12.9 / 20.8 / 47.6 against 11.0 / 13.1 / 21.2 / 48.4; past 3 CTAs per SM, TP1 B = 128 and
    256, every query takes the fp8 product already)."""
    if problem.kv_layout == "nvfp4":
        return True
    if problem.kv_layout in WGMMA_ONLY_LAYOUTS:  # (16-bit keys are the product's operand as stored)
        return False
    return WGMMA_FP8_KREG and Q_KINDS.get(problem.q_dtype) != "e4m3"


def _union_shape(problem: DecodeProblem, sm_count: int, tokens: int) -> WgmmaShape:
    """The walk of `tokens` rows a program: one warpgroup (`_wave_walk`, the union counted at half
    its pages shared), values in registers for NVFP4, keys in f16 registers (fp8: converted on the
    tensor cores at 4 tokens of 8 heads; ptxas serialises the products of its other shapes)."""
    nvfp4 = problem.kv_layout == "nvfp4"
    kreg = _keys_in_registers(problem)
    heads = wgmma_heads(problem.geometry.group_size)
    tconv = not nvfp4 and kreg and heads == WGMMA_TCONV_HEADS and tokens * heads == WGMMA_TOKEN_COLUMNS
    splits, stages = _wave_walk(max(wgmma_programs(problem, tokens), 1), sm_count,
                                wgmma_tiles(problem) * (1 + tokens) // 2)
    return WgmmaShape(splits, stages, 1, nvfp4, kreg, tconv, tokens)


def choose_wgmma_shape(problem: DecodeProblem, sm_count: int, tokens: int = 1, device_name: str = "") -> WgmmaShape:
    """The measured choice (H200, 132 SMs, benchmarks/bench_cute.py, M3 TP1 / TP4 / TP8 at 64K;
    `device_name` picks the rules measured to differ between devices):

    - more programs than 3 CTAs per SM hold (TP1 B = 256: 1024): 2 stages, values in registers,
      4 CTAs per SM, one split — fp8 145.1 us against 162.7 for 3 stages (Triton 172.6); fp8
      with 8-head CTAs (TP8 L = 4 B = 256, TP8 B = 1024) 3 stages (`WGMMA_WIDE_8HEAD_STAGES`);
    - one to three per SM (TP1 B = 64, TP8 B = 256: 256): 3 stages, one split — 50.2 / 48.2 us
      (vreg 50.5 / 49.0, two splits 55.8-69.1: a second partial wave; Triton 52.6 / 53.6);
    - fp8 steps of several rows a request (L > 1, `WGMMA_SHARED_ROWS_WGS`) with one to two
      programs an SM (TP1 L = 4 B = 16, TP8 L = 4 B = 64: 256): two warpgroups of 2 stages a CTA,
      one split, values in registers, the fp8 product (2 CTAs an SM, one wave) — at 80% of a
      row's pages its predecessor's 32.3 / 27.9 us against 42.8 / 31.6 for one warpgroup of 3
      stages (TP8's with values in registers; the older default took 38.2) and 33.2 / 29.4 for
      two splits of one (2026-12-05, session 24): the rows' shared
      pages come from L2, so the walk is bound by each warpgroup's chain of tiles, not by bytes;
    - one to 1.5 programs an SM (`WGMMA_HALF_SPLIT_PROGRAMS`; TP1 B = 34-49, TP4 and TP8 B =
      133-198), NVFP4, and fp8 on an H200 (`WGMMA_HALF_SPLIT_FP8_DEVICES`): two splits of 2
      stages, values in registers — NVFP4 TP1 B = 40 34.5 us against 41.5 for one split (which
      leaves a second program on some SMs only), fp8 37.3 against 44.1;
    - fewer programs than SMs, fp8 with 16 heads a CTA and at least `WGMMA_TWO_WG_MIN_PROGRAMS`
      (TP1 B = 8 / 16, TP4 B = 64): two warpgroups per CTA, `WGMMA_TWO_WG_STAGES` stages, splits
      up to one CTA per SM, each warpgroup keeping 4 tiles — 18.7 / 23.8 / 24.0 us against 20.9
      / 24.4 / 24.6 with one warpgroup (at 3 stages);
    - the other steps below the SMs (TP1 B = 1, TP8, NVFP4): one warpgroup, splits up to two
      CTAs per SM, each keeping 4 tiles — fp8 TP8 B = 8 / 16 / 64 12.5 / 13.8 / 21.8 us against
      13.4 / 14.3 / 22.1 with two; NVFP4 TP1 B = 16 22.3 against 27.6, TP8 B = 16 / 64 13.2 /
      19.2 against 14.0 / 23.9; fp8 with 8- or 16-head CTAs (TP8; TP1 B < 8, TP4 B < 32) reads
      its values into registers (`WGMMA_VREG_BELOW_WAVE`).

    NVFP4 takes the same walk with its keys and values always in registers (H200, M3 NVFP4
    against the mma kernel: TP1 B = 64 / 256 49.4 / 151.1 us against 51.0 / 162.8). fp8 keys in
    registers: `WGMMA_FP8_KREG`, except past 3 CTAs per SM, where the keys' registers (168 with
    the values', against 124) leave 3 CTAs per SM instead of 4 and a second partial wave: TP1
    B = 128 / 256 95.0 / 147.3 us with them against 80.9 / 145.0 without (Triton 92.8 / 172.3).

    A 16-bit cache (bf16, f16: read by both products from the ring as stored, 16 KiB a stage's keys)
    takes one warpgroup of 3 stages where its programs fit 2 CTAs an SM, else 2 (3 CTAs an SM),
    and the splits that fill the SMs once (`choose_wgmma_splits`) — a first rule from the ring's
    shared memory; at M3 TP1 B = 64 / 256 it measured faster than 2 or 4 stages and two
    warpgroups (benchmarks/RESULTS.md, session 27).

    With `tokens` > 1 rows of a request a program: `_union_shape`."""
    if tokens > 1:
        return _union_shape(problem, sm_count, tokens)
    if problem.kv_layout in WGMMA_ONLY_LAYOUTS:
        stages = 3 if wgmma_programs(problem) <= wgmma_slots(problem, sm_count, 3, 1, False) else 2
        return WgmmaShape(choose_wgmma_splits(problem, sm_count, stages), stages, 1, False, False)
    programs = max(wgmma_programs(problem), 1)
    nvfp4 = problem.kv_layout == "nvfp4"
    kreg = _keys_in_registers(problem)
    tiles = wgmma_tiles(problem)
    splits, stages = _wave_walk(programs, sm_count, tiles)
    if programs > 3 * sm_count:
        if not nvfp4 and wgmma_heads(problem.geometry.group_size) == 8:
            stages = WGMMA_WIDE_8HEAD_STAGES
        return WgmmaShape(splits, stages, 1, True, nvfp4)
    if not nvfp4 and problem.query_len > 1 and sm_count <= programs <= 2 * sm_count:
        return WgmmaShape(1, 2, WGMMA_SHARED_ROWS_WGS, True, False)
    most, per = WGMMA_HALF_SPLIT_PROGRAMS
    halves = nvfp4 or any(name in device_name for name in WGMMA_HALF_SPLIT_FP8_DEVICES)
    if halves and sm_count < programs and per * programs <= most * sm_count and tiles >= 2 * _WGMMA_MIN_TILES:
        return WgmmaShape(2, 2, 1, True, kreg)
    if programs >= sm_count:
        return WgmmaShape(splits, stages, 1, nvfp4, kreg)
    if not nvfp4 and wgmma_heads(problem.geometry.group_size) == 16 and programs >= WGMMA_TWO_WG_MIN_PROGRAMS:
        return WgmmaShape(max(1, min(sm_count // programs, tiles // (2 * _WGMMA_MIN_TILES))), WGMMA_TWO_WG_STAGES, 2,
                          False, kreg)
    vreg = nvfp4 or WGMMA_VREG_BELOW_WAVE
    return WgmmaShape(splits, stages, 1, vreg, kreg)


def choose_wgmma_splits(problem: DecodeProblem, sm_count: int, stages: int = 3, wgs: int = 1,
                        vreg: bool = False, tokens: int = 1) -> int:
    """Splits that fill the SMs' CTA slots once at most, each warpgroup keeping at least 4 tiles
    (of one row's selection: a program of several rows has at least as many)."""
    most = max(1, wgmma_tiles(problem) // (_WGMMA_MIN_TILES * wgs))
    slots = wgmma_slots(problem, sm_count, stages, wgs, vreg)
    return max(1, min(most, slots // max(wgmma_programs(problem, tokens), 1)))
