"""An output-only stand-in for MSA's `fmha_sm100` (the API shape of vLLM 0.33's
`vllm.third_party.fmha_sm100.api`), found as the standalone `fmha_sm100` package. It records its
calls and computes what the kernel would from the arguments it is given (the plan's per-row
lengths, offsets and page pointers, the token-major lists, the flat block table); it validates
nothing — tests/conformance runs the real library's code."""

from __future__ import annotations

from typing import Any

import torch
from fake_attend import attend

from msa.layouts import NVFP4

PLAN_CALLS: list[dict[str, Any]] = []
RUN_CALLS: list[dict[str, Any]] = []


def fmha_sm100_plan(qo_segment_lens: torch.Tensor, kv_segment_lens: torch.Tensor, num_qo_heads: int, **options: Any) -> Any:
    rows = int(qo_segment_lens.sum())
    device = options["device"]
    decode = {
        "kv_page_indptr": torch.zeros(rows + 1, dtype=torch.int32, device=device),
        "kv_segment_lens": torch.zeros(rows, dtype=torch.int32, device=device),
        "qo_offset": torch.zeros(rows, dtype=torch.int32, device=device),
    }
    PLAN_CALLS.append(dict(options, num_qo_heads=num_qo_heads))
    return (False, 0, qo_segment_lens.shape[0], decode, None)


def fmha_sm100(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any, **kw: Any) -> Any:
    decode = plan[3]
    rows, _, _ = q.shape
    pages, hkv, p, _ = k.shape
    table, ids, out = kw["kv_indices"], kw["kv_block_indexes"], kw["out"]
    indptr, kv_lens, q_pos = decode["kv_page_indptr"], decode["kv_segment_lens"], decode["qo_offset"]
    spec = []
    for r in range(rows):
        n = min(int(q_pos[r]) + 1, int(kv_lens[r]))  # causal, within the segment
        per_head = []
        for h in range(hkv):
            blocks = [j for j in ids[r, h].tolist() if j >= 0]
            per_head.append((blocks, [int(table[int(indptr[r]) + j]) for j in blocks], n))
        spec.append(per_head)
    nvfp4 = k.dtype == torch.uint8

    def dequant(page_ids: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        if nvfp4:
            slots = torch.stack((k[page_ids, h], v[page_ids, h]), dim=1)  # [n, 2, P, W]: K, V slots
            return NVFP4.gather(slots, torch.arange(len(page_ids)), torch.zeros(1, dtype=torch.long),
                                k_scale=kw["k_scale"], v_scale=kw["v_scale"])
        return k[page_ids, h].float() * kw["k_scale"], v[page_ids, h].float() * kw["v_scale"]

    result, _ = attend(q.float(), kw["sm_scale"] * kw["q_scale"], dequant, spec, hkv)
    out.copy_(result.to(out.dtype))
    RUN_CALLS.append(dict(kw, q=q, k=k, v=v, plan=plan))
    return out, None
