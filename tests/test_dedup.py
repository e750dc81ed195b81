"""Multi-token decode: the Triton dedup kernel (each page read once per request and KV head)
and ragged query lengths, against the reference."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from cases import gpu_atol

import msa
from msa.backends.triton import TritonBackend
from msa.backends.triton.config import choose_config
from msa.layouts import get_layout
from msa.planning import StepTables
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "") in ("", "0") and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
GEOMETRY = msa.Geometry(8, 2, 64, 16, 4)


def run(kw: dict[str, Any], backend: TritonBackend, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, Any]:
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    problem, inputs = check_decode_inputs(**kw, return_lse=True)
    plan = backend.plan(problem, StepTables.for_inputs(problem, inputs))
    out = torch.full(kw["q"].shape, float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full(kw["q"].shape[:2], float("nan"), device=device)
    backend.run(plan, inputs, out, lse)
    return out.cpu(), lse.cpu(), plan


def check(kw: dict[str, Any], out: torch.Tensor, lse: torch.Tensor, atol: float = 2e-4, rtol: float = 2**-7) -> None:
    ref_out, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
    ref_out, ref_lse = ref_out.cpu(), ref_lse.cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten (poisoned) rows"
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=rtol, atol=atol)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty) and (out[empty] == 0).all()
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], rtol=1e-5, atol=2e-5)


def _dedup_cases() -> list[Any]:
    """Every layout x L x overlap; L = 32 (four token chunks per request, ~20 s each under the
    interpreter) runs once in the default suite and in full with `-m slow` (`make test-slow`)."""
    cases = []
    for layout in ("bfloat16", "float16", "fp8_e4m3", "nvfp4"):
        for length in (2, 4, 8, 32):
            for overlap in (0.0, 0.5, 1.0):
                slow = length == 32 and (layout, overlap) != ("bfloat16", 0.5)
                cases.append(pytest.param(layout, length, overlap, marks=[pytest.mark.slow] if slow else []))
    return cases


@pytest.mark.parametrize("layout, length, overlap", _dedup_cases())
def test_dedup_matches_reference(layout: str, length: int, overlap: float, gen: torch.Generator) -> None:
    step = make_decode_step(GEOMETRY, batch_size=2, decode_query_len=length, context_len=130, kv_cache_dtype=layout,
                            q_dtype=torch.float16 if layout == "float16" else torch.bfloat16,
                            seed=int(torch.randint(2**30, (1,), generator=gen)), overlap=overlap)
    kw = step.kwargs()
    out, lse, plan = run(kw, TritonBackend(dedup=True, num_splits=1 + length % 3))
    assert plan.config.dedup and plan.config.tokens == length
    check(kw, out, lse)


def test_shared_pages_with_different_causal_limits(gen: torch.Generator) -> None:
    """Every token of a request selects the same blocks, the last one partly visible and more
    of it visible to each later token; -1s at the front, middle and tail."""
    step = make_decode_step(GEOMETRY, batch_size=3, decode_query_len=4, context_len=100, seed=3)
    kw = step.kwargs()
    kw["seq_lens"] = torch.tensor([37, 50, 3], dtype=torch.int32)  # request 2: its first row sees nothing
    ids = torch.tensor([-1, 0, 2, -1], dtype=torch.int32)
    lists = torch.stack([ids, ids.roll(1), torch.tensor([2, -1, -1, 0], dtype=torch.int32)])
    kw["topk_indices"] = lists.repeat_interleave(4, dim=0).unsqueeze(0).repeat(2, 1, 1)  # [Hkv, 12, 4]
    out, lse, plan = run(kw, TritonBackend(dedup=True))
    assert plan.config.dedup
    check(kw, out, lse)
    per_token, per_token_lse, _ = run(kw, TritonBackend(dedup=False))
    torch.testing.assert_close(out.float(), per_token.float(), rtol=2**-7, atol=2e-4)


@pytest.mark.parametrize("dedup", [True, False])
def test_ragged_query_lengths(dedup: bool, gen: torch.Generator) -> None:
    """Requests of 3, 0, 1, 4 and 0 tokens in a budget of 10 rows (the last 2 are padding)."""
    step = make_decode_step(GEOMETRY, batch_size=5, decode_query_len=2, context_len=120, seed=11)
    g = GEOMETRY
    qsl = torch.tensor([0, 3, 3, 4, 8, 8], dtype=torch.int32)
    rows = 10
    kw = step.kwargs()
    kw.update(
        q=torch.randn((rows, g.num_q_heads, g.head_dim), generator=gen).bfloat16(),
        topk_indices=torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(g.num_kv_heads * rows)])
        .view(g.num_kv_heads, rows, 4).int(),
        decode_query_len=4,
        query_start_loc=qsl,
    )
    out, lse, plan = run(kw, TritonBackend(dedup=dedup, num_splits=2))
    assert plan.config.dedup == dedup
    check(kw, out, lse)
    assert (out[8:] == 0).all() and torch.isneginf(lse[8:]).all()
    # independently: each request alone, as a uniform step, through the reference
    for b, (lo, hi) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist(), strict=True)):
        if hi == lo:
            continue
        alone = dict(kw, q=kw["q"][lo:hi], topk_indices=kw["topk_indices"][:, lo:hi], seq_lens=kw["seq_lens"][b : b + 1],
                     block_table=kw["block_table"][b : b + 1], decode_query_len=hi - lo, query_start_loc=None)
        ref = msa.sparse_decode(**alone, backend="reference")
        torch.testing.assert_close(out[lo:hi].float(), ref.float(), rtol=2**-7, atol=2e-4)


def test_ragged_through_the_api_and_validation() -> None:
    step = make_decode_step(GEOMETRY, batch_size=2, decode_query_len=3, context_len=100, seed=4)
    kw = step.kwargs()
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    out = msa.sparse_decode(**kw, query_start_loc=qsl, validate=True)
    assert isinstance(out, torch.Tensor) and out.shape == kw["q"].shape
    with pytest.raises(msa.MSAInputError, match=r"^query_start_loc: expected non-decreasing offsets, at most decode_query_len = 3"):
        msa.sparse_decode(**kw, query_start_loc=torch.tensor([0, 4, 5], dtype=torch.int32), validate=True)
    with pytest.raises(msa.MSAInputError, match=r"^query_start_loc: expected 3 entries \(B\+1"):
        msa.sparse_decode(**kw, query_start_loc=torch.tensor([0, 4], dtype=torch.int32))
    short = dict(kw, q=kw["q"][:4], topk_indices=kw["topk_indices"][:, :4])
    with pytest.raises(msa.MSAInputError, match=r"^query_start_loc: expected a last offset <= the 4 rows of q"):
        msa.sparse_decode(**short, query_start_loc=torch.tensor([0, 3, 6], dtype=torch.int32), validate=True)


def test_policy_picks_dedup_from_shapes_only() -> None:
    m3 = msa.MINIMAX_M3
    assert choose_config(m3, 64 * 4, 132, layout=get_layout("fp8_e4m3"), batch_size=64, query_len=4).dedup
    assert choose_config(m3, 33 * 3, 132, layout=get_layout("bfloat16"), batch_size=33, query_len=3).dedup
    assert not choose_config(m3, 16 * 4, 132, layout=get_layout("fp8_e4m3"), batch_size=16, query_len=4).dedup, "too few programs"
    assert not choose_config(m3, 64 * 8, 132, layout=get_layout("fp8_e4m3"), batch_size=64, query_len=8).dedup
    assert not choose_config(m3, 64 * 2, 132, layout=get_layout("fp8_e4m3"), batch_size=64, query_len=2).dedup
    assert not choose_config(m3, 64, 132, layout=get_layout("fp8_e4m3"), batch_size=64, query_len=1).dedup
    assert choose_config(m3, 64 * 4, 132, layout=get_layout("nvfp4"), batch_size=64, query_len=4).dedup
    wide = choose_config(m3, 2 * 32, 132, layout=get_layout("bfloat16"), batch_size=2, query_len=32, dedup=True)
    assert wide.dedup and wide.tokens == 8 and wide.token_chunks == 4 and wide.block_m == 128


def test_nvfp4_programs_of_32_rows_are_not_deduplicated_by_shape() -> None:
    """M3 TP8 (GQA 8) at L = 4: 32 rows a program. NVFP4 keeps the per-token kernel there (H100,
    80% overlap: 198.3 against 238.4 us at B = 256), fp8 and bf16 take dedup; forced, the NVFP4
    program walks 64-token tiles (128-token ones spilled 7080 bytes of registers on Triton 3.6)."""
    tp8 = msa.MINIMAX_M3_TP[8]
    nvfp4 = get_layout("nvfp4")
    assert not choose_config(tp8, 256 * 4, 132, layout=nvfp4, batch_size=256, query_len=4).dedup
    for layout in ("fp8_e4m3", "bfloat16"):
        assert choose_config(tp8, 256 * 4, 132, layout=get_layout(layout), batch_size=256, query_len=4).dedup
    assert choose_config(msa.MINIMAX_M3_TP[4], 256 * 4, 132, layout=nvfp4, batch_size=256, query_len=4).dedup
    for batch in (16, 64, 256):
        forced = choose_config(tp8, batch * 4, 132, layout=nvfp4, batch_size=batch, query_len=4, dedup=True)
        assert forced.dedup and forced.block_m == 32 and forced.block_n == 64
    fp8 = choose_config(tp8, 256 * 4, 132, layout=get_layout("fp8_e4m3"), batch_size=256, query_len=4)
    assert fp8.block_m == 32 and fp8.block_n == 128  # 56 bytes of stack there, and faster than 64-token tiles


def test_dedup_environment_override(monkeypatch: pytest.MonkeyPatch) -> None:
    from msa.problem import DecodeProblem

    problem = DecodeProblem(msa.MINIMAX_M3, 64, 4, "fp8_e4m3", torch.bfloat16, torch.bfloat16, "cpu", 0, 512)
    monkeypatch.setenv("MSA_TRITON_DEDUP", "1")
    assert TritonBackend().config_for(problem, torch.device("cpu")).dedup
    monkeypatch.setenv("MSA_TRITON_DEDUP", "0")
    assert not TritonBackend().config_for(problem, torch.device("cpu")).dedup
    assert TritonBackend(dedup=True).config_for(problem, torch.device("cpu")).dedup


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bfloat16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("length", [2, 4, 8])
def test_dedup_full_m3_shapes_on_gpu(layout: str, length: int) -> None:
    step = make_decode_step(msa.MINIMAX_M3, batch_size=16, decode_query_len=length, context_len=128 * 40,
                            kv_cache_dtype=layout, device="cuda", overlap=0.8)
    out, lse, plan = run(step.kwargs(), TritonBackend(dedup=True), device="cuda")
    assert plan.config.dedup
    check(step.kwargs(), out, lse, atol=gpu_atol(step.kwargs()), rtol=2**-6)


def test_a_context_parallel_rank_does_not_get_the_dedup_kernel() -> None:
    """A rank holding a share of each selection (dcp_size > 1) runs the per-token kernel where a
    whole-selection step would take the dedup one (2 H200s, L = 4, B = 64: dedup 168 us, per
    token 105). Through the planner and the one-shot path alike."""
    from msa.problem import DecodeProblem

    def problem(dcp: int) -> DecodeProblem:
        return DecodeProblem(msa.MINIMAX_M3, 64, 4, "fp8_e4m3", torch.bfloat16, torch.bfloat16, "cuda", 0, 0,
                             dcp_size=dcp)

    assert choose_config(msa.MINIMAX_M3, 256, 132, layout=get_layout("fp8"), batch_size=64, query_len=4).dedup
    assert not choose_config(msa.MINIMAX_M3, 256, 132, layout=get_layout("fp8"), batch_size=64, query_len=4,
                             dcp_size=2).dedup
    backend = TritonBackend()
    assert backend.config_for(problem(1), torch.device("cpu")).dedup
    assert not backend.config_for(problem(2), torch.device("cpu")).dedup
    planner = msa.DecodePlanner(msa.MINIMAX_M3, kv_cache_dtype="fp8", device="cpu", dcp_size=2)
    assert planner._problem((64, 4, 16, None)).dcp_size == 2
    with pytest.raises(msa.MSAInputError, match=r"^dcp_size: expected the ranks each request's pages are spread over"):
        msa.DecodePlanner(msa.MINIMAX_M3, device="cpu", dcp_size=0)
