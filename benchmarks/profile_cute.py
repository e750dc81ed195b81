"""One `cute` kernel launch of an M3 fp8 step under Nsight Compute (GPU, `nvidia-cutlass-dsl`):

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/profile_cute.py --tp 1 --batch 64 [--variant '{"wgs": 2}'] \
        [--query-len 4 --overlap 0.8]

The step is compiled and run once first; only the launch between `cudaProfilerStart` and
`cudaProfilerStop` is profiled (plus Triton's merge kernel when the variant splits without
merging in the kernel)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from m3_step import add_step_arguments, make_m3_step

from msa.backends.cute import CuteBackend


def profile_second_launch(call: Callable[[], object]) -> None:
    """Run `call` once (compiling, planning), then once more between `cudaProfilerStart` and
    `cudaProfilerStop`: the launch `ncu --profile-from-start off` profiles."""
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()  # type: ignore[no-untyped-call]
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()  # type: ignore[no-untyped-call]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_arguments(parser, tp=1, batch=64)
    args = parser.parse_args()
    _, problem, inputs, tables, _ = make_m3_step(args)
    backend = CuteBackend(**json.loads(args.variant))
    plan = backend.plan(problem, tables)
    out = torch.empty(inputs.q.shape, dtype=problem.out_dtype, device="cuda")
    profile_second_launch(lambda: backend.run(plan, inputs, out, None))
    print(f"profiled TP{args.tp} B={args.batch} {args.layout} {plan.config}")


if __name__ == "__main__":
    main()
