"""The adapters for external kernel libraries, on the CPU, against output-only stand-ins
(tests/fakes) that compute what the kernels would from the arguments they get.

These tests cover msa's side: the plan is reused and refreshed in place, the index lists are
compacted without allocating, strided tables and outputs are staged in plan buffers, the cache
forms and graph capture are refused where the libraries cannot serve them, host scalars are
refused inside capture. Whether the real libraries accept the calls is tests/conformance's
question (`make conformance`): the stand-ins here validate nothing.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from adapter_checks import assert_matches_reference, pretend_capture

import msa
import msa.planner
from msa.backends.cutlass_sm100 import MIN_BATCH_ENV, CutlassSM100Backend
from msa.backends.external import TopkCompactor
from msa.backends.flashinfer import FlashInferBackend, FlashInferPlan
from msa.errors import MSAInputError, MSAUnsupportedError
from msa.layouts import get_layout
from msa.planner import DecodePlanner
from msa.planning import StepTables, resolve_entries
from msa.platform import Platform, package_installed
from msa.policy import SelectionPolicy
from msa.registry import BackendRegistry
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step

FAKES = Path(__file__).parent / "fakes"
SM100 = Platform.cuda((10, 0), packages=("fmha_sm100", "flashinfer", "triton"))
SM120 = Platform.cuda((12, 0), packages=("fmha_sm100", "flashinfer", "triton"))
FAKE_MODULES = ("fmha_sm100", "flashinfer", "flashinfer.msa_ops", "fake_attend")


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    monkeypatch.setenv(MIN_BATCH_ENV, "1")  # vLLM's knob: small fp8 batches keep these CPU tests quick
    monkeypatch.syspath_prepend(str(FAKES))
    for name in FAKE_MODULES:
        sys.modules.pop(name, None)
    importlib.invalidate_caches()
    yield {"fmha": importlib.import_module("fmha_sm100"), "fi": importlib.import_module("flashinfer.msa_ops")}
    for name in FAKE_MODULES:
        sys.modules.pop(name, None)


def _step(layout: str, batch: int, length: int, heads: tuple[int, int], seed: int, form: str = "packed") -> Any:
    geometry = msa.Geometry(heads[0], heads[1], 128, 128, 16)
    return make_decode_step(
        geometry, batch_size=batch, decode_query_len=length, context_len=128 * 20,
        kv_cache_dtype=layout, q_dtype=torch.float8_e4m3fn, seed=seed, kv_form=form,
    )


def _malform(kw: dict[str, Any]) -> None:
    """-1 in the middle of lists, ids past the visible blocks, a negative page, an empty request."""
    ids = kw["topk_indices"].clone()
    ids[:, ::3, 5] = -1
    kw["topk_indices"] = ids
    table = kw["block_table"].clone()
    table[0, 3] = -1
    kw["block_table"] = table
    lens = kw["seq_lens"].clone()
    lens[-1] = 0
    lens[1] = 300  # 3 visible blocks: most of request 1's ids lie past them
    kw["seq_lens"] = lens


def _compact_reference(inputs: Any) -> torch.Tensor:
    """The lists as the libraries want them, from `planning.resolve_entries` (the one home of
    which entries are used): used ids ascending, `-1` at the tail."""
    used, block, _, _ = resolve_entries(inputs)
    last = torch.iinfo(torch.int32).max
    ordered = torch.where(used, block, last).sort(dim=-1).values
    return torch.where(ordered == last, -1, ordered).to(torch.int32)


def make_planner(kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch, backend: str = "auto", lse: bool = False,
                 max_plans: int = 16, platform: Platform = SM100) -> DecodePlanner:
    """A planner on a pretend machine for this step, told the step's cache form."""
    problem, _ = check_decode_inputs(**kw)
    options: dict[str, Any] = dict(
        kv_cache_dtype=problem.kv_layout, backend=backend, device="cpu", q_dtype=torch.float8_e4m3fn,
        with_lse=lse, platform=platform, max_plans=max_plans,
        policy=SelectionPolicy(BackendRegistry(environ={}), environ={}),
    )
    return DecodePlanner(problem.geometry, kv_form=problem.kv_form, **options)


def _run(planner: DecodePlanner, kw: dict[str, Any], lse: bool = False) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """Plan and run one step with poisoned outputs; returns (the backend's plan, out, lse)."""
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=kw["decode_query_len"])
    out = torch.full(kw["q"].shape, float("nan"), dtype=torch.bfloat16)
    lse_t = torch.full(kw["q"].shape[:2], float("nan")) if lse else None
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, lse=lse_t,
                k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    return plan.backend_plan, out, lse_t


# -- the index lists ------------------------------------------------------------------------------


@pytest.mark.parametrize("length, stride_pad", [(1, 0), (3, 5)])
def test_compactor_writes_used_entries_ascending(length: int, stride_pad: int, seed: int) -> None:
    """The plan-buffer compaction gives exactly the used entries of docs/semantics.md §3, sorted,
    -1 at the tail (checked against `_compact_reference` and, entry by entry, against
    `resolve_entries`' used set), into head-major and token-major targets alike."""
    kw = _step("fp8_e4m3", 5, length, (16, 2), seed).kwargs()
    _malform(kw)
    ids = kw["topk_indices"]
    ids[:, 1::2, 2] = 10_000  # past every table
    table = kw["block_table"]
    wide = torch.full((table.shape[0], table.shape[1] + stride_pad), 7, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    wide[2, 1] = 1 << 30  # a page past the cache
    kw["block_table"] = wide[:, : table.shape[1]]
    problem, inputs = check_decode_inputs(**kw)
    tables = StepTables.for_inputs(problem, inputs)
    compactor = TopkCompactor(problem, tables.rows, torch.device("cpu"))
    head_major = torch.full_like(ids, 99)
    token_major = torch.full((ids.shape[1], ids.shape[0], ids.shape[2]), 99, dtype=torch.int32)
    compactor.compact(inputs, head_major)
    compactor.compact(inputs, token_major.transpose(0, 1))
    expected = _compact_reference(inputs)
    assert torch.equal(head_major, expected) and torch.equal(token_major.transpose(0, 1), expected)
    used, block, _, _ = msa.planning.resolve_entries(inputs)
    for h in range(ids.shape[0]):
        for r in range(ids.shape[1]):
            want = sorted(block[h, r][used[h, r]].tolist())
            assert head_major[h, r].tolist() == want + [-1] * (ids.shape[2] - len(want))


# -- cutlass_sm100 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, batch, length, heads, form", [
    ("fp8_e4m3", 4, 2, (16, 1), "packed"),
    ("fp8_e4m3", 3, 1, (32, 2), "separate"),
    ("fp8_e4m3", 3, 1, (16, 2), "sglang"),
    ("nvfp4", 4, 3, (16, 2), "packed"),
    ("nvfp4", 3, 1, (16, 4), "packed"),
])
def test_cutlass_adapter(layout: str, batch: int, length: int, heads: tuple[int, int], form: str, fakes: dict[str, Any], seed: int, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    fmha = fakes["fmha"]
    kw = _step(layout, batch, length, heads, seed, form).kwargs()
    _malform(kw)
    planner = make_planner(kw, monkeypatch, "cutlass")
    plan, out, _ = _run(planner, kw)
    assert planner.plans.keys()[0].backend == "cutlass_sm100"
    assert_matches_reference(out, kw)
    assert len(fmha.PLAN_CALLS) == 1
    assert fmha.PLAN_CALLS[0]["decode_backend"] == "kv_mode3"
    stride = kw["block_table"].stride(0)
    want_indptr = (torch.arange(batch * length + 1) // length * stride).int()
    want_indptr[-1] = (batch - 1) * stride  # the closing entry stays inside the flat table
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
    assert_matches_reference(out2, kw)
    call = fmha.RUN_CALLS[-1]
    assert call["kv_block_indexes"] is plan.topk and call["out"] is out2, "plan-owned lists, the caller's out"


def test_cutlass_plans_per_shape(fakes: dict[str, Any], seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = _step("fp8_e4m3", 3, 1, (16, 1), seed).kwargs()
    planner = make_planner(kw, monkeypatch, "cutlass", max_plans=2)
    plan_a, _, _ = _run(planner, kw)
    kw2 = _step("fp8_e4m3", 3, 2, (16, 1), seed).kwargs()
    plan_b, _, _ = _run(planner, kw2)
    assert plan_b is not plan_a and plan_b.problem.query_len == 2
    wide = torch.full((3, 40), -1, dtype=torch.int32)
    wide[:, : kw["block_table"].shape[1]] = kw["block_table"]
    kw["block_table"] = wide[:, : kw["block_table"].shape[1]]  # a view with a longer row stride
    plan_c, out, _ = _run(planner, kw)
    assert plan_c.problem.table_stride == 40 and plan_c is not plan_a
    assert int(plan_c.decode["kv_page_indptr"][-1]) <= 2 * 40 + kw["block_table"].shape[1]
    assert_matches_reference(out, kw)
    assert len(fakes["fmha"].PLAN_CALLS) == 3 and planner.plans.evictions == 1


def test_cutlass_stages_non_contiguous_out(fakes: dict[str, Any], seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = _step("nvfp4", 2, 1, (16, 1), seed).kwargs()
    planner = make_planner(kw, monkeypatch)
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1)
    assert plan.backend.name == "cutlass_sm100", "auto picks the CUTLASS route for nvfp4 caches"
    buf = torch.full((2, 16, 160), float("nan"), dtype=torch.bfloat16)
    out = buf[:, :, 16:144]
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    assert_matches_reference(out, kw)
    assert torch.isnan(buf[:, :, :16]).all()
    assert fakes["fmha"].RUN_CALLS[-1]["out"] is plan.backend_plan.out


def test_cutlass_nvfp4_global_scales_are_device_tensors(fakes: dict[str, Any], seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The NVFP4 route's global scales are device tensors in the library: floats become a plan
    tensor (a device fill, capturable); tensors pass through."""
    kw = _step("nvfp4", 3, 1, (16, 2), seed).kwargs()
    planner = make_planner(kw, monkeypatch)
    kw["k_scale"], kw["v_scale"] = float(kw["k_scale"]), float(kw["v_scale"])
    plan, out, _ = _run(planner, kw)
    call = fakes["fmha"].RUN_CALLS[-1]
    assert isinstance(call["k_scale"], torch.Tensor) and call["k_scale"].data_ptr() == plan.global_scales.data_ptr()
    assert float(call["v_scale"]) == kw["v_scale"] and isinstance(call["sm_scale"], float)
    assert_matches_reference(out, kw)


def test_cutlass_host_scalars_inside_capture(fakes: dict[str, Any], seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 scales are C++ doubles in the library: floats are fine inside capture, a tensor would
    be read on the host and is refused there; NVFP4's tensor global scales are fine."""
    kw = _step("fp8_e4m3", 3, 1, (16, 1), seed).kwargs()
    planner = make_planner(kw, monkeypatch, "cutlass")
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1)
    out = torch.empty(kw["q"].shape, dtype=torch.bfloat16)
    pretend_capture(monkeypatch)
    with pytest.raises(MSAUnsupportedError, match="takes k_scale as a host number .* CUDA-graph capture forbids: pass a python float"):
        planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, k_scale=kw["k_scale"], v_scale=0.5)
    with pytest.raises(MSAUnsupportedError, match="takes q_scale as a host number"):
        planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, k_scale=0.5, v_scale=0.5,
                    q_scale=torch.ones(1))
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, k_scale=float(kw["k_scale"]),
                v_scale=float(kw["v_scale"]))
    assert_matches_reference(out, kw)
    nv = _step("nvfp4", 3, 1, (16, 2), seed).kwargs()
    planner = make_planner(nv, monkeypatch)
    _, out, _ = _run(planner, nv)
    assert_matches_reference(out, nv)


def test_cutlass_refuses_a_strided_q(fakes: dict[str, Any], seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = _step("nvfp4", 2, 1, (16, 1), seed).kwargs()
    planner = make_planner(kw, monkeypatch)
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1)
    wide = torch.zeros(2, 16, 256, dtype=torch.float8_e4m3fn)
    wide[..., :128] = kw["q"]
    with pytest.raises(MSAUnsupportedError, match="needs a contiguous q"):
        planner.run(plan, wide[..., :128], kw["kv_cache"], kw["topk_indices"], out=torch.empty(2, 16, 128, dtype=torch.bfloat16),
                    k_scale=kw["k_scale"], v_scale=kw["v_scale"])


# -- flashinfer -------------------------------------------------------------------------------------


def test_flashinfer_adapter(fakes: dict[str, Any], seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    fi = fakes["fi"]
    kw = _step("fp8_e4m3", 3, 4, (32, 2), seed, form="separate").kwargs()
    _malform(kw)
    kw["k_scale"], kw["v_scale"] = torch.tensor([0.37]), 1.9  # folded into softmax_scale, v_global_scale
    planner = make_planner(kw, monkeypatch, lse=True)
    plan, out, lse = _run(planner, kw, lse=True)
    assert isinstance(plan, FlashInferPlan) and planner.plans.keys()[0].backend == "flashinfer"
    assert_matches_reference(out, kw, lse)
    call = fi.CALLS[-1]
    assert call["seqlen_q"] == 4 and call["return_softmax_lse"] is True and call["force_fused"] is True
    assert call["out"] is out and call["q2k_indices"] is plan.indices, "writes the caller's out; plan-owned lists"
    assert call["k"] is kw["kv_cache"][0] and call["v"] is kw["kv_cache"][1], "the caller's K and V, not copies"
    assert "k_scale" not in call and "v_scale" not in call and "workspace" not in call
    # a strided block table and lengths are staged in plan buffers; a strided out too
    table = kw["block_table"]
    wide = torch.full((3, table.shape[1] + 6), -1, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    kw["block_table"] = wide[:, : table.shape[1]]
    kw["seq_lens"] = torch.stack((kw["seq_lens"], kw["seq_lens"]), dim=1)[:, 0]
    planner = make_planner(kw, monkeypatch, lse=True)
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=4)
    buf = torch.full((12, 32, 200), float("nan"), dtype=torch.bfloat16)
    lse_t = torch.full((12, 32), float("nan"))
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=buf[..., :128], lse=lse_t,
                k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    assert_matches_reference(buf[..., :128], kw, lse_t)
    call = fi.CALLS[-1]
    backend_plan = plan.backend_plan
    assert call["page_table"] is backend_plan.table and call["page_table"].is_contiguous()
    assert call["seqused_k"] is backend_plan.seq_lens and call["out"] is backend_plan.out
    assert torch.isnan(buf[..., 128:]).all()


@pytest.mark.parametrize("form", ["packed", "sglang"])
def test_flashinfer_refuses_caches_it_cannot_read(form: str, fakes: dict[str, Any], seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On 10.x the library reads two contiguous tensors only: a packed cache (or strided views)
    is refused when the step is selected, with the reason, and in `run` (never copied)."""
    kw = _step("fp8_e4m3", 2, 1, (16, 1), seed, form=form).kwargs()
    planner = make_planner(kw, monkeypatch, "flashinfer")
    with pytest.raises(MSAUnsupportedError, match=r"on compute capability 10.x it reads separate contiguous K and V caches"):
        planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1)
    # a planner told "separate" that is then handed another form refuses it in run
    separate = _step("fp8_e4m3", 2, 1, (16, 1), seed, form="separate").kwargs()
    planner = make_planner(separate, monkeypatch, "flashinfer")
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1)
    with pytest.raises(MSAUnsupportedError, match="cannot read this cache: on compute capability 10.x"):
        planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=torch.empty(2, 16, 128, dtype=torch.bfloat16),
                    k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    assert not fakes["fi"].CALLS


def test_flashinfer_12x_route_reads_packed_caches(fakes: dict[str, Any], seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On 12.x the library reads a packed cache's halves and takes no `out=`: its result is copied."""
    fi = fakes["fi"]
    monkeypatch.setattr(fi, "PACKED_VIEWS", True)
    kw = _step("fp8_e4m3", 2, 2, (16, 1), seed).kwargs()
    planner = make_planner(kw, monkeypatch, lse=True, platform=SM120)
    plan, out, lse = _run(planner, kw, lse=True)
    assert plan.packed_views and planner.plans.keys()[0].backend == "flashinfer"
    assert fi.CALLS[-1]["out"] is None and fi.CALLS[-1]["result"] is not out
    assert_matches_reference(out, kw, lse)


def test_flashinfer_is_not_captured(fakes: dict[str, Any], seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = _step("fp8_e4m3", 2, 1, (16, 1), seed, form="separate").kwargs()
    planner = make_planner(kw, monkeypatch, "flashinfer")
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1)
    pretend_capture(monkeypatch)
    with pytest.raises(MSAUnsupportedError, match="backend 'flashinfer' cannot run inside CUDA-graph capture: FlashInfer's graph workspace"):
        planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=torch.empty(2, 16, 128, dtype=torch.bfloat16),
                    k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    assert not fakes["fi"].CALLS
    problem, _ = check_decode_inputs(**kw)
    policy = SelectionPolicy(BackendRegistry(environ={}), environ={})
    assert policy.evaluate(problem, SM100).chosen == "flashinfer"
    selection = policy.evaluate(attrs.evolve(problem, graph_capture=True), SM100)
    assert any("cannot run inside CUDA-graph capture" in r for r in selection.rejected["flashinfer"])


def test_planner_chooses_by_the_cache_form_and_capture_it_is_told(fakes: dict[str, Any], seed: int) -> None:
    """`DecodePlanner(kv_form=..., graph_capture=...)` reaches the policy: FlashInfer is chosen for
    a separate cache on 10.x, never for a packed one or for steps to be captured."""
    kw = _step("fp8_e4m3", 2, 1, (16, 1), seed, form="separate").kwargs()
    problem, _ = check_decode_inputs(**kw)

    def chosen(**extra: Any) -> str:
        planner = DecodePlanner(
            problem.geometry, kv_cache_dtype=problem.kv_layout, device="cpu", q_dtype=torch.float8_e4m3fn,
            platform=SM100, policy=SelectionPolicy(BackendRegistry(environ={}), environ={}), **extra,
        )
        planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1)
        return planner.plans.keys()[0].backend

    assert chosen(kv_form="separate") == "flashinfer"
    assert chosen() != "flashinfer"
    assert chosen(kv_form="separate", graph_capture=True) != "flashinfer"
    with pytest.raises(MSAInputError, match="kv_form"):
        DecodePlanner(problem.geometry, kv_form="pair")


# -- finding the libraries ----------------------------------------------------------------------------


def test_fmha_sm100_is_found_inside_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM ships the library as `vllm.third_party.fmha_sm100`: found there without importing
    vLLM, and as a standalone `fmha_sm100`."""
    for name in ("vllm", "fmha_sm100"):
        sys.modules.pop(name, None)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not package_installed("fmha_sm100")
    inner = tmp_path / "vllm" / "third_party" / "fmha_sm100"
    inner.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("raise RuntimeError('vllm must not be imported')\n")
    (tmp_path / "vllm" / "third_party" / "__init__.py").write_text("")
    importlib.invalidate_caches()
    assert not package_installed("fmha_sm100"), "a vLLM without the library"
    (inner / "__init__.py").write_text("")
    importlib.invalidate_caches()
    assert package_installed("fmha_sm100") and "vllm" not in sys.modules
    (inner / "__init__.py").unlink()
    (tmp_path / "fmha_sm100.py").write_text("")
    importlib.invalidate_caches()
    assert package_installed("fmha_sm100")


def test_adapters_without_their_library_raise_clearly(seed: int) -> None:
    for name in FAKE_MODULES:
        sys.modules.pop(name, None)
    kw = _step("fp8_e4m3", 16, 1, (16, 1), seed).kwargs()
    problem, inputs = check_decode_inputs(**kw)
    tables = StepTables.for_inputs(problem, inputs)
    with pytest.raises(MSAUnsupportedError, match="backend 'cutlass_sm100' needs one of the modules 'vllm.third_party.fmha_sm100.api'"):
        CutlassSM100Backend().plan(problem, tables)
    with pytest.raises(MSAUnsupportedError, match="backend 'flashinfer' needs one of the modules 'flashinfer.msa_ops'"):
        FlashInferBackend().plan(problem, tables)


def test_separate_caches_allocate_as_the_library_reads_them() -> None:
    """`layout.allocate(..., separate=True)` gives the form FlashInfer reads on 10.x."""
    k, v = get_layout("fp8").allocate(4, 2, 128, 128, separate=True)
    assert k.is_contiguous() and v.is_contiguous() and k.shape == (4, 2, 128, 128)
