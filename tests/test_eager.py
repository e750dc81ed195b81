"""The eager fast path of msa.sparse_decode: a call with the signature of a checked one skips the
checks that depend only on that signature, and the layers of one step share one refresh — without
changing any result or letting a bad argument through."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import msa
from msa import api
from msa.workload import make_decode_step

GEOMETRY = msa.Geometry(8, 2, 64, 16, 4)


def _layers(count: int, layout: str = "bfloat16", seed: int = 0) -> list[dict[str, Any]]:
    """`count` layers of one step: shared metadata, each layer its own q, cache and indices."""
    steps = [make_decode_step(GEOMETRY, batch_size=3, decode_query_len=2, context_len=100, kv_cache_dtype=layout,
                              seed=seed + i) for i in range(count)]
    first = steps[0]
    return [dict(s.kwargs(), block_table=first.block_table, seq_lens=first.seq_lens) for s in steps]


def _refreshes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = msa.planning.RowMetadata.refresh

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(msa.planning.RowMetadata, "refresh", counting)
    return calls


def test_layers_of_a_step_share_one_refresh_and_give_exact_results(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = _layers(4)
    expected = [msa.sparse_decode(**kw, backend="reference", validate=True) for kw in layers]  # full path
    refreshes = _refreshes(monkeypatch)
    got = [msa.sparse_decode(**kw, backend="reference") for kw in layers]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert len(refreshes) <= 1, "one refresh for the step (none if the checked call already refreshed it)"
    # the next step changes the lengths in place through torch: the version counter says so
    layers[0]["seq_lens"].sub_(1)
    refreshes.clear()
    again = [msa.sparse_decode(**kw, backend="reference") for kw in layers]
    assert len(refreshes) == 1
    fresh = [msa.sparse_decode(**kw, backend="reference", validate=True) for kw in layers]
    assert all(torch.equal(a, b) for a, b in zip(again, fresh, strict=True))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_tables_changed_in_place_are_seen(backend: str) -> None:
    """sparse_decode's docstring: the eager metadata is refreshed when `block_table` or
    `query_start_loc` (as `seq_lens`, tested above) was changed in place through torch."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET", "") in ("", "0"):
        pytest.skip("the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
    kw = make_decode_step(GEOMETRY, batch_size=3, decode_query_len=2, context_len=100, seed=1).kwargs()
    qsl = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    before = msa.sparse_decode(**kw, query_start_loc=qsl, backend=backend)
    msa.sparse_decode(**kw, query_start_loc=qsl, backend=backend)
    kw["block_table"][0].copy_(kw["block_table"][1].clone())  # request 0 reads request 1's pages
    qsl[1:] = torch.tensor([1, 3, 5], dtype=torch.int32)  # one row for request 0, two each after, a padding row
    got = msa.sparse_decode(**kw, query_start_loc=qsl, backend=backend)
    fresh = msa.sparse_decode(**dict(kw, block_table=kw["block_table"].clone()), query_start_loc=qsl.clone(),
                              backend="reference", validate=True)
    torch.testing.assert_close(got.float(), fresh.float(), rtol=2**-7, atol=2e-3)
    assert not torch.equal(got, before)


def test_new_metadata_objects_are_refreshed(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = _layers(2)
    msa.sparse_decode(**layers[0], backend="reference")
    refreshes = _refreshes(monkeypatch)
    lens = layers[0]["seq_lens"].clone()
    lens[0] -= 5
    out = msa.sparse_decode(**dict(layers[0], seq_lens=lens), backend="reference")
    assert len(refreshes) == 1
    assert torch.equal(out, msa.sparse_decode(**dict(layers[0], seq_lens=lens), backend="reference", validate=True))


def test_inference_mode_tables_share_one_refresh_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving engines run under torch.inference_mode(), whose tensors have no version counters:
    the layers of a step must still share one refresh (they once refreshed at every layer), and a
    new step's tables (new objects, as engines pass them) are refreshed."""
    with torch.inference_mode():
        layers = _layers(4)
        expected = [msa.sparse_decode(**kw, backend="reference", validate=True) for kw in layers]
        refreshes = _refreshes(monkeypatch)
        got = [msa.sparse_decode(**kw, backend="reference") for kw in layers]
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert len(refreshes) <= 1, f"{len(refreshes)} refreshes for one step of 4 layers"
        lens = layers[0]["seq_lens"].clone()  # the next step: new objects
        lens[1] -= 7
        refreshes.clear()
        nxt = [msa.sparse_decode(**dict(kw, seq_lens=lens), backend="reference") for kw in layers]
        assert len(refreshes) == 1
        fresh = [msa.sparse_decode(**dict(kw, seq_lens=lens), backend="reference", validate=True) for kw in layers]
        assert all(torch.equal(a, b) for a, b in zip(nxt, fresh, strict=True))


def test_a_known_signature_still_tells_devices_apart() -> None:
    """A call signature holds each tensor's device: after a call with `out` on the CPU, the same
    call with `out` on the meta device is refused as the first check refuses it (the signature
    held `get_device()`, -1 for both, and the meta `out` was returned uncomputed), one-shot and
    through a planner."""
    kw = _layers(1)[0]
    out = torch.empty(kw["q"].shape, dtype=torch.bfloat16)
    match = r"^out: expected a tensor on cpu \(the device of q\), got meta"
    msa.sparse_decode(**kw, out=out, backend="reference")
    with pytest.raises(msa.MSAInputError, match=match):
        msa.sparse_decode(**kw, out=out.to("meta"), backend="reference")
    planner = msa.DecodePlanner(GEOMETRY, backend="reference")
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=kw["decode_query_len"])
    run = (plan, kw["q"], kw["kv_cache"], kw["topk_indices"])
    planner.run(*run, out=out, k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    with pytest.raises(msa.MSAInputError, match=match):
        planner.run(*run, out=out.to("meta"), k_scale=kw["k_scale"], v_scale=kw["v_scale"])


def test_a_known_signature_still_refuses_bad_values() -> None:
    kw = _layers(1)[0]
    msa.sparse_decode(**kw, backend="reference")
    signature_calls = len(api._thread_local().calls)
    assert signature_calls >= 1
    with pytest.raises(msa.MSAInputError, match=r"^k_scale: expected a float or a one-element fp32 tensor, got True"):
        msa.sparse_decode(**dict(kw, k_scale=True), backend="reference")
    with pytest.raises(msa.MSAInputError, match=r"^v_scale: expected a finite scale > 0 within float32.s normal range \[2\^-125, 1.7e38\], got nan"):
        msa.sparse_decode(**dict(kw, v_scale=float("nan")), backend="reference")
    with pytest.raises(msa.MSAInputError, match=r"^out: expected memory that does not overlap q"):
        msa.sparse_decode(**kw, out=kw["q"], backend="reference")
    out = torch.empty(kw["q"].shape, dtype=torch.bfloat16)
    msa.sparse_decode(**kw, out=out, backend="reference")
    with pytest.raises(msa.MSAInputError, match=r"^out: expected memory that does not overlap q"):
        msa.sparse_decode(**dict(kw, q=out), out=out, backend="reference")  # the same signature, aliased


def test_other_signatures_are_checked_in_full() -> None:
    kw = _layers(1)[0]
    msa.sparse_decode(**kw, backend="reference")
    with pytest.raises(msa.MSAInputError, match=r"^topk_indices: expected shape"):
        msa.sparse_decode(**dict(kw, topk_indices=kw["topk_indices"][:1]), backend="reference")
    with pytest.raises(msa.MSAInputError, match=r"^q: expected"):
        msa.sparse_decode(**dict(kw, q=kw["q"].float()), backend="reference")


def test_planner_run_remembers_checked_signatures() -> None:
    kw = _layers(1)[0]
    planner = msa.DecodePlanner(GEOMETRY, backend="reference", device="cpu")
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2)
    out = torch.empty(kw["q"].shape, dtype=torch.bfloat16)
    args = (plan, kw["q"], kw["kv_cache"], kw["topk_indices"])
    planner.run(*args, out=out)
    assert len(plan.runs) == 1
    again = torch.empty_like(out)
    planner.run(*args, out=again)  # the remembered signature
    assert torch.equal(again, out) and torch.equal(out, msa.sparse_decode(**kw, backend="reference"))
    with pytest.raises(msa.MSAInputError, match=r"^out: expected memory that does not overlap q"):
        planner.run(plan, out, kw["kv_cache"], kw["topk_indices"], out=out)
    with pytest.raises(msa.MSAInputError, match=r"^k_scale: expected a finite scale > 0"):
        planner.run(*args, out=out, k_scale=-1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bfloat16", "fp8_e4m3", "nvfp4"])
def test_direct_launches_follow_new_tensors_and_alignments(layout: str) -> None:
    """On a GPU, repeated calls of one signature go through the compiled launchers directly: each
    call with fresh data (and, once, a q whose pointer is only 2-byte aligned, which Triton compiles
    separately) matches the reference, and the direct path was taken."""
    from msa.backends.triton import launch

    geometry = msa.Geometry(16, 2, 128, 128, 4)
    taken: list[int] = []
    original = launch.DirectKernel.__call__

    def spy(self: Any, args: dict[str, Any], direct: bool) -> None:
        taken.append(int(direct and bool(self.compiled)))
        original(self, args, direct)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch.DirectKernel, "__call__", spy)
        for seed in range(4):
            step = make_decode_step(geometry, batch_size=5, context_len=700, kv_cache_dtype=layout, seed=seed,
                                    device="cuda")
            kw = step.kwargs()
            if seed == 2:  # the same values at a pointer 2 bytes past a 16-byte boundary
                wide = torch.empty(kw["q"].numel() + 1, dtype=kw["q"].dtype, device="cuda")
                kw["q"] = wide[1:].view(kw["q"].shape).copy_(kw["q"])
            out = torch.full(kw["q"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
            msa.sparse_decode(**kw, out=out, backend="triton")
            expected = msa.sparse_decode(**kw, backend="reference")
            torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert any(taken), "the direct launch path was never taken"
