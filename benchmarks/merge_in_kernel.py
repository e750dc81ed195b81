"""Split-K merged by the last split to finish, against the separate merge kernel (GPU):

    PYTHONPATH=src:benchmarks python3 benchmarks/merge_in_kernel.py --out DIR [--layouts fp8_e4m3,bfloat16,nvfp4] \
        [--batches 1,8,32] [--replays 20000] [--rounds 1]

For each layout and batch (M3 TP1, 64K contexts, L = 1, steps the heuristic splits):

1. time, as L2-flushed CUDA-graph replays (`--rounds` times, interleaved; the median and the
   range), each checked against the reference: the two-kernel step (decode, then
   `merge_kernel`), the in-kernel merge with the GPU-scope fence and without it; then the decode
   kernel alone, the merge kernel alone, and one / two empty kernels (the floor of a one- and a
   two-launch graph);
2. replay the captured in-kernel step `--replays` times on fixed inputs, poisoning the output
   and the split partials before each replay, and count the replays whose output differs from
   the two-kernel result by more than 1e-3: a partial read by the merging split before it
   landed shows up there as NaN.

Writes merge_in_kernel.json and prints two tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from tune_kernels import m3_cases, try_check_and_time

from msa.backends.triton import TritonBackend
from msa.backends.triton.launch import step_launches
from msa.bench.kernels import empty_kernel
from msa.bench.timing import Timer, capture_graph
from msa.display import format_table

VARIANTS = {"two kernels": {"in_kernel_merge": False}, "in-kernel, fenced": {"in_kernel_merge": True},
            "in-kernel, no fence": {"in_kernel_merge": True, "merge_fence": False}}


def _kernel_parts(plan: Any, inputs: Any, out: torch.Tensor) -> list[Any]:
    """The plan's kernels one by one (decode, merge), each a call launching it alone."""
    return [lambda k=kernel, a=args: k(a, False)
            for kernel, args in step_launches(plan.problem, inputs, plan.rows, out, None, plan.config, plan.workspace)]


def _wrong_replays(backend: TritonBackend, case: Any, expect: torch.Tensor, replays: int) -> int:
    """Replays of the captured step whose output is not `expect` (within 1e-3)."""
    _, _, problem, inputs, tables, out = case
    plan = backend.plan(problem, tables)
    graph = capture_graph(lambda: backend.run(plan, inputs, out, None), warmup=3)
    wrong = torch.zeros((), dtype=torch.int32, device="cuda")
    for _ in range(replays):
        out.fill_(float("nan"))
        # poisoned partials: a split that read another's partials before they landed would read
        # NaN (with fixed inputs the previous replay's partials equal this one's, so a stale read
        # would otherwise go unseen)
        plan.workspace.partial_out.fill_(float("nan"))
        plan.workspace.partial_ml.fill_(float("nan"))
        graph.replay()
        diff = (out.float() - expect).abs().amax()
        wrong += (~(diff <= 1e-3)).int()
    return int(wrong.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layouts", default="fp8_e4m3,bfloat16,nvfp4")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--replays", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=1, help="time the variants this many times, interleaved "
                        "(the median is reported, and the range)")
    args = parser.parse_args()
    timer = Timer(reps=args.reps)
    gen = torch.Generator(device="cuda").manual_seed(0)
    flag = torch.zeros(1, device="cuda")
    floors = {"1 empty kernel": timer.graph(lambda: empty_kernel[(1,)](flag)),
              "2 empty kernels": timer.graph(lambda: (empty_kernel[(1,)](flag), empty_kernel[(1,)](flag)))}
    rows: list[dict[str, Any]] = []
    races: list[dict[str, Any]] = []
    for layout, batch, case in m3_cases(args.layouts.split(","), [int(b) for b in args.batches.split(",")], gen):
        times: dict[str, Any] = {}
        expect = None
        for round_ in range(args.rounds):  # the variants interleaved, each checked every round
            for name, overrides in VARIANTS.items():
                timed = try_check_and_time(f"{layout} B={batch} {name}", TritonBackend(**overrides), case, timer)
                if timed is None:
                    continue
                plan, err, us = timed
                entry = times.setdefault(name, dict(samples=[], err=0.0, splits=plan.config.num_splits))
                entry["samples"].append(us)
                entry["err"] = max(entry["err"], err)
                entry["us"] = statistics.median(entry["samples"])
                if name == "two kernels" and round_ == 0:
                    expect = case[-1].float().clone()
                    parts = _kernel_parts(plan, case[3], case[-1])
                    times["decode kernel alone"] = dict(us=timer.graph(parts[0]))
                    if len(parts) > 1:
                        times["merge kernel alone"] = dict(us=timer.graph(parts[1]))
        for name, value in times.items():
            rows.append(dict(layout=layout, batch=batch, variant=name, **value))
            spread = (f" ({min(value['samples']):.1f}-{max(value['samples']):.1f})" if len(value.get("samples", [])) > 1
                      else "")
            print(f"{layout:9s} B={batch:3d} {name:22s} {value['us']:7.1f} us{spread}"
                  + (f"  err {value['err']:.1e} splits {value['splits']}" if "err" in value else ""), flush=True)
        if expect is not None and times.get("two kernels", {}).get("splits", 1) > 1:
            for name in ("in-kernel, fenced", "in-kernel, no fence"):
                wrong = _wrong_replays(TritonBackend(**VARIANTS[name]), case, expect, args.replays)
                races.append(dict(layout=layout, batch=batch, variant=name, replays=args.replays, wrong=wrong))
                print(f"{layout:9s} B={batch:3d} {name:22s} {wrong} of {args.replays} replays wrong", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "merge_in_kernel.json").write_text(json.dumps(dict(floors=floors, rows=rows, races=races), indent=1))
    print(format_table(["floor", "us"], [[k, round(v, 1)] for k, v in floors.items()]))
    names = [*VARIANTS, "decode kernel alone", "merge kernel alone"]
    keys = sorted({(r["layout"], r["batch"]) for r in rows}, key=lambda k: (k[0], k[1]))
    table = {(r["layout"], r["batch"], r["variant"]): r["us"] for r in rows}
    print(format_table(["layout", "B", *names], [[k[0], k[1], *(round(table[(*k, n)], 1) if (*k, n) in table else "-"
                                                                 for n in names)] for k in keys]))
    print(format_table(["layout", "B", "variant", "wrong replays"],
                       [[r["layout"], r["batch"], r["variant"], f"{r['wrong']} / {r['replays']}"] for r in races]))


if __name__ == "__main__":
    main()
