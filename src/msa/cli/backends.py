"""`msa backends` and `msa explain`: what is registered, and which backend would run a step.

Both judge through the same `SelectionPolicy`, on the same platform (this machine, or a pretend
one: `--cpu`, `--capability 10.0 --packages ...`): `msa backends` shows each backend's
machine-level refusals (`Backend.platform_reasons`), `msa explain` those plus the step's.
"""

from __future__ import annotations

import argparse
import os

import torch

from msa.cli.args import Subparsers, capability, heads, names, positive_int
from msa.display import format_table
from msa.layouts import LAYOUT_NAMES, get_layout
from msa.platform import OPTIONAL_PACKAGES, Platform, detect
from msa.policy import SelectionPolicy, Verdict
from msa.problem import CACHE_FORMS, MINIMAX_M3, DecodeProblem, Geometry
from msa.registry import BackendRegistry, get_registry
from msa.validation import output_dtype

__all__ = ["add_parsers"]

_Q_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def _add_platform_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--capability", type=capability, default=None, help="pretend a CUDA device of this capability, e.g. 10.0"
    )
    where.add_argument(
        "--cpu", action="store_true", help="pretend a CPU (TRITON_INTERPRET as in the environment)"
    )
    parser.add_argument("--sm-count", type=positive_int, default=148, help="SMs of the pretend device")
    parser.add_argument(
        "--packages",
        type=names,
        default=None,
        help="comma list of installed packages on the pretend device "
        f"(default: all of {', '.join(OPTIONAL_PACKAGES)})",
    )


def add_parsers(subparsers: Subparsers) -> None:
    backends = subparsers.add_parser(
        "backends",
        help="list every registered backend and whether it can run here",
        description="Every registered backend, whether it runs on this machine (or a pretend one) "
        "and why not, and every plugin that failed.",
    )
    _add_platform_arguments(backends)
    backends.set_defaults(func=run_backends)

    explain = subparsers.add_parser(
        "explain",
        help="which backend would run a described step, and why each other one would not",
        description="Describe a decode step (defaults: MiniMax-M3 TP1, fp8 cache, B=64, L=1) "
        "and a platform (default: this machine) and see the selection.",
    )
    m3 = MINIMAX_M3
    explain.add_argument(
        "--heads", type=heads, default=(m3.num_q_heads, m3.num_kv_heads), help="Hq/Hkv, e.g. 64/4"
    )
    explain.add_argument("--head-dim", type=positive_int, default=m3.head_dim)
    explain.add_argument("--page-size", type=positive_int, default=m3.page_size)
    explain.add_argument("--topk", type=positive_int, default=m3.topk)
    explain.add_argument("--kv-dtype", choices=LAYOUT_NAMES, default="fp8")
    explain.add_argument("--q-dtype", choices=tuple(_Q_DTYPES), default="bf16")
    explain.add_argument("--batch", type=positive_int, default=64)
    explain.add_argument("--query-len", type=positive_int, default=1)
    explain.add_argument("--lse", action="store_true", help="the caller wants the LSE")
    explain.add_argument(
        "--kv-form", choices=CACHE_FORMS, default="packed",
        help="how the cache is held: one packed tensor, a (k_cache, v_cache) pair of contiguous "
        "tensors, or strided views",
    )
    explain.add_argument(
        "--graph-capture", action="store_true", help="the caller will capture the step in a CUDA graph"
    )
    explain.add_argument("--backend", default="auto", help="a backend name to request")
    _add_platform_arguments(explain)
    explain.set_defaults(func=run_explain)


def _platform(args: argparse.Namespace) -> Platform:
    """This machine, or the pretend one the flags describe."""
    packages: tuple[str, ...] = OPTIONAL_PACKAGES if args.packages is None else args.packages
    if args.cpu:
        interpret = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
        return Platform("cpu", packages=frozenset(packages), triton_interpret=interpret)
    if args.capability is not None:
        return Platform.cuda(args.capability, sm_count=args.sm_count, packages=packages)
    return detect()


def _runs_here(policy: SelectionPolicy, verdict: Verdict, platform: Platform) -> str:
    """yes, "by name" (only when requested), no, or broken."""
    if verdict.failure is not None:
        return "broken"
    if verdict.qualified:
        return "yes"
    return "by name" if policy.judge(verdict.name, None, platform, requested=True).qualified else "no"


def _version(registry: BackendRegistry, verdict: Verdict) -> str:
    if verdict.failure is not None:
        return "-"
    try:
        return registry.get(verdict.name).version() or "-"
    except Exception as exc:  # a plugin's bug must not break the listing
        return f"? ({type(exc).__name__})"


def run_backends(args: argparse.Namespace) -> int:
    registry = get_registry()
    platform = _platform(args)
    policy = SelectionPolicy(registry, environ={})  # every backend as `auto` sees it
    print(f"platform: {platform.describe()}")
    rows: list[list[object]] = []
    for verdict in policy.evaluate(None, platform).verdicts:
        record = registry.record(verdict.name)
        required = " (named in MSA_PLUGINS)" if verdict.failure is not None and verdict.failure.required else ""
        rows.append(
            [
                record.name + (f" ({', '.join(record.aliases)})" if record.aliases else ""),
                record.priority,
                record.source,
                _version(registry, verdict),
                _runs_here(policy, verdict, platform),
                ("; ".join(verdict.reasons) or record.description) + required,
            ]
        )
    for failure in registry.failures.values():
        required = " (named in MSA_PLUGINS)" if failure.required else ""
        rows.append([failure.name, "-", failure.source, "-", "broken", f"failed to load: {failure.error}{required}"])
    print(format_table(["backend", "priority", "source", "version", "runs here", "notes"], rows))
    if registry.not_loaded:
        print("plugins not loaded (MSA_PLUGINS / MSA_DISABLE_PLUGINS): " + ", ".join(registry.not_loaded))
    for failure in registry.required_failures():
        print(f"backend='auto' refuses to run: {failure.required_message()}")
    return 0


def run_explain(args: argparse.Namespace) -> int:
    num_q_heads, num_kv_heads = args.heads
    geometry = Geometry(num_q_heads, num_kv_heads, args.head_dim, args.page_size, args.topk)
    q_dtype = _Q_DTYPES[args.q_dtype]
    out_dtype = output_dtype(q_dtype)
    layout = get_layout(args.kv_dtype).resolve(out_dtype)
    platform = _platform(args)
    problem = DecodeProblem(
        geometry=geometry,
        batch_size=args.batch,
        query_len=args.query_len,
        kv_layout=layout.name,
        q_dtype=q_dtype,
        out_dtype=out_dtype,
        device_type=platform.device_type,
        num_pages=1 << 20,
        max_blocks=1 << 10,
        return_lse=args.lse,
        kv_form=args.kv_form,
        graph_capture=args.graph_capture,
    )
    selection = SelectionPolicy().evaluate(problem, platform, args.backend)
    print(
        f"step: {geometry.describe()}, {problem.kv_layout} cache, q {args.q_dtype}, "
        f"B={args.batch}, L={args.query_len}{', LSE' if args.lse else ''}, K/V {args.kv_form}"
        f"{', graph capture' if args.graph_capture else ''}"
    )
    print(f"platform: {platform.describe()}")
    print(selection.explain())
    return 0 if selection.chosen else 1
