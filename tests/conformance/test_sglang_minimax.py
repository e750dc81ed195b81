"""msa's SGLang drop-in (`msa.integrations.sglang.flash_decode_with_gqa_share_sparse`) under
SGLang 0.5.23's own MiniMax sparse decode layer, `minimax_sparse_decode`
(sglang/srt/layers/attention/minimax_sparse_ops/minimax_sparse.py), run as it is with its one
Triton kernel call — the name `flash_decode_with_gqa_share_sparse` it imported from
sglang/kernels/ops/attention/minimax_sparse/decode/topk_sparse.py — replaced by msa's drop-in.

The structures are SGLang's, laid out as its memory pools lay them out (`ReqToTokenPool`: a
`[size + 1, max_context]` int32 `req_to_token` whose row 0 is the padding row;
`MHATokenToKVPool`: per-layer `[size + page_size, Hkv, D]` K and V buffers whose first page
is the dummy page; pages handed out in any order). The pool classes themselves do not import here
(`sglang.srt.mem_cache.memory_pool` reaches torchvision through SGLang's model configs). The
result is compared with an oracle that reads those structures token by token in float64
(tests/engine_oracles.py), not through msa's block table.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import torch
from engine_oracles import assert_close_to_oracle, sglang_decode_oracle
from harness import require

import msa
from msa.integrations.sglang import flash_decode_with_gqa_share_sparse
from msa.workload import indexer_topk

pytestmark = pytest.mark.conformance

SGLANG = ("sglang", "0.5.23")
LAYER = "sglang.srt.layers.attention.minimax_sparse_ops.minimax_sparse"
KERNEL = "sglang.kernels.ops.attention.minimax_sparse.decode.topk_sparse"
BLOCK = 16  # block_size_k (128 for M3; small for the CPU)
HKV, HQ, D, TOPK, MAX_CONTEXT = 2, 8, 64, 4, 8 * BLOCK


@pytest.fixture
def layer(monkeypatch: pytest.MonkeyPatch) -> Any:
    """SGLang's decode layer module, its kernel call going to msa's drop-in (calls recorded)."""
    require(*SGLANG)
    module = importlib.import_module(LAYER)
    module.calls = []

    def intercepted(**kwargs: Any) -> torch.Tensor:
        module.calls.append(kwargs)
        return flash_decode_with_gqa_share_sparse(**kwargs)

    monkeypatch.setattr(module, "flash_decode_with_gqa_share_sparse", intercepted)
    return module


def _structures(gen: torch.Generator, layout: str, page_size: int, batch: int = 4) -> dict[str, Any]:
    dtype = torch.float8_e4m3fn if layout == "fp8_e4m3" else torch.bfloat16
    max_reqs = batch + 2
    pages = batch * -(-MAX_CONTEXT // page_size) + 1
    size = pages * page_size
    req_to_token = torch.zeros((max_reqs + 1, MAX_CONTEXT), dtype=torch.int32)  # row 0: padding
    k_buffer = (torch.randn((size + page_size, HKV, D), generator=gen) * 2).to(dtype)  # page 0: dummy
    v_buffer = (torch.randn((size + page_size, HKV, D), generator=gen) * 2).to(dtype)
    free_pages = (torch.randperm(pages, generator=gen) + 1).tolist()
    req_pool_indices = (torch.randperm(max_reqs, generator=gen)[:batch] + 1).int()
    lens = torch.randint(1, MAX_CONTEXT + 1, (batch,), generator=gen)
    for req, n in zip(req_pool_indices.tolist(), lens.tolist(), strict=True):
        owned = torch.tensor([free_pages.pop() for _ in range(-(-n // page_size))])
        pos = torch.arange(n)
        req_to_token[req, :n] = (owned[pos // page_size] * page_size + pos % page_size).int()
    seq_lens = lens.int()
    topk = indexer_topk(seq_lens, decode_query_len=1, num_kv_heads=HKV, topk=TOPK, page_size=BLOCK,
                        max_blocks=MAX_CONTEXT // BLOCK, generator=gen).contiguous()  # [Hkv, B, K]
    q = torch.randn((batch, HQ, D), generator=gen).bfloat16()
    return dict(q=q, k=k_buffer, v=v_buffer, req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                seq_lens=seq_lens, topk=topk, page_size=page_size)


def _decode(layer: Any, s: dict[str, Any], sink: torch.Tensor | None = None, **scales: Any) -> torch.Tensor:
    """`minimax_sparse_decode` called as MiniMaxSparseAttnBackend.forward_decode calls it, on a
    skip layer of an index-sharing group (`cached_topk_idx`: the indexer's kernels stay out)."""
    batch = s["q"].shape[0]
    idx_q = torch.zeros((batch, HKV, D), dtype=torch.bfloat16)
    idx_k = torch.zeros((s["k"].shape[0], 1, D), dtype=torch.bfloat16)
    idx_o, o = layer.minimax_sparse_decode(
        s["q"], sink, s["k"], s["v"], idx_q, None, idx_k, None, s["req_to_token"], s["req_pool_indices"],
        s["seq_lens"], MAX_CONTEXT, 1, BLOCK, TOPK, 1, 2, score_type="max", disable_index_value=True,
        dense_main_attn_fn=None, page_size=s["page_size"], use_msa=False, q_scale=scales.get("q_scale"),
        k_scale=scales.get("k_scale"), v_scale=scales.get("v_scale"), cached_topk_idx=s["topk"],
        sm_scale=scales.get("sm_scale"))
    assert idx_o is None
    return o  # type: ignore[no-any-return]


def test_drop_in_has_the_kernels_signature() -> None:
    require(*SGLANG)
    kernel = importlib.import_module(KERNEL).flash_decode_with_gqa_share_sparse
    theirs = inspect.signature(kernel).parameters
    ours = inspect.signature(flash_decode_with_gqa_share_sparse).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [(p.name, p.kind, p.default) for p in theirs.values()]
    assert importlib.import_module(LAYER).flash_decode_with_gqa_share_sparse is kernel, "the layer calls this kernel"


@pytest.mark.parametrize("layout, page_size, backend", [
    ("bfloat16", BLOCK, "reference"),
    ("bfloat16", 4 * BLOCK, "reference"),
    ("fp8_e4m3", 2 * BLOCK, "reference"),
    ("fp8_e4m3", 2 * BLOCK, "triton"),
])
def test_minimax_sparse_decode_on_msa(layer: Any, layout: str, page_size: int, backend: str, gen: torch.Generator,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSA_BACKEND", backend)
    s = _structures(gen, layout, page_size)
    scales = dict(sm_scale=0.11, q_scale=0.75, k_scale=0.5, v_scale=1.5) if layout == "fp8_e4m3" else {}
    o = _decode(layer, s, **scales)
    (call,) = layer.calls
    assert call["topk_idx"] is s["topk"] and call["k_cache"] is s["k"] and call["page_size"] == page_size
    assert call["slot_ids"] is s["req_pool_indices"] and call["hisparse_slots"] is None
    assert o.shape == s["q"].shape and o.dtype == torch.bfloat16
    oracle = sglang_decode_oracle(s["q"], s["k"], s["v"], s["req_to_token"], s["seq_lens"], s["req_pool_indices"],
                                  BLOCK, s["topk"], **scales)
    assert_close_to_oracle(o, oracle, f"{layout}, page_size={page_size}, {backend}")


def test_sglangs_sink_reaches_msas_refusal(layer: Any, gen: torch.Generator) -> None:
    """SGLang sends a model with attention sinks to this kernel too: msa refuses it by name."""
    s = _structures(gen, "bfloat16", BLOCK)
    with pytest.raises(msa.MSAUnsupportedError, match="^sink: msa has no attention sinks"):
        _decode(layer, s, sink=torch.zeros((HQ, D), dtype=torch.bfloat16))
