"""`msa bench`'s rows, table and plot on the CPU (no timing: rows built from given numbers)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from msa.bench.eager import eager_table
from msa.bench.sweep import StepShape, plot, summary_table


def _shape(overlap: float | None, length: int = 4) -> StepShape:
    # 2 requests of 4 tokens: 1 MB counted per token's pages, 0.4 MB once per request's pages
    return StepShape("bfloat16", 1, 64, 4, 2, length, 1_000_000, 400_000, overlap, 0.8 if overlap else 0.0, 1000.0)


def test_every_timed_thing_gets_the_steps_unique_bytes_and_overlap() -> None:
    """A backend's row, an engine kernel's and a baseline's timed on one step carry the same
    bytes, unique bytes and overlap (engine and baseline rows once showed their per-token bytes
    in the unique columns and no overlap)."""
    shape = _shape(0.8)
    rows = [shape.row("triton", "graph", 2.0, 1e-3, strategy="auto", kv_form="packed"),
            shape.row("sglang-kernel", "eager", 2.0, 1e-3, kv_form="sglang-kernel"),
            shape.row("torch", "eager", 2.0, 1e-3)]
    for row in rows:
        assert (row["bytes"], row["unique_bytes"], row["overlap"], row["realized_overlap"]) == (
            1_000_000, 400_000, 0.8, 0.8)
        assert row["gbps"] == pytest.approx(500) and row["unique_gbps"] == pytest.approx(200)
        assert row["frac_copy"] == pytest.approx(0.5) and row["unique_frac_copy"] == pytest.approx(0.2)
        assert row["us_per_token"] == pytest.approx(0.25)
    table = summary_table({"rows": rows}).splitlines()
    assert all(line.split()[-3:-1] == ["200", "0.200"] for line in table[2:]), table  # unique GB/s, unique x copy


class _Axes:
    """Records what `plot` draws (the grouping of rows into lines is msa's; drawing is matplotlib's)."""

    def __init__(self, drawn: list[tuple[list[float], list[float], str]]) -> None:
        self.drawn = drawn

    def plot(self, x: list[float], y: list[float], **kw: Any) -> None:
        self.drawn.append((list(x), list(y), kw["label"]))

    def __getattr__(self, name: str) -> Any:  # axhline, set_xscale, legend, ...: nothing to record
        return lambda *a, **kw: None


def test_the_plot_draws_a_line_per_strategy_and_overlap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of two strategies at two overlaps are four lines, each of its own rows' unique
    bandwidth (they were drawn as one zig-zag line of per-token bytes). matplotlib's module is
    a recorder here (CI has no matplotlib)."""
    drawn: list[tuple[list[float], list[float], str]] = []
    figure = types.SimpleNamespace(tight_layout=lambda: None, savefig=lambda *a, **kw: None)
    pyplot = types.SimpleNamespace(subplots=lambda **kw: (figure, _Axes(drawn)))
    monkeypatch.setitem(sys.modules, "matplotlib", types.SimpleNamespace(use=lambda name: None))
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    rows = []
    for overlap in (0.0, 0.8):
        for strategy in ("dedup", "per-token"):
            for batch in (64, 256):
                for length in (1, 4):  # (at L = 1 nothing is shared: one line per strategy)
                    shape = StepShape("fp8_e4m3", 1, 64, 4, batch, length, 1000 * batch, 400 * batch, overlap,
                                      overlap, 10.0)
                    rows.append(shape.row("triton", "graph", 1.0, 0.0, strategy=strategy, kv_form="packed"))
    plot({"rows": rows, "copy_gbps": 10.0, "device": "cpu", "date": "today"}, tmp_path / "p.png", sys.stderr)
    labels = sorted(label.split(" 64/4 ")[1] for _, _, label in drawn)
    assert labels == ["L=1 dedup", "L=1 per-token", "L=4 dedup overlap 0", "L=4 dedup overlap 0.8",
                      "L=4 per-token overlap 0", "L=4 per-token overlap 0.8"]
    for x, y, label in drawn:
        if "L=4" in label:
            assert x == [256, 1024] and y == pytest.approx([0.4 * 64, 0.4 * 256])
        else:  # both overlaps' rows of a batch on one line
            assert x == [64, 64, 256, 256] and y == pytest.approx([0.4 * 64] * 2 + [0.4 * 256] * 2)


def test_the_eager_table_names_the_backend_and_the_overlap() -> None:
    row: dict[str, Any] = dict(layout="fp8_e4m3", tp=1, batch=4, query_len=4, overlap=0.8, entry="DecodePlanner.run",
                               backend="cute", launches=1, host_us=5.0, budget_us=9.0, within_budget=True,
                               wall_us=20.0, gpu_us=18.0)
    lines = eager_table({"rows": [row, dict(row, overlap=None, entry="vllm-kernel", backend="engine")]}).splitlines()
    assert lines[0].split()[:7] == ["layout", "TP", "B", "L", "overlap", "entry", "point"]
    assert "0.8" in lines[2] and "cute" in lines[2] and " - " in lines[3] and "engine" in lines[3]


def test_the_flashinfer_harness_measures_against_the_unrounded_reference() -> None:
    """`flashinfer_sm90.reference_f32` is the reference backend's output before its bf16 rounding:
    rounded, it is that output bit for bit; unrounded, a kernel exact up to its own bf16 rounding
    measures no more than half a bf16 step of the largest element (2^-8), where against the rounded
    output it could read a whole step."""
    import flashinfer_sm90
    import torch

    import msa
    from msa.workload import make_decode_step

    step = make_decode_step(msa.MINIMAX_M3_TP[8], batch_size=3, decode_query_len=2, context_len=1024,
                            kv_cache_dtype="fp8_e4m3", seed=7)
    kw = step.kwargs()
    exact = flashinfer_sm90.reference_f32(kw)
    rounded = msa.sparse_decode(**kw, backend="reference")
    assert exact.dtype == torch.float32 and torch.equal(exact.to(torch.bfloat16), rounded)
    assert 0 < flashinfer_sm90.rel_err(rounded, exact) <= 2.0**-8


def test_the_flashinfer_harness_gives_both_kernels_the_same_fp8_query() -> None:
    """`flashinfer_sm90.py --q-dtype fp8`: msa gets an E4M3 query and FlashInfer (`time_flashinfer`,
    here with its `run` and the timer stubbed) the same values as bf16, which its own rounding to
    E4M3 gives back bit for bit; the output FlashInfer fills is the one returned."""
    import flashinfer_sm90
    import torch

    import msa
    from msa.workload import make_decode_step

    step = make_decode_step(msa.MINIMAX_M3_TP[8], batch_size=2, context_len=512, kv_cache_dtype="fp8_e4m3",
                            q_dtype=flashinfer_sm90.Q_DTYPES["fp8"], seed=3)
    kw = step.kwargs()
    seen: dict[str, torch.Tensor] = {}

    class Stub:
        @staticmethod
        def run(q: torch.Tensor, kv: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                out: torch.Tensor) -> None:
            seen["q"], seen["out"] = q, out
            out.zero_()

    class Clock:
        @staticmethod
        def graph(call: Any) -> float:
            call()
            return 1.5

    micros, out = flashinfer_sm90.time_flashinfer(Stub(), kw, Clock())  # type: ignore[arg-type]
    assert micros == 1.5 and out is seen["out"] and not out.isnan().any()
    assert kw["q"].dtype == torch.float8_e4m3fn and seen["q"].dtype == torch.bfloat16
    assert torch.equal(seen["q"].to(torch.float8_e4m3fn).view(torch.uint8), kw["q"].view(torch.uint8))
