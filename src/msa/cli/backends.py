"""`msa backends` and `msa explain`: what is registered, and which backend would run a step."""

from __future__ import annotations

import argparse

import torch

from msa.display import format_table
from msa.layouts import get_layout
from msa.platform import OPTIONAL_PACKAGES, Platform, detect
from msa.policy import SelectionPolicy
from msa.problem import MINIMAX_M3, DecodeProblem, Geometry
from msa.registry import get_registry

__all__ = ["add_parsers"]

_Q_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    backends = subparsers.add_parser(
        "backends", help="list every registered backend and whether it can run here"
    )
    backends.set_defaults(func=run_backends)

    explain = subparsers.add_parser(
        "explain",
        help="which backend would run a described step, and why each other one would not",
        description="Describe a decode step (defaults: MiniMax-M3 TP1, fp8 cache, B=64, L=1) "
        "and a platform (default: this machine) and see the selection.",
    )
    m3 = MINIMAX_M3
    explain.add_argument("--heads", default=f"{m3.num_q_heads}/{m3.num_kv_heads}", help="Hq/Hkv, e.g. 64/4")
    explain.add_argument("--head-dim", type=int, default=m3.head_dim)
    explain.add_argument("--page-size", type=int, default=m3.page_size)
    explain.add_argument("--topk", type=int, default=m3.topk)
    explain.add_argument("--kv-dtype", default="fp8", help="auto, bfloat16, float16, fp8, nvfp4")
    explain.add_argument("--q-dtype", choices=tuple(_Q_DTYPES), default="bf16")
    explain.add_argument("--batch", type=int, default=64)
    explain.add_argument("--query-len", type=int, default=1)
    explain.add_argument("--lse", action="store_true", help="the caller wants the LSE")
    explain.add_argument("--backend", default="auto", help="a backend name to request")
    explain.add_argument(
        "--capability", default=None, help="pretend a CUDA device of this capability, e.g. 10.0"
    )
    explain.add_argument("--sm-count", type=int, default=148, help="SMs of the pretend device")
    explain.add_argument(
        "--packages",
        default=None,
        help="comma list of installed packages on the pretend device "
        f"(default: all of {', '.join(OPTIONAL_PACKAGES)})",
    )
    explain.set_defaults(func=run_explain)


def run_backends(args: argparse.Namespace) -> int:
    registry = get_registry()
    platform = detect()
    print(f"platform: {platform.describe()}")
    rows = []
    for record in registry.records():
        backend = registry.get(record.name)
        reasons = backend.not_supported_reasons(None, platform)
        rows.append(
            [
                record.name + (f" ({', '.join(record.aliases)})" if record.aliases else ""),
                record.priority,
                record.source,
                backend.version() or "-",
                "yes" if not reasons else "no",
                "; ".join(reasons) or record.description,
            ]
        )
    for failure in registry.failures.values():
        rows.append([failure.name, "-", failure.source, "-", "broken", failure.error])
    print(format_table(["backend", "priority", "source", "version", "runs here", "notes"], rows))
    if registry.not_loaded:
        print("plugins not loaded (MSA_PLUGINS / MSA_DISABLE_PLUGINS): " + ", ".join(registry.not_loaded))
    return 0


def _platform(args: argparse.Namespace) -> Platform:
    if args.capability is None:
        return detect()
    major, _, minor = args.capability.partition(".")
    packages = OPTIONAL_PACKAGES if args.packages is None else tuple(
        p.strip() for p in args.packages.split(",") if p.strip()
    )
    return Platform.cuda((int(major), int(minor or 0)), sm_count=args.sm_count, packages=packages)


def run_explain(args: argparse.Namespace) -> int:
    hq, _, hkv = args.heads.partition("/")
    geometry = Geometry(int(hq), int(hkv or 1), args.head_dim, args.page_size, args.topk)
    layout = get_layout(args.kv_dtype)
    q_dtype = _Q_DTYPES[args.q_dtype]
    platform = _platform(args)
    problem = DecodeProblem(
        geometry=geometry,
        batch_size=args.batch,
        query_len=args.query_len,
        kv_layout="bfloat16" if layout.name == "auto" else layout.name,
        q_dtype=q_dtype,
        out_dtype=torch.bfloat16 if q_dtype == torch.float8_e4m3fn else q_dtype,
        device_type=platform.device_type,
        num_pages=1 << 20,
        max_blocks=1 << 10,
        return_lse=args.lse,
    )
    selection = SelectionPolicy().evaluate(problem, platform, args.backend)
    print(
        f"step: {geometry.describe()}, {problem.kv_layout} cache, q {args.q_dtype}, "
        f"B={args.batch}, L={args.query_len}{', LSE' if args.lse else ''}"
    )
    print(f"platform: {platform.describe()}")
    print(selection.explain())
    return 0 if selection.chosen else 1
