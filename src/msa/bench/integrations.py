"""The engines' drop-ins (`msa.integrations`) as the benchmark times them: each takes a step of the
sweep (msa's packed cache) and returns a call in the engine's own form on the same data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from msa.integrations.sglang import flash_decode_with_gqa_share_sparse
from msa.layouts import KVLayout
from msa.scales import Scale

__all__ = ["INTEGRATIONS", "sglang_call"]


def _float(value: Scale) -> float:
    """A benchmark-side scale as a python float (outside any timing)."""
    return float(value) if isinstance(value, torch.Tensor) else value


def sglang_call(kw: dict[str, Any], layout: KVLayout) -> Callable[[], torch.Tensor] | None:
    """SGLang's Hopper decode entry (one query token per row) on SGLang-form data: token pools
    `[slots, Hkv, D]` with pages of P slots, `req_to_token` built from msa's block table."""
    if not layout.separable or kw["decode_query_len"] != 1:
        return None
    keys, values = layout.kv_views(kw["kv_cache"])
    pages, heads, p, d = keys.shape
    pools = [t.transpose(1, 2).reshape(pages * p, heads, d) for t in (keys, values)]
    table = kw["block_table"]
    position = torch.arange(table.shape[1] * p, device=table.device)
    req_to_token = (table.long()[:, position // p] * p + position % p).int()
    slot_ids = torch.arange(table.shape[0], dtype=torch.int32, device=table.device)
    k_scale, v_scale = _float(kw["k_scale"]), _float(kw["v_scale"])

    def call() -> torch.Tensor:
        return flash_decode_with_gqa_share_sparse(
            kw["q"], None, pools[0], pools[1], req_to_token, kw["seq_lens"], slot_ids, p, kw["topk_indices"],
            page_size=p, k_scale=k_scale, v_scale=v_scale,
        )

    return call


#: name -> (step kwargs, layout) -> the drop-in's call on that step, or None where it does not apply.
INTEGRATIONS: dict[str, Callable[[dict[str, Any], KVLayout], Callable[[], torch.Tensor] | None]] = {
    "sglang-dropin": sglang_call,
}
