"""`msa backends` and `msa explain`: what is registered, and which backend would run a step.

Both judge through the same `SelectionPolicy`, on the same platform (this machine, or a pretend
one: `--cpu`, `--capability 10.0 --packages ...`): `msa backends` shows each backend's
machine-level refusals (`Backend.platform_reasons`), `msa explain` those plus the step's.
Both list every plugin that failed, with its error: a plugin's fault never ends either command
in a traceback.

torch, the registry and the backends are imported by the commands, not by their parsers
(`msa --help` stays fast).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from typing import TYPE_CHECKING

from msa.cli.args import Subparsers, capability, heads, names, positive_int
from msa.cli.defaults import (
    CACHE_FORMS,
    LAYOUT_NAMES,
    M3_HEAD_DIM,
    M3_HEADS,
    M3_PAGE_SIZE,
    M3_TOPK,
    OPTIONAL_PACKAGES,
    Q_DTYPES,
)

if TYPE_CHECKING:
    from msa.hooks import BackendRecord
    from msa.layouts import KVLayout
    from msa.platform import Platform
    from msa.policy import SelectionPolicy, Verdict
    from msa.problem import DecodeProblem, Geometry
    from msa.registry import BackendRegistry

__all__ = ["add_parsers", "run_backends", "run_explain"]


def _add_platform_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--capability", type=capability, default=None, help="pretend a CUDA device of this capability, e.g. 10.0"
    )
    where.add_argument(
        "--cpu", action="store_true", help="pretend a CPU (TRITON_INTERPRET as in the environment)"
    )
    parser.add_argument("--sm-count", type=positive_int, default=148, help="SMs of the pretend device")
    parser.add_argument("--device-name", default="", help="name of the pretend device (with --capability), e.g. "
                        "'NVIDIA H200' with --sm-count 132 "
                        "(some measured rules differ by device)")
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
    explain.add_argument(
        "--heads", type=heads, default=M3_HEADS, metavar="HQ/HKV",
        help="query heads / KV heads, both required, e.g. 64/4 (default: 64/4)",
    )
    explain.add_argument("--head-dim", type=positive_int, default=M3_HEAD_DIM, help="D (default %(default)s)")
    explain.add_argument(
        "--page-size", type=positive_int, default=M3_PAGE_SIZE, help="tokens per KV page P (default %(default)s)"
    )
    explain.add_argument(
        "--topk", type=positive_int, default=M3_TOPK, help="pages selected per query token K (default %(default)s)"
    )
    explain.add_argument("--kv-dtype", choices=LAYOUT_NAMES, default="fp8", help="cache layout (default %(default)s)")
    explain.add_argument("--q-dtype", choices=tuple(Q_DTYPES), default="bf16", help="query dtype (default %(default)s)")
    explain.add_argument("--batch", type=positive_int, default=64, help="decode requests B (default %(default)s)")
    explain.add_argument(
        "--query-len", type=positive_int, default=1, help="query tokens per request L (default %(default)s)"
    )
    explain.add_argument("--lse", action="store_true", help="the caller wants the LSE")
    explain.add_argument(
        "--kv-form", choices=CACHE_FORMS, default="packed",
        help="how the cache is held: one packed tensor, a (k_cache, v_cache) pair of contiguous "
        "tensors, or strided views",
    )
    explain.add_argument(
        "--graph-capture", action="store_true", help="the caller will capture the step in a CUDA graph"
    )
    explain.add_argument(
        "--dcp-size", type=positive_int, default=1,
        help="ranks each request's pages are spread over (decode context parallelism; default 1)",
    )
    explain.add_argument("--backend", default="auto", help="a backend name to request (default: auto)")
    explain.add_argument(
        "--machine-code", action="store_true",
        help="compile the Triton kernels of the step for the (pretend) GPU here, no GPU needed, and show "
        "their registers, spills, shared memory and main loop",
    )
    _add_platform_arguments(explain)
    explain.set_defaults(func=run_explain)


def _platform(args: argparse.Namespace) -> Platform:
    """This machine, or the pretend one the flags describe."""
    from msa.errors import MSAInputError
    from msa.platform import Platform, detect

    if args.device_name and args.capability is None:
        raise MSAInputError("--device-name", "given with --capability (it names a pretend CUDA device)",
                            args.device_name)
    packages: tuple[str, ...] = OPTIONAL_PACKAGES if args.packages is None else args.packages
    if args.cpu:
        interpret = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
        return Platform("cpu", packages=frozenset(packages), triton_interpret=interpret)
    if args.capability is not None:
        return Platform.cuda(args.capability, sm_count=args.sm_count, packages=packages, name=args.device_name)
    return detect()


def _runs_here(policy: SelectionPolicy, verdict: Verdict, platform: Platform) -> str:
    """yes, "by name" (only when requested), no, or broken."""
    if verdict.failure is not None:
        return "broken"
    if verdict.qualified:
        return "yes"
    return "by name" if policy.judge(verdict.name, None, platform, requested=True).qualified else "no"


#: The distributions that install each optional package a backend may declare
#: (`Capabilities.packages`), first first.
_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "triton": ("triton",),
    "cutlass_dsl": ("nvidia-cutlass-dsl",),
    "flashinfer": ("flashinfer-python", "flashinfer"),
    "fmha_sm100": ("vllm", "fmha_sm100", "fmha-sm100"),
}


def _distribution_version(distributions: tuple[str, ...]) -> str | None:
    """`name version` of the first installed of `distributions`, or None."""
    for distribution in distributions:
        try:
            return f"{distribution} {importlib.metadata.version(distribution)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _version(registry: BackendRegistry, verdict: Verdict, record: BackendRecord) -> str:
    """What the backend runs on: the library its `version()` names; else the packages its
    capabilities declare (their installed distributions' versions); else the distribution that
    registered it, msa itself for the built-ins. "-" for a broken backend or nothing installed."""
    from msa.plugins.faults import PluginFault, guarded

    if verdict.failure is not None:
        return "-"
    try:
        backend = registry.get(verdict.name)
        version = guarded(backend.version)
    except PluginFault as fault:  # a plugin's bug must not break the listing
        return f"? ({type(fault.cause).__name__})"
    if not isinstance(version, str):
        return f"? ({type(version).__name__})"
    if version:
        return version
    try:
        packages: object = guarded(lambda: backend.capabilities.packages)
    except PluginFault:  # the registry checked the record, not every attribute of a plugin's backend
        packages = ()
    if isinstance(packages, tuple) and packages:
        found = [_distribution_version(_DISTRIBUTIONS.get(str(p), (str(p),))) for p in packages]
        return ", ".join(v for v in found if v is not None) or "-"
    from msa.registry import BUILTIN_SOURCE

    if record.source == BUILTIN_SOURCE:
        from msa import __version__

        return f"msa {__version__}"
    # a plugin's source reads "<distribution> <version> (entry point <name> = <value>)"
    where, entry_point, _ = record.source.partition(" (entry point ")
    return where if entry_point and where != "unknown distribution" else "-"


def _failure_lines(registry: BackendRegistry) -> list[str]:
    """Every plugin that failed to load, as `Selection.explain` lists a broken backend."""
    return [
        f"  {f.name:<16} {'broken':<10} failed to load: {f.error}"
        + (" (named in MSA_PLUGINS)" if f.required else "")
        for f in registry.failures.values()
    ]


def run_backends(args: argparse.Namespace) -> int:
    from msa.display import format_table
    from msa.policy import SelectionPolicy
    from msa.registry import get_registry

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
                _version(registry, verdict, record),
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


#: The flags of `msa explain` that set what a layout's `allocate` checks.
_GEOMETRY_FLAGS = {"head_dim": "--head-dim", "page_size": "--page-size", "num_kv_heads": "--heads"}


def _check_layout_holds(layout: KVLayout, geometry: Geometry, kv_form: str) -> None:
    """A step the layout cannot hold (NVFP4's head dims and pages, separate K and V caches of its
    one tensor of head slots; a strided view of that tensor is one) is refused as the API refuses
    its cache, naming the flag."""
    from msa.errors import MSAInputError

    if kv_form == "separate" and not layout.separable:
        raise MSAInputError("--kv-form", f"packed or strided for the {layout.name!r} layout (one tensor of head slots)",
                            kv_form)
    try:
        layout.allocate(1, geometry.num_kv_heads, geometry.page_size, geometry.head_dim, device="meta")
    except MSAInputError as exc:
        flag = _GEOMETRY_FLAGS.get(exc.argument, exc.argument)
        raise MSAInputError(flag, exc.expected, exc.given) from None
    except (RuntimeError, OverflowError):  # a page no tensor can hold
        raise MSAInputError("--heads / --page-size / --head-dim", "a page of a size a tensor can have",
                            f"{geometry.num_kv_heads} KV heads x {geometry.page_size} tokens x D = {geometry.head_dim}",
                            ) from None


def _print_strategy(name: str, policy: SelectionPolicy, problem: DecodeProblem, platform: Platform) -> None:
    """How the chosen backend runs the step (`Backend.strategy`, plugin code: a fault or a value
    that is neither a str nor None is reported on its line, not raised; an msa error stays one)."""
    from msa.errors import MSAError
    from msa.plugins.faults import PluginFault, given, guarded

    try:
        how = guarded(policy.registry.get(name).strategy, problem, platform)
    except PluginFault as fault:
        if isinstance(fault.cause, MSAError):
            raise fault.cause from None
        print(f"{name}: strategy() failed: {fault.error}")
        return
    if how is not None and not isinstance(how, str):  # (None: nothing to say, as `Backend.strategy` allows)
        print(f"{name}: strategy() returned {given(how)}, not a str or None")
    elif how:
        print(f"{name} runs it with {how}")


def run_explain(args: argparse.Namespace) -> int:
    import torch

    from msa.layouts import get_layout
    from msa.policy import SelectionPolicy
    from msa.problem import DecodeProblem, Geometry
    from msa.validation import output_dtype

    num_q_heads, num_kv_heads = args.heads
    geometry = Geometry(num_q_heads, num_kv_heads, args.head_dim, args.page_size, args.topk)
    q_dtype: torch.dtype = getattr(torch, Q_DTYPES[args.q_dtype])
    out_dtype = output_dtype(q_dtype)
    layout = get_layout(args.kv_dtype).resolve(out_dtype)
    _check_layout_holds(layout, geometry, args.kv_form)
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
        dcp_size=args.dcp_size,
    )
    policy = SelectionPolicy()
    selection = policy.evaluate(problem, platform, args.backend)
    print(
        f"step: {geometry.describe()}, {problem.kv_layout} cache, q {args.q_dtype}, "
        f"B={args.batch}, L={args.query_len}{', LSE' if args.lse else ''}, K/V {args.kv_form}"
        f"{', graph capture' if args.graph_capture else ''}"
        f"{f', DCP over {args.dcp_size} ranks' if args.dcp_size > 1 else ''}"
    )
    print(f"platform: {platform.describe()}")
    print(selection.explain())
    if selection.chosen is not None:
        _print_strategy(selection.chosen, policy, problem, platform)
    for line in _failure_lines(policy.registry):
        print(line)
    if args.machine_code:
        from msa.cli.machine_code import print_machine_code

        print_machine_code(problem, platform, selection.chosen)
    return 0 if selection.chosen else 1
