"""Benchmarks shared by `msa bench` and the scripts in benchmarks/: realistic steps far larger
than L2, L2-flushed and CUDA-graph timings, byte accounting, baselines, JSON and a plot."""

from msa.bench.sweep import BenchConfig, run_sweep

__all__ = ["BenchConfig", "run_sweep"]
