"""Adapter for FlashInfer's MSA sparse decode (`flashinfer.msa_ops.msa_sparse_decode_attention`,
FlashInfer 0.7.2.post1): FP8 queries and FP8 caches, GQA groups up to 16, natural-log LSE.

What the library takes, and how the adapter meets it:

- Compute capability 10.0 / 10.3 (its dense SM100 programs refuse 10.7) and 12.0 / 12.1.
- K and V: on 10.x, two separate contiguous `[pages, Hkv, 128, 128]` tensors — views split from
  one packed `[pages, Hkv, P, 2D]` cache are rejected, and the adapter copies no cache: it reads
  a `(k_cache, v_cache)` pair of contiguous tensors (`layout.allocate(..., separate=True)`)
  and refuses a packed cache (a reason in `msa explain`, `MSAUnsupportedError` in `run`). On
  12.x the library also reads the two halves of one compact packed cache.
- Scales: `k_scale` / `v_scale` of the library are NVFP4 block scales only (any value raises on
  the FP8 route), so msa's per-tensor scales go elsewhere: `k_scale` is folded into
  `softmax_scale` (with `sm_scale * q_scale`) and `v_scale` is `v_global_scale`. All are host
  numbers: a tensor scale is read with `float()`.
- `page_table` and `seqused_k` must be contiguous: a block table with a row stride wider than
  its rows (which msa allows) is copied into a plan-owned `[B, row_stride]` buffer, and
  likewise strided lengths; a non-contiguous `q` is refused.
- `out=`: the 10.x routes write the caller's contiguous bf16 `out` in place (a plan-owned
  staging buffer when it is strided); the 12.x route takes no `out` and returns its own tensor,
  which is copied.
- Index lists: rewritten every run into a plan-owned head-major buffer (ascending, `-1` at the
  tail, docs/semantics.md §3-skipped entries removed; `external.TopkCompactor`).

Not capturable (`Capabilities.uncapturable`): the library's CUDA-graph workspace serves exactly
one captured invocation — warmed eagerly with that invocation's exact tensors, bound to one
stream, latched after its capture — while an msa plan serves every layer of its step shape.
Without a workspace the library refuses capture and allocates its LSE buffer (on 12.x its
outputs too) on every call. So `run` is eager only: it raises `MSAUnsupportedError` while the
stream is capturing, and the policy refuses the backend for steps declared `graph_capture`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import attrs
import torch

from msa.backends.base import Backend
from msa.backends.capabilities import Capabilities
from msa.backends.external import (
    TopkCompactor,
    host_scalar,
    import_first,
    library_version,
    stream_capturing,
)
from msa.errors import MSAUnsupportedError
from msa.planning import StepTables
from msa.platform import Platform
from msa.problem import DecodeProblem
from msa.validation import DecodeInputs

__all__ = ["FlashInferBackend", "FlashInferPlan", "LIBRARY_MODULES", "UNCAPTURABLE"]

LIBRARY_MODULES = ("flashinfer.msa_ops",)
UNCAPTURABLE = (
    "FlashInfer's graph workspace serves one captured call, warmed with that call's exact tensors, "
    "while an msa plan serves every layer of its step shape; without one the library allocates on "
    "every call"
)
_PAIR_NEEDED = (
    "on compute capability 10.x it reads separate contiguous K and V caches: pass a (k_cache, v_cache) "
    "pair of contiguous tensors (layout.allocate(..., separate=True)), not {form} (the library copies "
    "no cache)"
)
_CONTIGUOUS_NEEDED = (
    "reads contiguous caches (one compact packed tensor, or a (k_cache, v_cache) pair), not strided views"
)
_FLOAT = "the library takes python floats"


@attrs.define(eq=False)
class FlashInferPlan:
    """The buffers one step shape needs.

    Attributes:
        problem: the step shape it serves.
        packed_views: the device takes the library's 12.x route (reads packed caches, takes no
            `out=`), else the 10.x route.
        compactor: rewrites the index lists into `indices`.
        indices: int32 `[Hkv, B*L, K]`, contiguous (the library's `q2k_indices`).
        table: int32 `[B, row_stride]` staging for block tables whose rows are strided.
        seq_lens: int32 `[B]` staging for strided lengths.
        out: bf16 `[B*L, Hq, D]` staging output for callers whose `out` is strided (10.x).
    """

    problem: DecodeProblem
    packed_views: bool
    compactor: TopkCompactor
    indices: torch.Tensor
    table: torch.Tensor
    seq_lens: torch.Tensor
    out: torch.Tensor


class FlashInferBackend(Backend[FlashInferPlan]):
    """FlashInfer `msa_ops` sparse decode (compute capability 10.0/10.3/12.0/12.1, FP8)."""

    name = "flashinfer"
    description = "FlashInfer msa_ops sparse decode (sm_100/103/120/121; fp8 q and cache; LSE; eager only)"
    capabilities = Capabilities(
        device_types=frozenset({"cuda"}),
        compute_capabilities=frozenset({(10, 0), (10, 3), (12, 0), (12, 1)}),
        packages=("flashinfer",),
        kv_layouts=frozenset({"fp8_e4m3"}),
        q_dtypes=frozenset({torch.float8_e4m3fn}),
        head_dims=frozenset({128}),
        page_sizes=frozenset({128}),
        topks=frozenset({16}),
        max_group=16,
        query_lens=(1, 32),
        lse=True,
        uncapturable=UNCAPTURABLE,
    )

    def version(self) -> str:
        return library_version("flashinfer-python", "flashinfer")

    @staticmethod
    def form_reason(kv_form: str, capability_major: int | None) -> str | None:
        """Why the library cannot read a cache of form `kv_form` on a device of this compute
        capability major (None: it can, or the machine is refused anyway)."""
        if capability_major == 10 and kv_form != "separate":
            return _PAIR_NEEDED.format(form="a packed cache" if kv_form == "packed" else "strided views")
        if capability_major == 12 and kv_form == "strided":
            return _CONTIGUOUS_NEEDED
        return None

    def extra_reasons(
        self, problem: DecodeProblem, platform: Platform, *, requested: bool = False
    ) -> list[str]:
        major = platform.capability[0] if platform.capability is not None else None
        reason = self.form_reason(problem.kv_form, major)
        return [reason] if reason else []

    def _library(self) -> ModuleType:
        return import_first(self.name, LIBRARY_MODULES, ("msa_sparse_decode_attention", "supports_packed_kv"))

    def plan(self, problem: DecodeProblem, tables: StepTables) -> FlashInferPlan:
        g = problem.geometry
        device = tables.seq_lens.device
        lib = self._library()
        rows = problem.num_rows
        return FlashInferPlan(
            problem=problem,
            packed_views=bool(lib.supports_packed_kv(device)),
            compactor=TopkCompactor(problem, tables.rows, device),
            indices=torch.empty((g.num_kv_heads, rows, g.topk), dtype=torch.int32, device=device),
            table=torch.zeros((problem.batch_size, problem.table_stride), dtype=torch.int32, device=device),
            seq_lens=torch.zeros((problem.batch_size,), dtype=torch.int32, device=device),
            out=torch.empty((rows, g.num_q_heads, g.head_dim), dtype=torch.bfloat16, device=device),
        )

    def run(
        self, plan: FlashInferPlan, inputs: DecodeInputs, out: torch.Tensor, lse: torch.Tensor | None
    ) -> None:
        p = plan
        q = inputs.q
        if stream_capturing(q.device):
            raise MSAUnsupportedError(f"backend {self.name!r} cannot run inside CUDA-graph capture: {UNCAPTURABLE}")
        if not q.is_contiguous():
            raise MSAUnsupportedError(f"backend {self.name!r} needs a contiguous q, got strides {q.stride()}")
        form = inputs.problem.kv_form
        reason = self.form_reason(form, 12 if p.packed_views else 10)
        if reason is not None:
            raise MSAUnsupportedError(f"backend {self.name!r} cannot read this cache: {reason}")
        lib = self._library()
        p.compactor.compact(inputs, p.indices)
        k, v = p.problem.layout.kv_views(inputs.kv_cache)
        table = inputs.block_table
        if not table.is_contiguous():
            p.table[:, : table.shape[1]].copy_(table)
            table = p.table
        seq_lens = inputs.seq_lens
        if not seq_lens.is_contiguous():
            seq_lens = p.seq_lens.copy_(seq_lens)
        device = q.device
        scale = 1.0
        for name in ("sm_scale", "q_scale", "k_scale"):
            scale *= host_scalar(self.name, name, getattr(inputs, name), device, _FLOAT)
        options: dict[str, Any] = {
            "page_table": table,
            "seqused_k": seq_lens,
            "seqlen_q": p.problem.query_len,
            "causal": True,
            "softmax_scale": scale,
            "return_softmax_lse": lse is not None,
            "v_global_scale": host_scalar(self.name, "v_scale", inputs.v_scale, device, _FLOAT),
            "force_fused": True,
        }
        if not p.packed_views:  # the 10.x routes write into `out`
            options["out"] = out if out.is_contiguous() else p.out
        result = lib.msa_sparse_decode_attention(q, k, v, p.indices, **options)
        if lse is not None:
            result, result_lse = result
            lse.copy_(result_lse)
        if result is not out:
            out.copy_(result)
