"""One-shot calls from many threads at once: each result equals the single-threaded one."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import msa
from msa.workload import make_decode_step

GEOMETRY = msa.Geometry(8, 2, 64, 16, 4)


def _steps(count: int, layout: str, device: str = "cpu") -> list[dict[str, Any]]:
    """`count` steps of one shape (one plan key) with different lengths, tables, indices, q, cache."""
    return [
        make_decode_step(GEOMETRY, batch_size=3, decode_query_len=2, context_len=150, kv_cache_dtype=layout,
                         device=device, seed=100 + i).kwargs()
        for i in range(count)
    ]


# The Triton interpreter itself is not thread-safe (it patches module state while a kernel
# runs), so the Triton backend is stressed from threads on the GPU only.
@pytest.mark.parametrize("backend, layout, device", [
    ("reference", "bfloat16", "cpu"),
    ("reference", "nvfp4", "cpu"),
    pytest.param("triton", "fp8_e4m3", "cuda", marks=pytest.mark.gpu),
    pytest.param("triton", "nvfp4", "cuda", marks=pytest.mark.gpu),
])
def test_one_shot_calls_from_many_threads(backend: str, layout: str, device: str) -> None:
    steps = _steps(8, layout, device)
    expected = [msa.sparse_decode(**kw, backend=backend, return_lse=True) for kw in steps]
    calls = [i % len(steps) for i in range(12 * len(steps))]
    start = threading.Barrier(8)

    def call(i: int) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
        if i < 8:
            start.wait()  # the first calls of every worker begin together
        result = msa.sparse_decode(**steps[i], backend=backend, return_lse=True)
        assert isinstance(result, tuple)
        return i, result

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(call, calls))
    if device == "cuda":
        torch.cuda.synchronize()
    wrong = [i for i, (out, lse) in results
             if not (torch.equal(out, expected[i][0]) and torch.equal(lse, expected[i][1]))]
    assert not wrong, f"{len(wrong)} of {len(results)} results belong to another call (steps {sorted(set(wrong))})"


def test_planner_refuses_use_from_two_threads_at_once() -> None:
    kw = _steps(1, "bfloat16")[0]
    planner = msa.DecodePlanner(GEOMETRY, device="cpu", backend="reference")
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2)
    out = torch.empty(kw["q"].shape, dtype=torch.bfloat16)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2)
        except msa.MSAInputError as exc:
            errors.append(exc)

    with planner._exclusive():  # this thread is inside the planner
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
    assert errors and "use from one thread at a time" in str(errors[0])
    # a plan refreshed by another thread describes that thread's step: run() refuses it
    worker = threading.Thread(target=lambda: planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2))
    worker.start()
    worker.join()
    with pytest.raises(msa.MSAInputError, match="last refreshed by another thread"):
        planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out)
    planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2)  # this thread's step again
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out)


@pytest.mark.gpu
def test_one_shot_calls_on_several_streams() -> None:
    """Calls on different CUDA streams do not share plan buffers (each stream has its own)."""
    steps = _steps(4, "fp8_e4m3", device="cuda")
    expected = [msa.sparse_decode(**kw) for kw in steps]
    streams = [torch.cuda.Stream() for _ in steps]
    torch.cuda.synchronize()
    results = []
    for _ in range(20):
        for kw, stream in zip(steps, streams, strict=True):
            with torch.cuda.stream(stream):
                results.append(msa.sparse_decode(**kw))
    torch.cuda.synchronize()
    for i, out in enumerate(results):
        assert torch.equal(out, expected[i % len(steps)]), f"call {i} on stream {i % len(steps)}"


def test_a_plan_refreshed_by_a_thread_that_has_ended_is_refused() -> None:
    """run() refuses a plan last refreshed by another thread, also once that thread has ended
    (CPython hands an ended thread's ident to new threads: the check compared idents, and about
    half of such runs went through with the ended thread's tables)."""
    g = msa.Geometry(8, 2, 64, 16, 4)
    a = make_decode_step(g, batch_size=3, decode_query_len=2, context_len=150, seed=1).kwargs()
    b = make_decode_step(g, batch_size=3, decode_query_len=2, context_len=150, seed=2).kwargs()
    planner = msa.DecodePlanner(g, device="cpu", backend="reference")
    outcomes: list[str] = []

    def plan(box: dict[str, Any]) -> None:
        box["plan"] = planner.plan(a["block_table"], a["seq_lens"], decode_query_len=2)

    def run(box: dict[str, Any]) -> None:
        try:
            planner.run(box["plan"], b["q"], b["kv_cache"], b["topk_indices"],
                        out=torch.empty(b["q"].shape, dtype=torch.bfloat16))
            outcomes.append("ran")
        except msa.MSAInputError as exc:
            outcomes.append("refused" if "last refreshed by another thread" in str(exc) else str(exc))

    for _ in range(40):
        box: dict[str, Any] = {}
        for step in (plan, run):  # each in a new thread, the first ended before the second starts
            thread = threading.Thread(target=step, args=(box,))
            thread.start()
            thread.join()
    assert outcomes == ["refused"] * 40, outcomes
