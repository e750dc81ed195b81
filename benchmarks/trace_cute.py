"""Where a wgmma-kernel step's time goes: the kernel compiled with `Sm90Spec.trace` (thread 0 of
each CTA writes its SM clock at the walk's milestones), run on an M3 step with L2 flushed first
(GPU, `nvidia-cutlass-dsl`):

    PYTHONPATH=src:benchmarks python3 benchmarks/trace_cute.py --tp 8 --batch 16 [--variant JSON] \\
        [--query-len 4 --overlap 0.8] [--runs 20] [--json PATH]

Prints, per milestone, the median over CTAs and runs of the time since the CTA started (us, the
clock converted with its rate measured against the global timer), the spread of the CTAs'
start times, the kernel's span (first start to last end, global timer), the most CTAs resident
at once and how the CTAs' ends spread (the tail a balanced schedule could take back). The traced output is
compared with the reference first: the trace must not change the answer."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from bench_cute import TOLERANCE
from m3_step import add_step_arguments, make_m3_step

from msa.backends.cute import CuteBackend
from msa.backends.cute.launch import launch_cute, traced_kernel
from msa.backends.cute.sm90 import TRACE_POINTS, TRACE_TILE_STEPS, TRACE_TILES, TRACE_WORDS
from msa.display import format_table
from msa.errors import MSAInputError

_GT_START, _GT_END, _CLOCK_END, _, _MERGED = range(len(TRACE_POINTS), len(TRACE_POINTS) + 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_arguments(parser, tp=8, batch=16)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None, help="write every CTA's words of every run here")
    args = parser.parse_args()
    _, problem, inputs, tables, reference = make_m3_step(args)
    backend = CuteBackend(**json.loads(args.variant))
    plan = backend.plan(problem, tables)
    config = plan.config
    try:
        traced, ctas = traced_kernel(problem, config)
    except MSAInputError as exc:
        raise SystemExit(f"trace_cute: {exc}") from None
    words = torch.zeros((ctas, TRACE_WORDS), dtype=torch.int64, device="cuda")
    out = torch.full(inputs.q.shape, float("nan"), dtype=problem.out_dtype, device="cuda")
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    want = reference()
    runs = []
    for i in range(args.runs + 1):
        flush.zero_()
        words.zero_()
        launch_cute(problem, inputs, plan.rows, out, words, config, plan.workspace, {True: traced})
        torch.cuda.synchronize()
        if i == 0:
            err = (out.float() - want.float()).abs().max().item()
            if not err <= TOLERANCE:
                raise SystemExit(f"trace_cute: the traced kernel is {err:.3g} from the reference (> {TOLERANCE})")
            print(f"traced output within {err:.2e} of the reference")
        if i > 0:  # (the first run loads the module)
            runs.append(words.cpu().tolist())
    report(runs, args, config)
    if args.json is not None:
        args.json.write_text(json.dumps({"config": repr(config), "points": list(TRACE_POINTS), "runs": runs}))


def report(runs: list[list[list[int]]], args: argparse.Namespace, config: object) -> None:
    """The table of milestones (median over CTAs and runs) and the kernel's span."""
    per_point: list[list[float]] = [[] for _ in TRACE_POINTS]
    merged_after: list[float] = []
    spans, skews, rates = [], [], []
    for run in runs:
        starts = [w[_GT_START] for w in run]
        spans.append((max(w[_GT_END] for w in run) - min(starts)) / 1e3)
        skews.append((max(starts) - min(starts)) / 1e3)
        for w in run:
            cycles = w[_CLOCK_END] - w[0]
            if cycles > 0 and w[_GT_END] > w[_GT_START]:
                rates.append(cycles / (w[_GT_END] - w[_GT_START]))  # cycles a ns
    rate = statistics.median(rates)
    for run in runs:
        for w in run:
            for k in range(1, len(TRACE_POINTS)):
                if w[k]:
                    per_point[k].append((w[k] - w[0]) / rate / 1e3)
            if w[_MERGED]:
                merged_after.append((w[TRACE_POINTS.index("merged")] - w[TRACE_POINTS.index("split counted")])
                                    / rate / 1e3)
    rows = [[name, f"{statistics.median(v):.2f}", f"{min(v):.2f}", f"{max(v):.2f}", str(len(v))]
            for name, v in zip(TRACE_POINTS, per_point, strict=True) if v]
    print(f"TP{args.tp} B={args.batch} L={args.query_len} {args.layout} {config}; clock {rate:.3f} GHz")
    print(format_table(["milestone", "us since CTA start (median)", "min", "max", "samples"], rows))
    # a steady tile's phases (tiles 1 .. TRACE_TILES - 1): each milestone after the one before it
    phases: dict[str, list[float]] = {step: [] for step in TRACE_TILE_STEPS}
    for run in runs:
        for w in run:
            for u in range(1, TRACE_TILES):
                at = [w[TRACE_POINTS.index(f"tile {u} {step}")] for step in TRACE_TILE_STEPS]
                before = w[TRACE_POINTS.index(f"tile {u - 1} done")]
                for step, prev, now in zip(TRACE_TILE_STEPS, [before, *at], at, strict=False):
                    if now and prev:
                        phases[step].append((now - prev) / rate / 1e3)
    print(f"steady tile (tiles 1-{TRACE_TILES - 1}), us after the milestone before: "
          + ", ".join(f"{step} {statistics.median(v):.3f}" for step, v in phases.items() if v))
    merge = statistics.median(merged_after or [0.0])
    print(f"kernel span (first CTA start to last end) {statistics.median(spans):.2f} us; CTA start spread "
          f"{statistics.median(skews):.2f} us; merge (counted -> merged) {merge:.2f} us")
    waves = [statistics.median(col) for col in zip(*(_waves(run) for run in runs), strict=True)]
    print("CTAs resident at once (peak) {:.0f}; CTAs' ends, us after the first start: p10 {:.1f}, p50 {:.1f}, "
          "p90 {:.1f}, last {:.1f} (medians over runs; the clock reads may take registers: compare the peak "
          "with the untraced kernel's CTAs per SM)".format(*waves))


def _waves(run: list[list[int]]) -> tuple[float, ...]:
    """(the most CTAs resident at once, then the 10th, 50th and 90th percentile and the last of
    the CTAs' end times in us after the first start) of one run, from the global timer words."""
    start = min(w[_GT_START] for w in run)
    events = sorted([(w[_GT_START], 1) for w in run] + [(w[_GT_END], -1) for w in run])
    peak = resident = 0
    for _, step in events:  # (an end sorts before a start at the same time)
        resident += step
        peak = max(peak, resident)
    ends = sorted((w[_GT_END] - start) / 1e3 for w in run)
    return (float(peak), *(ends[min(len(ends) - 1, int(q * len(ends)))] for q in (0.1, 0.5, 0.9)), ends[-1])


if __name__ == "__main__":
    main()
