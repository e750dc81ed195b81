"""A second, independent formulation of docs/semantics.md §3 in float64: dense attention over each request's
whole context with a token mask built from the top-k lists. Used by `msa demo` to check the
reference itself, and by third-party backend authors as a cross-check."""

from __future__ import annotations

import torch

from msa.layouts import KVCache, KVLayout
from msa.scales import Scale, scale_tensor

__all__ = ["dense_masked_attention"]


def dense_masked_attention(
    q: torch.Tensor,
    kv_cache: KVCache,
    topk_indices: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    layout: KVLayout,
    decode_query_len: int,
    sm_scale: float | None = None,
    q_scale: Scale = 1.0,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/semantics.md §3 as masked dense attention, one request at a time, in float64.

    Returns:
        `(out, lse)`: float64 `[B*L, Hq, D]` and `[B*L, Hq]`.
    """
    shape = layout.inspect(kv_cache)
    rows, hq, d = q.shape
    hkv, p, length = shape.num_kv_heads, shape.page_size, decode_query_len
    group = hq // hkv
    device = q.device
    max_blocks = block_table.shape[1]
    scale = (d**-0.5 if sm_scale is None else sm_scale) * scale_tensor(q_scale, device).double()
    out = torch.zeros((rows, hq, d), dtype=torch.float64, device=device)
    lse = torch.full((rows, hq), float("-inf"), dtype=torch.float64, device=device)
    token = torch.arange(max_blocks * p, device=device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        pages = block_table[b].long()
        page_ok = (pages >= 0) & (pages < shape.num_pages)
        keys, values = layout.gather(
            kv_cache,
            pages.clamp(0, shape.num_pages - 1).view(1, -1),
            torch.arange(hkv, device=device).view(-1, 1),
            k_scale=k_scale,
            v_scale=v_scale,
        )  # [Hkv, M, P, D]
        keys = keys.double().flatten(1, 2)  # [Hkv, M*P, D]
        values = values.double().flatten(1, 2)
        for i in range(length):
            r = b * length + i
            visible = max(seq_len - length + i + 1, 0)
            ids = topk_indices[:, r].long()  # [Hkv, K]
            chosen = torch.zeros((hkv, max_blocks + 1), dtype=torch.bool, device=device)
            in_table = (ids >= 0) & (ids < max_blocks)
            chosen.scatter_(1, torch.where(in_table, ids, max_blocks), True)
            mask = chosen[:, token // p] & page_ok[token // p] & (token < visible)  # [Hkv, M*P]
            # only the attended tokens take part: what the others hold (NaN, Inf) is never used
            k_used = torch.where(mask.unsqueeze(-1), keys, 0.0)
            v_used = torch.where(mask.unsqueeze(-1), values, 0.0)
            qr = q[r].double().view(hkv, group, d)
            s = torch.einsum("hgd,htd->hgt", qr, k_used) * scale
            s = s.masked_fill(~mask.unsqueeze(1), float("-inf"))
            row_lse = torch.logsumexp(s, dim=-1)  # [Hkv, G]
            if bool(mask.any()):
                probs = torch.softmax(s, dim=-1).nan_to_num(0.0)
                out[r] = torch.einsum("hgt,htd->hgd", probs, v_used).reshape(hq, d)
            lse[r] = row_lse.reshape(hq)
    return out, lse
