"""The Triton kernels on a 16-bit cache with a query of the other 16-bit type (a bf16 query over an
fp16 cache, an fp16 one over a bf16 cache): the cache's own 16-bit dots (the bf16 query fitted
into fp16's range, the fp16 one as two bf16 terms) against the fp32 IEEE dots they replaced,
timed in one run on one GPU (the old path by patching `launch._compute_dtype`):

    PYTHONPATH=src:benchmarks python3 benchmarks/ab_mixed_16bit.py [--batches 16,64,256] [--tp 1,8] [--reps 30]

M3 at 64K contexts (`msa.workload.make_decode_step`), L = 1, `backend="triton"` through a planner,
as L2-flushed CUDA-graph replays (`msa.bench.timing.Timer`), the variants interleaved (new, old,
new again). Each output is compared with the reference first (max abs error printed).
"""

from __future__ import annotations

import argparse

import torch
import triton.language as tl
from ab_q_fit import interleaved

import msa
from msa.backends.triton import launch
from msa.bench.timing import Timer
from msa.display import format_table
from msa.workload import make_decode_step

#: (cache layout, query dtype) pairs of the other 16-bit type
MIXED = (("float16", torch.bfloat16), ("bfloat16", torch.float16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--tp", default="1,8")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    timer = Timer(reps=args.reps)
    def fp32(q_dtype: torch.dtype, cache_dtype: torch.dtype, config: object) -> tuple[object, str]:
        return tl.float32, "ieee"

    variants = {"16-bit": launch._compute_dtype, "fp32": fp32}
    rows = []
    for tp in (int(x) for x in args.tp.split(",")):
        for layout, q_dtype in MIXED:
            for batch in (int(x) for x in args.batches.split(",")):
                step = make_decode_step(msa.MINIMAX_M3_TP[tp], batch_size=batch, context_len=65536,
                                        kv_cache_dtype=layout, q_dtype=q_dtype, device="cuda", seed=batch + tp)
                times, errors = interleaved(timer, step, layout, 1, "_compute_dtype", variants)
                rows.append([tp, layout, str(q_dtype).removeprefix("torch."), batch,
                             *(round(times[n], 1) for n in ("16-bit", "fp32")),
                             f"{errors['16-bit']:.1e}", f"{errors['fp32']:.1e}"])
                print(rows[-1], flush=True)
    print(format_table(["TP", "cache", "q", "B", "16-bit dots us", "fp32 dots us", "err 16-bit", "err fp32"], rows))


if __name__ == "__main__":
    main()
