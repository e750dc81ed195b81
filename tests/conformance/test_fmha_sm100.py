"""msa's `cutlass_sm100` adapter against vLLM 0.33.0's `vllm.third_party.fmha_sm100` (its
planner, plan options, layout checks and input validation run for real; see conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from adapter_checks import assert_matches_reference, pretend_capture
from harness import FmhaHarness, make_planner, pretend, run_step

import msa
from msa.backends.cutlass_sm100 import MIN_BATCH_ENV, CutlassSM100Backend
from msa.errors import MSAUnsupportedError
from msa.workload import make_decode_step

pytestmark = pytest.mark.conformance

SM100 = (10, 0)


@pytest.fixture(autouse=True)
def _small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's own knob for the fp8 batch floor: small batches keep the kernel stand-in quick
    monkeypatch.setenv(MIN_BATCH_ENV, "1")


def _step(layout: str, batch: int, length: int, heads: tuple[int, int], seed: int, form: str = "packed") -> dict[str, Any]:
    step = make_decode_step(
        msa.Geometry(heads[0], heads[1], 128, 128, 16), batch_size=batch, decode_query_len=length,
        context_len=128 * 12, kv_cache_dtype=layout, q_dtype=torch.float8_e4m3fn, seed=seed, kv_form=form,
    )
    kw = step.kwargs()
    ids = kw["topk_indices"].clone()
    ids[:, ::3, 5] = -1  # -1 inside lists
    ids[:, 1::4, 2] = 400  # ids past every table
    kw["topk_indices"] = ids
    kw["seq_lens"] = kw["seq_lens"].clone()
    return kw


def _widen(kw: dict[str, Any], pad: int) -> None:
    """The block table as a view whose rows are `pad` entries wider than they are used."""
    table = kw["block_table"]
    wide = torch.full((table.shape[0], table.shape[1] + pad), 3, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    kw["block_table"] = wide[:, : table.shape[1]]


def test_found_where_vllm_ships_it(fmha: FmhaHarness) -> None:
    platform = pretend(SM100)
    assert "fmha_sm100" in platform.packages, "msa.platform.detect finds vllm.third_party.fmha_sm100"
    backend = CutlassSM100Backend()
    assert backend._library() is fmha.api
    assert backend.version() == "vllm 0.33.0"


CASES = [
    # layout, batch, L, heads, cache form, table pad
    ("fp8_e4m3", 3, 1, (64, 4), "packed", 0),
    ("fp8_e4m3", 2, 3, (16, 2), "separate", 5),
    ("fp8_e4m3", 3, 2, (8, 1), "sglang", 0),
    ("nvfp4", 3, 1, (64, 4), "packed", 0),  # GQA 16: the library's default would plan Q8KV4
    ("nvfp4", 2, 2, (16, 2), "packed", 7),  # GQA 8, a strided table
    ("nvfp4", 2, 1, (8, 2), "packed", 0),  # GQA 4: kv_mode 3 serves any group
]


@pytest.mark.parametrize("layout, batch, length, heads, form, pad", CASES)
def test_decode_follows_refreshed_steps(layout: str, batch: int, length: int, heads: tuple[int, int], form: str,
                                        pad: int, fmha: FmhaHarness, seed: int, gen: torch.Generator,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan once, run two steps of one shape with different lengths and lists: the kernel reads
    the plan buffers msa refreshes in place (kv_mode 3), never plan-time state (Q8KV4)."""
    kw = _step(layout, batch, length, heads, seed, form)
    if pad:
        _widen(kw, pad)
    planner = make_planner(kw, monkeypatch, pretend(SM100), "cutlass")
    plan, out, _ = run_step(planner, kw)
    assert planner.plans.keys()[0].backend == "cutlass_sm100"
    assert not fmha.q8kv4_plans and "q8kv4" not in plan.decode, "planned the Q8KV4 route (decode_backend)"
    variant = fmha.variants[-1]
    assert variant["kv_mode"] == (3 if layout == "nvfp4" else 0) and variant["sparse_mode"] == "Sparse"
    assert_matches_reference(out, kw)

    # the next step: new lengths (shorter and longer than at planning), lists reordered
    kw["seq_lens"].copy_(torch.randint(length, 128 * 12, (batch,), generator=gen).int())
    kw["seq_lens"][0] = length  # a request with only its new tokens
    kw["seq_lens"][-1] = 0  # a padded request
    kw["topk_indices"].copy_(kw["topk_indices"].flip(-1))
    kw["q"].copy_(torch.randn(kw["q"].shape, generator=gen).to(torch.float8_e4m3fn))
    plan2, out2, _ = run_step(planner, kw)
    assert plan2 is plan and len(fmha.plans) == 1 and not fmha.q8kv4_runs
    assert_matches_reference(out2, kw)
    run = fmha.runs[-1]
    assert run["maybe_o"] is out2 and run["maybe_kv_block_indexes"] is plan.topk


def test_nvfp4_global_scales_reach_the_binding_as_tensors(fmha: FmhaHarness, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kv_mode-3 binding takes the NVFP4 global scales as fp32 device tensors
    (`ffi::TensorView`): python floats become a plan tensor."""
    kw = _step("nvfp4", 2, 1, (16, 1), seed)
    kw["k_scale"], kw["v_scale"] = float(kw["k_scale"]), float(kw["v_scale"])
    planner = make_planner(kw, monkeypatch, pretend(SM100))
    _, out, _ = run_step(planner, kw)
    assert fmha.runs, "the kv_mode-3 kernel did not run"
    run = fmha.runs[-1]
    assert isinstance(run["nvfp4_k_global_scale"], torch.Tensor) and float(run["nvfp4_v_global_scale"]) == kw["v_scale"]
    assert_matches_reference(out, kw)


def test_fp8_scales_are_host_numbers(fmha: FmhaHarness, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The FP8 binding takes scales as C++ doubles: a tensor scale is read outside capture and
    refused inside it (where the read is impossible)."""
    kw = _step("fp8_e4m3", 2, 1, (16, 1), seed)
    planner = make_planner(kw, monkeypatch, pretend(SM100), "cutlass")
    _, out, _ = run_step(planner, kw)  # k_scale / v_scale: one-element tensors
    assert all(isinstance(fmha.runs[-1][n], float) for n in ("sm_scale", "scale_q", "scale_k", "scale_v"))
    assert_matches_reference(out, kw)
    pretend_capture(monkeypatch)
    with pytest.raises(MSAUnsupportedError, match="takes k_scale as a host number"):
        run_step(planner, kw)
    kw["k_scale"], kw["v_scale"] = float(kw["k_scale"]), float(kw["v_scale"])
    _, out, _ = run_step(planner, kw)
    assert_matches_reference(out, kw)


def test_strided_out_is_staged(fmha: FmhaHarness, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel writes `out` compactly from its pointer: a strided `out` gets a plan buffer."""
    kw = _step("nvfp4", 2, 1, (16, 1), seed)
    planner = make_planner(kw, monkeypatch, pretend(SM100))
    buf = torch.full((2, 16, 160), float("nan"), dtype=torch.bfloat16)
    plan, _, _ = run_step(planner, kw, out=buf[..., 16:144])
    assert fmha.runs and fmha.runs[-1]["maybe_o"] is plan.out, "the kv_mode-3 kernel wrote a plan buffer"
    assert_matches_reference(buf[..., 16:144], kw)
    assert torch.isnan(buf[..., :16]).all() and torch.isnan(buf[..., 144:]).all()


def test_msa_limits_are_the_librarys(fmha: FmhaHarness) -> None:
    """The planner option msa passes exists; the row budget msa declares is the planner's."""
    api = fmha.api

    def plan(batch: int, heads: int, **options: Any) -> Any:
        lens = torch.full((batch,), 700, dtype=torch.int32)
        ones = torch.ones(batch, dtype=torch.int32)
        return api.fmha_sm100_plan(ones, lens, heads, num_kv_heads=4, qo_offset=lens - ones, page_size=128,
                                   output_maxscore=False, kv_block_num=16, causal=True, sparse_kernel_mode="decode",
                                   use_fp8_kvcache=True, split_prefill_decode=False, device=torch.device("cpu"),
                                   **options)

    assert "q8kv4" not in plan(4, 64, decode_backend="kv_mode3")[3]
    with pytest.raises(ValueError, match="decode_backend must be one of"):
        plan(4, 64, decode_backend="kv_mode_3")
    budget = CutlassSM100Backend.capabilities.max_rows
    assert budget is not None
    plan(budget // 64, 64, decode_backend="kv_mode3")
    with pytest.raises(AssertionError):
        plan(budget // 64 + 1, 64, decode_backend="kv_mode3")
