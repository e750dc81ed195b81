"""The CuTe DSL NVFP4 kernel against the reference and against the Triton kernel (GPU with
`nvidia-cutlass-dsl`):

    PYTHONPATH=src:benchmarks python3 benchmarks/bench_cute.py --out DIR [--batches 1,64,256] [--splits 1,2,3,4]

First every check case (NVFP4 and FP8 caches, short and long contexts, partly visible last
pages, -1 padding, L = 1 and L = 4, GQA groups 16, 8 and 20, bf16, f16 and fp8 q, with and
without LSE), each on fresh data and compared with the reference (outputs poisoned with NaN
first); then M3 TP1 at 64K contexts, L = 1, per layout: the Triton kernel's default and the cute
kernel at its default and forced split counts, stages and score chains,
as L2-flushed CUDA-graph replays, with the copy bandwidth of the same run. Writes
bench_cute.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tune_kernels import m3_cases, try_check_and_time

import msa
from msa.backends.cute import CuteBackend
from msa.backends.triton import TritonBackend
from msa.bench.timing import FLUSHES, Timer, copy_bandwidth
from msa.cli.defaults import Q_DTYPES
from msa.display import format_table
from msa.problem import Geometry
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step

#: Command-line flags that time `CuteBackend` with one option forced, and that option.
OPTION_FLAGS = (("splits", "num_splits"), ("stages", "stages"), ("chains", "qk_chains"), ("min_ctas", "min_ctas"))
TOLERANCE = 2e-2  # max abs error against the reference (outputs are O(1); fp16 operands, fp32 sums)


def add_flush_argument(parser: argparse.ArgumentParser) -> None:
    """`--flush write|read`: `Timer`'s `flush`."""
    parser.add_argument("--flush", choices=FLUSHES, default="write",
                        help="empty L2 before each repetition by writing 512 MB (L2 left full of dirty lines) "
                             "or by reading them (left clean)")


@dataclass(frozen=True)
class CheckCase:
    geometry: Geometry
    batch: int
    length: int
    context: int
    q: torch.dtype
    lse: bool
    layout: str = "nvfp4"


M3 = msa.MINIMAX_M3
CASES = (
    CheckCase(M3, 3, 1, 1000, torch.bfloat16, False, "fp8_e4m3"),
    CheckCase(M3, 2, 4, 3000, torch.float8_e4m3fn, True, "fp8_e4m3"),
    CheckCase(M3, 3, 1, 1000, torch.bfloat16, False),
    CheckCase(M3, 5, 1, 20000, torch.bfloat16, True),
    CheckCase(M3, 2, 4, 3000, torch.bfloat16, True),
    CheckCase(M3, 4, 1, 300, torch.float8_e4m3fn, False),
    CheckCase(Geometry(num_q_heads=16, num_kv_heads=2, head_dim=128, page_size=64, topk=8), 3, 2, 700,
              torch.float16, True),
    CheckCase(Geometry(num_q_heads=40, num_kv_heads=2, head_dim=128, page_size=128, topk=20), 2, 1, 5000,
              torch.bfloat16, True),
    # fp8 steps of the wgmma kernel: f16 q (three fp8 terms), 8/1 heads (N = 8), a group of 20
    # (two chunks, the second partly empty), 64-token pages, L = 4 with partly visible pages
    CheckCase(M3, 3, 1, 2000, torch.float16, True, "fp8_e4m3"),
    CheckCase(msa.MINIMAX_M3_TP[8], 4, 1, 9000, torch.bfloat16, True, "fp8_e4m3"),
    CheckCase(msa.MINIMAX_M3_TP[8], 2, 4, 700, torch.float8_e4m3fn, False, "fp8_e4m3"),
    CheckCase(Geometry(num_q_heads=40, num_kv_heads=2, head_dim=128, page_size=128, topk=20), 2, 2, 5000,
              torch.bfloat16, True, "fp8_e4m3"),
    CheckCase(Geometry(num_q_heads=16, num_kv_heads=2, head_dim=128, page_size=64, topk=16), 3, 2, 1500,
              torch.bfloat16, True, "fp8_e4m3"),
)


def check_cases(gen: torch.Generator) -> list[dict[str, Any]]:
    rows = []
    for i, c in enumerate(CASES):
        step = make_decode_step(c.geometry, batch_size=c.batch, decode_query_len=c.length, context_len=c.context,
                                kv_cache_dtype=c.layout, q_dtype=c.q, device="cuda",
                                seed=int(torch.randint(2**31, (), generator=gen, device="cuda").item()))
        kw = step.kwargs()
        topk = kw["topk_indices"].clone()
        topk[:, ::3, -2:] = -1  # -1 padding in a few lists
        kw["topk_indices"] = topk
        ref_out, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
        problem, inputs = check_decode_inputs(**kw)
        # NVFP4 steps of 64-token pages: the mma kernel (the default) and the wgmma kernel (by name)
        kernels = [None, "wgmma"] if c.layout == "nvfp4" and c.geometry.page_size % 64 == 0 else [None]
        for kernel, splits in ((k, s) for k in kernels for s in (None, 1, 3)):
            o = torch.full_like(ref_out, float("nan"))
            lse = torch.full(o.shape[:2], float("nan"), device="cuda") if c.lse else None
            CuteBackend(num_splits=splits, kernel=kernel).run_step(problem, inputs, o, lse)
            err = (o.float() - ref_out.float()).abs().max().item()
            lerr, lse_inf_ok = 0.0, True
            if lse is not None:
                lerr = (lse - ref_lse).abs().nan_to_num(0.0).max().item()
                lse_inf_ok = bool(((lse == float("-inf")) == (ref_lse == float("-inf"))).all())
            lse_nan = lse is not None and bool(lse.isnan().any())
            ok = err < TOLERANCE and lerr < TOLERANCE and lse_inf_ok and not lse_nan and not o.isnan().any().item()
            rows.append(dict(case=i, layout=c.layout, kernel=kernel, splits=splits, err=err, lse_err=lerr, ok=ok))
            print(f"check case {i} ({c.layout}, {kernel or 'default'}) splits={splits}: err {err:.2e} lse {lerr:.2e} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--layouts", default="nvfp4,fp8_e4m3")
    for flag, _ in OPTION_FLAGS:
        parser.add_argument(f"--{flag.replace('_', '-')}", default="", help="comma-separated values to time")
    parser.add_argument("--variant", action="append", default=[],
                        help="JSON CuteBackend options to time as one more variant (repeatable)")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--query-len", type=int, default=1)
    parser.add_argument("--overlap", type=float, default=None,
                        help="share of each token's pages that are its predecessor's (query length > 1)")
    parser.add_argument("--tp", default="1", help="M3 tensor-parallel head layouts to time (1: 64/4 ... 8: 8/1)")
    parser.add_argument("--q-dtype", choices=tuple(Q_DTYPES), default="bf16", help="the timed steps' query dtype")
    parser.add_argument("--ascending", action="store_true",
                        help="the timed steps' top-k lists in ascending block-id order (default: score order)")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--no-triton", action="store_true", help="do not time the Triton kernel beside")
    add_flush_argument(parser)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(int(time.time()))
    t0 = time.time()
    checks = [] if args.skip_checks else check_cases(gen)
    print(f"checks done in {time.time() - t0:.1f} s (includes compiling)", flush=True)
    timer = Timer(reps=args.reps, flush=args.flush)
    copy = copy_bandwidth(timer)
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict[str, Any]] = []
    variants: list[tuple[str, dict[str, Any]]] = [("cute", {})]
    for flag, option in OPTION_FLAGS:  # one variant per value of each option flag
        variants += [(f"cute {flag}={v}", {option: int(v)}) for v in getattr(args, flag).split(",") if v]
    variants += [(f"cute {v}", json.loads(v)) for v in args.variant]
    cases = ((tp, *case) for tp in map(int, args.tp.split(","))
             for case in m3_cases(args.layouts.split(","), batches, gen, args.query_len, args.overlap,
                                  geometry=msa.MINIMAX_M3_TP[tp], q_dtype=getattr(torch, Q_DTYPES[args.q_dtype]),
                                  ascending=args.ascending))
    for tp, layout, batch, case in cases:
        n_bytes = case[0]
        backends = [*(() if args.no_triton else [("triton", TritonBackend())]),
                    *((name, CuteBackend(**kw)) for name, kw in variants)]
        for name, backend in backends:
            timed = try_check_and_time(f"TP{tp} {layout} B={batch} {name}", backend, case, timer)
            if timed is None:
                continue
            plan, err, us = timed
            splits = plan.config.num_splits
            kernel = getattr(plan.config, "kernel", "")
            rows.append(dict(tp=tp, layout=layout, batch=batch, variant=name, kernel=kernel, us=us,
                             frac_copy=n_bytes / us / 1e3 / copy, err=err, splits=splits))
            print(f"TP{tp} {layout:8s} B={batch:3d} {name:16s} {kernel:5s} splits {splits:2d} {us:8.1f} us "
                  f"{n_bytes / us / 1e3 / copy:.2f} err {err:.1e}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_cute.json").write_text(json.dumps(dict(copy_gbps=copy, checks=checks, rows=rows), indent=1))
    print(f"L2 emptied by a 512 MB {args.flush} before each replay")
    print(f"copy bandwidth {copy:.0f} GB/s; checks {sum(c['ok'] for c in checks)}/{len(checks)} ok")
    print(format_table(["TP", "layout", "B", "variant", "kernel", "splits", "us", "x copy", "err"],
                       [[r["tp"], r["layout"], r["batch"], r["variant"], r["kernel"], r["splits"], round(r["us"], 1),
                         round(r["frac_copy"], 2), f"{r['err']:.1e}"] for r in rows]))


if __name__ == "__main__":
    main()
