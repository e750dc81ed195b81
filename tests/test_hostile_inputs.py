"""Inputs the cheap checks let through (the deep checks are opt-in): no kernel reads or writes
outside the tensors it was given, a bad call cannot spoil the next one, and every backend reads a
malformed `query_start_loc` the same way (`msa.semantics.request_starts`)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import msa
from msa.backends.triton import TritonBackend
from msa.backends.triton.kernels import merge_kernel
from msa.semantics import request_starts
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step

INTERPRET = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
needs_triton = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
GUARD = 3  # rows of NaN before and after the output views

BAD_STARTS = ([-2, 3, 4, 6], [0, 4, 8, 99], [0, 9, 3, 10], [5, 2, 12, 1], [0, 0, 0, 0], [10, 10, 10, 10])
GOOD_STARTS = [0, 3, 7, 10]


def _ragged_step(layout: str = "fp8_e4m3", device: str = DEVICE) -> dict[str, Any]:
    step = make_decode_step(msa.Geometry(4, 1, 64, 16, 3), batch_size=3, decode_query_len=4, context_len=100,
                            kv_cache_dtype=layout, device=device, seed=7)
    kw = step.kwargs()
    kw["q"] = torch.randn((10, 4, 64), generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(device)
    kw["topk_indices"] = kw["topk_indices"][:, :10]
    return kw


def _guarded(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """NaN-filled buffers with GUARD rows on both sides, and the views a backend writes."""
    rows, hq, d = kw["q"].shape
    device = kw["q"].device
    out_buf = torch.full((rows + 2 * GUARD, hq, d), float("nan"), dtype=torch.bfloat16, device=device)
    lse_buf = torch.full((rows + 2 * GUARD, hq), float("nan"), device=device)
    return out_buf, lse_buf, out_buf[GUARD:-GUARD], lse_buf[GUARD:-GUARD]


def _run(kw: dict[str, Any], backend: str | TritonBackend, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    kw = dict(kw, query_start_loc=torch.tensor(starts, dtype=torch.int32, device=kw["q"].device))
    out_buf, lse_buf, out, lse = _guarded(kw)
    if isinstance(backend, str):
        msa.sparse_decode(**kw, backend=backend, out=out, lse=lse)
    else:
        problem, inputs = check_decode_inputs(**kw, lse=lse, out=out)
        backend.run_step(problem, inputs, out, lse)
    for name, buf in (("out", out_buf), ("lse", lse_buf)):
        assert torch.isnan(buf[:GUARD]).all() and torch.isnan(buf[-GUARD:]).all(), f"a write outside {name}"
    return out.clone(), lse.clone()


def test_request_starts_makes_any_offsets_well_formed() -> None:
    for starts in BAD_STARTS + (GOOD_STARTS,):
        clean = request_starts(torch.tensor(starts, dtype=torch.int32), num_rows=10, decode_query_len=4).tolist()
        counts = [b - a for a, b in zip(clean, clean[1:], strict=False)]
        assert 0 <= clean[0] <= clean[-1] <= 10 and all(0 <= c <= 4 for c in counts), (starts, clean)
    assert request_starts(torch.tensor(GOOD_STARTS), 10, 4).tolist() == GOOD_STARTS, "valid offsets unchanged"
    # docs/semantics.md §3.2: starts rebuilt from the first offset by the capped counts (request 1
    # after a capped request 0 starts at 3, not at its offset 7)
    assert request_starts(torch.tensor([0, 7, 8]), 8, 3).tolist() == [0, 3, 4]
    assert request_starts(torch.tensor([2, 9, 9, 12]), 10, 4).tolist() == [2, 6, 6, 7]


STRATEGIES = [
    pytest.param(TritonBackend(dedup=True, num_splits=1), id="dedup-fused"),
    pytest.param(TritonBackend(dedup=True, num_splits=3), id="dedup-split"),
    pytest.param(TritonBackend(dedup=False, num_splits=1), id="per-token-fused"),
    pytest.param(TritonBackend(dedup=False, num_splits=3), id="per-token-split"),
]


@needs_triton
@pytest.mark.parametrize("backend", STRATEGIES)
def test_malformed_query_start_loc_stays_in_bounds_and_spoils_nothing(backend: TritonBackend) -> None:
    """valid -> invalid -> valid on every kernel path: no write outside out/lse, the invalid
    call reads the offsets as the reference does, and the last call equals the first."""
    kw = _ragged_step()
    first = _run(kw, backend, GOOD_STARTS)
    ref = _run(kw, "reference", GOOD_STARTS)
    torch.testing.assert_close(first[0].float(), ref[0].float(), rtol=2**-7, atol=3e-3)
    for starts in BAD_STARTS:
        bad_out, bad_lse = _run(kw, backend, starts)
        ref_out, ref_lse = _run(kw, "reference", starts)
        assert torch.isfinite(bad_out).all() and not torch.isnan(bad_lse).any()
        torch.testing.assert_close(bad_out.float(), ref_out.float(), rtol=2**-7, atol=3e-3)
        torch.testing.assert_close(bad_lse, ref_lse, rtol=1e-4, atol=1e-3)
        last = _run(kw, backend, GOOD_STARTS)
        assert torch.equal(last[0], first[0]) and torch.equal(last[1], first[1]), f"spoiled by {starts}"


@needs_triton
@pytest.mark.parametrize("layout", ["bfloat16", "nvfp4"])
def test_lengths_near_the_int32_limit(layout: str) -> None:
    """seq_lens >= 2**31 - 16: the visible-block limit is computed without overflow."""
    step = make_decode_step(msa.Geometry(4, 1, 64, 16, 3), batch_size=3, decode_query_len=2, context_len=64,
                            kv_cache_dtype=layout, device=DEVICE, seed=11)
    kw = step.kwargs()
    kw["seq_lens"] = torch.tensor([2**31 - 1, 2**31 - 16, 2**31 - 9], dtype=torch.int32, device=DEVICE)
    for splits in (1, 2):
        out, lse = _plain(kw, TritonBackend(num_splits=splits))
        ref_out, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
        assert torch.isfinite(lse).all(), "every row sees its whole (full) pages"
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=2**-7, atol=3e-3)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-3)


def _plain(kw: dict[str, Any], backend: TritonBackend) -> tuple[torch.Tensor, torch.Tensor]:
    problem, inputs = check_decode_inputs(**kw, return_lse=True)
    out = torch.full(kw["q"].shape, float("nan"), dtype=torch.bfloat16, device=kw["q"].device)
    lse = torch.full(kw["q"].shape[:2], float("nan"), device=kw["q"].device)
    backend.run_step(problem, inputs, out, lse)
    return out, lse


@needs_triton
def test_merge_never_reads_partials_of_rows_that_see_nothing() -> None:
    """Rows at a negative position (padding of a ragged step, which the dedup kernel does not
    cover) get 0 / -inf from the merge, whatever the workspace holds."""
    rows, heads, d, splits = 3, 2, 64, 4
    part_o = torch.full((rows * heads * splits, d), float("nan"), device=DEVICE)
    part_ml = torch.full((rows * heads * splits, 2), float("nan"), device=DEVICE)
    part_o[: heads * splits] = 1.0  # row 0 attends: every split holds acc 1, max 0, sum 1
    part_ml[: heads * splits] = torch.tensor([0.0, 1.0], device=DEVICE)
    q_pos = torch.tensor([5, -1, -1], dtype=torch.int32, device=DEVICE)
    out = torch.full((rows, heads, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((rows, heads), float("nan"), device=DEVICE)
    merge_kernel[(rows * heads,)](
        part_o, part_ml, out, lse, out, 1.0, q_pos, out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        NUM_Q_HEADS=heads, HEAD_DIM=d, NUM_SPLITS=splits, BLOCK_S=splits, V_SCALE_PTR=False, WRITE_LSE=True,
    )
    assert (out[0] == 1.0).all() and torch.allclose(lse[0], torch.full((heads,), 4.0, device=DEVICE).log())
    assert (out[1:] == 0).all() and torch.isneginf(lse[1:]).all()
