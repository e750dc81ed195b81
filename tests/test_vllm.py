"""msa.integrations.vllm: vLLM's MiniMax-M3 Triton decode signature, on msa."""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest
import torch

import msa
from msa.integrations.vllm import minimax_m3_sparse_attn_decode
from msa.workload import make_decode_step

INTERPRET = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
#: vLLM 0.33.0's eleven parameters, then the two of vLLM's main branch, in order.
VLLM_PARAMETERS = ["q", "kv_cache", "topk_idx", "block_table", "seq_lens", "num_kv_heads", "sm_scale", "output",
                   "decode_query_len", "k_scale", "v_scale", "query_start_loc", "token_to_req_indices"]


def test_signature_is_vllms() -> None:
    params = inspect.signature(minimax_m3_sparse_attn_decode).parameters
    assert list(params) == VLLM_PARAMETERS
    assert [n for n, p in params.items() if p.default is inspect.Parameter.empty] == VLLM_PARAMETERS[:9]


def _vllm_args(layout: str, length: int, seed: int, device: str = "cpu") -> tuple[list[Any], dict[str, Any], Any]:
    step = make_decode_step(msa.Geometry(16, 2, 64, 128, 4), batch_size=3, decode_query_len=length, context_len=600,
                            kv_cache_dtype=layout, device=device, seed=seed)
    output = torch.full(step.q.shape, float("nan"), dtype=torch.bfloat16, device=device)
    scales = {}
    if layout == "fp8_e4m3":
        scales = dict(k_scale=step.k_scale.reshape(()), v_scale=step.v_scale.reshape(()))  # vLLM's 0-dim buffers
    args = [step.q, step.kv_cache, step.topk_indices, step.block_table, step.seq_lens, 2, 64**-0.5, output, length]
    return args, scales, step


@pytest.mark.parametrize("layout, length", [("bfloat16", 1), ("fp8_e4m3", 2)])
def test_drop_in_equals_the_reference(layout: str, length: int, seed: int) -> None:
    args, scales, step = _vllm_args(layout, length, seed)
    assert minimax_m3_sparse_attn_decode(*args, **scales) is None
    ref = msa.sparse_decode(**step.kwargs(), backend="reference")
    torch.testing.assert_close(args[7].float(), ref.float(), rtol=2**-7, atol=2e-3)


def test_scales_are_read_only_for_fp8_caches(seed: int) -> None:
    args, _, step = _vllm_args("bfloat16", 1, seed)
    ignored = torch.full((), 7.0)
    minimax_m3_sparse_attn_decode(*args, k_scale=ignored, v_scale=ignored)
    torch.testing.assert_close(args[7].float(), msa.sparse_decode(**step.kwargs(), backend="reference").float(),
                               rtol=2**-7, atol=2e-3)


def test_ragged_mode(seed: int) -> None:
    """query_start_loc + token_to_req_indices (vLLM main): requests of 3, 0 and 2 tokens, padded
    to 6 rows; decode_query_len is not used, as in vLLM."""
    args, _, step = _vllm_args("bfloat16", 2, seed)
    qsl = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    t2r = torch.tensor([0, 0, 0, 2, 2, 0], dtype=torch.int32)
    minimax_m3_sparse_attn_decode(*args[:8], 1, query_start_loc=qsl, token_to_req_indices=t2r)
    ref = msa.sparse_decode(**dict(step.kwargs(), decode_query_len=3), backend="reference", query_start_loc=qsl)
    torch.testing.assert_close(args[7].float(), ref.float(), rtol=2**-7, atol=2e-3)
    assert (args[7][5] == 0).all(), "the padding row past qsl[B]"


def test_refusals(seed: int) -> None:
    args, scales, _ = _vllm_args("fp8_e4m3", 1, seed)
    with pytest.raises(msa.MSAInputError, match=r"^k_scale / v_scale: expected both None or both given"):
        minimax_m3_sparse_attn_decode(*args, k_scale=scales["k_scale"])
    per_slot = torch.ones((2, 128 * 20))
    with pytest.raises(msa.MSAUnsupportedError, match=r"^k_scale: msa takes one scale per cache side"):
        minimax_m3_sparse_attn_decode(*args, k_scale=per_slot, v_scale=per_slot)
    with pytest.raises(msa.MSAInputError, match=r"^num_kv_heads: expected the KV heads of kv_cache"):
        minimax_m3_sparse_attn_decode(*args[:5], 4, *args[6:], **scales)
    with pytest.raises(msa.MSAInputError, match=r"^token_to_req_indices: expected a tensor of at least total_q"):
        minimax_m3_sparse_attn_decode(*args, **scales, query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32))
    if hasattr(torch, "float8_e5m2"):
        with pytest.raises(msa.MSAUnsupportedError, match=r"^kv_cache: msa reads fp8 caches in float8_e4m3fn"):
            minimax_m3_sparse_attn_decode(args[0], args[1].view(torch.float8_e5m2), *args[2:], **scales)


@pytest.mark.skipif(not INTERPRET, reason="the Triton backend runs on the CPU only under TRITON_INTERPRET=1")
def test_drop_in_through_the_triton_kernels(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSA_BACKEND", "triton")
    args, scales, step = _vllm_args("fp8_e4m3", 2, seed)
    minimax_m3_sparse_attn_decode(*args, **scales)
    ref = msa.sparse_decode(**step.kwargs(), backend="reference")
    torch.testing.assert_close(args[7].float(), ref.float(), rtol=2**-7, atol=2e-3)


def test_fp8_cache_as_uint8_storage(seed: int) -> None:
    """vLLM allocates fp8 caches as uint8: the drop-in reads that storage as e4m3 (it was taken
    for an NVFP4 cache and refused as a bad NVFP4 shape)."""
    args, scales, _ = _vllm_args("fp8_e4m3", 1, seed)
    minimax_m3_sparse_attn_decode(*args, **scales)
    ref = args[7].clone()
    args[7].fill_(float("nan"))
    args[1] = args[1].view(torch.uint8)
    minimax_m3_sparse_attn_decode(*args, **scales)
    assert torch.equal(args[7], ref)
