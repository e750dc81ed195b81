"""The engines' own decode kernels on msa's benchmark steps.

Each adapter takes the kwargs of a step (`msa.workload.DecodeStep.kwargs()`, or the sweep's
per-case kwargs) and its layout, builds the engine's inputs once — outside any timing — and
returns a zero-argument call that runs the engine's function on them and returns its output
`[B*L, Hq, D]`, or None where the engine cannot run the step:

- `vllm_call`: vLLM 0.33.0 `minimax_m3_sparse_attn_decode` on msa's packed cache itself (the
  same `[pages, Hkv, 128, 2D]` layout), the head-major top-k view as given, a preallocated
  `output`, one-element fp32 device scales for FP8 (read by the kernel: graph-safe). Pages of
  128 tokens only (vLLM hard-wires its block size), any uniform L.
- `sglang_call`: SGLang 0.5.23 `flash_decode_with_gqa_share_sparse` on SGLang-form copies of the
  cache (token pools `[pages * P, Hkv, D]`, slot `page * P + offset`), `req_to_token` built from
  the block table, `slot_ids = arange(B)`, `block_size = page_size = P`, scales as python floats
  (read on the host here; a call keeps the values it was built with). L = 1 only (SGLang's
  decode entry takes one query token per row).

Both: bf16/fp16 `q` with a cache of the same dtype or FP8 e4m3; NVFP4 caches, fp8 `q`, ragged
steps (`query_start_loc`) and caller-provided `out`/LSE are not served (None). Neither engine
returns an LSE.

Semantics on msa's steps: `make_decode_step`/`indexer_topk` lists are front-packed (valid ids
first, `-1` only at the tail, never more valid ids than the row's visible blocks) and no row is
empty, so both engines compute msa's attention. Outside that they differ from msa: a row that
attends nothing (e.g. `seq_lens = 0` padding) comes out NaN in both engines (msa: zeros); vLLM
scans only the first ceil(n/128) list positions and does not check pages; SGLang reads garbage
for a `-1` before a valid id and does not check ids against the visible length.

To time them in `msa bench`'s sweep (same signature as its integrations):

    from msa.bench.integrations import INTEGRATIONS
    INTEGRATIONS.update(ENGINE_CALLS)       # then BenchConfig(integrations=("vllm-kernel", "sglang-kernel"))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from msa.layouts import KVLayout

from . import load

__all__ = ["ENGINE_CALLS", "sglang_call", "vllm_call"]

_FP8 = torch.float8_e4m3fn
_Q_DTYPES = (torch.bfloat16, torch.float16)
#: vLLM's SPARSE_BLOCK_SIZE: its decode kernel reads pages of exactly 128 tokens.
VLLM_PAGE_SIZE = 128


def _scale_value(value: Any) -> float:
    """A scale as a python float (a host read of a tensor: never inside a timed call)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _scale_tensor(value: Any, device: torch.device) -> torch.Tensor:
    """A scale as a one-element fp32 tensor on `device` (msa's tensors are used as they are)."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.device == device:
        return value.reshape(1)
    return torch.tensor([_scale_value(value)], dtype=torch.float32, device=device)


def _servable(kw: dict[str, Any], layout: KVLayout) -> bool:
    """bf16/fp16 q, a split-layout cache (same dtype as q, or fp8 e4m3), uniform L, no q scale."""
    q, cache = kw["q"], kw["kv_cache"]
    dtype = cache[0].dtype if isinstance(cache, tuple) else cache.dtype
    return (
        layout.separable
        and not layout.block_scaled
        and q.dtype in _Q_DTYPES
        and dtype in (q.dtype, _FP8)
        and kw.get("query_start_loc") is None
        and kw.get("q_scale") is None
    )


def _sm_scale(kw: dict[str, Any]) -> float:
    sm_scale = kw.get("sm_scale")
    return float(kw["q"].shape[-1] ** -0.5 if sm_scale is None else sm_scale)


def vllm_call(kw: dict[str, Any], layout: KVLayout) -> Callable[[], torch.Tensor] | None:
    """vLLM 0.33.0's `minimax_m3_sparse_attn_decode` on the step (msa's packed cache as is)."""
    q, cache = kw["q"], kw["kv_cache"]
    if not _servable(kw, layout) or not isinstance(cache, torch.Tensor):
        return None
    _, num_kv_heads, page_size, width = cache.shape
    if page_size != VLLM_PAGE_SIZE or width != 2 * q.shape[-1]:
        return None
    scales: dict[str, torch.Tensor | None] = {"k_scale": None, "v_scale": None}
    if cache.dtype == _FP8:
        scales = {name: _scale_tensor(kw.get(name, 1.0), q.device) for name in scales}
    elif any(_scale_value(kw.get(name, 1.0)) != 1.0 for name in scales):
        return None  # vLLM ignores the scales of a bf16/fp16 cache; msa applies them
    decode = load.vllm_decode
    args = (q, cache, kw["topk_indices"], kw["block_table"], kw["seq_lens"], num_kv_heads, _sm_scale(kw))
    length = int(kw["decode_query_len"])
    output = torch.empty_like(q)

    def call() -> torch.Tensor:
        decode(*args, output, length, **scales)
        return output

    return call


def sglang_call(kw: dict[str, Any], layout: KVLayout) -> Callable[[], torch.Tensor] | None:
    """SGLang 0.5.23's `flash_decode_with_gqa_share_sparse` on SGLang-form copies of the step's
    cache (L = 1)."""
    if not _servable(kw, layout) or int(kw["decode_query_len"]) != 1:
        return None
    keys, values = layout.kv_views(kw["kv_cache"])
    pages, num_kv_heads, page_size, head_dim = keys.shape
    if page_size & (page_size - 1):
        return None  # SGLang's block size must be a power of two
    # contiguous pools as SGLang allocates them (token-major, K and V apart)
    k_pool, v_pool = (
        t.transpose(1, 2).reshape(pages * page_size, num_kv_heads, head_dim).contiguous() for t in (keys, values)
    )
    table = kw["block_table"]
    position = torch.arange(table.shape[1] * page_size, device=table.device)
    req_to_token = (table.long()[:, position // page_size] * page_size + position % page_size).int()
    slot_ids = torch.arange(table.shape[0], dtype=torch.int64, device=table.device)
    decode = load.sglang_decode
    args = (kw["q"], None, k_pool, v_pool, req_to_token, kw["seq_lens"], slot_ids, page_size, kw["topk_indices"])
    options = {
        "sm_scale": _sm_scale(kw),
        "page_size": page_size,
        "k_scale": _scale_value(kw.get("k_scale", 1.0)),
        "v_scale": _scale_value(kw.get("v_scale", 1.0)),
    }

    def call() -> torch.Tensor:
        out: torch.Tensor = decode(*args, **options)
        return out

    return call


#: name -> (step kwargs, layout) -> the engine's call on that step, or None where it does not apply
#: (the form of `msa.bench.integrations.INTEGRATIONS`).
ENGINE_CALLS: dict[str, Callable[[dict[str, Any], KVLayout], Callable[[], torch.Tensor] | None]] = {
    "vllm-kernel": vllm_call,
    "sglang-kernel": sglang_call,
}
