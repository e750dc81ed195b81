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
from msa.backends.flashinfer import FlashInferBackend
from msa.errors import MSAUnsupportedError
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


def _run(backend: Any, kw: dict[str, Any], lse: bool = False) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    problem, inputs = check_decode_inputs(**kw, return_lse=lse)
    plan = backend.plan(problem, inputs)
    out = torch.full(kw["q"].shape, float("nan"), dtype=torch.bfloat16)
    lse_t = torch.full(kw["q"].shape[:2], float("nan")) if lse else None
    backend.run(plan, inputs, out, lse_t)
    return plan, out, lse_t


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
    registry = BackendRegistry(environ={})
    policy = SelectionPolicy(registry, environ={})
    step = _step(layout, batch, length, heads, seed)
    kw = step.kwargs()
    _malform(kw, gen)
    problem, _ = check_decode_inputs(**kw)
    chosen, selection = policy.select(problem, SM100, "cutlass")
    assert isinstance(chosen, CutlassSM100Backend) and selection.chosen == "cutlass_sm100"

    plan, out, _ = _run(chosen, kw)
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
    plan2, out2, _ = _run(chosen, kw)
    assert plan2 is plan and len(fmha.PLAN_CALLS) == 1 and chosen.plans.hits == 1
    assert {k: v.data_ptr() for k, v in plan.decode.items() if isinstance(v, torch.Tensor)} == addresses
    row_req = torch.arange(batch * length) // length
    local = torch.arange(batch * length) % length
    assert torch.equal(plan.decode["kv_segment_lens"], new_lens[row_req])
    assert torch.equal(plan.decode["qo_offset"], (new_lens[row_req] - length + local).int())
    _assert_matches_reference(out2, kw)


def test_cutlass_plan_cache_keys(fakes: dict[str, Any], seed: int) -> None:
    backend = CutlassSM100Backend(max_plans=2)
    kw = _step("fp8_e4m3", 16, 1, (16, 1), seed).kwargs()
    plan_a, _, _ = _run(backend, kw)
    kw2 = _step("fp8_e4m3", 16, 2, (16, 1), seed).kwargs()
    plan_b, _, _ = _run(backend, kw2)
    assert plan_b is not plan_a and plan_b.key.query_len == 2
    wide = torch.full((16, 40), -1, dtype=torch.int32)
    wide[:, : kw["block_table"].shape[1]] = kw["block_table"]
    kw["block_table"] = wide[:, : kw["block_table"].shape[1]]  # a view with a longer row stride
    plan_c, out, _ = _run(backend, kw)
    assert plan_c.key.table_stride == 40 and plan_c is not plan_a
    _assert_matches_reference(out, kw)
    assert len(backend.plans) == 2 and backend.plans.evictions == 1
    assert plan_a.key not in backend.plans  # least recently used went first


def test_cutlass_stages_non_contiguous_out(fakes: dict[str, Any], seed: int) -> None:
    backend = CutlassSM100Backend()
    kw = _step("nvfp4", 2, 1, (16, 1), seed).kwargs()
    problem, inputs = check_decode_inputs(**kw)
    plan = backend.plan(problem, inputs)
    buf = torch.full((2, 16, 160), float("nan"), dtype=torch.bfloat16)
    out = buf[:, :, 16:144]
    backend.run(plan, inputs, out, None)
    _assert_matches_reference(out, kw)
    assert torch.isnan(buf[:, :, :16]).all()


def test_flashinfer_adapter_against_fake_library(fakes: dict[str, Any], seed: int, gen: torch.Generator) -> None:
    fi = fakes["fi"]
    policy = SelectionPolicy(BackendRegistry(environ={}), environ={})
    kw = _step("fp8_e4m3", 3, 4, (32, 2), seed).kwargs()
    _malform(kw, gen)
    problem, _ = check_decode_inputs(**kw, return_lse=True)
    chosen, selection = policy.select(problem, SM100)
    assert isinstance(chosen, FlashInferBackend), selection.explain()
    plan, out, lse = _run(chosen, kw, lse=True)
    _assert_matches_reference(out, kw, lse)
    assert fi.CALLS[-1]["seqlen_q"] == 4 and fi.CALLS[-1]["return_softmax_lse"] is True
    plan2, out2, _ = _run(chosen, kw)
    assert plan2 is plan and plan2.workspace is plan.workspace
    _assert_matches_reference(out2, kw)


def test_adapters_without_their_library_raise_clearly(seed: int) -> None:
    for name in FAKE_MODULES:
        sys.modules.pop(name, None)
    kw = _step("fp8_e4m3", 16, 1, (16, 1), seed).kwargs()
    problem, inputs = check_decode_inputs(**kw)
    with pytest.raises(MSAUnsupportedError, match="backend 'cutlass_sm100' needs the 'fmha_sm100' package"):
        CutlassSM100Backend().plan(problem, inputs)
    with pytest.raises(MSAUnsupportedError, match="backend 'flashinfer' needs the 'flashinfer.msa_ops' package"):
        FlashInferBackend().plan(problem, inputs)
