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

import torch
from tune_kernels import prepare_case

import msa
from msa.backends.cute import CuteBackend
from msa.planning import StepTables
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--layout", default="fp8_e4m3")
    parser.add_argument("--variant", default="{}", help="JSON CuteBackend options")
    parser.add_argument("--query-len", type=int, default=1)
    parser.add_argument("--overlap", type=float, default=None,
                        help="share of each token's pages that are its predecessor's (query length > 1)")
    args = parser.parse_args()
    step = make_decode_step(msa.MINIMAX_M3_TP[args.tp], batch_size=args.batch, context_len=65536,
                            decode_query_len=args.query_len, kv_cache_dtype=args.layout, device="cuda", seed=0)
    if args.query_len > 1:  # the multi-token selections of the benchmarks (`tune_kernels.prepare_case`)
        gen = torch.Generator(device="cuda").manual_seed(0)
        _, _, problem, inputs, tables, _ = prepare_case(step, args.batch, gen, args.query_len, args.overlap)
    else:
        problem, inputs = check_decode_inputs(**step.kwargs())
        tables = StepTables.for_inputs(problem, inputs)
    backend = CuteBackend(**json.loads(args.variant))
    plan = backend.plan(problem, tables)
    out = torch.empty(inputs.q.shape, dtype=problem.out_dtype, device="cuda")
    backend.run(plan, inputs, out, None)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()  # type: ignore[no-untyped-call]
    backend.run(plan, inputs, out, None)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()  # type: ignore[no-untyped-call]
    print(f"profiled TP{args.tp} B={args.batch} {args.layout} {plan.config}")


if __name__ == "__main__":
    main()
