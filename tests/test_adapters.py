"""The adapters for external kernel libraries, against fake libraries (tests/fakes) that check
every argument and compute from what they are given."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import msa
from msa.backends.cutlass_sm100 import CutlassSM100Backend
from msa.backends.flashinfer import FlashInferBackend, FlashInferPlan
from msa.errors import MSAUnsupportedError
from msa.planner import DecodePlanner
from msa.planning import StepTables
from msa.platform import Platform
from msa.policy import SelectionPolicy
from msa.registry import BackendRegistry
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step

FAKES = Path(__file__).parent / "fakes"
SM100 = Platform.cuda((10, 0), packages=("fmha_sm100", "flashinfer", "triton"))
FAKE_MODULES = ("fmha_sm100", "flashinfer", "flashinfer.msa_ops", "fake_attend")


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    monkeypatch.syspath_prepend(str(FAKES))
    for name in FAKE_MODULES:
        sys.modules.pop(name, None)
    importlib.invalidate_caches()
    yield {"fmha": importlib.import_module("fmha_sm100"), "fi": importlib.import_module("flashinfer.msa_ops")}
    for name in FAKE_MODULES:
        sys.modules.pop(name, None)


def _step(layout: str, batch: int, length: int, heads: tuple[int, int], seed: int) -> Any:
    geometry = msa.Geometry(heads[0], heads[1], 128, 128, 16)
    step = make_decode_step(
        geometry, batch_size=batch, decode_query_len=length, context_len=128 * 20,
        kv_cache_dtype=layout, q_dtype=torch.float8_e4m3fn, seed=seed,
    )
    return step


def _malform(kw: dict[str, Any], gen: torch.Generator) -> None:
    """-1 in the middle of lists, ids past the visible blocks, a negative page, an empty request."""
    ids = kw["topk_indices"].clone()
    hkv, rows, k = ids.shape
    ids[:, ::3, 5] = -1
    kw["topk_indices"] = ids
    table = kw["block_table"].clone()
    table[0, 3] = -1
    kw["block_table"] = table
    lens = kw["seq_lens"].clone()
    lens[-1] = 0
    lens[1] = 300  # 3 visible blocks: most of request 1's ids lie past them
    kw["seq_lens"] = lens


def _planner(kw: dict[str, Any], backend: str = "auto", lse: bool = False, max_plans: int = 16) -> DecodePlanner:
    problem, _ = check_decode_inputs(**kw)
    return DecodePlanner(
        problem.geometry, kv_cache_dtype=problem.kv_layout, backend=backend, device="cpu",
        q_dtype=torch.float8_e4m3fn, with_lse=lse, platform=SM100, max_plans=max_plans,
        policy=SelectionPolicy(BackendRegistry(environ={}), environ={}),
    )


def _run(planner: DecodePlanner, kw: dict[str, Any], lse: bool = False) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """Plan and run one step with poisoned outputs; returns (the backend's plan, out, lse)."""
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=kw["decode_query_len"])
    out = torch.full(kw["q"].shape, float("nan"), dtype=torch.bfloat16)
    lse_t = torch.full(kw["q"].shape[:2], float("nan")) if lse else None
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, lse=lse_t,
                k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    return plan.backend_plan, out, lse_t


def _reference(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
    return out, lse


def _assert_matches_reference(out: torch.Tensor, kw: dict[str, Any], lse: torch.Tensor | None = None) -> None:
    ref_out, ref_lse = _reference(kw)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2**-7, atol=2e-3)
    if lse is not None:
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("layout, batch, length, heads", [
    ("fp8_e4m3", 16, 2, (16, 1)),
    ("nvfp4", 4, 3, (16, 2)),
    ("nvfp4", 3, 1, (8, 1)),
])
def test_cutlass_adapter_against_fake_library(layout: str, batch: int, length: int, heads: tuple[int, int], fakes: dict[str, Any], seed: int, gen: torch.Generator) -> None:
    fmha = fakes["fmha"]
    step = _step(layout, batch, length, heads, seed)
    kw = step.kwargs()
    _malform(kw, gen)
    planner = _planner(kw, "cutlass")
    plan, out, _ = _run(planner, kw)
    assert planner.plans.keys()[0].backend == "cutlass_sm100"
    _assert_matches_reference(out, kw)
    assert len(fmha.PLAN_CALLS) == 1
    call = fmha.PLAN_CALLS[0]
    assert call["kv_block_num"] == 16 and call["num_kv_heads"] == heads[1]
    stride = kw["block_table"].stride(0)
    rows = torch.arange(batch * length + 1)
    want_indptr = (rows // length * stride).int()
    want_indptr[-1] = batch * stride
    assert torch.equal(plan.decode["kv_page_indptr"], want_indptr), "indptr points rows at their table row"

    # a new step of the same shape: same plan object and buffers, metadata refreshed in place
    addresses = {k: v.data_ptr() for k, v in plan.decode.items() if isinstance(v, torch.Tensor)}
    new_lens = torch.randint(length, 128 * 20, (batch,), generator=gen).int()
    kw["seq_lens"].copy_(new_lens)
    kw["q"].copy_(torch.randn(kw["q"].shape, generator=gen).to(torch.float8_e4m3fn))
    kw["topk_indices"].copy_(kw["topk_indices"].flip(-1))  # order must not matter
    plan2, out2, _ = _run(planner, kw)
    assert plan2 is plan and len(fmha.PLAN_CALLS) == 1 and planner.plans.hits == 1
    assert {k: v.data_ptr() for k, v in plan.decode.items() if isinstance(v, torch.Tensor)} == addresses
    row_req = torch.arange(batch * length) // length
    local = torch.arange(batch * length) % length
    assert torch.equal(plan.decode["kv_segment_lens"], new_lens[row_req])
    assert torch.equal(plan.decode["qo_offset"], (new_lens[row_req] - length + local).int())
    _assert_matches_reference(out2, kw)


def test_cutlass_plans_per_shape(fakes: dict[str, Any], seed: int) -> None:
    kw = _step("fp8_e4m3", 16, 1, (16, 1), seed).kwargs()
    planner = _planner(kw, "cutlass", max_plans=2)
    plan_a, _, _ = _run(planner, kw)
    kw2 = _step("fp8_e4m3", 16, 2, (16, 1), seed).kwargs()
    plan_b, _, _ = _run(planner, kw2)
    assert plan_b is not plan_a and plan_b.problem.query_len == 2
    wide = torch.full((16, 40), -1, dtype=torch.int32)
    wide[:, : kw["block_table"].shape[1]] = kw["block_table"]
    kw["block_table"] = wide[:, : kw["block_table"].shape[1]]  # a view with a longer row stride
    plan_c, out, _ = _run(planner, kw)
    assert plan_c.problem.table_stride == 40 and plan_c is not plan_a
    _assert_matches_reference(out, kw)
    assert len(fakes["fmha"].PLAN_CALLS) == 3 and planner.plans.evictions == 1


def test_cutlass_stages_non_contiguous_out(fakes: dict[str, Any], seed: int) -> None:
    kw = _step("nvfp4", 2, 1, (16, 1), seed).kwargs()
    planner = _planner(kw)
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1)
    assert plan.backend.name == "cutlass_sm100", "auto picks the CUTLASS route for nvfp4 caches"
    buf = torch.full((2, 16, 160), float("nan"), dtype=torch.bfloat16)
    out = buf[:, :, 16:144]
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    _assert_matches_reference(out, kw)
    assert torch.isnan(buf[:, :, :16]).all()


def test_flashinfer_adapter_against_fake_library(fakes: dict[str, Any], seed: int, gen: torch.Generator) -> None:
    fi = fakes["fi"]
    kw = _step("fp8_e4m3", 3, 4, (32, 2), seed).kwargs()
    _malform(kw, gen)
    planner = _planner(kw, lse=True)
    plan, out, lse = _run(planner, kw, lse=True)
    assert isinstance(plan, FlashInferPlan) and planner.plans.keys()[0].backend == "flashinfer"
    _assert_matches_reference(out, kw, lse)
    assert fi.CALLS[-1]["seqlen_q"] == 4 and fi.CALLS[-1]["return_softmax_lse"] is True
    plan2, out2, _ = _run(planner, kw)
    assert plan2 is plan and plan2.workspace is plan.workspace
    _assert_matches_reference(out2, kw)


def test_adapters_without_their_library_raise_clearly(seed: int) -> None:
    for name in FAKE_MODULES:
        sys.modules.pop(name, None)
    kw = _step("fp8_e4m3", 16, 1, (16, 1), seed).kwargs()
    problem, inputs = check_decode_inputs(**kw)
    tables = StepTables.for_inputs(problem, inputs)
    with pytest.raises(MSAUnsupportedError, match="backend 'cutlass_sm100' needs the 'fmha_sm100' package"):
        CutlassSM100Backend().plan(problem, tables)
    with pytest.raises(MSAUnsupportedError, match="backend 'flashinfer' needs the 'flashinfer.msa_ops' package"):
        FlashInferBackend().plan(problem, tables)
