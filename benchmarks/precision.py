"""Each kernel's error against the float64 oracle (`msa.oracle.dense_masked_attention`: masked
dense attention over the whole context, an independent formulation), at M3 shapes, on fresh
random data every run (GPU):

    PYTHONPATH=src:benchmarks python3 benchmarks/precision.py --out DIR [--batch 4] [--context 16384] [--tp 1,8] \
        [--query-len 4 --overlap 0.8]

For every layout (bf16, fp8, NVFP4) x query dtype (bf16, f16, fp8) x kernel that serves it (the
reference backend in float32, what `auto` runs, Triton, `cute` with each of its kernels; the
policy's choice depends on the batch and query length, so a wide step needs its own `--batch`
and `--query-len`), the output's relative
error ||out - oracle|| / ||oracle|| (Frobenius, over the whole step) and max |out - oracle| /
max |oracle|. The oracle reads the same quantised cache, so this is the kernels' own error (the
products, the softmax, the bf16 output), not the cache's quantisation. Writes precision.json
and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import msa
from msa.backends.cute import CuteBackend
from msa.backends.triton import TritonBackend
from msa.display import format_table
from msa.problem import DecodeProblem
from msa.validation import DecodeInputs, check_decode_inputs
from msa.workload import make_decode_step

#: (label, backend factory, layouts it is asked for)
KERNELS: tuple[tuple[str, Any, tuple[str, ...]], ...] = (
    ("reference", None, ("bfloat16", "fp8_e4m3", "nvfp4")),
    ("auto", "auto", ("bfloat16", "fp8_e4m3", "nvfp4")),
    ("triton", TritonBackend, ("bfloat16", "fp8_e4m3", "nvfp4")),
    ("cute mma", lambda: CuteBackend(kernel="mma"), ("fp8_e4m3", "nvfp4")),
    ("cute wgmma", lambda: CuteBackend(kernel="wgmma"), ("fp8_e4m3", "nvfp4")),
    ("cute wgmma kreg", lambda: CuteBackend(kernel="wgmma", kreg=True), ("fp8_e4m3",)),
    ("cute wgmma terms", lambda: CuteBackend(kernel="wgmma", kreg=False), ("fp8_e4m3",)),
)
Q_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "fp8": torch.float8_e4m3fn}


def kernel_output(backend: Any, problem: DecodeProblem, inputs: DecodeInputs) -> torch.Tensor:
    """`backend`'s output of a validated step, written over NaN (no LSE)."""
    out = torch.full(inputs.q.shape, float("nan"), dtype=problem.out_dtype, device=inputs.q.device)
    backend.run_step(problem, inputs, out, None)
    return out


def errors(out: torch.Tensor, oracle: torch.Tensor) -> tuple[float, float]:
    """(||out - oracle|| / ||oracle||, max |out - oracle| / max |oracle|)."""
    diff = out.double() - oracle
    return (diff.norm() / oracle.norm()).item(), (diff.abs().max() / oracle.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--query-len", type=int, default=1, help="query tokens per request L")
    parser.add_argument("--overlap", type=float, default=None,
                        help="share of a token's pages its request's previous token selected too (L > 1)")
    parser.add_argument("--tp", default="1,8", help="M3 tensor-parallel head layouts (1: 64/4 ... 8: 8/1)")
    parser.add_argument("--q", default="bf16,f16,fp8")
    parser.add_argument("--layouts", default="bfloat16,fp8_e4m3,nvfp4")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (no cute kernels there)")
    args = parser.parse_args()
    seed = int(time.time())
    rows: list[dict[str, Any]] = []
    for tp in map(int, args.tp.split(",")):
        geometry = msa.MINIMAX_M3_TP[tp]
        for layout in args.layouts.split(","):
            for q_name in args.q.split(","):
                if q_name == "fp8" and layout == "bfloat16":
                    continue
                seed += 1
                step = make_decode_step(geometry, batch_size=args.batch, decode_query_len=args.query_len,
                                        context_len=args.context, kv_cache_dtype=layout, q_dtype=Q_DTYPES[q_name],
                                        device=args.device, seed=seed, overlap=args.overlap)
                kw = step.kwargs()
                oracle = step.oracle()[0]
                problem, inputs = check_decode_inputs(**kw)
                for label, factory, layouts in KERNELS:
                    if layout not in layouts:
                        continue
                    if factory is None or factory == "auto":
                        out = msa.sparse_decode(**kw, backend="reference" if factory is None else "auto")
                    else:
                        try:
                            out = kernel_output(factory(), problem, inputs)
                        except Exception as exc:  # a kernel that does not serve the step: say so
                            print(f"TP{tp} {layout} q={q_name} {label}: {type(exc).__name__}: {str(exc)[:160]}")
                            continue
                    rel, rel_max = errors(out, oracle)
                    rows.append(dict(tp=tp, layout=layout, q=q_name, kernel=label, rel=rel, rel_max=rel_max))
                    print(f"TP{tp} {layout:8s} q={q_name:4s} {label:10s} rel {rel:.2e} max {rel_max:.2e}", flush=True)
                del step, kw, oracle
                torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "precision.json").write_text(json.dumps(dict(batch=args.batch, context=args.context,
                                                             query_len=args.query_len, overlap=args.overlap,
                                                             seed=seed, rows=rows), indent=1))
    print(format_table(["TP", "layout", "q", "kernel", "rel (Frobenius)", "max / max"],
                       [[r["tp"], r["layout"], r["q"], r["kernel"], f"{r['rel']:.2e}", f"{r['rel_max']:.2e}"]
                        for r in rows]))


if __name__ == "__main__":
    main()
