"""Kernel variants for the memory-bound targets, checked and timed in one run (GPU):

    PYTHONPATH=src python3 benchmarks/tune_kernels.py --out DIR [--layouts nvfp4,fp8_e4m3] [--batches 64,256] \
        [--query-len 4 --overlap 0.8] [--tp 8] [--variant '{"num_splits": 2}' ...]

For each layout and batch (M3 TP1 or the head layout of `--tp`, 64K contexts, L = 1 unless
`--query-len`): the default launch configuration and variants of tile size, warps, pipeline stages
and (NVFP4) the packed PTX decode, each compared with the reference on the same step (max abs
error) and timed as L2-flushed CUDA-graph replays; the copy bandwidth is measured in the same run.
Prints a table, writes tune_kernels.json.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import msa
from msa.backends.triton import TritonBackend
from msa.bench.sweep import _case, step_bytes
from msa.bench.timing import Timer, copy_bandwidth
from msa.display import format_table
from msa.planning import StepTables
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step

VARIANTS: dict[str, list[dict[str, Any]]] = {
    "nvfp4": [
        *(dict(swap_ab=swap, block_n=bn, num_warps=4, num_stages=st)
          for swap, bn, st in itertools.product((False, True), (64, 128), (2, 3))),
        dict(swap_ab=False, block_n=128, num_warps=8, num_stages=2),
    ],
    "fp8_e4m3": [
        dict(block_n=bn, num_warps=w, num_stages=st) for bn, w, st in itertools.product((64, 128), (4, 8), (2, 3, 4))
    ],
    "bfloat16": [
        dict(block_n=bn, num_warps=w, num_stages=st) for bn, w, st in itertools.product((64, 128), (4, 8), (2, 3))
    ],
}


def ascending_topk(topk: torch.Tensor) -> None:
    """Each list of `topk` in ascending block-id order, its -1 padding last (in place), as some
    indexers emit them (the default workload's lists are in score order)."""
    big = torch.iinfo(topk.dtype).max
    ordered = torch.where(topk < 0, big, topk).sort(dim=-1).values
    topk.copy_(torch.where(ordered == big, -1, ordered))


def prepare_case(step: Any, batch: int, gen: torch.Generator, query_len: int = 1,
                 overlap: float | None = None,
                 ascending: bool = False) -> tuple[int, torch.Tensor, Any, Any, StepTables, torch.Tensor]:
    """The first `batch` requests of `step` (`query_len` tokens each, fresh q and indices; with
    `overlap`, that share of each token's pages are its predecessor's; with `ascending`, each list
    in block-id order): (bytes the step moves, the reference output, problem, inputs, tables, an
    output buffer)."""
    kw = _case(step, batch, query_len, gen, overlap)
    if ascending:
        ascending_topk(kw["topk_indices"])
    problem, inputs = check_decode_inputs(**kw)
    out = torch.empty(kw["q"].shape, dtype=problem.out_dtype, device="cuda")
    return (step_bytes(kw, step), msa.sparse_decode(**kw, backend="reference"), problem, inputs,
            StepTables.for_inputs(problem, inputs), out)


def checked_run(backend: Any, problem: Any, inputs: Any, tables: StepTables, out: torch.Tensor,
                ref: torch.Tensor) -> tuple[Any, Callable[[], object], float]:
    """(plan, a call that runs it on the step into `out`, max abs error against `ref`) of `backend`;
    `out` is poisoned with NaN before the first run."""
    plan = backend.plan(problem, tables)
    run = functools.partial(backend.run, plan, inputs, out, None)
    out.fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    return plan, run, (out.float() - ref.float()).abs().max().item()


def check_and_time(backend: TritonBackend, problem: Any, inputs: Any, tables: StepTables, out: torch.Tensor,
                   ref: torch.Tensor, timer: Timer) -> tuple[Any, float, float]:
    """(plan, max abs error against `ref`, us per L2-flushed graph replay) of `backend` on a step
    (`checked_run`)."""
    plan, run, err = checked_run(backend, problem, inputs, tables, out, ref)
    return plan, err, timer.graph(run)


def m3_cases(layouts: list[str], batches: list[int], gen: torch.Generator, query_len: int = 1,
             overlap: float | None = None, geometry: msa.Geometry | None = None,
             q_dtype: torch.dtype = torch.bfloat16, ascending: bool = False) -> Iterator[tuple[str, int, Any]]:
    """(layout, batch, `prepare_case` of it) for M3 (TP1 unless `geometry` says otherwise) at 64K
    contexts, queries of `q_dtype`: one cache per layout (sized for the largest batch), freed
    before the next."""
    for layout in layouts:
        step = make_decode_step(geometry or msa.MINIMAX_M3, batch_size=max(batches), decode_query_len=query_len,
                                context_len=65536, kv_cache_dtype=layout, q_dtype=q_dtype, device="cuda", seed=0)
        for batch in batches:
            yield layout, batch, prepare_case(step, batch, gen, query_len, overlap, ascending)
        del step
        torch.cuda.empty_cache()


def try_check_and_time(label: str, backend: Any, case: Any, timer: Timer) -> tuple[Any, float, float] | None:
    """`check_and_time` on a prepared case, or None (printed) for a configuration that does not
    compile or launch (registers, shared memory)."""
    _, ref, problem, inputs, tables, out = case
    try:
        return check_and_time(backend, problem, inputs, tables, out, ref, timer)
    except Exception as exc:
        print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layouts", default="nvfp4,fp8_e4m3")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--query-len", type=int, default=1)
    parser.add_argument("--overlap", type=float, default=None,
                        help="share of each token's pages that are its predecessor's (L > 1)")
    parser.add_argument("--variant", action="append", default=[],
                        help="JSON launch-config overrides to time instead of the built-in list (repeatable)")
    parser.add_argument("--tp", type=int, choices=sorted(msa.MINIMAX_M3_TP), default=1,
                        help="M3's tensor-parallel head layout (1: 64/4 ... 8: 8/1)")
    args = parser.parse_args()
    timer = Timer(reps=args.reps)
    copy = copy_bandwidth(timer)
    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict[str, Any]] = []
    for layout, batch, case in m3_cases(args.layouts.split(","), batches, gen, args.query_len, args.overlap,
                                         msa.MINIMAX_M3_TP[args.tp]):
        n_bytes = case[0]
        variants: list[dict[str, Any]] = [{}, *([json.loads(v) for v in args.variant] or VARIANTS[layout])]
        for overrides in variants:
            timed = try_check_and_time(f"{layout} B={batch} {overrides}", TritonBackend(**overrides), case, timer)
            if timed is None:
                continue
            plan, err, us = timed
            c = plan.config
            row = dict(layout=layout, batch=batch, variant=overrides or "default", us=us,
                       frac_copy=n_bytes / us / 1e3 / copy, err=err, block_n=c.block_n, warps=c.num_warps,
                       stages=c.num_stages, splits=c.num_splits, decode_asm=c.decode_asm, dedup=c.dedup)
            rows.append(row)
            print(f"{layout:9s} B={batch:3d} {str(row['variant']):70s} {us:8.1f} us "
                  f"{row['frac_copy']:.2f} err {err:.1e}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune_kernels.json").write_text(json.dumps(dict(copy_gbps=copy, rows=rows), indent=1, default=str))
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        key = (r["layout"], r["batch"])
        if r["err"] < 5e-2 and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    defaults = {(r["layout"], r["batch"]): r for r in rows if r["variant"] == "default"}
    print(f"copy bandwidth {copy:.0f} GB/s")
    print(format_table(
        ["layout", "B", "default us", "x copy", "best us", "x copy", "best variant"],
        [[k[0], k[1], round(defaults[k]["us"], 1), round(defaults[k]["frac_copy"], 2), round(b["us"], 1),
          round(b["frac_copy"], 2), str(b["variant"])] for k, b in best.items() if k in defaults],
    ))


if __name__ == "__main__":
    main()
