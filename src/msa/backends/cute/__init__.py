"""The `cute` backend: sparse decode in kernels written with the CuTe DSL (`nvidia-cutlass-dsl`, an
optional dependency: `pip install nvidia-cutlass-dsl`), compiled on first use for the GPU they run
on. Compute capability >= 9.0, NVFP4 head-slot and fp8 caches (and on Hopper bf16 and f16 ones),
head dim 128, pages of a multiple of 16 tokens, top-k <= 32, any query length 1..32, any GQA
group, bf16 / f16 / fp8 queries, natural-log LSE. Two kernels:

- "mma" (`kernel.py`): each thread decodes its share of the code bytes straight into `mma.sync`
  operand registers; any page size of a multiple of 16, and compute capability 10.x (by name, or
  where the other cannot serve).
- "wgmma" (`sm90.py`): a TMA ring and WGMMA on sm_90a, for fp8, NVFP4, bf16 and f16 caches with
  pages of a multiple of 64 tokens (fp8: the query split into fp8 terms, or with `kreg` the keys
  decoded into f16 registers for an exact product; NVFP4: keys and values decoded into f16
  operand registers; bf16 / f16: both products read the ring's stages as stored, the query in
  terms of the cache's type, exact). The default wherever it serves; the only one for bf16 and
  f16.

`auto` takes this backend on Hopper for steps of at least `WGMMA_AUTO_MIN_PROGRAMS` (row, KV head,
head chunk) programs where the wgmma kernel serves them (16 of 8-head CTAs, fp8 1 of 16-head ones,
NVFP4 16; bf16 and f16 caches only at one query row, GQA groups of 8 and a one-term query, where it
measured 2-7% faster than the Triton kernel: `WGMMA_AUTO_16_BIT`), for the other NVFP4 steps of at
least `AUTO_MIN_PROGRAMS` (row, KV head) programs and for no other fp8 step, eager or captured in
CUDA graphs alike (launches pack their own arguments: `fastcall`), multi-token steps included (the
wgmma kernel measured faster than the Triton dedup kernel on fp8 and NVFP4, with and without shared
pages; the mma kernel leaves the steps that kernel serves to it); the Triton backend stays the
portable default. Requested by name it runs any step it supports."""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

import attrs
import torch

from msa.backends.base import Backend
from msa.backends.capabilities import Capabilities
from msa.backends.cute.config import (
    AUTO_MIN_PROGRAMS,
    DEFAULT_QK_CHAINS,
    DEFAULT_STAGES,
    KERNELS,
    KINDS,
    Q_KINDS,
    SM90_SMEM,
    VERIFIED_DSL_VERSIONS,
    WGMMA_AUTO_16_BIT,
    WGMMA_DEFAULT_LAYOUTS,
    WGMMA_DEFAULT_TOKENS,
    WGMMA_EVICT,
    WGMMA_EVICT_DEFAULT,
    WGMMA_FUSED_MERGE,
    WGMMA_KINDS,
    WGMMA_LAG,
    WGMMA_ONLY_LAYOUTS,
    WGMMA_REFILL,
    WGMMA_REFILL_DEFAULT,
    WGMMA_TOKENS,
    CuteConfig,
    choose_min_ctas,
    choose_splits,
    choose_wgmma_shape,
    choose_wgmma_splits,
    max_stages,
    programs,
    wgmma_auto_min_programs,
    wgmma_cluster,
    wgmma_cluster_default,
    wgmma_evict,
    wgmma_heads,
    wgmma_programs,
    wgmma_q_bytes,
    wgmma_serves,
    wgmma_smem_bytes,
    wgmma_tokens_serve,
)
from msa.backends.triton.config import dedup_wanted, uses_dedup
from msa.errors import MSAInputError, is_int
from msa.planning import RowMetadata, StepTables
from msa.platform import Platform, detect
from msa.problem import DecodeProblem
from msa.validation import DecodeInputs

__all__ = ["CuteBackend", "CutePlan", "dsl_version"]


@functools.cache
def dsl_version() -> str | None:
    """The installed nvidia-cutlass-dsl's version (None: not installed)."""
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


@attrs.frozen(eq=False)
class CutePlan:
    """The split count, the plan's workspace, the planner's per-row metadata and the compiled
    kernels (by whether they write the LSE)."""

    problem: DecodeProblem
    config: CuteConfig
    workspace: Any
    rows: RowMetadata
    kernels: dict[bool, Any]


def _why_not_wgmma(problem: DecodeProblem, platform: Platform) -> str:
    """Why a step that takes the mma kernel does not take the wgmma one (for a 16-bit cache,
    which only the wgmma kernel reads)."""
    mma = "kernel='mma' was asked for, which reads fp8 and nvfp4 caches only"
    return wgmma_serves(problem, platform.capability) or mma


def _check_option(name: str, value: object, allowed: str, ok: bool) -> None:
    """Refuse a backend option outside what the kernels take (None is always allowed)."""
    if value is not None and not ok:
        raise MSAInputError(name, allowed, repr(value))


class CuteBackend(Backend[CutePlan]):
    """NVFP4 decode with operands decoded in registers (CuTe DSL, sm_90+), and fp8, NVFP4, bf16
    and f16 decode with a TMA ring and WGMMA on Hopper (sm_90a).

    Options (None: the measured choice): `num_splits` (>= 1), `stages` (>= 1; "wgmma": >= 2, as
    many as fit an SM's shared memory), `kernel` ("mma" / "wgmma"), `qk_chains` (1, 2 or 4) and
    `min_ctas` (>= 0, launch bounds), `fused`, `cluster` (a fused program's 2-8 splits one cluster,
    merged through distributed shared memory), `lag`, `wgs` (1 or 2), `vreg`, `kreg`, `tconv`,
    `tokens` (1, 2 or 4: rows of a request a program takes, walking their pages' union once),
    `evict` ("normal", "first" or "last": the L2 eviction priority of the pages' copies) and
    `refill` ("top" or "late": when a ring copy starts) ("wgmma"; NVFP4 needs `vreg` and `kreg`,
    `tconv` takes fp8 and `kreg`, bf16 and f16 none of the three nor `lag` or a late refill,
    `tokens` a uniform step and a GQA group of 8 or 16:
    `sm90.Sm90Spec` says what each does). A value no kernel
    takes raises `MSAInputError` here; one the step's kernel cannot take (too many stages for its
    shared memory, `vreg=False` on NVFP4) raises it when the step is planned."""

    name = "cute"
    description = ("CuTe DSL kernels (nvidia-cutlass-dsl; compute capability >= 9.0): fp8 and NVFP4 with TMA + "
                   "WGMMA on sm_90a (bf16 and f16 too, by name), fp8 and NVFP4 with mma.sync "
                   "elsewhere")
    capabilities = Capabilities(
        device_types=frozenset({"cuda"}),
        min_capability=(9, 0),
        packages=("cutlass_dsl",),
        kv_layouts=frozenset({"nvfp4", "fp8_e4m3"}) | WGMMA_ONLY_LAYOUTS,
        auto_layouts=frozenset({"nvfp4", "fp8_e4m3"}) | WGMMA_ONLY_LAYOUTS,
        q_dtypes=frozenset({torch.bfloat16, torch.float16, torch.float8_e4m3fn}),
        head_dims=frozenset({128}),
        query_lens=(1, 32),
        lse=True,
        ragged=True,
    )

    def __init__(self, num_splits: int | None = None, stages: int | None = None, qk_chains: int | None = None,
                 min_ctas: int | None = None, kernel: str | None = None, fused: bool | None = None,
                 lag: bool | None = None, wgs: int | None = None, vreg: bool | None = None,
                 kreg: bool | None = None, tconv: bool | None = None, tokens: int | None = None,
                 cluster: bool | None = None, evict: str | None = None, refill: str | None = None) -> None:
        if kernel is not None and kernel not in KERNELS:
            raise MSAInputError("kernel", f"one of {', '.join(map(repr, KERNELS))}", repr(kernel))
        for name, value in (("num_splits", num_splits), ("stages", stages)):
            _check_option(name, value, "an int >= 1", is_int(value) and value >= 1)
        _check_option("min_ctas", min_ctas, "an int >= 0", is_int(min_ctas) and min_ctas >= 0)
        _check_option("qk_chains", qk_chains, "the int 1, 2 or 4", is_int(qk_chains) and qk_chains in (1, 2, 4))
        _check_option("wgs", wgs, "the int 1 or 2", is_int(wgs) and wgs in (1, 2))
        _check_option("tokens", tokens, f"an int, one of {WGMMA_TOKENS}", is_int(tokens) and tokens in WGMMA_TOKENS)
        _check_option("evict", evict, f"one of {', '.join(map(repr, WGMMA_EVICT))}", evict in WGMMA_EVICT)
        _check_option("refill", refill, f"one of {', '.join(map(repr, WGMMA_REFILL))}", refill in WGMMA_REFILL)
        for name, flag in (("fused", fused), ("lag", lag), ("vreg", vreg), ("kreg", kreg), ("tconv", tconv),
                           ("cluster", cluster)):
            _check_option(name, flag, "a bool", isinstance(flag, bool))
        self.kernel = kernel
        self.fused = fused
        self.lag = lag
        self.wgs = wgs
        self.vreg = vreg
        self.kreg = kreg
        self.tconv = tconv
        self.tokens = tokens
        self.cluster = cluster
        self.evict = evict
        self.refill = refill
        self.num_splits = num_splits
        self.stages = stages
        self.qk_chains = qk_chains
        self.min_ctas = min_ctas

    def extra_reasons(self, problem: DecodeProblem, platform: Platform, *, requested: bool = False) -> list[str]:
        g = problem.geometry
        reasons = []
        wgmma_why = wgmma_serves(problem, platform.capability)
        if self.kernel == "wgmma" and wgmma_why is not None:
            reasons.append(f"kernel='wgmma' was asked for: {wgmma_why}")
        if problem.kv_layout in WGMMA_ONLY_LAYOUTS and self.kernel_for(problem, platform) == "mma":
            reasons.append(f"a {problem.kv_layout} cache is read by the wgmma kernel only: "
                           f"{_why_not_wgmma(problem, platform)}")
        if g.page_size % 16:
            reasons.append(f"page size {g.page_size} is not a multiple of 16")
        if g.topk > 32:
            reasons.append(f"top-k {g.topk} > 32")
        if not problem.vector_aligned:
            reasons.append("q/out rows not 4-byte or cache pages not 16-byte aligned (it loads them as vectors; the "
                           "triton backend takes any alignment)")
        fp8 = problem.kv_layout == "fp8_e4m3"
        on_wgmma = wgmma_why is None and self.kernel_for(problem, platform) == "wgmma"
        least = wgmma_auto_min_programs(problem)
        if not requested and on_wgmma and least is None:
            reasons.append(f"auto: a {problem.kv_layout} cache's steps only with {WGMMA_AUTO_16_BIT}, where the "
                           "wgmma kernel measured faster than the Triton kernel")
        elif not requested and on_wgmma and least is not None and wgmma_programs(problem) < least:
            reasons.append(f"auto: fewer than {least} (row, KV head, head chunk) programs of "
                           f"{wgmma_heads(g.group_size)} heads, where the Triton kernel measured as fast or faster")
        elif not requested and fp8 and not on_wgmma:
            why = wgmma_why or "the mma kernel was asked for"
            reasons.append(f"auto: fp8 only on the wgmma kernel ({why}; the mma kernel is slower than Triton's "
                           "on fp8)")
        elif not requested and not on_wgmma and programs(problem) < AUTO_MIN_PROGRAMS:
            reasons.append(f"auto: fewer than {AUTO_MIN_PROGRAMS} (row, KV head) programs, where the Triton "
                           "kernel measured faster")
        version = dsl_version()
        unverified = version is not None and version not in VERIFIED_DSL_VERSIONS
        if not requested and not problem.graph_capture and unverified:
            reasons.append(f"auto: an eager step with nvidia-cutlass-dsl {version}, whose launch path msa has not "
                           "verified (it may cost ~150-300 us a call); declare graph_capture=True or request it "
                           "by name")
        dedup = uses_dedup(g, problem.layout, problem.query_len, problem.batch_size, platform.sm_count,
                           dedup_wanted(), problem.dcp_size)  # the Triton backend's choice for the step
        # the wgmma kernel, a pass per token, measured faster than the dedup kernel at 80% page overlap
        # and without: fp8 (H200, M3 L = 4: TP1 B = 64 115.7 / 137.2 us against 134.9 / 243.2) and
        # NVFP4 (H100, M3 L = 4, 80%: TP1 B = 64 / 256 127.4 / 470.2 us against 158.3 / 551.7; no
        # overlap 136.0 / 489.0 against 272.1 / 1047.4); the mma kernel leaves such steps to it
        if not requested and dedup and not on_wgmma:
            reasons.append("auto: a multi-token step the triton backend's dedup kernel serves (each page read once; "
                           "faster than this per-token kernel at 80% page overlap)")
        if not requested and platform.capability is not None and platform.capability[0] != 9:
            reasons.append("auto: measured on Hopper (compute capability 9.x) only; request it by name elsewhere")
        if not requested and not reasons:  # (asked by name, `plan` raises the option's error itself)
            try:
                self.config_on(problem, platform)
            except MSAInputError as exc:
                reasons.append(f"auto: its options do not fit this step ({exc})")
        return reasons

    def kernel_for(self, problem: DecodeProblem, platform: Platform) -> str:
        """The kernel a step takes: the one requested, else "wgmma" for the layouts it is the
        default of (`WGMMA_DEFAULT_LAYOUTS`) wherever it serves."""
        if self.kernel is not None:
            return self.kernel
        default = problem.kv_layout in WGMMA_DEFAULT_LAYOUTS
        return "wgmma" if default and wgmma_serves(problem, platform.capability) is None else "mma"

    def config_for(self, problem: DecodeProblem, device: torch.device) -> CuteConfig:
        """The launch configuration of `problem` on `device` (the options given, the measured
        choice for the rest). Raises `MSAInputError` for options the step's kernel cannot take."""
        return self.config_on(problem, detect(device))

    def config_on(self, problem: DecodeProblem, platform: Platform) -> CuteConfig:
        """`config_for` on a described platform (its SM count and compute capability)."""
        sm_count = platform.sm_count
        if self.kernel_for(problem, platform) == "wgmma":
            _check_option("qk_chains", self.qk_chains, "1 (or None) on the wgmma kernel (its scores are one "
                          "product chain; kernel='mma' takes 2 or 4)", self.qk_chains == 1)
            tokens = WGMMA_DEFAULT_TOKENS if self.tokens is None else self.tokens
            why = wgmma_tokens_serve(problem, tokens)
            _check_option("tokens", tokens, f"rows a wgmma program can take together ({why})", why is None)
            shape = choose_wgmma_shape(problem, sm_count, tokens, platform.device_name)
            stages, wgs = self.stages or shape.stages, self.wgs or shape.wgs
            vreg = shape.vreg if self.vreg is None else self.vreg
            tconv = (shape.tconv and self.kreg is not False) if self.tconv is None else self.tconv
            kreg = (shape.kreg or tconv) if self.kreg is None else self.kreg
            lag = WGMMA_LAG if self.lag is None else self.lag
            _check_option("lag", lag, "False (or None) with tokens > 1", not (lag and tokens > 1))
            refill = WGMMA_REFILL_DEFAULT if self.refill is None else self.refill
            self._check_wgmma_shape(problem, stages, wgs, vreg, kreg, tconv, tokens, lag, refill)
            if self.num_splits is not None:
                splits = self.num_splits
            elif (stages, wgs, vreg) == (shape.stages, shape.wgs, shape.vreg):
                splits = shape.num_splits
            else:  # a shape of the caller's: splits that fill its CTA slots once
                splits = choose_wgmma_splits(problem, sm_count, stages, wgs, vreg, tokens)
            fused = WGMMA_FUSED_MERGE if self.fused is None else self.fused
            _check_option("cluster", self.cluster, "False (or None) with fused=False: a cluster is the kernel's own "
                          "merge of the splits", fused or not self.cluster)
            return CuteConfig(num_splits=splits, stages=stages, kernel="wgmma", fused=fused,
                              lag=lag, min_ctas=self.min_ctas or 0, wgs=wgs, vreg=vreg, kreg=kreg, tconv=tconv,
                              tokens=tokens, cluster=wgmma_cluster_default(problem, tokens, wgs, splits)
                              if self.cluster is None else self.cluster,
                              evict=wgmma_evict(problem, sm_count, stages, wgs, vreg, splits, tokens)
                              if self.evict is None else self.evict,
                              refill=refill)
        if problem.kv_layout in WGMMA_ONLY_LAYOUTS:
            raise MSAInputError("kv_cache_dtype", "fp8_e4m3 or nvfp4 for the mma kernel (the wgmma kernel reads "
                                f"{problem.kv_layout} caches, but not this step: {_why_not_wgmma(problem, platform)})",
                                problem.kv_layout)
        for name, asked, default in (("evict", self.evict, WGMMA_EVICT_DEFAULT),
                                     ("refill", self.refill, WGMMA_REFILL_DEFAULT)):
            _check_option(name, asked, f"{default!r} (or None) on the mma kernel (kernel='wgmma' takes the others)",
                          asked == default)
        for name, value in (("fused", self.fused), ("cluster", self.cluster)):
            _check_option(name, value, "False (or None) on the mma kernel (it leaves its splits to the Triton merge "
                          "kernel; kernel='wgmma' merges them itself)", not value)
        # the mma kernel: one warpgroup's warps, a row a program, both operands decoded into f16
        # registers (the exact product), the tile's own maximum: what it is, or refused
        wgmma_only: tuple[tuple[str, object, object], ...] = (
            ("tokens", self.tokens, 1), ("wgs", self.wgs, 1), ("lag", self.lag, False), ("tconv", self.tconv, False),
            ("vreg", self.vreg, True), ("kreg", self.kreg, True))
        for name, given, itself in wgmma_only:
            _check_option(name, given, f"{itself!r} (or None) on the mma kernel, which this step takes "
                          "(kernel='wgmma' takes the others where it serves)", given == itself)
        splits = self.num_splits or choose_splits(problem, sm_count)
        most = max_stages(KINDS[problem.kv_layout])
        _check_option("stages", self.stages, f"at most {most} for the mma kernel on {problem.kv_layout} (its shared "
                      "memory)", (self.stages or 1) <= most)
        stages = self.stages or min(DEFAULT_STAGES, most)
        return CuteConfig(num_splits=splits, stages=stages,
                          qk_chains=self.qk_chains or DEFAULT_QK_CHAINS,
                          min_ctas=choose_min_ctas(problem, sm_count, splits) if self.min_ctas is None
                          else self.min_ctas)

    def strategy(self, problem: DecodeProblem, platform: Platform) -> str | None:
        try:
            c = self.config_on(problem, platform)
        except MSAInputError as exc:
            return f"cannot run this step with these options: {exc}"
        splits = f"{c.num_splits} split{'s' if c.num_splits > 1 else ''}"
        if c.num_splits > 1 and wgmma_cluster(c):
            splits += f" merged in the kernel, a cluster of {c.num_splits} CTAs through distributed shared memory"
        elif c.num_splits > 1:
            splits += " merged in the kernel" if c.fused else " merged by the Triton merge kernel"
        if c.kernel == "mma":
            return f"mma kernel (mma.sync, operands decoded in registers): {splits}, {c.stages} steps in flight"
        wide = problem.kv_layout in WGMMA_ONLY_LAYOUTS
        scores = ("keys converted to f16 on the tensor cores, f16 query (exact product)" if c.tconv
                  else "keys decoded into f16 registers, f16 query (exact product)" if c.kreg
                  else "keys from the ring as stored, the query in terms of their type (exact product)" if wide
                  else "fp8 product of the query's fp8 terms, smallest first (fp8 accumulation, ~4e-4 "
                        "relative error with an f16 query where the exact product holds ~3e-4)")
        values = ("values in registers" if c.vreg else "values from the ring as stored" if wide
                  else "values through an f16 copy in shared memory")
        union = (f"; {c.tokens} rows of a request a program, their selected pages' union walked once"
                 if c.tokens > 1 else "")
        return (f"wgmma kernel (TMA ring + WGMMA, sm_90a): {splits}, {c.stages}-stage ring, {c.wgs} warpgroup"
                f"{'s' if c.wgs > 1 else ''}; scores: {scores}; {values}{union}")

    @staticmethod
    def _check_wgmma_shape(problem: DecodeProblem, stages: int, wgs: int, vreg: bool, kreg: bool,
                           tconv: bool = False, tokens: int = 1, lag: bool = False, refill: str = "top") -> None:
        """Refuse a shape the wgmma kernel cannot run for `problem` (named by the option to change)."""
        kind = WGMMA_KINDS[problem.kv_layout]
        wide = problem.kv_layout in WGMMA_ONLY_LAYOUTS
        for name, flag in (("tconv", tconv), ("vreg", vreg), ("kreg", kreg), ("lag", lag)):
            _check_option(name, flag, f"False (or None) for {problem.kv_layout}: both products read its ring's stages "
                          "as stored", not (flag and wide))
        _check_option("refill", refill, f"'top' (or None) for {problem.kv_layout}: a stage refills once its values' "
                      "product has retired", not (refill == "late" and wide))
        for name, flag, what in (("vreg", vreg, "values"), ("kreg", kreg, "keys")):
            _check_option(name, flag, f"True (or None) for nvfp4: the wgmma kernel decodes its {what} into registers",
                          flag or kind != "nvfp4")
        _check_option("tconv", tconv, "False (or None) for nvfp4: the tensor cores convert fp8 keys only",
                      not tconv or kind != "nvfp4")
        _check_option("kreg", kreg, "True (or None) with tconv: its keys are the f16 product's registers",
                      kreg or not tconv)
        _check_option("stages", stages, "at least 2 for the wgmma kernel (its ring keeps a tile in flight)",
                      stages >= 2)
        q_bytes = wgmma_q_bytes(kind, Q_KINDS[problem.q_dtype], kreg)
        need = wgmma_smem_bytes(kind, stages, wgs, vreg, problem.geometry.page_size,
                                wgmma_heads(problem.geometry.group_size) * tokens, q_bytes, tconv, tokens)
        _check_option("stages", stages, f"few enough for the wgmma kernel's shared memory ({stages} stages x {wgs} "
                      f"warpgroups need {need} bytes; a CTA may have {SM90_SMEM})", need <= SM90_SMEM)

    def plan(self, problem: DecodeProblem, tables: StepTables) -> CutePlan:
        from msa.backends.cute.launch import CuteWorkspace, prepare

        device = tables.seq_lens.device
        config = self.config_for(problem, device)
        kernels = prepare(problem, config, device)
        return CutePlan(problem, config, CuteWorkspace(problem, config, device), tables.rows, kernels)

    def run(self, plan: CutePlan, inputs: DecodeInputs, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        from msa.backends.cute.launch import launch_cute

        launch_cute(plan.problem, inputs, plan.rows, out, lse, plan.config, plan.workspace, plan.kernels)
