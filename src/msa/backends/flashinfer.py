"""Adapter for FlashInfer's MSA sparse decode (`flashinfer.msa_ops.msa_sparse_decode_attention`):
FP8 queries and FP8 split caches on the SM100 family, GQA groups up to 16, natural-log LSE.

Per step shape a plan holds the library's graph workspace (`MSASparseAttentionWorkspace`) and a
head-major index buffer; every run rewrites the index lists there in the form the library
expects (ascending, `-1` padding at the tail, docs/semantics.md §3-skipped entries removed).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import attrs
import torch

from msa.backends.base import Backend
from msa.backends.capabilities import Capabilities
from msa.backends.external import host_float, import_library, library_version
from msa.planning import StepTables, compact_topk
from msa.problem import DecodeProblem
from msa.validation import DecodeInputs

__all__ = ["FlashInferBackend", "FlashInferPlan", "LIBRARY"]

LIBRARY = "flashinfer.msa_ops"


@attrs.define(eq=False)
class FlashInferPlan:
    """Attributes: `problem` (the step shape it serves), `workspace` (the library's graph
    workspace, or None where the library has none), `indices` int32 `[Hkv, B*L, K]`."""

    problem: DecodeProblem
    workspace: Any
    indices: torch.Tensor


class FlashInferBackend(Backend[FlashInferPlan]):
    """FlashInfer `msa_ops` sparse decode (SM100 family, FP8)."""

    name = "flashinfer"
    description = "FlashInfer msa_ops sparse decode (SM100 family; fp8 q and cache; LSE)"
    capabilities = Capabilities(
        device_types=frozenset({"cuda"}),
        capability_families=frozenset({10}),
        packages=("flashinfer",),
        kv_layouts=frozenset({"fp8_e4m3"}),
        q_dtypes=frozenset({torch.float8_e4m3fn}),
        head_dims=frozenset({128}),
        page_sizes=frozenset({128}),
        topks=frozenset({16}),
        max_group=16,
        query_lens=(1, 8),
        lse=True,
    )

    def version(self) -> str:
        return library_version("flashinfer-python") or library_version("flashinfer")

    def _library(self) -> ModuleType:
        return import_library(self.name, LIBRARY)

    def plan(self, problem: DecodeProblem, tables: StepTables) -> FlashInferPlan:
        g = problem.geometry
        device = tables.seq_lens.device
        lib = self._library()
        factory = getattr(lib, "MSASparseAttentionWorkspace", None)
        return FlashInferPlan(
            problem=problem,
            workspace=factory(device) if factory is not None else None,
            indices=torch.empty((g.num_kv_heads, problem.num_rows, g.topk), dtype=torch.int32, device=device),
        )

    def run(
        self, plan: FlashInferPlan, inputs: DecodeInputs, out: torch.Tensor, lse: torch.Tensor | None
    ) -> None:
        p = plan
        length = p.problem.query_len
        lib = self._library()
        compact_topk(inputs, p.indices)
        k, v = p.problem.layout.kv_views(inputs.kv_cache)
        result = lib.msa_sparse_decode_attention(
            inputs.q,
            k,
            v,
            p.indices,
            page_table=inputs.block_table,
            seqused_k=inputs.seq_lens,
            seqlen_q=length,
            causal=True,
            softmax_scale=host_float(inputs.sm_scale) * host_float(inputs.q_scale),
            return_softmax_lse=lse is not None,
            k_scale=inputs.k_scale,
            v_scale=inputs.v_scale,
            force_fused=True,
            workspace=p.workspace,
        )
        if lse is not None:
            result_out, result_lse = result
            lse.copy_(result_lse)
        else:
            result_out = result
        out.copy_(result_out)
