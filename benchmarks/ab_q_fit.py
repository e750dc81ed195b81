"""The Triton kernels with and without the bf16 query's fit into fp16's range (`kernels._fit_q`),
timed in one run on one GPU (the fit is switched off by patching `launch._query_form`):

    PYTHONPATH=src python3 benchmarks/ab_q_fit.py [--layouts fp8_e4m3,nvfp4] [--batches 1,16,64,256] \
        [--query-lens 1,4] [--reps 30]

M3 TP1 at 64K contexts (`msa.workload.make_decode_step`, bf16 queries), `backend="triton"` through
a planner, as L2-flushed CUDA-graph replays (`msa.bench.timing.Timer`); the variants are
interleaved per step (fit, no fit, fit again) so that drift shows. Each output is compared with
the reference first (max abs error printed). Prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType

import torch

import msa
from msa.backends.triton import launch
from msa.bench.timing import Timer
from msa.display import format_table
from msa.workload import DecodeStep, make_decode_step


def _step(step: DecodeStep, layout: str, length: int, backend: str = "triton") -> tuple[Callable[[], object], float]:
    """A planned graph-capturable call of `step` on a fresh planner (the launcher decides the fit,
    as patched, when it first meets the step), and its error against the reference."""
    kw = step.kwargs()
    planner = msa.DecodePlanner(step.geometry, kv_cache_dtype=layout, backend=backend, device="cuda",
                                q_dtype=kw["q"].dtype)
    out = torch.empty_like(kw["q"])
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=length)

    def call() -> object:
        planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, k_scale=kw["k_scale"],
                    v_scale=kw["v_scale"])
        return out

    call()
    ref = msa.sparse_decode(**kw, backend="reference")
    return call, float((out.float() - ref.float()).abs().max())


@contextlib.contextmanager
def patched(module: ModuleType, attribute: str, value: object) -> Iterator[None]:
    """`<module>.<attribute>` replaced by `value` inside the block, put back whatever happens."""
    own = getattr(module, attribute)
    setattr(module, attribute, value)
    try:
        yield
    finally:
        setattr(module, attribute, own)


def interleaved(timer: Timer, step: DecodeStep, layout: str, length: int, attribute: str,
                variants: Mapping[str, Callable[..., object]], module: ModuleType = launch,
                backend: str = "triton") -> tuple[dict[str, float], dict[str, float]]:
    """`step` timed (L2-flushed graph replays, `timer`) and checked against the reference with
    `<module>.<attribute>` (the Triton launcher's by default) replaced by each of two `variants`
    in turn, interleaved (first, second, first again, so that drift shows), on a fresh planner of
    `backend` each: (fastest us, max abs error) by variant name. The module's own function is put
    back whatever happens."""
    first, second = variants
    times: dict[str, list[float]] = {first: [], second: []}
    errors = {}
    for name in (first, second, first):
        with patched(module, attribute, variants[name]):
            call, errors[name] = _step(step, layout, length, backend)
            times[name].append(timer.graph(call))
    return {name: min(t) for name, t in times.items()}, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="fp8_e4m3,nvfp4")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--query-lens", default="1,4")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    timer = Timer(reps=args.reps)
    own = launch._query_form
    variants = {"fit": own, "no fit": lambda q_dtype, compute: {**own(q_dtype, compute), "Q_FIT": False}}
    rows = []
    for layout in args.layouts.split(","):
        for length in (int(x) for x in args.query_lens.split(",")):
            for batch in (int(x) for x in args.batches.split(",")):
                step = make_decode_step(msa.MINIMAX_M3, batch_size=batch, decode_query_len=length,
                                        context_len=65536, kv_cache_dtype=layout, device="cuda",
                                        seed=batch * 10 + length)
                times, errors = interleaved(timer, step, layout, length, "_query_form", variants)
                rows.append([layout, length, batch, *(round(times[n], 1) for n in ("fit", "no fit")),
                             f"{errors['fit']:.1e}", f"{errors['no fit']:.1e}"])
                print(rows[-1], flush=True)
    print(format_table(["layout", "L", "B", "fit us", "no fit us", "err fit", "err no fit"], rows))


if __name__ == "__main__":
    main()
