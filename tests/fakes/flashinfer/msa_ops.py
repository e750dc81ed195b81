"""An output-only stand-in for FlashInfer 0.7.2.post1's `msa_ops` sparse decode. It records its
calls and computes what the kernel would from the arguments it is given; it validates nothing —
tests/conformance runs the real library's code."""

from __future__ import annotations

from typing import Any

import torch
from fake_attend import attend

CALLS: list[dict[str, Any]] = []
#: Pretend a 12.x device (the library's packed-view route, which takes no `out=`).
PACKED_VIEWS = False


def supports_packed_kv(device: torch.device | str) -> bool:
    return PACKED_VIEWS


def msa_sparse_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q2k_indices: torch.Tensor, *,
                                page_table: torch.Tensor, seqused_k: torch.Tensor, seqlen_q: int,
                                softmax_scale: float, return_softmax_lse: bool = False,
                                v_global_scale: float | None = None, out: torch.Tensor | None = None,
                                **options: Any) -> Any:
    rows, hq, d = q.shape
    hkv = k.shape[1]
    spec = []
    for r in range(rows):
        b, i = divmod(r, seqlen_q)
        n = max(int(seqused_k[b]) - seqlen_q + i + 1, 0)  # right-aligned, causal
        per_head = []
        for h in range(hkv):
            blocks = [j for j in q2k_indices[h, r].tolist() if j >= 0]
            per_head.append((blocks, [int(page_table[b, j]) for j in blocks], n))
        spec.append(per_head)

    def dequant(page_ids: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        return k[page_ids, h].float(), v[page_ids, h].float()

    result, lse = attend(q.float(), softmax_scale, dequant, spec, hkv)
    result = result * (1.0 if v_global_scale is None else v_global_scale)
    target = out if out is not None else torch.empty((rows, hq, d), dtype=torch.bfloat16)
    target.copy_(result.to(torch.bfloat16))
    CALLS.append(dict(options, q=q, k=k, v=v, q2k_indices=q2k_indices, page_table=page_table, seqused_k=seqused_k,
                      seqlen_q=seqlen_q, softmax_scale=softmax_scale, return_softmax_lse=return_softmax_lse,
                      v_global_scale=v_global_scale, out=out, result=target))
    return (target, lse.float()) if return_softmax_lse else target
