"""msa's `flashinfer` adapter against FlashInfer 0.7.2.post1's `flashinfer.msa_ops` (its argument
validation, route selection, layout and workspace rules run for real; see harness.py)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from adapter_checks import assert_matches_reference, pretend_capture
from harness import FlashInferHarness, cuda_like, make_planner, pretend, run_step

import msa
from msa.backends.flashinfer import FlashInferBackend
from msa.errors import MSAUnsupportedError
from msa.policy import SelectionPolicy
from msa.registry import BackendRegistry
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step

pytestmark = pytest.mark.conformance

SM100, SM120 = (10, 0), (12, 0)


def _step(batch: int, length: int, heads: tuple[int, int], seed: int, form: str = "separate") -> dict[str, Any]:
    step = make_decode_step(
        msa.Geometry(heads[0], heads[1], 128, 128, 16), batch_size=batch, decode_query_len=length,
        context_len=128 * 12, kv_cache_dtype="fp8", q_dtype=torch.float8_e4m3fn, seed=seed, kv_form=form,
    )
    kw = step.kwargs()
    kw["q"] = cuda_like(kw["q"])
    ids = kw["topk_indices"].clone()
    ids[:, ::3, 5] = -1  # -1 inside lists
    ids[:, 1::4, 2] = 400  # ids past every table
    kw["topk_indices"] = ids
    kw["seq_lens"] = kw["seq_lens"].clone()
    # per-tensor scales that matter: k folds into the softmax scale, v scales the output
    kw["k_scale"], kw["v_scale"] = torch.tensor([0.37]), 1.9
    return kw


def test_found_and_qualified_as_the_library_says(flashinfer: FlashInferHarness) -> None:
    """msa's capability set is the library's: its SM100 programs on 10.0/10.3 (10.7 is admitted
    for NVFP4 routes only, and the dense programs refuse it) and its packed-view 12.0/12.1 route."""
    platform = pretend(SM100)
    assert "flashinfer" in platform.packages
    bw = flashinfer.sm100
    dense = {c for c in bw._SUPPORTED_COMPUTE_CAPABILITIES if c != (10, 7)}
    with pytest.raises(RuntimeError, match="not qualified on compute capability 10.7"):
        bw._program("decode_uniform_fp8:paged:main", "sm107a")
    twelve = set()
    for capability in ((10, 0), (10, 3), (12, 0), (12, 1), (12, 2)):
        flashinfer.monkeypatch.setattr(flashinfer.ops, "get_compute_capability", lambda device, c=capability: c)
        if flashinfer.supports_packed_kv("cuda:0"):
            twelve.add(capability)
    assert FlashInferBackend.capabilities.compute_capabilities == dense | twelve
    assert FlashInferBackend().version() == "flashinfer-python 0.7.2.post1"


@pytest.mark.parametrize("batch, length, heads, pad, lse", [
    (3, 1, (64, 4), 0, True),
    (2, 4, (16, 1), 5, True),
    (2, 16, (32, 2), 0, False),  # L past msa's old limit of 8: the library takes 1..32
])
def test_decode_with_separate_caches(batch: int, length: int, heads: tuple[int, int], pad: int, lse: bool,
                                     flashinfer: FlashInferHarness, seed: int, gen: torch.Generator,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    kw = _step(batch, length, heads, seed)
    if pad:  # a block table whose rows are strided, and strided lengths
        table = kw["block_table"]
        wide = torch.full((batch, table.shape[1] + pad), 3, dtype=torch.int32)
        wide[:, : table.shape[1]] = table
        kw["block_table"] = wide[:, : table.shape[1]]
        kw["seq_lens"] = torch.stack((kw["seq_lens"], kw["seq_lens"]), dim=1)[:, 0]
    planner = make_planner(kw, monkeypatch, pretend(SM100), lse=lse)
    plan, out, lse_t = run_step(planner, kw, lse=lse)
    assert planner.plans.keys()[0].backend == "flashinfer"
    assert_matches_reference(out, kw, lse_t)
    launch = flashinfer.launches[-1]
    assert launch["program"] == flashinfer.route("decode_uniform_fp8:paged:main")
    assert launch["O"] is out, "the library writes the caller's out (out=), no copy"
    k_cache, v_cache = kw["kv_cache"]
    assert launch["K"].data_ptr() == k_cache.data_ptr() and launch["V"].data_ptr() == v_cache.data_ptr()
    # the next step of the same shape, with a padded request
    kw["seq_lens"].copy_(torch.randint(length, 128 * 12, (batch,), generator=gen).int())
    kw["seq_lens"][-1] = 0
    kw["topk_indices"].copy_(kw["topk_indices"].flip(-1))
    plan2, out2, lse2 = run_step(planner, kw, lse=lse)
    assert plan2 is plan
    assert_matches_reference(out2, kw, lse2)


def test_strided_out_is_staged(flashinfer: FlashInferHarness, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = _step(2, 1, (16, 1), seed)
    planner = make_planner(kw, monkeypatch, pretend(SM100))
    buf = torch.full((2, 16, 160), float("nan"), dtype=torch.bfloat16)
    plan, _, _ = run_step(planner, kw, out=buf[..., 16:144])
    assert flashinfer.launches[-1]["O"] is plan.out
    assert_matches_reference(buf[..., 16:144], kw)
    assert torch.isnan(buf[..., :16]).all()


@pytest.mark.parametrize("form", ["packed", "sglang"])
def test_packed_or_strided_caches_are_refused(form: str, flashinfer: FlashInferHarness, seed: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """On 10.x the library rejects K/V views of one packed cache and copies nothing; msa refuses
    such steps when selecting (the reason `msa explain` prints) and in `run`."""
    kw = _step(2, 1, (16, 1), seed, form=form)
    planner = make_planner(kw, monkeypatch, pretend(SM100), "flashinfer")
    with pytest.raises(MSAUnsupportedError, match="on compute capability 10.x it reads separate contiguous K and V caches"):
        run_step(planner, kw)
    problem, inputs = check_decode_inputs(**kw)
    k, v = problem.layout.kv_views(inputs.kv_cache)
    with pytest.raises(ValueError, match="does not directly support K/V views split from a packed paged cache"):
        flashinfer.ops.msa_sparse_decode_attention(
            kw["q"], k, v, torch.zeros((1, 2, 16), dtype=torch.int32), page_table=kw["block_table"],
            seqused_k=kw["seq_lens"], seqlen_q=1, causal=True, force_fused=True)
    assert not flashinfer.launches


def test_12x_route_reads_a_packed_cache(flashinfer: FlashInferHarness, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On 12.0/12.1 the library's CuTe-DSL route reads a packed cache's halves and takes no
    `out=` (it raises NotImplementedError for one): msa copies its result."""
    flashinfer.use_12x()
    kw = _step(2, 2, (16, 2), seed, form="packed")
    planner = make_planner(kw, monkeypatch, pretend(SM120), lse=True)
    plan, out, lse = run_step(planner, kw, lse=True)
    assert plan.packed_views and planner.plans.keys()[0].backend == "flashinfer"
    call = flashinfer.sm12x_calls[-1]
    assert call["k"].dim() == 5, "the kernel got the packed cache itself"
    assert_matches_reference(out, kw, lse)


def test_graph_capture_is_declared_not_attempted(flashinfer: FlashInferHarness, seed: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's graph workspace serves one captured call (warmed with its exact tensors):
    one plan serving every layer cannot meet that, so msa refuses capture, and says so."""
    kw = _step(2, 1, (16, 1), seed)
    problem, _ = check_decode_inputs(**kw)
    policy = SelectionPolicy(BackendRegistry(environ={}), environ={})
    selection = policy.evaluate(attrs.evolve(problem, graph_capture=True), pretend(SM100))
    assert any("cannot run inside CUDA-graph capture" in r for r in selection.rejected.get("flashinfer", []))
    planner = make_planner(kw, monkeypatch, pretend(SM100))
    run_step(planner, kw)
    # what the library does with one workspace and two layers: the second capture is refused
    ops, device = flashinfer.ops, kw["q"].device
    workspace = flashinfer.sm100.MSASparseAttentionWorkspace(device)
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1).backend_plan
    k, v = kw["kv_cache"]
    layers = [(k, v), (k.clone(), v.clone())]
    call = dict(page_table=kw["block_table"], seqused_k=kw["seq_lens"], seqlen_q=1, causal=True, force_fused=True,
                workspace=workspace)
    for kk, vv in layers:
        ops.msa_sparse_decode_attention(kw["q"], kk, vv, plan.indices, **call)
    flashinfer.capturing = True
    ops.msa_sparse_decode_attention(kw["q"], *layers[0], plan.indices, **call)
    with pytest.raises(RuntimeError, match="already participated in CUDA graph capture and cannot be captured again"):
        ops.msa_sparse_decode_attention(kw["q"], *layers[1], plan.indices, **call)
    with pytest.raises(RuntimeError, match="requires an explicit MSASparseAttentionWorkspace"):
        ops.msa_sparse_decode_attention(kw["q"], *layers[1], plan.indices, **dict(call, workspace=None))
    # and msa refuses before reaching the library
    pretend_capture(monkeypatch)
    launches = len(flashinfer.launches)
    with pytest.raises(MSAUnsupportedError, match="cannot run inside CUDA-graph capture"):
        run_step(planner, kw)
    assert len(flashinfer.launches) == launches
