"""Adapter for MSA's CUTLASS SM100 kernel library (`fmha_sm100`), driven as vLLM's MiniMax-M3
decode drives it (vLLM 0.33: `vllm/models/minimax_m3/nvidia/msa_cutlass_sparse_decode.py`).

Where the library lives: inside vLLM as `vllm.third_party.fmha_sm100` (its `api` module holds
`fmha_sm100_plan` and `fmha_sm100`); a standalone `fmha_sm100` package is the second place
looked at. There is no `fmha_sm100` distribution on the package index.

- One library plan per step shape (batch, query length, block-table row stride, geometry,
  layout), cached by the planner, planned with `decode_backend="kv_mode3"`: the library's
  default ("auto") attaches a Q8KV4 decode plan for GQA 8/16 whose kernel reads the lengths
  and page offsets of planning time, which an in-place refresh never reaches. kv_mode 3 is the
  CUTLASS kernel with the FP8 or NVFP4 cache reader; it reads the plan buffers below.
- The plan's `kv_page_indptr` is rewritten once so every query row points at its request's
  block-table row (`(r // L) * row_stride`); the library then reads pages through the block
  table viewed flat. (Its last entry, which the sparse kernel never reads, is set to the start of
  the last row so it stays inside the flat view of a table whose rows are strided.)
- Every `plan` (`refresh`) rewrites `kv_segment_lens[r] = seq_lens[b]` and
  `qo_offset[r] = seq_lens[b] - L + i` in the library plan's own buffers, in place, on the device.
- Every `run` rewrites the index lists into a plan-owned token-major buffer
  (`external.TopkCompactor`: device ops into plan buffers), then calls `fmha_sm100` on FP8
  K/V views (a packed cache's halves or a `(k_cache, v_cache)` pair) or NVFP4 head-slot views.

`run` is capturable — it allocates nothing and never synchronises — given host numbers where
the library's C++ binding takes `double`s: `sm_scale`, `q_scale`, and on the FP8 route `k_scale`
and `v_scale`. A one-element tensor given for one of them is read with `float()` (a host
synchronisation) outside capture and refused (`MSAUnsupportedError`) inside it; vLLM passes
floats (`layer._k_scale_float`). On the NVFP4 route `k_scale`/`v_scale` are the global scales,
which the library takes as one-element fp32 device tensors: a python float is written into a
plan-owned tensor (a device fill; a graph captured with it replays that value).

docs/semantics.md §7 rules (vLLM's `should_prepare_decode_metadata`): requested by name or an
NVFP4 cache; compute capability 10.x; fp8/nvfp4 cache; fp8 q; Hq <= 64, Hkv <= 4; D = P = 128;
K = 16; 1 <= L <= 32; B*L*Hq <= 65536; no LSE; uniform query lengths; a batch floor for FP8
caches (`CutlassSM100Backend.min_batch`): 16 requests, except on compute capability 10.3 with
L <= 8 and MiniMax-M3 heads per rank ((64, 4), (32, 2), (16, 1)), where it is
ceil(1024 / (L * Hq)); `VLLM_MINIMAX_M3_MSA_CUTLASS_MIN_BATCH` replaces the rule when set.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import attrs
import torch

from msa.backends.base import Backend
from msa.backends.capabilities import Capabilities
from msa.backends.external import TopkCompactor, host_scalar, import_first, library_version
from msa.errors import MSAUnsupportedError
from msa.planning import RowMetadata, StepTables
from msa.platform import Platform
from msa.problem import DecodeProblem
from msa.validation import DecodeInputs

__all__ = [
    "CutlassSM100Backend",
    "CutlassPlan",
    "LIBRARY_MODULES",
    "MIN_BATCH_ENV",
    "ROW_BUDGET",
]

#: Where `fmha_sm100_plan` and `fmha_sm100` are looked for, in order.
LIBRARY_MODULES = (
    "vllm.third_party.fmha_sm100.api",
    "vllm.third_party.fmha_sm100",
    "fmha_sm100.api",
    "fmha_sm100",
)
#: The library's limit on query-head rows per plan (`B * L * Hq`; an assert in its planner).
ROW_BUDGET = 65536
#: vLLM's override of the FP8 batch floor (an int; replaces the rule on every device).
MIN_BATCH_ENV = "VLLM_MINIMAX_M3_MSA_CUTLASS_MIN_BATCH"
_DEFAULT_MIN_BATCH = 16
#: vLLM's rule on compute capability 10.3 (B300) for short speculative steps: CUTLASS once
#: B * L * Hq >= 1024 query-head rows, for MiniMax-M3's heads per rank.
_SM103_ROWS = 1024
_SM103_MAX_QUERY_LEN = 8
_SM103_HEADS = frozenset({(64, 4), (32, 2), (16, 1)})
_DOUBLE = "the library's C++ binding takes a double"


@attrs.define(eq=False)
class CutlassPlan:
    """A cached library plan and the buffers msa owns beside it.

    Attributes:
        problem: the step shape it serves (the planner's plan key holds the same).
        library_plan: what `fmha_sm100_plan` returned (passed back to `fmha_sm100`).
        decode: the library plan's decode dictionary (`kv_page_indptr`, `kv_segment_lens`,
            `qo_offset`, ...), whose buffers msa rewrites in place.
        rows: the per-row metadata views onto `decode`'s buffers.
        compactor: rewrites the index lists into `topk` (its buffers allocated here).
        topk: int32 `[B*L, Hkv, K]` token-major index lists (rewritten every run).
        out: bf16 `[B*L, Hq, D]` staging output for callers whose `out` is not contiguous.
        global_scales: fp32 `[2]`: the NVFP4 global scales when the caller passes floats.
    """

    problem: DecodeProblem
    library_plan: Any
    decode: dict[str, Any]
    rows: RowMetadata
    compactor: TopkCompactor
    topk: torch.Tensor
    out: torch.Tensor
    global_scales: torch.Tensor


class CutlassSM100Backend(Backend[CutlassPlan]):
    """MSA's `fmha_sm100` kernels (Blackwell, compute capability 10.x), FP8 and NVFP4 caches."""

    name = "cutlass_sm100"
    description = "MSA's CUTLASS fmha_sm100 kernels, from vLLM (SM100 family; fp8 q; fp8/nvfp4 cache)"
    capabilities = Capabilities(
        device_types=frozenset({"cuda"}),
        # vLLM gates the route on the 10.x family; the kernels are built for sm_100a, sm_103a
        # and the family target sm_100f
        capability_families=frozenset({10}),
        packages=("fmha_sm100",),
        kv_layouts=frozenset({"fp8_e4m3", "nvfp4"}),
        auto_layouts=frozenset({"nvfp4"}),
        q_dtypes=frozenset({torch.float8_e4m3fn}),
        head_dims=frozenset({128}),
        page_sizes=frozenset({128}),
        topks=frozenset({16}),
        max_q_heads=64,
        max_kv_heads=4,
        query_lens=(1, 32),
        max_rows=ROW_BUDGET,
        lse=False,
    )

    def version(self) -> str:
        return library_version("vllm", "fmha_sm100", "fmha-sm100")

    @staticmethod
    def min_batch(problem: DecodeProblem, platform: Platform) -> tuple[int, str]:
        """vLLM's batch floor for an FP8 cache (NVFP4 has none), and where it comes from.

        Returns:
            `(floor, source)`, or `(-1, message)` when the environment override is not an int.
        """
        override = os.environ.get(MIN_BATCH_ENV)
        if override is not None:
            try:
                return int(override), f"{MIN_BATCH_ENV}={override}"
            except ValueError:
                return -1, f"{MIN_BATCH_ENV}={override!r} is not an int"
        g, length = problem.geometry, problem.query_len
        if (
            platform.capability == (10, 3)
            and 1 <= length <= _SM103_MAX_QUERY_LEN
            and (g.num_q_heads, g.num_kv_heads) in _SM103_HEADS
        ):
            rows = length * g.num_q_heads
            return -(-_SM103_ROWS // rows), f"ceil({_SM103_ROWS} / (L*Hq)) on compute capability 10.3"
        return _DEFAULT_MIN_BATCH, ""

    def extra_reasons(
        self, problem: DecodeProblem, platform: Platform, *, requested: bool = False
    ) -> list[str]:
        reasons = []
        if problem.batch_size < 1:
            reasons.append("needs at least one request")
        if problem.kv_layout != "nvfp4":
            floor, source = self.min_batch(problem, platform)
            if floor < 0:
                reasons.append(source)
            elif problem.batch_size < floor:
                why = f", {source}" if source else ""
                reasons.append(
                    f"needs a batch of >= {floor} requests (unless the cache is nvfp4{why}), "
                    f"got {problem.batch_size}"
                )
        return reasons

    def _library(self) -> ModuleType:
        return import_first(self.name, LIBRARY_MODULES, ("fmha_sm100_plan", "fmha_sm100"))

    def plan(self, problem: DecodeProblem, tables: StepTables) -> CutlassPlan:
        """A library plan for this shape (the planner caches it) with msa's buffers beside it."""
        device = tables.seq_lens.device
        g = problem.geometry
        lib = self._library()
        b, length, stride = problem.batch_size, problem.query_len, problem.table_stride
        rows = b * length
        qo_lens = torch.full((b,), length, dtype=torch.int32)
        # Read once, when the shape is first planned: the kv_mode-3 schedule depends on the
        # shape alone (every row is planned for K * P tokens); later steps only refresh the
        # lengths and offsets in place.
        kv_lens = tables.seq_lens_cpu if tables.seq_lens_cpu is not None else tables.seq_lens.to("cpu")
        library_plan = lib.fmha_sm100_plan(
            qo_lens,
            kv_lens,
            g.num_q_heads,
            num_kv_heads=g.num_kv_heads,
            qo_offset=kv_lens - qo_lens,
            page_size=g.page_size,
            output_maxscore=False,
            kv_block_num=g.topk,
            causal=True,
            sparse_kernel_mode="decode",
            use_fp8_kvcache=True,
            split_prefill_decode=False,
            device=device,
            decode_backend="kv_mode3",
        )
        decode: dict[str, Any] = library_plan[3]
        # row r reads its request's block-table row; the closing entry (unread by the sparse
        # kernel) is the last row's start, inside the flat table view whatever the row stride
        starts = torch.arange(rows + 1, device=device, dtype=torch.int32) // length * stride
        starts[-1] = (b - 1) * stride
        decode["kv_page_indptr"].copy_(starts)
        row_meta = RowMetadata.for_problem(
            problem, device, kv_lens=decode["kv_segment_lens"], q_pos=decode["qo_offset"]
        )
        topk = torch.empty((rows, g.num_kv_heads, g.topk), dtype=torch.int32, device=device)
        plan = CutlassPlan(
            problem=problem,
            library_plan=library_plan,
            decode=decode,
            rows=row_meta,
            compactor=TopkCompactor(problem, row_meta, device),
            topk=topk,
            out=torch.empty((rows, g.num_q_heads, g.head_dim), dtype=torch.bfloat16, device=device),
            global_scales=torch.ones(2, dtype=torch.float32, device=device),
        )
        self.refresh(plan, tables)
        return plan

    def refresh(self, plan: CutlassPlan, tables: StepTables) -> None:
        """Rewrite the library plan's `kv_segment_lens` and `qo_offset` from `seq_lens`, in place."""
        plan.rows.refresh(tables.seq_lens)

    def run(
        self, plan: CutlassPlan, inputs: DecodeInputs, out: torch.Tensor, lse: torch.Tensor | None
    ) -> None:
        p, problem = plan, plan.problem
        device = inputs.q.device
        if not inputs.q.is_contiguous():
            # the kernel addresses a GQA-packed q with compact strides
            raise MSAUnsupportedError(
                f"backend {self.name!r} needs a contiguous q, got strides {inputs.q.stride()}"
            )
        lib = self._library()
        p.compactor.compact(inputs, p.topk.transpose(0, 1))
        layout = problem.layout
        k, v = layout.kv_views(inputs.kv_cache)
        k_scale: Any
        v_scale: Any
        if layout.block_scaled:
            k_scale = self._global_scale(p.global_scales[0:1], inputs.k_scale)
            v_scale = self._global_scale(p.global_scales[1:2], inputs.v_scale)
        else:
            k_scale = host_scalar(self.name, "k_scale", inputs.k_scale, device, _DOUBLE)
            v_scale = host_scalar(self.name, "v_scale", inputs.v_scale, device, _DOUBLE)
        table = inputs.block_table
        flat_table = table.as_strided(((problem.batch_size - 1) * table.stride(0) + table.shape[1],), (1,))
        target = out if out.is_contiguous() else p.out
        lib.fmha_sm100(
            inputs.q,
            k,
            v,
            p.library_plan,
            kv_indices=flat_table,
            kv_block_indexes=p.topk,
            out=target,
            output_maxscore=False,
            output_o=True,
            sm_scale=host_scalar(self.name, "sm_scale", inputs.sm_scale, device, _DOUBLE),
            q_scale=host_scalar(self.name, "q_scale", inputs.q_scale, device, _DOUBLE),
            k_scale=k_scale,
            v_scale=v_scale,
            o_scale=1.0,
        )
        if target is not out:
            out.copy_(target)

    @staticmethod
    def _global_scale(buffer: torch.Tensor, value: float | torch.Tensor) -> torch.Tensor:
        """An NVFP4 global scale as the one-element fp32 device tensor the library reads."""
        if isinstance(value, torch.Tensor):
            return value.reshape(1)
        return buffer.fill_(value)
