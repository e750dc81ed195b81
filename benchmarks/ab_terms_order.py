"""The wgmma kernel's fp8 score product of the query's fp8 terms with the smallest term's k-steps
first (`config.WGMMA_TERMS_LO_FIRST`, the default) against the largest's first, in one run on
one GPU (the order is switched by patching `launch.spec_for`):

    PYTHONPATH=src:benchmarks python3 benchmarks/ab_terms_order.py [--reps 30] [--seeds 2]

First the error of each order against the float64 oracle (`msa.oracle.dense_masked_attention`)
on fresh random data (M3 fp8 at 16K contexts, bf16 and f16 queries, the steps that take the fp8
product: wide L = 1 and L = 4 steps at 80% page overlap; Triton beside as the exact product's
error), then each order timed at 64K contexts as L2-flushed CUDA-graph replays, interleaved
(lo first, hi first, lo first again). Prints two tables.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import attrs
import torch
from ab_q_fit import interleaved, patched
from precision import errors, kernel_output

import msa
from msa.backends.cute import CuteBackend, launch
from msa.backends.triton import TritonBackend
from msa.bench.timing import Timer
from msa.display import format_table
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step

OWN = launch.spec_for
VARIANTS = {"lo first": OWN, "hi first": lambda *a, **k: attrs.evolve(OWN(*a, **k), lo_first=False)}
#: (TP, batch, query length, overlap): steps whose default cute kernel takes the fp8 product
PRECISION_STEPS = ((1, 256, 1, None), (1, 256, 4, 0.8), (8, 256, 4, 0.8), (8, 64, 4, 0.8))
TIMED_STEPS = ((1, 128, 1, None), (1, 256, 1, None), (1, 64, 4, 0.8), (1, 256, 4, 0.8), (8, 64, 4, 0.8),
               (8, 256, 4, 0.8))
Q = {"bf16": torch.bfloat16, "f16": torch.float16}


def precision_rows(seed: int) -> list[list[Any]]:
    rows = []
    for tp, batch, length, overlap in PRECISION_STEPS:
        for q_name, q_dtype in Q.items():
            seed += 1
            step = make_decode_step(msa.MINIMAX_M3_TP[tp], batch_size=batch, decode_query_len=length,
                                    context_len=16384, kv_cache_dtype="fp8_e4m3", q_dtype=q_dtype, device="cuda",
                                    seed=seed, overlap=overlap)
            oracle = step.oracle()[0]
            problem, inputs = check_decode_inputs(**step.kwargs())
            found = []
            for name, backend in (("lo first", CuteBackend), ("hi first", CuteBackend), ("triton", TritonBackend)):
                with patched(launch, "spec_for", VARIANTS.get(name, OWN)):
                    out = kernel_output(backend(), problem, inputs)
                found += [f"{e:.2e}" for e in errors(out, oracle)]
            rows.append([tp, batch, length, overlap or 0, q_name, *found])
            print(rows[-1], flush=True)
            del step, oracle
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=2, help="fresh data sets of each precision step")
    args = parser.parse_args()
    seed = int(time.time())
    rows = [row for s in range(args.seeds) for row in precision_rows(seed + 100 * s)]
    print(format_table(["TP", "B", "L", "overlap", "q", "lo first rel", "max/max", "hi first rel", "max/max",
                        "triton rel", "max/max"], rows))
    timer = Timer(reps=args.reps)
    timed = []
    for tp, batch, length, overlap in TIMED_STEPS:
        step = make_decode_step(msa.MINIMAX_M3_TP[tp], batch_size=batch, decode_query_len=length, context_len=65536,
                                kv_cache_dtype="fp8_e4m3", device="cuda", seed=seed + batch, overlap=overlap)
        times, errs = interleaved(timer, step, "fp8_e4m3", length, "spec_for", VARIANTS, launch, "cute")
        timed.append([tp, batch, length, overlap or 0, *(round(times[n], 1) for n in VARIANTS),
                      *(f"{errs[n]:.1e}" for n in VARIANTS)])
        print(timed[-1], flush=True)
        del step
        torch.cuda.empty_cache()
    print(format_table(["TP", "B", "L", "overlap", "lo first us", "hi first us", "err lo", "err hi"], timed))


if __name__ == "__main__":
    main()
