"""msa's vLLM general plugin (`msa.integrations.vllm_plugin`) against vLLM 0.33.0's own plugin
loader and MiniMax-M3 attention backends (their Python code as shipped; see harness.py).

vLLM's `load_general_plugins` finds msa's `vllm.general_plugins` entry point through
`importlib.metadata` (msa is pip-installed) and runs it; afterwards the name both M3 backends call,
`minimax_m3_sparse_attn_decode` in their own modules, is msa's; their real `forward` then runs msa,
whose result equals msa's reference backend and an oracle of vLLM's contract
(tests/engine_oracles.py). `VLLM_PLUGINS` without `msa`, or `MSA_VLLM_PLUGIN=0`, leaves vLLM's
function in place.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from engine_oracles import assert_close_to_oracle, vllm_decode_oracle
from harness import VllmM3

import msa
from msa.integrations.vllm import minimax_m3_sparse_attn_decode
from msa.workload import make_decode_step

pytestmark = pytest.mark.conformance


def test_vllms_loader_finds_msas_entry_point(vllm_m3: VllmM3) -> None:
    found = vllm_m3.plugins.load_plugins_by_group(vllm_m3.plugins.DEFAULT_PLUGINS_GROUP)
    assert found.get("msa") is vllm_m3.plugin.register, f"vllm.general_plugins: {sorted(found)} (pip install -e .)"


@pytest.mark.parametrize("allow", [None, "msa", "lora_filesystem_resolver,msa"])
def test_load_general_plugins_routes_both_m3_backends(vllm_m3: VllmM3, allow: str | None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The call sites imported before the plugins load (vLLM's model import after plugin load is
    the next test): both now call msa's drop-in; vLLM's function stays where it is defined."""
    if allow is not None:
        monkeypatch.setenv("VLLM_PLUGINS", allow)
    vllm_original = vllm_m3.ops.minimax_m3_sparse_attn_decode
    vllm_m3.load_general_plugins()
    for module in (vllm_m3.common, vllm_m3.nvidia):
        routed = module.minimax_m3_sparse_attn_decode
        assert vllm_m3.routed(module), module.__name__
        assert routed.__wrapped__ is minimax_m3_sparse_attn_decode and routed.__vllm_original__ is vllm_original
    assert vllm_m3.ops.minimax_m3_sparse_attn_decode is vllm_original
    before = [m.minimax_m3_sparse_attn_decode for m in (vllm_m3.common, vllm_m3.nvidia)]
    vllm_m3.load_general_plugins()  # a plugin may be loaded more than once: nothing changes
    assert all(m.minimax_m3_sparse_attn_decode is f for m, f in zip((vllm_m3.common, vllm_m3.nvidia), before, strict=True))


def test_m3_modules_imported_after_the_plugins_are_routed(vllm_m3: VllmM3) -> None:
    """vLLM loads its general plugins before it imports the model: the modules are patched as
    they are imported."""
    vllm_m3.unload_call_sites()
    vllm_m3.load_general_plugins()
    for module in vllm_m3.call_sites():
        assert module is not vllm_m3.common and module is not vllm_m3.nvidia, "imported anew"
        assert vllm_m3.routed(module), module.__name__


@pytest.mark.parametrize("env", [{"VLLM_PLUGINS": "lora_filesystem_resolver"}, {"VLLM_PLUGINS": ""},
                                 {"MSA_VLLM_PLUGIN": "0"}])
def test_switched_off_leaves_vllms_function(vllm_m3: VllmM3, env: dict[str, str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    vllm_m3.load_general_plugins()
    vllm_m3.unload_call_sites()
    for module in (vllm_m3.common, vllm_m3.nvidia, *vllm_m3.call_sites()):
        assert module.minimax_m3_sparse_attn_decode is vllm_m3.ops.minimax_m3_sparse_attn_decode, module.__name__


def _forward(vllm_m3: VllmM3, impl_name: str, layout: str, length: int, seed: int) -> tuple[torch.Tensor, Any, Any]:
    """One decode step through an M3 backend's own `forward`, as vLLM's model runner calls it:
    vLLM's metadata classes and forward context, the indexer's token-major top-k buffer on the
    layer, fp8 caches stored as bytes, the layer's fp32 scale tensors."""
    hq, hkv, d = 16, 2, 64
    step = make_decode_step(msa.Geometry(hq, hkv, d, 128, 4), batch_size=3, decode_query_len=length, context_len=600,
                            kv_cache_dtype=layout, seed=seed)
    fp8 = layout == "fp8_e4m3"
    module = vllm_m3.common if impl_name == "MiniMaxM3SparseTritonImpl" else vllm_m3.nvidia
    impl = getattr(module, impl_name)(hq, d, d**-0.5, hkv, "fp8" if fp8 else "auto", topk_blocks=4,
                                      sparse_block_size=128)
    tokens = step.q.shape[0]
    layer = types.SimpleNamespace(layer_name="model.layers.3.self_attn.attn",
                                  topk_indices_buffer=step.topk_indices.transpose(0, 1),  # [tokens, Hkv, K]
                                  _k_scale=step.k_scale * 0.5, _v_scale=step.v_scale * 3.0)
    sa = vllm_m3.common
    decode = sa.MiniMaxM3SparseDecodeMetadata(seq_lens=step.seq_lens, block_table=step.block_table,
                                              decode_query_len=length)
    metadata = sa.MiniMaxM3SparseMetadata(
        seq_lens=step.seq_lens, max_seq_len=int(step.seq_lens.max()), slot_mapping=torch.zeros(tokens, dtype=torch.long),
        num_actual_tokens=tokens, num_decodes=3, num_decode_tokens=tokens, num_prefills=0, num_prefill_tokens=0,
        decode=decode)
    context = vllm_m3.forward_context.ForwardContext(no_compile_layers={}, attn_metadata={layer.layer_name: metadata},
                                                     slot_mapping={})
    query = step.q.reshape(tokens, hq * d)
    output = torch.full((tokens, hq * d), float("nan"), dtype=torch.bfloat16)
    kv_cache = step.kv_cache.view(torch.uint8) if fp8 else step.kv_cache
    with vllm_m3.forward_context.override_forward_context(context):
        assert impl.forward(layer, query, kv_cache, output) is output
    scales = dict(k_scale=layer._k_scale, v_scale=layer._v_scale) if fp8 else {}
    return output.view(tokens, hq, d), step, scales


@pytest.mark.parametrize("impl", ["MiniMaxM3SparseTritonImpl", "MiniMaxM3SparseMSAImpl"])
@pytest.mark.parametrize("layout, length, backend", [("bfloat16", 1, "reference"), ("fp8_e4m3", 2, "reference"),
                                                     ("fp8_e4m3", 1, "triton")])
def test_m3_forward_runs_msa(vllm_m3: VllmM3, impl: str, layout: str, length: int, backend: str, seed: int,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Hopper's backend (`MiniMaxM3SparseTritonImpl`) and Blackwell's Triton decode
    (`MiniMaxM3SparseMSAImpl` without CUTLASS decode), through vLLM's own `forward`: every row
    written, equal to msa's reference backend and to the oracle of vLLM's contract."""
    monkeypatch.setenv("MSA_BACKEND", backend)
    vllm_m3.load_general_plugins()
    calls: list[dict[str, Any]] = []
    module = vllm_m3.common if impl == "MiniMaxM3SparseTritonImpl" else vllm_m3.nvidia
    routed = module.minimax_m3_sparse_attn_decode
    module.minimax_m3_sparse_attn_decode = lambda *a, **k: calls.append(dict(k, args=a)) or routed(*a, **k)
    try:
        out, step, scales = _forward(vllm_m3, impl, layout, length, seed)
    finally:
        module.minimax_m3_sparse_attn_decode = routed
    assert len(calls) == 1 and calls[0]["args"][8] == length, "vLLM's forward called the routed name once"
    kw = dict(step.kwargs(), **scales)
    reference = msa.sparse_decode(**kw, backend="reference")
    torch.testing.assert_close(out.float(), reference.float(), rtol=2**-7, atol=2e-3)
    oracle = vllm_decode_oracle(step.q, step.kv_cache, step.topk_indices, step.block_table, step.seq_lens, 64**-0.5,
                                length, **scales)
    assert_close_to_oracle(out, oracle, f"{impl} {layout} L={length} on {backend}")
