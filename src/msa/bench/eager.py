"""Eager calls, as a serving engine makes them between CUDA-graph pieces: host microseconds per
call (the Python work and the launches, GPU running behind), next to the host cost of one empty
Triton launch measured in the same run, and the wall time per call (L2 flushed).

The target: a call's host time is at most (kernels it launches) x (one empty launch) + 10 us.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import triton

from msa.api import sparse_decode
from msa.bench.integrations import sglang_call
from msa.bench.kernels import empty_kernel
from msa.bench.timing import Timer
from msa.integrations.vllm import minimax_m3_sparse_attn_decode
from msa.planner import DecodePlanner
from msa.validation import check_decode_inputs

__all__ = ["empty_launch_us", "host_us", "count_launches", "eager_calls", "EAGER_TARGET_SLACK_US"]

#: Python work allowed per call beyond the launches themselves.
EAGER_TARGET_SLACK_US = 10.0


def host_us(call: Callable[[], object], reps: int = 400, rounds: int = 5) -> float:
    """Median over `rounds` of the host time per call of `reps` back-to-back calls (the GPU runs
    behind; it is synchronised between rounds, outside the timing)."""
    call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            call()
        samples.append((time.perf_counter() - start) / reps * 1e6)
        torch.cuda.synchronize()
    return sorted(samples)[len(samples) // 2]


def empty_launch_us(reps: int = 2000) -> float:
    """Host microseconds of one launch of an empty one-argument Triton kernel."""
    x = torch.empty(1, device="cuda")
    return host_us(lambda: empty_kernel[(1,)](x), reps)


def count_launches(call: Callable[[], object]) -> int:
    """Triton kernels one call launches in steady state (after a first call), counted through
    Triton's launch hook: torch ops and CuTe DSL kernels (the `cute` backend's) are not counted,
    nor is their host time in the budget (`eager_rows`)."""
    from triton import knobs

    call()
    torch.cuda.synchronize()
    count = [0]
    previous = knobs.runtime.launch_enter_hook
    knobs.runtime.launch_enter_hook = lambda *_: count.__setitem__(0, count[0] + 1)
    try:
        call()
        torch.cuda.synchronize()
    finally:
        knobs.runtime.launch_enter_hook = previous
    return count[0]


def eager_calls(kw: dict[str, Any]) -> tuple[str, dict[str, Callable[[], object]]]:
    """The backend `auto` chose for one step (msa's packed cache), and the eager entry points on
    it: `DecodePlanner.run` of a planned step, `msa.sparse_decode` as every layer after the first
    of a step calls it (same metadata), and the engines' drop-ins (`msa.integrations`) on the same
    data."""
    q = kw["q"]
    problem, _ = check_decode_inputs(**kw)
    out = torch.empty(q.shape, dtype=problem.out_dtype, device=q.device)
    planner = DecodePlanner(problem.geometry, kv_cache_dtype=problem.kv_layout, device=q.device, q_dtype=q.dtype)
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=kw["decode_query_len"])
    scales = {"k_scale": kw["k_scale"], "v_scale": kw["v_scale"]}
    calls: dict[str, Callable[[], object]] = {
        "DecodePlanner.run": lambda: planner.run(plan, q, kw["kv_cache"], kw["topk_indices"], out=out, **scales),
        # every layer but the first of a step: the same metadata tensors, the refresh reused
        "msa.sparse_decode": lambda: sparse_decode(**kw, out=out),
        # the first layer of a step: new metadata tensors (views), refreshed
        "sparse_decode, new step": lambda: sparse_decode(
            **dict(kw, seq_lens=kw["seq_lens"][:], block_table=kw["block_table"][:]), out=out
        ),
    }
    if not problem.layout.block_scaled:
        fp8 = problem.layout.quantized
        k, v = (kw["k_scale"].reshape(()), kw["v_scale"].reshape(())) if fp8 else (None, None)
        g = problem.geometry
        calls["vllm drop-in"] = lambda: minimax_m3_sparse_attn_decode(
            q, kw["kv_cache"], kw["topk_indices"], kw["block_table"], kw["seq_lens"], g.num_kv_heads,
            g.head_dim**-0.5, out, kw["decode_query_len"], k_scale=k, v_scale=v,
        )
        sglang = sglang_call(kw, problem.layout)  # one query token per row only
        if sglang is not None:
            calls["sglang drop-in"] = sglang
    return plan.backend.name, calls


def wall_us(call: Callable[[], object], reps: int = 200) -> float:
    """Wall microseconds per call of back-to-back calls, the GPU work included (what an engine
    calling layer after layer waits: the larger of its host and GPU time)."""
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def eager_rows(
    kw: dict[str, Any], timer: Timer, empty_us: float, extra: dict[str, Callable[[], object]] | None = None,
    log: Any = sys.stderr,
) -> list[dict[str, Any]]:
    """One row per entry point: launches, host us/call, the target, wall us/call (back to back),
    and the GPU time of one call (L2 flushed); `backend`: the one `auto` chose for msa's entry
    points (the engines' own kernels: "engine")."""
    rows = []
    chosen, calls = eager_calls(kw)
    for name, call in {**calls, **(extra or {})}.items():
        launches = count_launches(call)
        host = host_us(call)
        wall = wall_us(call)
        gpu = timer.eager(call)
        budget = launches * empty_us + EAGER_TARGET_SLACK_US
        rows.append(dict(entry=name, backend=chosen if name in calls else "engine", launches=launches,
                         host_us=host, budget_us=budget, wall_us=wall, gpu_us=gpu, within_budget=host <= budget))
        print(f"    {name:24s} launches {launches}  host {host:7.1f} us (budget {budget:6.1f})  "
              f"wall {wall:7.1f} us  gpu {gpu:7.1f} us", file=log, flush=True)
    return rows


def run_eager(
    config: Any,
    out_dir: Any = None,
    extra: Callable[[dict[str, Any]], dict[str, Callable[[], object]]] | None = None,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    """The eager sweep over `config`'s layouts, TP head layouts, batches, query lengths and page
    overlaps (a `msa.bench.sweep.BenchConfig`; its backends, strategies, cache forms, baselines
    and integrations are the graph sweep's: `msa bench --eager` refuses them), msa's entry points
    with `backend="auto"`; `extra(kw)` may add other entry points on each step (e.g. the engines'
    own kernels). Writes `eager.json` under `out_dir`."""
    import datetime
    import itertools
    import json

    import attrs

    from msa.bench.sweep import _case
    from msa.problem import MINIMAX_M3_TP
    from msa.workload import make_decode_step

    timer = Timer(reps=config.reps)
    empty = empty_launch_us()
    print(f"one empty Triton launch: {empty:.1f} us of host time", file=log, flush=True)
    generator = torch.Generator(device="cuda")
    generator.manual_seed(config.seed)
    rows: list[dict[str, Any]] = []
    for layout, tp in itertools.product(config.layouts, config.tps):
        step = make_decode_step(MINIMAX_M3_TP[tp], batch_size=max(config.batches), context_len=config.context,
                                kv_cache_dtype=layout, q_dtype=getattr(torch, config.q_dtype), device="cuda",
                                seed=config.seed)
        for batch, length, overlap in itertools.product(config.batches, config.query_lens, config.overlaps):
            kw = _case(step, batch, length, generator, overlap)
            print(f"  {layout} TP{tp} B={batch} L={length} overlap {overlap}", file=log, flush=True)
            for row in eager_rows(kw, timer, empty, extra(kw) if extra is not None else None, log):
                rows.append(dict(row, layout=layout, tp=tp, batch=batch, query_len=length, overlap=overlap))
        del step
        torch.cuda.empty_cache()
    result = {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "config": attrs.asdict(config), "empty_launch_us": empty, "rows": rows,
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "eager.json").write_text(json.dumps(result, indent=1))
    return result


def eager_table(result: dict[str, Any]) -> str:
    from msa.display import format_table

    return format_table(
        ["layout", "TP", "B", "L", "overlap", "entry point", "backend", "Triton launches", "host us", "budget us",
         "within", "wall us", "gpu us"],
        [[r["layout"], r["tp"], r["batch"], r["query_len"], "-" if r.get("overlap") is None else r["overlap"],
          r["entry"], r.get("backend", "-"), r["launches"], round(r["host_us"], 1),
          round(r["budget_us"], 1), "yes" if r["within_budget"] else "no", round(r["wall_us"], 1),
          round(r["gpu_us"], 1)] for r in result["rows"]],
    )
