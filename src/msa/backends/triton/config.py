"""Launch configuration of the Triton decode: a function of shapes and the device only, so a
CUDA graph captured for a shape stays valid whatever the lengths and indices hold."""

from __future__ import annotations

import os
from collections.abc import Callable

import attrs

from msa.errors import MSAInputError, is_int
from msa.layouts import BFLOAT16, KVLayout
from msa.platform import e4m3_in_hardware
from msa.problem import Geometry

__all__ = ["LaunchConfig", "choose_config", "check_overrides", "COMPUTE", "OVERRIDES", "dedup_wanted", "uses_dedup"]

#: Programs per SM the split heuristic aims for when a batch is too small to fill the GPU.
WAVES = 4
#: The most splits a per-token step is merged with inside the decode kernel (the last split to
#: finish merges, one launch) rather than by `merge_kernel`: the last split reads every split's
#: partials alone, which costs more than the second launch saves once there are many. H200, M3
#: TP1, 64K, graph replay (benchmarks/merge_in_kernel.py), two kernels -> in-kernel: 2 splits
#: (bf16 B=48/64) 65.8 -> 63.6, 81.4 -> 79.0 us; 4 splits (B=24) fp8 33.9 -> 30.2, bf16 44.4 ->
#: 40.8, nvfp4 42.2 -> 38.6; 8 splits (B=16) fp8 30.5 -> 30.3, bf16 34.3 -> 33.1, nvfp4 37.1 ->
#: 38.9; 16 splits (B=1) fp8 11.8 -> 14.2, bf16 12.5 -> 14.3, nvfp4 12.9 -> 15.1.
IN_KERNEL_MERGE_MAX_SPLITS = 4


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@attrs.frozen
class LaunchConfig:
    """Attributes:
    block_n: tokens per tile (a tile is part of one page).
    block_g: query heads per program (>= 16: the tensor-core minimum).
    group_chunks: programs per KV head when the GQA group exceeds `block_g`.
    num_splits: programs sharing one (row, KV head)'s tiles (1: one fused pass).
    tiles_per_split: tiles each split walks.
    num_warps, num_stages: Triton launch parameters.
    compute: dtype of the tensor-core dots for quantized caches ("fp16" or "bf16"; both are
        exact for fp8 and NVFP4 values; bf16/fp16 caches always use their own dtype). With
        "fp16" each head of a bf16 query is first scaled by a power of two into fp16's range (its
        largest finite magnitude in [2^14, 2^15)), its scores taking it back: exact for every
        element from 2^-31 of its head's largest, at any magnitude (`kernels._fit_q`); with
        "bf16" an f16 query is two bf16 terms, one more dot a tile (`kernels._q_low`: exact). The
        same holds for a 16-bit cache with a query of the other 16-bit type.
    decode_asm: NVFP4 tiles are decoded with packed PTX (`cvt.rn.f16x2.e4m3x2`) on a GPU; off: the
        portable Triton decode (the interpreter always uses it). The values are the same.
    codes_rows: NVFP4 code bytes are loaded as one contiguous row per token, then grouped.
    swap_ab: NVFP4 dots take the tokens as rows (scores^T = K q^T, acc^T += V^T P^T), the form
        Hopper's wgmma accepts (M >= 64); off (the default): the query heads are the rows
        (mma.sync), which on the H200 needs 168 registers against swap-AB's 246 and runs faster
        (tune_kernels.py: 66.8 vs 72.9 us at B=64, 209.0 vs 258.0 us at B=256).
    dedup: one program per (request, KV head, chunk of `tokens` query tokens) walks the union
        of the tokens' page lists, reading each page once (`token_chunks` chunks per request,
        `block_m` rows = tokens x GQA group, `entries_pad` list entries).
    in_kernel_merge: a split per-token step is merged by the last of each program's splits to
        finish (an atomic counter per program in the workspace), not by `merge_kernel`: one launch
        instead of two (dedup steps always use `merge_kernel`; never set without splits). By
        default for 2 to `IN_KERNEL_MERGE_MAX_SPLITS` splits.
    merge_fence: with `in_kernel_merge`, every thread fences its partial stores at GPU scope before
        the count (off only to show the race it prevents: benchmarks/merge_in_kernel.py).
    soft_e4m3: E4M3 bytes (an fp8 cache or query, NVFP4's block scales and codes) are read as
        integers and decoded by bits (`msa.layouts.kernels.e4m3_decode_bits`), not by the hardware conversion,
        which GPUs below compute capability 8.9 lack (`msa.platform.E4M3_MIN_CAPABILITY`; the
        backend sets it there). The values are the same; off the packed PTX decode too.
    """

    block_n: int
    block_g: int
    group_chunks: int
    num_splits: int
    tiles_per_split: int
    num_warps: int = 4
    num_stages: int = 2
    compute: str = "fp16"
    dedup: bool = False
    tokens: int = 1
    token_chunks: int = 1
    block_m: int = 16
    entries_pad: int = 0
    decode_asm: bool = True
    codes_rows: bool = True
    swap_ab: bool = False
    in_kernel_merge: bool = False
    merge_fence: bool = True
    soft_e4m3: bool = False

    @property
    def fused(self) -> bool:
        return self.num_splits == 1


def choose_config(
    geometry: Geometry,
    num_rows: int,
    sm_count: int,
    *,
    layout: KVLayout = BFLOAT16,
    batch_size: int | None = None,
    query_len: int = 1,
    dedup: bool | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    compute: str | None = None,
    decode_asm: bool = True,
    codes_rows: bool = True,
    swap_ab: bool = False,
    in_kernel_merge: bool | None = None,
    merge_fence: bool = True,
    soft_e4m3: bool | None = None,
    dcp_size: int = 1,
    capability: tuple[int, int] | None = None,
) -> LaunchConfig:
    """Pick tile sizes and the split count for `num_rows` query rows on `sm_count` SMs.

    When (row, KV head, group chunk) programs already fill `WAVES` programs per SM, one fused
    pass; otherwise the tiles of each row are split across programs (at most one tile each),
    and a small kernel merges the splits. Keyword arguments override the heuristic.

    Defaults measured on the H200 (benchmarks/RESULTS.md; tune_triton.py, tune_splits.py,
    tune_stages.py, tune_kernels.py): 64-token tiles, 4 warps, 3 pipeline stages for quantized
    caches and 2 for bf16/fp16; in one fused pass, or with a split per selected page, every
    layout takes whole 128-token pages.

    `capability`: the GPU's compute capability (None: as on Hopper, or the interpreter). Below 8.9
    E4M3 is decoded by bits (`soft_e4m3`, unless given); below 9.0 (`mma.sync` dots) the NVFP4
    dedup program takes 64-token tiles (`_narrow_nvfp4`).
    """
    g = geometry
    if soft_e4m3 is None:
        soft_e4m3 = not e4m3_in_hardware(capability)
    block_g = min(max(16, _next_pow2(g.group_size)), 64)
    group_chunks = -(-g.group_size // block_g)
    quantized = layout.quantized
    tokens = _dedup_rows(g, query_len) // g.group_size
    dedup = uses_dedup(g, layout, query_len, batch_size or 0, sm_count, dedup, dcp_size)
    token_chunks = -(-query_len // tokens) if dedup else 1
    batch = batch_size if batch_size is not None else max(num_rows // max(query_len, 1), 1)
    if dedup:
        programs = max(batch * g.num_kv_heads * token_chunks, 1)
    else:
        programs = max(num_rows * g.num_kv_heads * group_chunks, 1)
    if num_splits is None:
        # one fused pass once the grid holds 2 programs per SM (1 for quantized caches, whose
        # programs are longer); else split each row's tiles, aiming at WAVES programs per SM
        full = (1 if quantized else 2) * sm_count
        num_splits = 1 if programs >= full else 1 << max((WAVES * sm_count // programs).bit_length() - 1, 0)
    if block_n is None:
        # whole 128-token pages in one fused pass, and with one page per split when the heuristic
        # wants more splits than entries (NVFP4: as many). H200, tune_kernels.py, M3 TP1, against
        # 64-token tiles: B=1 fp8 12.7 -> 12.1 us, bf16 13.4 -> 13.0, nvfp4 13.9 -> 13.4; B=4 16.1
        # -> 15.7, 18.6 -> 17.9, 21.2 -> 17.0; at B=8 (16 splits) only nvfp4 gains (27.7 -> 24.8 us;
        # fp8 21.9 -> 22.7, bf16 23.5 -> 24.6 us)
        one_page_each = num_splits >= g.topk if layout.block_scaled else num_splits > g.topk
        # the dedup program of bf16/fp16 caches (64 query rows) takes 64-token tiles, 3 stages
        # (H200, L = 4, 80% overlap, B = 128: 381.6 us with 128-token tiles and 2 stages, 315.2
        # with 3 stages, 256.3 with both; B = 64 176.6 -> 157.5 us)
        # so do some NVFP4 dedup programs (`_narrow_nvfp4`)
        whole_pages = ((num_splits == 1 or one_page_each) and g.head_dim <= 128
                       and not (dedup and (not quantized or _narrow_nvfp4(g, layout, query_len, capability))))
        block_n = 128 if whole_pages else (64 if g.head_dim <= 128 else 32)
    block_n = min(block_n, g.page_size)
    tiles = g.topk * (g.page_size // block_n)
    num_splits = max(1, min(num_splits, tiles))
    if dedup:
        tiles = tokens * g.topk * (g.page_size // block_n)
        num_splits = max(1, min(num_splits, tiles))
    per_split = -(-tiles // num_splits)
    num_splits = -(-tiles // per_split)
    block_m = max(16, _next_pow2(tokens * g.group_size)) if dedup else block_g
    return LaunchConfig(
        block_n=block_n,
        block_g=block_g,
        group_chunks=group_chunks,
        num_splits=num_splits,
        tiles_per_split=per_split,
        # 4 warps for whole bf16 pages too (H200, tune_kernels.py: 255 vs 313 us at B=256)
        num_warps=num_warps if num_warps is not None else (8 if block_m * g.head_dim > 8192 else 4),
        # NVFP4 in one fused pass: 2 stages (H200, tune_kernels.py: 79 vs 89 us at B=64)
        # the dedup program: 3 stages for every layout (H200, L = 4, 80% overlap: NVFP4 B = 64 / 128
        # 167.1 / 305.1 us with 2, 157.8 / 292.3 with 3; fp8 already 3, 4 is slower: 173.7 us)
        num_stages=num_stages if num_stages is not None else (
            3 if dedup else 2 if layout.block_scaled and num_splits == 1 else 3 if quantized else 2
        ),
        compute=compute if compute is not None else "fp16",
        dedup=dedup,
        tokens=tokens if dedup else 1,
        token_chunks=token_chunks,
        block_m=block_m,
        entries_pad=_next_pow2(tokens * g.topk) if dedup else 0,
        decode_asm=decode_asm and not soft_e4m3,
        codes_rows=codes_rows,
        swap_ab=swap_ab,
        in_kernel_merge=not dedup and num_splits > 1 and (num_splits <= IN_KERNEL_MERGE_MAX_SPLITS
                                                          if in_kernel_merge is None else in_kernel_merge),
        merge_fence=merge_fence,
        soft_e4m3=soft_e4m3,
    )


def _flag(value: object) -> bool:
    return isinstance(value, bool)


def _at_least(low: int) -> Callable[[object], bool]:
    return lambda value: is_int(value) and value >= low


def _power_of_two(low: int, high: int) -> Callable[[object], bool]:
    return lambda value: is_int(value) and low <= value <= high and value & (value - 1) == 0


#: The dtypes a quantized cache's tensor-core dots may compute in (`LaunchConfig.compute`).
COMPUTE = ("fp16", "bf16")

#: `choose_config`'s overrides a `TritonBackend(**overrides)` takes: (what the kernels take, the
#: test, whether None — the heuristic's choice — is one).
OVERRIDES: dict[str, tuple[str, Callable[[object], bool], bool]] = {
    "dedup": ("a bool", _flag, True),
    "num_splits": ("an int >= 1", _at_least(1), True),
    "block_n": ("a power of two >= 16 (tokens a tile)", _power_of_two(16, 1 << 30), True),
    "num_warps": ("a power of two from 1 to 32", _power_of_two(1, 32), True),
    "num_stages": ("an int >= 1", _at_least(1), True),
    "compute": (" or ".join(map(repr, COMPUTE)), lambda value: value in COMPUTE, True),
    "in_kernel_merge": ("a bool", _flag, True),
    "decode_asm": ("a bool", _flag, False),
    "codes_rows": ("a bool", _flag, False),
    "swap_ab": ("a bool", _flag, False),
    "merge_fence": ("a bool", _flag, False),
    "soft_e4m3": ("a bool", _flag, True),
}


def check_overrides(overrides: dict[str, object]) -> None:
    """Refuse an override `choose_config` does not take, or a value outside what the kernels take.

    Raises:
        MSAInputError: naming the override.
    """
    for name, value in overrides.items():
        if name not in OVERRIDES:
            raise MSAInputError(name, "one of the Triton backend's options: " + ", ".join(OVERRIDES),
                                "an unknown option")
        expected, ok, none_ok = OVERRIDES[name]
        if not (ok(value) or (value is None and none_ok)):
            raise MSAInputError(name, expected + (" or None" if none_ok else ""), repr(value))


def dedup_wanted() -> bool | None:
    """`MSA_TRITON_DEDUP`: "1" forces the dedup strategy for multi-token steps, "0" the per-token
    one; None (unset): the shape policy (`dedup_pays`) decides."""
    env = os.environ.get("MSA_TRITON_DEDUP", "")
    return env == "1" if env in ("0", "1") else None


def uses_dedup(geometry: Geometry, layout: KVLayout, query_len: int, batch_size: int, sm_count: int,
               dedup: bool | None = None, dcp_size: int = 1) -> bool:
    """Whether a step runs the dedup program: `dedup` when given (forced by the caller or
    `MSA_TRITON_DEDUP`), else the shape policy (`dedup_pays`); never where it is unsupported."""
    wanted = dedup_pays(geometry, layout, query_len, batch_size, sm_count, dcp_size) if dedup is None else dedup
    return wanted and dedup_supported(geometry, layout, query_len)


def dedup_supported(geometry: Geometry, layout: KVLayout, query_len: int) -> bool:
    """The dedup kernel serves every layout (bf16, fp16, fp8, NVFP4) whose GQA group leaves room
    for two or more query tokens in a 128-row tile."""
    return query_len >= 2 and geometry.group_size <= 64 and geometry.topk <= 64


def dedup_pays(geometry: Geometry, layout: KVLayout, query_len: int, batch_size: int, sm_count: int,
               dcp_size: int = 1) -> bool:
    """The policy, from shapes only (the overlap between tokens is not known without reading the
    indices): dedup for L = 3 or 4 once (request, KV head) programs fill the SMs.

    Measured on the H200 (M3 TP1, 64K contexts; benchmarks/RESULTS.md, speed-up over
    per-token): at L = 4 and ~80% page overlap 1.21x (B=64) and 1.32x (B=128) for fp8, 1.24x and
    1.47x for bf16, 1.31x and 1.33x for NVFP4 (with the dedup tiles and stages of `choose_config`),
    but 0.62x / 0.82x at B=16 (too few programs); at L = 2 0.79x..1.09x; at L = 8 0.26x..1.18x.
    Without overlap at L = 4 it is 0.75x (fp8) / 0.88x-0.94x (bf16) / 0.76x (NVFP4) at B = 64-128:
    the price of choosing it without seeing the indices.

    Not for NVFP4 programs of 32 rows or fewer (GQA groups of 8 or less at L = 4): at M3 TP8, L = 4,
    80% overlap the per-token kernel took 111.5 / 198.3 us at B = 128 / 256 against the dedup
    kernel's 158.0 / 238.4 (H100, tune_kernels.py --tp 8; fp8 169.7 against 156.6 and bf16 241.5
    against 189.9 at B = 256 keep it).

    Not for a rank of decode context parallelism (`dcp_size` > 1), which holds a share of each
    selection: on 2 H200s, each holding half of every request's pages, at L = 4 and B = 64 the
    dedup kernel took 168 us against the per-token kernel's 105 (benchmarks/RESULTS.md)."""
    return (
        dcp_size == 1
        and dedup_supported(geometry, layout, query_len)
        and 3 <= query_len <= 4
        and batch_size * geometry.num_kv_heads >= sm_count
        and not (layout.block_scaled and _dedup_rows(geometry, query_len) <= 32)
    )


def _narrow_nvfp4(geometry: Geometry, layout: KVLayout, query_len: int, capability: tuple[int, int] | None) -> bool:
    """Whether an NVFP4 dedup program takes 64-token tiles: at 32 rows or fewer (GQA groups of 8 or
    less at L = 4), where with 128-token tiles Triton 3.6 gives it 7080 bytes of stack (spilled
    registers; Triton 3.9: 64) and at M3 TP8, L = 4, 80% overlap, B = 256 it took 17190 us against
    236.9 with 64-token tiles (H100, tune_kernels.py --tp 8; 32-row fp8 programs do not spill:
    156.0 against 167.4 us); and below compute capability 9.0, whose `mma.sync` dots gave M3 TP1's
    64-row program 1872 bytes of stack at 128-token tiles, 248-264 at 64 (sm_80, Triton 3.9,
    benchmarks/kernel_sass.py --capability 8.0: compiled, not timed)."""
    hopper = capability is None or capability >= (9, 0)
    return layout.block_scaled and (_dedup_rows(geometry, query_len) <= 32 or not hopper)


def _dedup_rows(geometry: Geometry, query_len: int) -> int:
    """Query rows of one dedup program: its tokens' query heads of one KV head."""
    return min(query_len, max(1, 128 // geometry.group_size), max(1, 128 // geometry.topk)) * geometry.group_size
