"""One launch of FlashInfer's SM90 sparse decode, or of msa's planned step, on the same M3 fp8 step
under Nsight Compute (GPU, `nvidia-cutlass-dsl`, FlashInfer's kernel fetched by
benchmarks/engine_baselines/flashinfer_sm90.sh; the step is `flashinfer_sm90.make_step`'s):

    PYTHONPATH=src:benchmarks ncu --profile-from-start off --metrics "$(paste -sd, benchmarks/ncu_metrics.txt)" \\
        python3 benchmarks/profile_flashinfer.py --which flashinfer|msa --tp 8 --batch 16

Each side runs once first (compiling, planning); only the launch between `cudaProfilerStart` and
`cudaProfilerStop` is profiled, so that the two reports compare one kernel each where msa's step
is one launch, as at the steps profiled so far (benchmarks/ncu_summary.py reads them, and refuses a
report of several kernels)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from flashinfer_sm90 import flashinfer_args, load_flashinfer, make_step
from profile_cute import profile_second_launch

import msa
from msa.bench.sweep import planned_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--which", choices=("flashinfer", "msa"), required=True)
    parser.add_argument("--tp", type=int, choices=sorted(msa.MINIMAX_M3_TP), default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    kw = make_step(args.tp, 1, args.batch, None, "fp8_e4m3", args.context, args.seed)
    call: Callable[[], object]
    if args.which == "flashinfer":
        fi = load_flashinfer()
        fi_args = flashinfer_args(kw)

        def call() -> object:
            return fi.run(*fi_args)
    else:
        call, _ = planned_step("auto", kw)
    profile_second_launch(call)
    print(f"profiled {args.which} TP{args.tp} B={args.batch}")


if __name__ == "__main__":
    main()
