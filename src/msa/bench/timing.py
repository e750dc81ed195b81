"""GPU timers: medians of CUDA-event times with L2 flushed before every repetition, eager or as
CUDA-graph replays."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from msa.errors import MSAInputError

__all__ = ["Timer", "capture_graph", "copy_bandwidth", "FLUSHES"]

#: `Timer`'s ways of emptying L2 before each repetition
FLUSHES = ("write", "read")

_FLUSH_BYTES = 512 * 2**20  # far larger than the H200's ~50-60 MB L2


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


class Timer:
    """Times a callable on the current CUDA device.

    Args:
        reps: timed repetitions (median reported).
        warmup: untimed calls first (compilation, autotuning, allocator warm-up).
        flush: how L2 is emptied of the step's bytes before each repetition, by 512 MB of
            `FLUSHES`: "write" (zeros written: L2 left holding dirty lines, which it writes back
            while the step runs) or "read" (a sum read: L2 left holding clean lines).
    """

    def __init__(self, reps: int = 50, warmup: int = 5, flush: str = "write") -> None:
        if flush not in FLUSHES:
            raise MSAInputError("flush", f"one of {', '.join(FLUSHES)}", repr(flush))
        self.reps = reps
        self.warmup = warmup
        self.flush = flush
        self._buffer = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def _empty_l2(self) -> None:
        if self.flush == "write":
            self._buffer.zero_()
        else:
            torch.sum(self._buffer.view(torch.int64))

    def _measure(self, call: Callable[[], object]) -> float:
        start = [_event() for _ in range(self.reps)]
        end = [_event() for _ in range(self.reps)]
        for i in range(self.reps):
            self._empty_l2()  # evict the step's pages from L2
            start[i].record()
            call()
            end[i].record()
        torch.cuda.synchronize()
        return float(statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(start, end, strict=True)))

    def eager(self, fn: Callable[[], object]) -> float:
        """Median microseconds of `fn()` launched from Python."""
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        return self._measure(fn)

    def graph(self, fn: Callable[[], object]) -> float:
        """Median microseconds of a CUDA-graph replay of `fn()` (captured once)."""
        return self._measure(capture_graph(fn, self.warmup).replay)


def capture_graph(fn: Callable[[], object], warmup: int) -> torch.cuda.CUDAGraph:
    """`fn()` captured in a CUDA graph, after `warmup` calls on a side stream (compilation and
    allocator warm-up happen outside the capture)."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def copy_bandwidth(timer: Timer, n_bytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting read + write bytes."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    micros = timer.eager(lambda: dst.copy_(src))
    return 2 * n_bytes / micros / 1e3
