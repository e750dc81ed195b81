"""`msa demo`: one MiniMax-M3-shaped decode step per layout, run on the best backend available,
checked against the reference (and the reference against a dense float64 oracle)."""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from msa.cli.args import Subparsers, device, positive_int, seed

if TYPE_CHECKING:  # imported by `run`: building the parser imports no torch
    import torch

    from msa.problem import Geometry

__all__ = ["add_parser", "run"]

DEMO_LAYOUTS = ("bfloat16", "fp8_e4m3", "nvfp4")
#: Demo tolerances: outputs (bf16, values of order 1) and the fp32 log-sum-exp.
OUT_TOLERANCE = 2.0**-7
LSE_TOLERANCE = 1e-3


def add_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run one MiniMax-M3-shaped decode step per layout and check it",
        description=__doc__,
    )
    parser.add_argument("--batch", type=positive_int, default=4, help="decode requests B (default 4)")
    parser.add_argument("--query-len", type=positive_int, default=1, help="query tokens per request L")
    parser.add_argument(
        "--context", type=positive_int, default=8192, help="tokens of context per request (default 8192)"
    )
    parser.add_argument(
        "--layout",
        choices=("all",) + DEMO_LAYOUTS + ("fp8", "float16"),
        default="all",
        help="KV-cache layout (default: all three)",
    )
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2, 4, 8), help="M3 TP head layout")
    parser.add_argument(
        "--device", type=device, default="auto", help="cpu, cuda, cuda:N, or auto (cuda if present)"
    )
    parser.add_argument("--backend", default="auto", help="backend name, or auto")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs (median reported)")
    parser.add_argument("--seed", type=seed, default=None, help="random seed (default: fresh)")
    parser.add_argument(
        "--no-oracle", action="store_true", help="skip the dense float64 check of the reference"
    )
    parser.set_defaults(func=run)


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of `fn` in microseconds (after one warm-up run)."""
    import torch

    fn()
    samples = []
    for _ in range(max(repeats, 1)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


#: The cross-check of the reference runs the Triton kernels on a step of this many requests and
#: tokens of context (small: on the CPU they run through the Triton interpreter).
CROSS_CHECK_BATCH, CROSS_CHECK_CONTEXT = 1, 1024


def _cross_check(
    name: str, geometry: Geometry, query_len: int, device: torch.device, seed: int | None
) -> tuple[str, float | None]:
    """When the demo's backend is the reference itself, compare it with the Triton kernels on a
    small step (under the Triton interpreter on the CPU), so the check means something; no error
    (None) where Triton cannot run."""
    from msa.api import select_backend, sparse_decode
    from msa.errors import MSAUnsupportedError
    from msa.validation import check_decode_inputs
    from msa.workload import make_decode_step

    step = make_decode_step(
        geometry, batch_size=CROSS_CHECK_BATCH, decode_query_len=query_len, context_len=CROSS_CHECK_CONTEXT,
        kv_cache_dtype=name, device=device, seed=seed,
    )
    kwargs = step.kwargs()
    try:
        select_backend(check_decode_inputs(**kwargs)[0], "triton")
    except MSAUnsupportedError:  # e.g. triton imported before the interpreter could be switched on
        return "nothing (Triton cannot run here)", None
    ref = sparse_decode(**kwargs, backend="reference")
    other = sparse_decode(**kwargs, backend="triton")
    where = "interpreter, " if device.type == "cpu" else ""
    err = (other.float() - ref.float()).abs().max().item()
    return f"triton ({where}B={CROSS_CHECK_BATCH}, {CROSS_CHECK_CONTEXT} tokens)", err


def _memory_bytes(device: torch.device) -> int:
    """The memory of `device`: the GPU's, or this machine's RAM for the CPU."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_step(
    args: argparse.Namespace, geometry: Geometry, layouts: tuple[str, ...], device: torch.device
) -> None:
    """Check the step each layout's demo will build, and select its backend, from the arguments
    alone, before anything is built or printed: more query tokens than context, a cache that
    would not fit the device, an unknown `--backend` or one that cannot run a step here each end
    the demo with one error line (`MSAInputError` / `MSAUnsupportedError`) and nothing else."""
    import torch

    from msa.api import select_backend
    from msa.errors import MSAInputError
    from msa.layouts import get_layout
    from msa.problem import DecodeProblem

    if args.query_len > args.context:
        raise MSAInputError("--query-len", f"at most --context = {args.context} tokens (a request's L new tokens "
                            "are part of its context)", args.query_len)
    max_blocks = max(1, -(-args.context // geometry.page_size))  # as msa.workload.make_decode_step
    num_pages = args.batch * max_blocks + 1
    room = _memory_bytes(device)
    tokens = num_pages * geometry.page_size * geometry.num_kv_heads  # (one KV head's token slots)
    for name in layouts:
        need = tokens * get_layout(name).bytes_per_token(geometry.head_dim)
        if need > room // 2:
            raise MSAInputError("--batch / --context", f"a step whose {name} cache fits in half of this "
                                f"{device.type} device's {room / 2**30:.0f} GiB", f"{need / 2**30:.3g} GiB for "
                                f"B={args.batch} and {args.context} tokens: lower --batch or --context")
    for name in layouts:
        problem = DecodeProblem(
            geometry=geometry,
            batch_size=args.batch,
            query_len=args.query_len,
            kv_layout=get_layout(name).name,
            q_dtype=torch.bfloat16,
            out_dtype=torch.bfloat16,
            device_type=device.type,
            num_pages=num_pages,
            max_blocks=max_blocks,
            return_lse=True,  # the demo compares LSEs too
        )
        select_backend(problem, args.backend)


def run(args: argparse.Namespace) -> int:
    import torch

    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if device.type == "cpu" and "triton" not in sys.modules:
        # the cross-check runs the Triton kernels through the interpreter on the CPU; it must be
        # switched on before triton is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from msa.api import select_backend, sparse_decode
    from msa.display import format_table, progress
    from msa.problem import MINIMAX_M3
    from msa.validation import check_decode_inputs
    from msa.workload import make_decode_step

    geometry = MINIMAX_M3.tensor_parallel(args.tp)
    layouts = DEMO_LAYOUTS if args.layout == "all" else (args.layout,)
    _check_step(args, geometry, layouts, device)  # every argument checked before the first line
    print(
        f"msa demo: MiniMax-M3 TP{args.tp} ({geometry.describe()}), B={args.batch}, "
        f"L={args.query_len}, context {args.context} tokens, on {device}"
    )
    rows = []
    worst = 0.0
    for name in progress(layouts, "layout"):
        step = make_decode_step(
            geometry,
            batch_size=args.batch,
            decode_query_len=args.query_len,
            context_len=args.context,
            kv_cache_dtype=name,
            device=device,
            seed=args.seed,
        )
        problem, _ = check_decode_inputs(**step.kwargs(), return_lse=True)
        backend = select_backend(problem, args.backend)
        kwargs = step.kwargs()
        out, lse = sparse_decode(**kwargs, backend=backend.name, return_lse=True, validate=True)
        micros = _timed(functools.partial(sparse_decode, **kwargs, backend=backend.name), device, args.repeats)
        ref_out, ref_lse = sparse_decode(**kwargs, backend="reference", return_lse=True)
        bound = OUT_TOLERANCE * max(ref_out.float().abs().max().item(), 1.0)
        if backend.name == "reference":
            against, err = _cross_check(name, geometry, args.query_len, device, args.seed)
        else:
            against, err = "reference", (out.float() - ref_out.float()).abs().max().item()
        if err is not None:
            worst = max(worst, err / bound)
        out_err: float | str = "-"
        lse_err: float | str = "-"
        if not args.no_oracle:
            dense_out, dense_lse = step.oracle()
            oracle_out = (ref_out.double() - dense_out).abs().max().item()
            oracle_lse = (ref_lse.double() - dense_lse).abs().max().item()
            worst = max(worst, oracle_out / bound, oracle_lse / LSE_TOLERANCE)
            out_err, lse_err = oracle_out, oracle_lse
        rows.append(
            [
                backend.name,
                step.layout.name,
                f"{problem.num_rows}x{geometry.num_q_heads}x{geometry.head_dim}",
                round(micros / 1e3, 3),
                against,
                "-" if err is None else err,
                out_err,
                lse_err,
            ]
        )
    print(
        format_table(
            [
                "backend",
                "layout",
                "q shape",
                "time (ms)",
                "checked against",
                "max err",
                "ref vs oracle: out",
                "lse",
            ],
            rows,
        )
    )
    ok = worst <= 1.0
    print(
        ("OK" if ok else "FAILED")
        + f": outputs within {OUT_TOLERANCE:.0e} x max(|out|, 1) (bf16 rounding and fp32 "
        f"accumulation), LSE within {LSE_TOLERANCE:.0e}; worst {worst:.2f} of the tolerance"
    )
    return 0 if ok else 1
