"""msa.integrations.vllm: vLLM's MiniMax-M3 Triton decode signature, on msa."""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_oracles import assert_close_to_oracle, vllm_decode_oracle

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


def test_one_element_scales_of_any_shape_and_float_dtype(seed: int) -> None:
    """vLLM reads any one-element float tensor as a side's scale (`numel() == 1`), whatever its
    shape or dtype: so does the drop-in ([1, 1] was refused as per-slot scales, fp64 / bf16 as bad
    scales)."""
    args, scales, _ = _vllm_args("fp8_e4m3", 1, seed)
    minimax_m3_sparse_attn_decode(*args, **scales)
    want = args[7].clone()
    k, v = float(scales["k_scale"]), float(scales["v_scale"])
    for shape, dtype in (((1, 1), torch.float32), ((1,), torch.float64), ((1, 1, 1), torch.bfloat16)):
        args[7].fill_(float("nan"))
        minimax_m3_sparse_attn_decode(*args, k_scale=torch.full(shape, k, dtype=dtype),
                                      v_scale=torch.full(shape, v, dtype=dtype))
        if dtype == torch.bfloat16 and (torch.tensor(k).bfloat16().item() != k or torch.tensor(v).bfloat16().item() != v):
            continue  # (a scale bf16 cannot hold is another scale)
        assert torch.equal(args[7], want), (shape, dtype)


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
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    with pytest.raises(msa.MSAInputError, match=r"^token_to_req_indices: expected a 1-D tensor of at least total_q"):
        minimax_m3_sparse_attn_decode(*args, **scales, query_start_loc=qsl)
    with pytest.raises(msa.MSAInputError, match=r"^token_to_req_indices: expected a 1-D tensor .* got shape \(\)"):
        minimax_m3_sparse_attn_decode(*args, **scales, query_start_loc=qsl, token_to_req_indices=torch.tensor(0))
    # checked before anything reads them (q's shape was read first: AttributeError / IndexError)
    with pytest.raises(msa.MSAInputError, match=r"^q: expected a 3-D tensor \[total_q, Hq, D\], got NoneType"):
        minimax_m3_sparse_attn_decode(None, *args[1:], **scales)
    with pytest.raises(msa.MSAInputError, match=r"^q: expected a 3-D tensor \[total_q, Hq, D\], got shape \(\)"):
        minimax_m3_sparse_attn_decode(torch.tensor(1.0), *args[1:], **scales)
    with pytest.raises(msa.MSAInputError, match=r"^output: expected a tensor \[total_q, Hq, D\], written in place"):
        minimax_m3_sparse_attn_decode(*args[:7], None, *args[8:], **scales)  # (vLLM's caller keeps no result)
    for heads in (1.0, True):
        with pytest.raises(msa.MSAInputError, match=r"^num_kv_heads: expected an int"):
            minimax_m3_sparse_attn_decode(*args[:5], heads, *args[6:], **scales)
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


# -- against vLLM's contract, read from vLLM's structures (tests/engine_oracles.py) ------------------


def _nhd_view(cache: torch.Tensor) -> torch.Tensor:
    """The same cache as vLLM's NHD-strided view: `[blocks, 128, Hkv, 2D]` storage seen as
    `[blocks, Hkv, 128, 2D]`."""
    storage = torch.empty((cache.shape[0], cache.shape[2], cache.shape[1], cache.shape[3]), dtype=cache.dtype)
    view = storage.permute(0, 2, 1, 3)
    view.copy_(cache)
    return view


@pytest.mark.parametrize("layout, length, nhd", [("bfloat16", 1, False), ("fp8_e4m3", 2, False), ("bfloat16", 3, True),
                                                 ("fp8_e4m3", 1, True)])
def test_drop_in_equals_the_vllm_oracle(layout: str, length: int, nhd: bool, seed: int) -> None:
    """The drop-in against an oracle that reads vLLM's block table, lengths, head-major top-k
    view and packed cache token by token (and distinct K and V scales for fp8)."""
    args, scales, _ = _vllm_args(layout, length, seed)
    if nhd:
        args[1] = _nhd_view(args[1])
    if scales:
        scales = dict(k_scale=scales["k_scale"] * 0.5, v_scale=scales["v_scale"] * 3.0)
    minimax_m3_sparse_attn_decode(*args, **scales)
    q, cache, topk, table, lens, _, sm_scale, out, _ = args
    oracle = vllm_decode_oracle(q, cache, topk, table, lens, sm_scale, length, **scales)
    assert_close_to_oracle(out, oracle, f"{layout}, L={length}, nhd={nhd}")


def test_ragged_mode_equals_the_vllm_oracle(seed: int) -> None:
    """vLLM main's ragged form: the oracle maps rows to requests through `token_to_req_indices`
    and places them with `query_start_loc`."""
    args, _, _ = _vllm_args("bfloat16", 2, seed)
    qsl = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    t2r = torch.tensor([0, 0, 0, 2, 2, 0], dtype=torch.int32)
    minimax_m3_sparse_attn_decode(*args[:8], 1, query_start_loc=qsl, token_to_req_indices=t2r)
    q, cache, topk, table, lens, _, sm_scale, out, _ = args
    oracle = vllm_decode_oracle(q, cache, topk, table, lens, sm_scale, 1, query_start_loc=qsl, token_to_req_indices=t2r)
    assert_close_to_oracle(out, oracle, "ragged")


@pytest.mark.skipif(not INTERPRET, reason="the Triton backend runs on the CPU only under TRITON_INTERPRET=1")
def test_triton_drop_in_equals_the_vllm_oracle(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSA_BACKEND", "triton")
    args, scales, _ = _vllm_args("fp8_e4m3", 2, seed)
    args[1] = _nhd_view(args[1])
    scales = dict(k_scale=scales["k_scale"] * 0.5, v_scale=scales["v_scale"] * 3.0)
    minimax_m3_sparse_attn_decode(*args, **scales)
    q, cache, topk, table, lens, _, sm_scale, out, _ = args
    assert_close_to_oracle(out, vllm_decode_oracle(q, cache, topk, table, lens, sm_scale, 2, **scales), "triton")


# -- the vLLM general plugin (msa.integrations.vllm_plugin) on a stand-in of vLLM's module layout -----
# (tests/conformance/test_vllm_plugin.py runs it through vLLM 0.33.0's own plugin loader)

_ORIGINAL = '''
CALLS = []


def minimax_m3_sparse_attn_decode({params}):
    CALLS.append(kv_cache.dtype)
    output.fill_(7.0)
'''
_CALL_SITE = '''
from vllm.models.minimax_m3.common.ops.sparse_attn import minimax_m3_sparse_attn_decode


def forward(*args, **kwargs):  # looks the name up at call time, as vLLM's Impl.forward does
    return minimax_m3_sparse_attn_decode(*args, **kwargs)
'''
_VLLM_PARAMS = "q, kv_cache, topk_idx, block_table, seq_lens, num_kv_heads, sm_scale, output, decode_query_len, " \
               "k_scale=None, v_scale=None"


def _write_fake_vllm(root: Any, params: str = _VLLM_PARAMS, with_nvidia: bool = True) -> None:
    files = {"__init__.py": "", "models/__init__.py": "", "models/minimax_m3/__init__.py": "",
             "models/minimax_m3/common/__init__.py": "", "models/minimax_m3/common/ops/__init__.py": "",
             "models/minimax_m3/common/ops/sparse_attn.py": _ORIGINAL.format(params=params),
             "models/minimax_m3/common/sparse_attention.py": _CALL_SITE}
    if with_nvidia:
        files.update({"models/minimax_m3/nvidia/__init__.py": "",
                      "models/minimax_m3/nvidia/sparse_attention_msa.py": _CALL_SITE})
    for rel, text in files.items():
        path = root / "vllm" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def fake_vllm(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A directory holding a stand-in `vllm` package (vLLM 0.33.0's M3 module layout), first on
    sys.path; any real vllm modules are out of sys.modules for the test."""
    from msa.integrations import vllm_plugin

    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    monkeypatch.delenv("MSA_BACKEND", raising=False)
    importlib.invalidate_caches()
    yield tmp_path
    vllm_plugin.unregister()
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


def _routed(module: Any) -> bool:
    return bool(getattr(module.minimax_m3_sparse_attn_decode, "__msa_routed__", False))


def test_plugin_module_imports_neither_vllm_nor_torch() -> None:
    """vLLM imports every plugin's module in every process: msa's costs nothing until it runs."""
    code = ("import sys, msa.integrations.vllm_plugin; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'triton')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_plugin_is_declared_as_a_vllm_general_plugin() -> None:
    from msa.integrations import vllm_plugin

    found = {ep.name: ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert "msa" in found, "pip install -e . (the entry point is declared in pyproject.toml)"
    assert found["msa"].load() is vllm_plugin.register


def test_plugin_routes_both_m3_call_sites(fake_vllm: Any, seed: int, caplog: pytest.LogCaptureFixture) -> None:
    """A call site imported before `register()` is patched at once, one imported after when it
    is imported; vLLM's defining module keeps its function; calls run msa."""
    from msa.integrations import vllm_plugin

    _write_fake_vllm(fake_vllm)
    common = importlib.import_module("vllm.models.minimax_m3.common.sparse_attention")
    ops = importlib.import_module("vllm.models.minimax_m3.common.ops.sparse_attn")
    caplog.set_level(logging.INFO, logger="vllm.plugins.msa")
    vllm_plugin.register()
    vllm_plugin.register()  # idempotent
    nvidia = importlib.import_module("vllm.models.minimax_m3.nvidia.sparse_attention_msa")
    for module in (common, nvidia):
        routed = module.minimax_m3_sparse_attn_decode
        assert _routed(module) and routed.__wrapped__ is minimax_m3_sparse_attn_decode
        assert routed.__vllm_original__ is ops.minimax_m3_sparse_attn_decode
    assert not _routed(ops), "vLLM's own function stays where it is defined"
    assert sum("now runs on msa" in r.getMessage() for r in caplog.records) == 2

    args, scales, step = _vllm_args("fp8_e4m3", 2, seed)
    nvidia.forward(*args, **scales)
    assert not ops.CALLS
    torch.testing.assert_close(args[7].float(), msa.sparse_decode(**step.kwargs(), backend="reference").float(),
                               rtol=2**-7, atol=2e-3)
    vllm_plugin.unregister()
    assert not _routed(common) and not _routed(nvidia)
    assert common.minimax_m3_sparse_attn_decode is ops.minimax_m3_sparse_attn_decode


@pytest.mark.skipif(not hasattr(torch, "float8_e5m2"), reason="needs torch.float8_e5m2")
def test_plugin_leaves_steps_msa_does_not_serve_to_vllm(fake_vllm: Any, seed: int,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """An fp8 e5m2 cache (vLLM's Triton path serves it, msa does not): vLLM's own function runs
    it, with one warning."""
    from msa.integrations import vllm_plugin

    _write_fake_vllm(fake_vllm)
    vllm_plugin.register()
    common = importlib.import_module("vllm.models.minimax_m3.common.sparse_attention")
    ops = importlib.import_module("vllm.models.minimax_m3.common.ops.sparse_attn")
    args, scales, _ = _vllm_args("fp8_e4m3", 1, seed)
    args[1] = args[1].view(torch.float8_e5m2)
    for _ in range(2):
        common.forward(*args, **scales)
    assert len(ops.CALLS) == 2 and set(ops.CALLS) == {torch.float8_e5m2} and (args[7] == 7.0).all()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "vLLM's own kernel runs it" in warnings[0]


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_plugin_off_switch(fake_vllm: Any, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from msa.integrations import vllm_plugin

    _write_fake_vllm(fake_vllm)
    monkeypatch.setenv(vllm_plugin.ENV, value)
    vllm_plugin.register()
    assert not _routed(importlib.import_module("vllm.models.minimax_m3.common.sparse_attention"))


@pytest.mark.parametrize("problem", ["layout", "signature"])
def test_plugin_refuses_another_vllm_with_one_warning(fake_vllm: Any, problem: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """M3 modules elsewhere, or a decode function with other parameters: one warning, vLLM's
    functions untouched, never an exception."""
    from msa.integrations import vllm_plugin

    if problem == "layout":
        _write_fake_vllm(fake_vllm, with_nvidia=False)
    else:
        _write_fake_vllm(fake_vllm, params="q, kv_cache, topk_idx, block_table, seq_lens, num_kv_heads, sm_scale, "
                                           "output, decode_query_len, k_scale=None, v_scale=None, kv_layout='hnd'")
    vllm_plugin.register()
    vllm_plugin.register()
    common = importlib.import_module("vllm.models.minimax_m3.common.sparse_attention")
    if problem == "signature":
        importlib.import_module("vllm.models.minimax_m3.nvidia.sparse_attention_msa")
    assert not _routed(common)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expected = "not found" if problem == "layout" else "kv_layout"
    assert len(warnings) == 1 and expected in warnings[0], warnings


def test_plugin_without_vllm_does_nothing(fake_vllm: Any, caplog: pytest.LogCaptureFixture) -> None:
    from msa.integrations import vllm_plugin

    vllm_plugin.register()  # the fake directory holds no vllm package: vLLM is absent
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "vLLM is not installed" in warnings[0]

