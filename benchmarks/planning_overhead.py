"""Planning overhead per step: host time of `DecodePlanner.plan` for a cached shape, and GPU
time of the row-metadata refresh it launches (Triton kernel; torch ops for comparison).

    PYTHONPATH=src python3 benchmarks/planning_overhead.py
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import msa
from msa.workload import make_decode_step


def kernel_us(fn: Callable[[], object], reps: int = 200) -> float:
    """Mean device time per call of the kernels `fn` launches (from the profiler)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages())
    return float(total) / reps


print(f"{'B':>4} {'L':>2} {'plan host us (median)':>22} {'refresh GPU us (triton)':>24} {'refresh GPU us (torch)':>23}")
for batch, length in ((1, 1), (64, 1), (256, 1), (64, 4), (1024, 1)):
    step = make_decode_step(
        msa.MINIMAX_M3, batch_size=batch, context_len=1024, kv_cache_dtype="fp8_e4m3", device="cuda", seed=0
    )
    planner = msa.DecodePlanner(msa.MINIMAX_M3, kv_cache_dtype="fp8", backend="triton", device="cuda")
    plan = planner.plan(step.block_table, step.seq_lens, decode_query_len=length)
    samples = []
    for _ in range(2000):
        t0 = time.perf_counter()
        planner.plan(step.block_table, step.seq_lens, decode_query_len=length)
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    host = statistics.median(samples[200:])
    rows = plan.tables.rows
    gpu_triton = kernel_us(functools.partial(rows.refresh, step.seq_lens, kernel=True))
    gpu_torch = kernel_us(functools.partial(rows.refresh, step.seq_lens, kernel=False))
    print(f"{batch:>4} {length:>2} {host:>22.1f} {gpu_triton:>24.2f} {gpu_torch:>23.2f}", flush=True)
