"""Compile msa's Triton decode kernels for Hopper (sm_90, or another GPU: `--capability`) without a
GPU and summarise the machine code: registers, spills, shared memory, and the instruction mix of
the main loop.

    PYTHONPATH=src python3 benchmarks/kernel_sass.py [--layouts nvfp4] [--batches 64,256] [--query-len 4] \
        [--q-dtype bf16|fp16|fp8] [--tp 1|2|4|8] [--capability 9.0] [--variant '{"block_n": 64}'] [--jobs N] \
        [--dump DIR]

The steps are M3's (`--tp` picks the head layout), compiled by `msa.bench.machine_code` (the
kernels, constants and argument types the Triton backend launches; `msa explain --machine-code`
does the same for any described step). Needs only the `triton` package (its bundled ptxas): the
evidence behind the profile summaries in benchmarks/RESULTS.md comes from here and from `ncu`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
from pathlib import Path
from typing import Any

import torch

import msa
from msa.bench.machine_code import compile_step, loop_mix
from msa.cli.defaults import Q_DTYPES


def _compile_case(case: tuple[str, int, dict[str, Any], int, str, int, tuple[int, int]]) -> list[dict[str, Any]]:
    layout, batch, overrides, query_len, q_dtype, tp, capability = case
    codes = compile_step(msa.MINIMAX_M3_TP[tp], layout, batch, query_len=query_len, q_dtype=getattr(torch, q_dtype),
                         capability=capability, overrides=overrides)
    return [dict(kernel=c.kernel, registers=c.registers, spills=c.spills, shared=c.shared, loop=c.loop, sass=c.sass,
                 ttgir=c.ttgir) for c in codes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="nvfp4")
    parser.add_argument("--batches", default="64")
    parser.add_argument("--query-len", type=int, default=1)
    parser.add_argument("--variant", action="append", default=[], help="JSON overrides of the launch config")
    parser.add_argument("--q-dtype", choices=tuple(Q_DTYPES), default="bf16", help="the query's dtype")
    parser.add_argument("--tp", type=int, choices=sorted(msa.MINIMAX_M3_TP), default=1,
                        help="M3's tensor-parallel head layout (1: 64/4 ... 8: 8/1)")
    parser.add_argument("--capability", default="9.0", help="the GPU's compute capability (major.minor)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="steps compiled at once, each in a process of its own (default: every core)")
    parser.add_argument("--dump", type=Path)
    args = parser.parse_args()
    variants = [json.loads(v) for v in args.variant] or [{}]
    major, _, minor = args.capability.partition(".")
    capability = (int(major), int(minor or 0))
    cases = [(layout, int(batch), overrides, args.query_len, Q_DTYPES[args.q_dtype], args.tp, capability)
             for layout in args.layouts.split(",") for batch in args.batches.split(",") for overrides in variants]
    with concurrent.futures.ProcessPoolExecutor(max(1, min(args.jobs, len(cases))),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        try:  # (compile_step checks each variant as the backend would: a bad one is one line, not a traceback)
            for (layout, batch, overrides, *_), results in zip(cases, pool.map(_compile_case, cases), strict=True):
                for r in results:
                    if args.dump:
                        args.dump.mkdir(parents=True, exist_ok=True)
                        tag = f"{r['kernel']}-{layout}-B{batch}-{abs(hash(json.dumps(overrides))) % 10**6}"
                        (args.dump / f"{tag}.sass").write_text(r["sass"])
                        (args.dump / f"{tag}.ttgir").write_text(r["ttgir"])
                    loop = r["loop"]
                    print(f"{r['kernel']:22s} {layout:9s} B={batch:3d} {json.dumps(overrides):40s} "
                          f"regs {r['registers']:3d} spills {r['spills']} smem {r['shared']:6d} | loop "
                          f"{loop.get('instructions', 0)} instr: {loop_mix(loop)}", flush=True)
        except msa.MSAError as exc:
            parser.error(str(exc))


if __name__ == "__main__":
    main()
