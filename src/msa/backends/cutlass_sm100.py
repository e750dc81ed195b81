"""Adapter for MSA's CUTLASS SM100 kernel library (`fmha_sm100`), driven as vLLM's MiniMax-M3
adapter drives it.

- One library plan per step shape (batch, query length, block-table row stride, Hq, Hkv, page
  size, top-k, layout), cached by the planner. Its `kv_page_indptr` is rewritten once so every query row points
  at its request's block-table row (`(r // L) * row_stride`); the library then reads pages through
  the flattened block table.
- Every `plan` (`refresh`) rewrites `kv_segment_lens[r] = seq_lens[b]` and `qo_offset[r] = seq_lens[b] - L + i`
  in the library plan's own buffers, in place, on the device.
- Every `run` rewrites the index lists into a plan-owned token-major buffer, ascending with `-1`
  padding at the tail and every docs/semantics.md §3-skipped entry removed (the library expects that form),
  then calls `fmha_sm100` on FP8 split K/V views or NVFP4 head-slot views.

docs/semantics.md §7 rules: requested by name or an NVFP4 cache; compute capability 10.x; fp8/nvfp4 cache;
Hq <= 64, Hkv <= 4; P = 128; K = 16; 1 <= L <= 32; B >= 16 unless NVFP4; B*L*Hq <= 65536.
The library takes fp8 queries only and returns no LSE.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import attrs
import torch

from msa.backends.base import Backend
from msa.backends.capabilities import Capabilities
from msa.backends.external import host_float, import_library, library_version
from msa.planning import RowMetadata, StepTables, compact_topk
from msa.platform import Platform
from msa.problem import DecodeProblem
from msa.validation import DecodeInputs

__all__ = ["CutlassSM100Backend", "CutlassPlan", "LIBRARY", "ROW_BUDGET"]

LIBRARY = "fmha_sm100"
#: The library's limit on query-head rows per plan (`B * L * Hq`).
ROW_BUDGET = 65536


@attrs.define(eq=False)
class CutlassPlan:
    """A cached library plan and the buffers msa owns beside it.

    Attributes:
        problem: the step shape it serves (the planner's plan key holds the same).
        library_plan: what `fmha_sm100_plan` returned (passed back to `fmha_sm100`).
        decode: the library plan's decode dictionary (`kv_page_indptr`, `kv_segment_lens`,
            `qo_offset`, ...), whose buffers msa rewrites in place.
        rows: the per-row metadata views onto `decode`'s buffers.
        topk: int32 `[B*L, Hkv, K]` token-major index lists (rewritten every run).
        out: bf16 `[B*L, Hq, D]` staging output for callers whose `out` is not contiguous.
    """

    problem: DecodeProblem
    library_plan: Any
    decode: dict[str, Any]
    rows: RowMetadata
    topk: torch.Tensor
    out: torch.Tensor


class CutlassSM100Backend(Backend[CutlassPlan]):
    """MSA's `fmha_sm100` kernels (Blackwell, compute capability 10.x), FP8 and NVFP4 caches."""

    name = "cutlass_sm100"
    description = "MSA's CUTLASS fmha_sm100 kernels (SM100 family; fp8 q; fp8/nvfp4 cache)"
    capabilities = Capabilities(
        device_types=frozenset({"cuda"}),
        capability_families=frozenset({10}),
        packages=(LIBRARY,),
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
        min_batch=16,
        min_batch_exempt_layouts=frozenset({"nvfp4"}),
        lse=False,
    )

    def version(self) -> str:
        return library_version(LIBRARY)

    def extra_reasons(
        self, problem: DecodeProblem, platform: Platform, *, requested: bool = False
    ) -> list[str]:
        if problem.kv_layout == "nvfp4" and problem.geometry.group_size not in (8, 16):
            return [f"the NVFP4 route needs a GQA group of 8 or 16, got {problem.geometry.group_size}"]
        return []

    def _library(self) -> ModuleType:
        return import_library(self.name, LIBRARY)

    def plan(self, problem: DecodeProblem, tables: StepTables) -> CutlassPlan:
        """A library plan for this shape (the planner caches it) with msa's buffers beside it."""
        device = tables.seq_lens.device
        g = problem.geometry
        lib = self._library()
        b, length, stride = problem.batch_size, problem.query_len, problem.table_stride
        rows = b * length
        qo_lens = torch.full((b,), length, dtype=torch.int32)
        # Read once, when the shape is first planned: the library schedules every row for
        # top-k * P tokens, so later steps only refresh lengths and offsets in place.
        kv_lens = tables.seq_lens_cpu if tables.seq_lens_cpu is not None else tables.seq_lens.to("cpu")
        extra = {"kv_dtype": "nvfp4"} if problem.layout.block_scaled else {}
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
            use_fp8_kvcache=not problem.layout.block_scaled,
            split_prefill_decode=False,
            device=device,
            **extra,
        )
        decode: dict[str, Any] = library_plan[3]
        # row r reads its request's block-table row; the last entry closes row R-1: B * stride
        starts = torch.arange(rows + 1, device=device, dtype=torch.int32) // length * stride
        decode["kv_page_indptr"].copy_(starts)
        plan = CutlassPlan(
            problem=problem,
            library_plan=library_plan,
            decode=decode,
            rows=RowMetadata.for_problem(
                problem, device, kv_lens=decode["kv_segment_lens"], q_pos=decode["qo_offset"]
            ),
            topk=torch.empty((rows, g.num_kv_heads, g.topk), dtype=torch.int32, device=device),
            out=torch.empty((rows, g.num_q_heads, g.head_dim), dtype=torch.bfloat16, device=device),
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
        lib = self._library()
        compact_topk(inputs, p.topk.transpose(0, 1))
        layout = problem.layout
        k, v = layout.kv_views(inputs.kv_cache)
        if layout.block_scaled:
            k_scale: Any = inputs.k_scale
            v_scale: Any = inputs.v_scale
        else:
            k_scale, v_scale = host_float(inputs.k_scale), host_float(inputs.v_scale)
        table = inputs.block_table
        flat_table = table.as_strided(((problem.batch_size - 1) * problem.table_stride + table.shape[1],), (1,))
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
            sm_scale=host_float(inputs.sm_scale),
            q_scale=host_float(inputs.q_scale),
            k_scale=k_scale,
            v_scale=v_scale,
            o_scale=1.0,
        )
        if target is not out:
            out.copy_(target)
