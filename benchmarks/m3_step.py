"""The M3 step a one-launch script of the `cute` kernel runs (`profile_cute.py`, `trace_cute.py`):
its command-line arguments and the step they describe."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from tune_kernels import prepare_case

import msa
from msa.planning import StepTables
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step


def add_step_arguments(parser: argparse.ArgumentParser, tp: int, batch: int) -> None:
    """--tp, --batch, --layout, --variant (JSON `CuteBackend` options), --query-len, --overlap."""
    parser.add_argument("--tp", type=int, default=tp)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--layout", default="fp8_e4m3")
    parser.add_argument("--variant", default="{}", help="JSON CuteBackend options")
    parser.add_argument("--query-len", type=int, default=1)
    parser.add_argument("--overlap", type=float, default=None,
                        help="share of each token's pages that are its predecessor's (query length > 1)")


def make_m3_step(args: argparse.Namespace) -> tuple[Any, Any, Any, StepTables, Callable[[], torch.Tensor]]:
    """(the decode step, its problem, its inputs, its tables, a function giving the reference's
    output on them) at 64K contexts: for a query length above 1, the benchmarks' multi-token
    selections (`tune_kernels.prepare_case`)."""
    step = make_decode_step(msa.MINIMAX_M3_TP[args.tp], batch_size=args.batch, context_len=65536,
                            decode_query_len=args.query_len, kv_cache_dtype=args.layout, device="cuda", seed=0)
    if args.query_len > 1:
        gen = torch.Generator(device="cuda").manual_seed(0)
        _, ref, problem, inputs, tables, _ = prepare_case(step, args.batch, gen, args.query_len, args.overlap)
        return step, problem, inputs, tables, lambda: ref
    problem, inputs = check_decode_inputs(**step.kwargs())
    tables = StepTables.for_inputs(problem, inputs)
    return step, problem, inputs, tables, lambda: msa.sparse_decode(**step.kwargs(), backend="reference")
