"""What msa is compared with: a plain torch gather-and-attend, and FlexAttention with a BlockMask
over the gathered pages (FlexAttention cannot follow a paged, per-token selection by itself)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from msa.layouts import KVLayout
from msa.planning import resolve_entries
from msa.validation import check_decode_inputs

__all__ = ["gather_pages", "torch_gather_attend", "flex_attend"]


def gather_pages(kw: dict[str, Any], layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Selected pages as bf16 `(K, V)` `[R, Hkv, K*P, D]` and the visible-token mask `[R, Hkv, K*P]`."""
    q, cache = kw["q"], kw["kv_cache"]
    shape = layout.inspect(cache)
    used, block, page, visible = resolve_entries(check_decode_inputs(**kw)[1])
    hkv = shape.num_kv_heads
    heads = torch.arange(hkv, device=q.device).view(hkv, 1, 1)
    if layout.block_scaled:
        k, v = layout.gather(cache, page, heads, k_scale=kw["k_scale"], v_scale=kw["v_scale"])
        k, v = k.bfloat16(), v.bfloat16()
    else:  # [Hkv, R, K, P, D] in the storage dtype, scaled in bf16
        keys, values = layout.kv_views(cache)
        k = keys[page, heads].to(torch.bfloat16) * kw["k_scale"].to(torch.bfloat16)
        v = values[page, heads].to(torch.bfloat16) * kw["v_scale"].to(torch.bfloat16)
    token = block.unsqueeze(-1) * shape.page_size + torch.arange(shape.page_size, device=q.device)
    mask = used.unsqueeze(-1) & (token < visible.view(1, -1, 1, 1))
    k = k.flatten(2, 3).transpose(0, 1)  # [R, Hkv, K*P, D]
    v = v.flatten(2, 3).transpose(0, 1)
    return k, v, mask.flatten(2, 3).transpose(0, 1)


def torch_gather_attend(kw: dict[str, Any], layout: KVLayout) -> Callable[[], torch.Tensor]:
    """A step in plain torch: gather the selected pages, bf16 matmuls, fp32 masked softmax."""
    q = kw["q"]
    rows, hq, d = q.shape
    scale = d**-0.5

    def step() -> torch.Tensor:
        k, v, mask = gather_pages(kw, layout)
        hkv = k.shape[1]
        qg = q.view(rows, hkv, hq // hkv, d).to(torch.bfloat16)
        s = torch.einsum("rhgd,rhtd->rhgt", qg, k).float() * scale
        s = s.masked_fill(~mask.unsqueeze(2), float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0).to(torch.bfloat16)
        return torch.einsum("rhgt,rhtd->rhgd", p, v).reshape(rows, hq, d)

    return step


def flex_attend(kw: dict[str, Any], layout: KVLayout) -> Callable[[], torch.Tensor]:
    """FlexAttention over the gathered pages with a BlockMask of the visible tokens (the gather
    is timed with it; the mask is built once, outside the timing)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q = kw["q"]
    rows, hq, d = q.shape
    k, v, mask = gather_pages(kw, layout)
    hkv, kv_len = k.shape[1], k.shape[2]
    group = hq // hkv

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mask[b, h // group, kv_idx]

    block_mask = create_block_mask(mask_mod, B=rows, H=hq, Q_LEN=1, KV_LEN=kv_len, device=q.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    q4 = q.to(torch.bfloat16).view(rows, hq, 1, d)

    def step() -> torch.Tensor:
        kk, vv, _ = gather_pages(kw, layout)
        out = compiled(q4, kk, vv, block_mask=block_mask, enable_gqa=True, scale=d**-0.5)
        assert isinstance(out, torch.Tensor)
        return out

    return step
