"""A fake of FlashInfer's `msa_ops` sparse decode: checks the adapter's calls, computes from them."""

from __future__ import annotations

from typing import Any

import torch
from fake_attend import attend, check, check_lists

CALLS: list[dict[str, Any]] = []


class MSASparseAttentionWorkspace:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.used_with: tuple[Any, ...] | None = None


def msa_sparse_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q2k_indices: torch.Tensor, **kw: Any) -> Any:
    rows, hq, d = q.shape
    pages, hkv, p, dk = k.shape
    check(q.dtype == torch.float8_e4m3fn and k.dtype == v.dtype == torch.float8_e4m3fn, "fp8 q/k/v")
    check(p == 128 and dk == d == 128 and hq // hkv <= 16, "geometry")
    check(k.stride() == (hkv * p * 2 * d, p * 2 * d, 2 * d, 1) and v.data_ptr() - k.data_ptr() == d, "split views")
    check(q2k_indices.dtype == torch.int32 and q2k_indices.is_contiguous(), "q2k_indices contiguous int32")
    check(q2k_indices.shape == (hkv, rows, 16), f"q2k_indices shape {tuple(q2k_indices.shape)}")
    check_lists(q2k_indices, "q2k_indices")
    table, lens, length = kw["page_table"], kw["seqused_k"], kw["seqlen_q"]
    check(table.dtype == torch.int32 and lens.dtype == torch.int32, "page_table/seqused_k int32")
    check(rows == lens.shape[0] * length and 1 <= length <= 8, "seqlen_q")
    check(kw["causal"] is True and kw["force_fused"] is True, "causal, force_fused")
    ws = kw["workspace"]
    check(isinstance(ws, MSASparseAttentionWorkspace), "workspace")
    shape = (rows, hq, d)
    check(ws.used_with in (None, shape), "one workspace per captured shape")
    ws.used_with = shape
    k_scale, v_scale = (float(s) for s in (kw["k_scale"], kw["v_scale"]))
    spec = []
    for r in range(rows):
        b, i = divmod(r, length)
        n = max(int(lens[b]) - length + i + 1, 0)
        per_head = []
        for h in range(hkv):
            blocks = [j for j in q2k_indices[h, r].tolist() if j >= 0]
            page_ids = [int(table[b, j]) for j in blocks]
            check(all(0 <= pg < pages for pg in page_ids), f"row {r}: page outside the cache")
            per_head.append((blocks, page_ids, n))
        spec.append(per_head)

    def dequant(page_ids: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        return k[page_ids, h].float() * k_scale, v[page_ids, h].float() * v_scale

    out, lse = attend(q.float(), kw["softmax_scale"], dequant, spec, hkv)
    CALLS.append(kw)
    out_bf16 = out.to(torch.bfloat16)
    if kw["return_softmax_lse"]:
        return out_bf16, lse.float()
    return out_bf16
