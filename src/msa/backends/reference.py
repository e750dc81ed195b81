"""The reference backend: docs/semantics.md §3 in float32 torch, on any device. The oracle every kernel is
checked against — written for clarity, vectorized over rows, chunked to bound memory."""

from __future__ import annotations

import torch

from msa.backends.base import Backend
from msa.backends.capabilities import Capabilities
from msa.planning import StepTables, resolve_entries
from msa.problem import DecodeProblem
from msa.scales import Scale, scale_tensor
from msa.semantics import INT32_MAX
from msa.validation import DecodeInputs

__all__ = ["ReferenceBackend", "CHUNK_BYTES"]

#: Upper bound on the dequantized K and V held at once (bytes); rows are processed in chunks.
CHUNK_BYTES = 512 * 2**20


def _product(a: Scale, b: Scale, device: torch.device) -> Scale:
    """a * b, staying a python float when both are (no host-to-device copy: capturable)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return scale_tensor(a, device) * scale_tensor(b, device)
    return a * b


class ReferenceBackend(Backend[DecodeProblem]):
    """float32 torch on any device: every layout, geometry, query length and LSE."""

    name = "reference"
    description = "docs/semantics.md §3 in float32 torch on any device (the oracle; slow)"
    capabilities = Capabilities(
        q_dtypes=frozenset({torch.bfloat16, torch.float16, torch.float8_e4m3fn}),
        query_lens=(1, INT32_MAX),
        lse=True,
        ragged=True,
    )

    def plan(self, problem: DecodeProblem, tables: StepTables) -> DecodeProblem:
        return problem

    def run(
        self,
        plan: DecodeProblem,
        inputs: DecodeInputs,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        problem = plan
        g = problem.geometry
        hkv, group, p, d = g.num_kv_heads, g.group_size, g.page_size, g.head_dim
        device = inputs.q.device
        used, block, page, visible = resolve_entries(inputs)
        # used entries first, in list order: where skipped entries sit in a list (-1 at the front,
        # middle or tail) then cannot change the order of the sums, so the result is bit-identical
        order = torch.argsort((~used).to(torch.int8), dim=-1, stable=True)
        used, block, page = (t.gather(-1, order) for t in (used, block, page))
        score_scale = _product(inputs.sm_scale, inputs.q_scale, device)
        q = inputs.q.float().view(-1, hkv, group, d).transpose(0, 1)  # [Hkv, R, G, D]
        heads = torch.arange(hkv, device=device).view(hkv, 1, 1)
        offsets = torch.arange(p, device=device)
        per_row = 2 * hkv * g.topk * p * d * 4
        step = max(1, CHUNK_BYTES // per_row)
        for r0 in range(0, problem.num_rows, step):
            r1 = min(r0 + step, problem.num_rows)
            keys, values = inputs.layout.gather(
                inputs.kv_cache,
                page[:, r0:r1],
                heads,
                k_scale=inputs.k_scale,
                v_scale=inputs.v_scale,
            )  # [Hkv, rc, K, P, D]
            token = block[:, r0:r1, :, None] * p + offsets  # [Hkv, rc, K, P]
            valid = (used[:, r0:r1, :, None] & (token < visible[r0:r1].view(1, -1, 1, 1))).unsqueeze(-1)
            # Tokens docs/semantics.md §3 does not read (skipped entries, the tail of a partly visible page)
            # were gathered too (from page 0, or past the row's length): zero them before any
            # arithmetic, so whatever those bytes hold (NaN, Inf) cannot reach the result.
            keys = torch.where(valid, keys, 0.0)
            values = torch.where(valid, values, 0.0)
            scores = torch.einsum("hrgd,hrkpd->hrgkp", q[:, r0:r1], keys) * score_scale
            scores = scores.masked_fill(~valid.squeeze(-1).unsqueeze(2), float("-inf")).flatten(-2)
            row_lse = torch.logsumexp(scores, dim=-1)  # [Hkv, rc, G]; -inf for empty rows
            shift = torch.where(torch.isfinite(row_lse), row_lse, 0.0)
            probs = torch.exp(scores - shift.unsqueeze(-1))  # exp(-inf) = 0 for skipped tokens
            o = torch.einsum("hrgt,hrtd->hrgd", probs, values.flatten(2, 3))
            out[r0:r1] = o.permute(1, 0, 2, 3).reshape(r1 - r0, g.num_q_heads, d).to(out.dtype)
            if lse is not None:
                lse[r0:r1] = row_lse.permute(1, 0, 2).reshape(r1 - r0, g.num_q_heads)
