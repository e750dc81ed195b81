"""DecodePlanner: plan identity, in-place refresh, the bounded cache, and graph capture (GPU)."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch
from cases import gpu_atol

import msa
from msa.errors import MSAInputError
from msa.planning import PlanCache, RowMetadata
from msa.platform import package_installed
from msa.workload import indexer_topk, make_decode_step

GEOMETRY = msa.Geometry(8, 2, 64, 16, 4)
INTERPRET = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def _step(layout: str = "bfloat16", batch: int = 3, length: int = 2, device: str = "cpu", geometry: msa.Geometry = GEOMETRY, context: int = 100) -> Any:
    return make_decode_step(geometry, batch_size=batch, decode_query_len=length, context_len=context,
                            kv_cache_dtype=layout, device=device, seed=5)


def _planner(**kw: Any) -> msa.DecodePlanner:
    kw.setdefault("device", "cpu")
    kw.setdefault("backend", "reference")
    return msa.DecodePlanner(GEOMETRY, **kw)


def test_same_key_same_plan_and_buffers() -> None:
    step = _step()
    planner = _planner()
    plan = planner.plan(step.block_table, step.seq_lens, decode_query_len=2)
    addresses = {k: v.data_ptr() for k, v in plan.buffers().items()}
    step.seq_lens.copy_(torch.tensor([7, 50, 99], dtype=torch.int32))
    again = planner.plan(step.block_table, step.seq_lens, decode_query_len=2)
    assert again is plan
    assert {k: v.data_ptr() for k, v in again.buffers().items()} == addresses
    assert planner.plans.hits == 1 and planner.plans.misses == 1 and len(planner.plans) == 1
    assert plan.key.problem.batch_size == 3 and plan.key.backend == "reference"


def test_different_shapes_different_plans() -> None:
    step = _step()
    planner = _planner()
    base = planner.plan(step.block_table, step.seq_lens, decode_query_len=2)
    other_len = planner.plan(step.block_table, step.seq_lens, decode_query_len=1)
    wide = torch.full((3, 16), -1, dtype=torch.int32)
    wide[:, : step.block_table.shape[1]] = step.block_table
    other_stride = planner.plan(wide[:, : step.block_table.shape[1]], step.seq_lens, decode_query_len=2)
    fewer = planner.plan(step.block_table[:2], step.seq_lens[:2], decode_query_len=2)
    plans = [base, other_len, other_stride, fewer]
    assert len({id(p) for p in plans}) == 4 and len({p.key for p in plans}) == 4
    fp8 = _planner(kv_cache_dtype="fp8").plan(step.block_table, step.seq_lens, decode_query_len=2)
    assert fp8.key != base.key and fp8.key.problem.kv_layout == "fp8_e4m3"


def test_lru_eviction_keeps_held_plans_valid() -> None:
    step = _step()
    planner = _planner(max_plans=2)
    a = planner.plan(step.block_table, step.seq_lens, decode_query_len=1)
    b = planner.plan(step.block_table, step.seq_lens, decode_query_len=2)
    planner.plan(step.block_table, step.seq_lens, decode_query_len=1)  # a is now the most recent
    c = planner.plan(step.block_table, step.seq_lens, decode_query_len=3)
    assert [k.problem.query_len for k in planner.plans.keys()]  # noqa: SIM118 (a list, not a dict view) == [1, 3], "b, least recently used, went"
    assert planner.plans.evictions == 1 and "2/2 plans" in planner.plans.stats()
    # the evicted plan still runs: its buffers live as long as the caller holds it
    kw = _step(length=2).kwargs()
    out = torch.empty(kw["q"].shape, dtype=torch.bfloat16)
    planner.run(b, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out)
    torch.testing.assert_close(out, msa.sparse_decode(**kw, backend="reference"))
    assert a is not c


def test_plan_cache_basics() -> None:
    cache: PlanCache[int, object] = PlanCache(max_plans=3)
    made = [cache.get_or_create(i, object) for i in range(4)]
    assert cache.keys() == [1, 2, 3] and cache.get_or_create(3, object) is made[3]
    with pytest.raises(ValueError):
        PlanCache(0)


def _three_lengths(planner: msa.DecodePlanner, step: Any) -> list[msa.DecodePlan]:
    return [planner.plan(step.block_table, step.seq_lens, decode_query_len=n) for n in (1, 2, 3)]


def test_a_held_plan_is_never_replaced_after_eviction() -> None:
    """The plan a captured graph reads (held by the engine) stays the plan of its shape: after
    it is evicted, plan() returns it again, refreshed (the old code built a second plan, and the
    held one silently kept the stale step)."""
    step = _step()
    planner = _planner(max_plans=2)
    held = planner.plan(step.block_table, step.seq_lens, decode_query_len=2)
    for length in (1, 3, 4):  # push it out of the cache
        planner.plan(step.block_table, step.seq_lens, decode_query_len=length)
    assert planner.plans.evictions >= 1 and held.key not in planner.plans
    step.seq_lens.copy_(torch.tensor([9, 40, 77], dtype=torch.int32))
    again = planner.plan(step.block_table, step.seq_lens, decode_query_len=2)
    assert again is held and planner.plans.revivals == 1
    assert held.tables.rows.q_pos.tolist() == [7, 8, 38, 39, 75, 76], "refreshed in place"


def test_plans_nobody_holds_are_released() -> None:
    step = _step()
    planner = _planner(max_plans=2)
    _three_lengths(planner, step)
    gc.collect()
    assert len(planner.plans.values()) == 2, "the evicted plan nobody held is gone"
    planner.plan(step.block_table, step.seq_lens, decode_query_len=1)
    assert planner.plans.misses == 4


def test_default_plan_bound_covers_engine_capture_sizes() -> None:
    """vLLM's default CUDA-graph capture list has 67 batch sizes (1, 2, 4, 8, 16, 24, ... 512)."""
    sizes = [1, 2, 4] + list(range(8, 513, 8))
    assert len(sizes) == 67
    planner = _planner()
    assert planner.plans.max_plans >= len(sizes)
    table = torch.zeros((512, 4), dtype=torch.int32)
    lens = torch.ones(512, dtype=torch.int32)
    plans = [planner.plan(table[:b], lens[:b], decode_query_len=1) for b in sizes]
    assert planner.plans.evictions == 0
    assert all(planner.plan(table[:b], lens[:b], decode_query_len=1) is p for b, p in zip(sizes, plans, strict=True))


def test_run_refuses_a_plan_of_another_planner() -> None:
    kw = _step().kwargs()
    mine, theirs = _planner(), _planner()
    plan = theirs.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2)
    out = torch.empty(kw["q"].shape, dtype=torch.bfloat16)
    with pytest.raises(MSAInputError, match=r"^plan: expected a plan made by this planner, got a plan of another planner"):
        mine.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out)


def test_clear_retires_held_plans() -> None:
    kw = _step().kwargs()
    planner = _planner()
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2)
    planner.clear()
    out = torch.empty(kw["q"].shape, dtype=torch.bfloat16)
    with pytest.raises(MSAInputError, match="retired by DecodePlanner.clear"):
        planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out)
    assert planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2) is not plan


@pytest.mark.parametrize("value", ["16", 0, -3, 2.5, True])
def test_max_plans_must_be_a_positive_int(value: object) -> None:
    with pytest.raises(MSAInputError, match=r"^max_plans: expected an int >= 1"):
        _planner(max_plans=value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_planner_device_defaults_to_what_the_machine_has() -> None:
    assert msa.DecodePlanner(GEOMETRY, backend="reference").device == torch.device("cpu")
    with pytest.raises(MSAInputError, match=r"^device: expected a device this machine has, got cuda \(no CUDA device"):
        msa.DecodePlanner(GEOMETRY, device="cuda")
    with pytest.raises(MSAInputError, match=r"^device: expected a torch.device or a name"):
        msa.DecodePlanner(GEOMETRY, device="gpu0")


@pytest.mark.parametrize("kernel", [False, True])
def test_refresh_matches_torch(kernel: bool, gen: torch.Generator) -> None:
    if kernel and not INTERPRET:
        pytest.skip("the Triton refresh kernel runs on the CPU only under TRITON_INTERPRET=1")
    for batch, length in ((1, 1), (5, 3), (300, 2)):
        rows = RowMetadata(batch, length, "cpu")
        for _ in range(3):
            seq_lens = torch.randint(0, 5000, (batch,), generator=gen, dtype=torch.int32)
            before = {k: v.data_ptr() for k, v in rows.buffers().items()}
            rows.refresh(seq_lens, kernel=kernel)
            r = torch.arange(batch * length)
            assert torch.equal(rows.kv_lens, seq_lens[r // length])
            position = (seq_lens[r // length].long() - length + r % length).clamp(min=-1)
            assert torch.equal(rows.q_pos, position.int()), "q_pos = max(seq_lens[b] - L + i, -1)"
            assert torch.equal(rows.row_request, (r // length).int())
            assert {k: v.data_ptr() for k, v in rows.buffers().items()} == before


@pytest.mark.parametrize("kernel", [False, True])
def test_refresh_never_wraps_around(kernel: bool) -> None:
    """Lengths near the int32 limits: positions are computed in int64 and rows that see
    nothing get -1 (on the old code a length of -2**31 wrapped to a position of 2**31 - 2)."""
    if kernel and not INTERPRET:
        pytest.skip("the Triton refresh kernel runs on the CPU only under TRITON_INTERPRET=1")
    low, high = -(2**31), 2**31 - 1
    rows = RowMetadata(3, 2, "cpu")
    rows.refresh(torch.tensor([low, high, 1], dtype=torch.int32), kernel=kernel)
    assert rows.q_pos.tolist() == [-1, -1, high - 2, high - 1, -1, 0]


def test_sparse_decode_is_the_planner_path(gen: torch.Generator) -> None:
    kw = _step(layout="nvfp4").kwargs()
    planner = _planner(kv_cache_dtype="nvfp4", with_lse=True)
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2)
    out = torch.full(kw["q"].shape, float("nan"), dtype=torch.bfloat16)
    lse = torch.full(kw["q"].shape[:2], float("nan"))
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, lse=lse, k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    ref_out, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_run_checks_against_the_plan() -> None:
    kw = _step().kwargs()
    planner = _planner()
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2)
    out = torch.empty(kw["q"].shape, dtype=torch.bfloat16)
    with pytest.raises(MSAInputError, match=r"^q: expected B\*L = 3\*2 = 6 rows"):
        planner.run(plan, kw["q"][:4], kw["kv_cache"], kw["topk_indices"], out=out)
    with pytest.raises(MSAInputError, match=r"^q: expected dtype torch.bfloat16 \(the planner's q_dtype\)"):
        planner.run(plan, kw["q"].half(), kw["kv_cache"], kw["topk_indices"], out=out.half())
    other = make_decode_step(msa.Geometry(16, 2, 64, 16, 4), batch_size=3, decode_query_len=2, context_len=100, seed=1)
    with pytest.raises(MSAInputError, match=r"^q / kv_cache / topk_indices: expected the planner's geometry"):
        planner.run(plan, other.q, other.kv_cache, other.topk_indices, out=torch.empty(other.q.shape, dtype=torch.bfloat16))
    with pytest.raises(MSAInputError, match=r"^plan: expected a DecodePlan"):
        planner.run("plan", kw["q"], kw["kv_cache"], kw["topk_indices"], out=out)  # type: ignore[arg-type]
    with pytest.raises(MSAInputError, match=r"^out: expected a \[B\*L, Hq, D\] tensor to write into \(run allocates nothing\), got None"):
        planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=None)  # type: ignore[arg-type]
    with pytest.raises(MSAInputError, match=r"^seq_lens: expected an int32 tensor \[B\]"):
        planner.plan(kw["block_table"], kw["seq_lens"].long(), decode_query_len=2)
    with pytest.raises(MSAInputError, match=r"^decode_query_len: expected an int >= 1, got 0"):
        planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=0)
    # the host copy of the lengths kernel libraries plan from is checked too (it was taken as given)
    for bad, match in (([100, 60, 3], r"^seq_lens_cpu: expected a torch.Tensor, got list"),
                       (kw["seq_lens"].float(), r"^seq_lens_cpu: expected an int32 tensor \[B\]"),
                       (kw["seq_lens"][:1], r"^seq_lens_cpu: expected 3 entries \(B from seq_lens\), got 1")):
        with pytest.raises(MSAInputError, match=match):
            planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2, seq_lens_cpu=bad)
    planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2, seq_lens_cpu=kw["seq_lens"].clone())


def test_padded_rows_are_zero_and_neg_inf() -> None:
    backend = "triton" if INTERPRET else "reference"
    kw = _step(batch=4).kwargs()
    kw["seq_lens"][2:] = 0  # a graph captured for 4 requests, running 2
    planner = _planner(backend=backend, with_lse=True)
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2)
    out = torch.full(kw["q"].shape, float("nan"), dtype=torch.bfloat16)
    lse = torch.full(kw["q"].shape[:2], float("nan"))
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, lse=lse, k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    assert (out[4:] == 0).all() and torch.isneginf(lse[4:]).all()
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    torch.testing.assert_close(out[:4], msa.sparse_decode(**kw, backend="reference")[:4], rtol=2**-7, atol=2e-4)


# ---- GPU: capture once per batch size, replay 50 changing steps -----------------------------

def _new_step_in_place(step: Any, kw: dict[str, Any], gen: torch.Generator, capacity_blocks: int) -> None:
    """Change lengths (some padded to 0), tables, indices, q and cache contents, in place."""
    g, batch = step.geometry, kw["seq_lens"].shape[0]
    p, length = g.page_size, kw["decode_query_len"]
    lens = torch.randint(length, capacity_blocks * p, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    pad = torch.rand(batch, device="cuda", generator=gen) < 0.25
    kw["seq_lens"].copy_(torch.where(pad, 0, lens))
    pages = step.kv_cache.shape[0]
    kw["block_table"].copy_(torch.randperm(pages, device="cuda", generator=gen)[: kw["block_table"].numel()].view_as(kw["block_table"]).int())
    kw["topk_indices"].copy_(indexer_topk(kw["seq_lens"], decode_query_len=length, num_kv_heads=g.num_kv_heads, topk=g.topk,
                                          page_size=p, max_blocks=kw["block_table"].shape[1], generator=gen))
    kw["q"].copy_(torch.randn(kw["q"].shape, device="cuda", generator=gen).to(kw["q"].dtype))
    n = 512
    slots = torch.randint(0, pages * p, (n,), device="cuda", generator=gen)
    fresh = torch.randn((n, g.num_kv_heads, g.head_dim), device="cuda", generator=gen).bfloat16()
    step.layout.write(step.kv_cache, fresh, fresh.flip(0), slots, k_scale=step.k_scale, v_scale=step.v_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bfloat16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("backend", ["triton", "reference", "cute"])
def test_graph_capture_and_replay(layout: str, backend: str, gen: torch.Generator) -> None:
    if backend == "cute" and (layout != "nvfp4" or not package_installed("cutlass_dsl")
                              or torch.cuda.get_device_capability() < (9, 0)):
        pytest.skip("the cute backend reads NVFP4, with nvidia-cutlass-dsl, on compute capability >= 9.0")
    cuda_gen = torch.Generator(device="cuda")
    cuda_gen.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    blocks = 12
    for batch in (1, 16, 64):
        step = make_decode_step(msa.MINIMAX_M3, batch_size=batch, decode_query_len=2, context_len=blocks * 128,
                                kv_cache_dtype=layout, device="cuda", seed=batch)
        kw = step.kwargs()
        kw["topk_indices"] = kw["topk_indices"].clone()  # a buffer of our own, changed in place
        planner = msa.DecodePlanner(msa.MINIMAX_M3, kv_cache_dtype=layout, backend=backend, device="cuda", with_lse=True)
        plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2)
        out = torch.empty(kw["q"].shape, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(kw["q"].shape[:2], device="cuda")
        args = (plan, kw["q"], kw["kv_cache"], kw["topk_indices"])
        scales = dict(k_scale=kw["k_scale"], v_scale=kw["v_scale"])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            planner.run(*args, out=out, lse=lse, **scales)  # warm-up (compiles) without any sync
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                planner.run(*args, out=out, lse=lse, **scales)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for _ in range(50):
            _new_step_in_place(step, kw, cuda_gen, blocks)
            again = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2)
            assert again is plan
            out.fill_(float("nan"))
            graph.replay()
            ref_out, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
            torch.testing.assert_close(out.float(), ref_out.float(), rtol=2**-6, atol=gpu_atol(kw))
            torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-3)
            padded = (kw["seq_lens"] == 0).repeat_interleave(2)
            assert (out[padded] == 0).all() and torch.isneginf(lse[padded]).all()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "") in ("", "0"), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("layout, length", [("bfloat16", 1), ("fp8_e4m3", 1), ("nvfp4", 1), ("bfloat16", 3)])
def test_run_creates_no_tensor_in_msa_code_on_the_cpu(layout: str, length: int) -> None:
    """README / run's docstring: `run` allocates nothing. On the CPU (the Triton backend under the
    interpreter), no torch op that returns a new tensor (any op whose result is not a view or an
    in-place write, `torch.tensor` included) is called from msa's code during a run (the
    interpreter's own tensors aside); the GPU test below counts the CUDA allocator's allocations."""
    import traceback
    from pathlib import Path

    import triton
    from torch.utils._python_dispatch import TorchDispatchMode

    ours, interpreter = str(Path(msa.__file__).parent), str(Path(triton.__file__).parent)

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.made: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            returns = func._schema.returns
            fresh = func.overloadpacket.__name__ == "lift_fresh" or (
                bool(returns) and any(r.alias_info is None and "Tensor" in str(r.type) for r in returns))
            if fresh:
                stack = traceback.extract_stack()
                mine = [f for f in stack if f.filename.startswith(ours)]
                if mine and not any(f.filename.startswith(interpreter) for f in stack):
                    self.made.append(f"{func} at {mine[-1].filename}:{mine[-1].lineno}")
            return func(*args, **(kwargs or {}))

    g = msa.Geometry(8, 2, 64, 16, 4)
    kw = make_decode_step(g, batch_size=2, decode_query_len=length, context_len=100, kv_cache_dtype=layout,
                          seed=0).kwargs()
    planner = msa.DecodePlanner(g, kv_cache_dtype=layout, backend="triton", device="cpu", with_lse=True)
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=length)
    out, lse = torch.empty(kw["q"].shape, dtype=torch.bfloat16), torch.empty(kw["q"].shape[:2])
    run = (plan, kw["q"], kw["kv_cache"], kw["topk_indices"])
    planner.run(*run, out=out, lse=lse, k_scale=kw["k_scale"], v_scale=kw["v_scale"])  # (its first call checks)
    record = Record()
    with record:
        planner.run(*run, out=out, lse=lse, k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    assert not record.made, record.made


@pytest.mark.gpu
def test_run_allocates_nothing() -> None:
    step = make_decode_step(msa.MINIMAX_M3, batch_size=8, context_len=4096, kv_cache_dtype="fp8_e4m3", device="cuda", seed=0)
    kw = step.kwargs()
    planner = msa.DecodePlanner(msa.MINIMAX_M3, kv_cache_dtype="fp8", backend="triton", device="cuda")
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1)
    out = torch.empty(kw["q"].shape, dtype=torch.bfloat16, device="cuda")
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(5):
        planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


@pytest.mark.gpu
def test_captured_graph_keeps_its_plan_across_evictions(gen: torch.Generator) -> None:
    """An engine holds the plan it captured with; planning more shapes than max_plans in between
    must not detach it: every later plan() of its shape refreshes the same buffers, and replays
    match the reference (the old LRU dropped it and the replays read a stale step)."""
    cuda_gen = torch.Generator(device="cuda")
    cuda_gen.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    blocks = 12
    step = make_decode_step(msa.MINIMAX_M3, batch_size=8, decode_query_len=2, context_len=blocks * 128,
                            kv_cache_dtype="fp8_e4m3", device="cuda", seed=3)
    kw = step.kwargs()
    kw["topk_indices"] = kw["topk_indices"].clone()
    planner = msa.DecodePlanner(msa.MINIMAX_M3, kv_cache_dtype="fp8", backend="triton", device="cuda", max_plans=2)
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2)
    out = torch.empty(kw["q"].shape, dtype=torch.bfloat16, device="cuda")
    args = (plan, kw["q"], kw["kv_cache"], kw["topk_indices"])
    scales = dict(k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    planner.run(*args, out=out, **scales)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        planner.run(*args, out=out, **scales)
    for _ in range(10):
        for b in (1, 2, 4):  # other shapes push the captured plan out of the cache
            planner.plan(kw["block_table"][:b], kw["seq_lens"][:b], decode_query_len=2)
        _new_step_in_place(step, kw, cuda_gen, blocks)
        assert planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2) is plan
        graph.replay()
        ref = msa.sparse_decode(**kw, backend="reference")
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=gpu_atol(kw))
    assert planner.plans.evictions > 0 and planner.plans.revivals >= 10


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("rows", [6, 12])
def test_a_ragged_plan_refuses_other_row_counts(backend: str, rows: int, gen: torch.Generator) -> None:
    """A ragged plan is sized for its `num_rows` (row metadata, workspaces): a q of 6 rows once
    corrupted the heap, one of 12 left 4 rows unwritten. run() compares and raises."""
    if backend == "triton" and not INTERPRET:
        pytest.skip("the Triton backend runs on the CPU only under TRITON_INTERPRET=1")
    step = _step(batch=3, length=3)
    planner = _planner(backend=backend)
    qsl = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    plan = planner.plan(step.block_table, step.seq_lens, decode_query_len=3, query_start_loc=qsl, num_rows=8)
    q = torch.randn((rows, 8, 64), generator=gen).bfloat16()
    topk = indexer_topk(step.seq_lens, decode_query_len=3, num_kv_heads=2, topk=4, page_size=16,
                        max_blocks=step.block_table.shape[1], generator=gen)
    topk = torch.cat([topk, topk], dim=1)[:, :rows]
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    with pytest.raises(MSAInputError, match=rf"^q: expected 8 rows, as planned \(num_rows=8 given to plan\(\)\), got {rows} rows"):
        planner.run(plan, q, step.kv_cache, topk, out=out, k_scale=step.k_scale, v_scale=step.v_scale)
    assert out.isnan().all(), "nothing may be written"
    # the planned row count runs (rows past qsl[B] are padding: zeros)
    q8, out8 = q.repeat(2, 1, 1)[:8], torch.full((8, 8, 64), float("nan"), dtype=torch.bfloat16)
    topk8 = torch.cat([topk, topk, topk], dim=1)[:, :8]
    planner.run(plan, q8, step.kv_cache, topk8, out=out8, k_scale=step.k_scale, v_scale=step.v_scale)
    assert not out8.isnan().any() and (out8[6:] == 0).all()


def test_the_thread_check_and_the_launch_are_one_step(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan() from another thread between run()'s thread check and its launch once refreshed the
    tables under it (a wrong answer, no error). Here that plan() is made at the latest point
    before the launch — while run() checks its inputs — and must be refused."""
    import threading

    import msa.planner.runs as runs

    # Triton reads the plan's row metadata (the reference backend reads the step's own lengths)
    step = _step()
    planner = _planner(backend="triton" if INTERPRET else "reference")
    plan = planner.plan(step.block_table, step.seq_lens, decode_query_len=2)
    other_lens = torch.zeros_like(step.seq_lens)  # another thread's step: every row empty
    errors: list[BaseException] = []
    original = runs.check_decode_inputs

    def checks_then_interleave(*args: Any, **kwargs: Any) -> Any:
        def other() -> None:
            try:
                planner.plan(step.block_table, other_lens, decode_query_len=2)
            except MSAInputError as exc:
                errors.append(exc)
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        return original(*args, **kwargs)

    monkeypatch.setattr(runs, "check_decode_inputs", checks_then_interleave)
    out = torch.empty(step.q.shape, dtype=torch.bfloat16)
    planner.run(plan, step.q, step.kv_cache, step.topk_indices, out=out, k_scale=step.k_scale, v_scale=step.v_scale)
    assert errors and "use from one thread at a time" in str(errors[0])
    ref = msa.sparse_decode(**step.kwargs(), backend="reference")
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-3, msg="run() must compute the step it checked")


def test_plan_repr_is_short_and_query_len_defaults_to_one() -> None:
    step = _step(length=1)
    planner = _planner()
    plan = planner.plan(step.block_table, step.seq_lens)
    assert plan.problem.query_len == 1
    text = repr(plan)
    assert len(text) < 200 and "B=3, L=1" in text and "backend reference" in text, text


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(("q_dtype", "layout"), [(torch.bfloat16, "float16"), (torch.float16, "bfloat16")])
def test_a_plan_refuses_a_cache_of_the_other_16_bit_layout(backend: str, q_dtype: torch.dtype, layout: str) -> None:
    """A planner of kv_cache_dtype 'auto' plans for the output dtype's layout (bf16 q: bfloat16);
    a cache of the other 16-bit layout run on that plan is refused by name (a backend's kernels
    were chosen and built for the planned layout: the wgmma kernel read f16 bytes as bf16), and a
    planner given the cache's layout runs it."""
    planned = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[q_dtype]
    kw = _step(layout=layout).kwargs()
    kw["q"] = kw["q"].to(q_dtype)
    planner = _planner(kv_cache_dtype="auto", backend=backend, q_dtype=q_dtype)
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2)
    out = torch.empty(kw["q"].shape, dtype=q_dtype)
    with pytest.raises(MSAInputError, match=rf"^kv_cache: expected a {planned} cache, as planned, got a {layout} "
                                            r"cache\. Give DecodePlanner the cache's layout"):
        planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out)
    exact = _planner(kv_cache_dtype=layout, backend=backend, q_dtype=q_dtype)
    exact.run(exact.plan(kw["block_table"], kw["seq_lens"], decode_query_len=2), kw["q"], kw["kv_cache"],
              kw["topk_indices"], out=out)
    ref = msa.sparse_decode(**kw, backend="reference")
    assert isinstance(ref, torch.Tensor)
    torch.testing.assert_close(out.float(), ref.float(), atol=8e-3, rtol=0)  # (Triton: fp32 sums in its own order)
