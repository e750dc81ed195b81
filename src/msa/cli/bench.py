"""`msa bench`: the benchmark sweep on the current GPU (see msa.bench); torch and msa.bench are
imported by the command, not by its parser."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from msa.cli.args import Subparsers, bench_file, floats, names, positive_int, positive_ints
from msa.cli.defaults import Q_DTYPES
from msa.errors import MSAInputError

__all__ = ["add_parser", "run"]


#: The defaults of the graph sweep's own flags (`--eager` takes none of them), and what else
#: `--eager` accepts for them (it runs backend "auto" and no baselines).
SWEEP_ONLY: dict[str, object] = {"same_tokens": False, "strategies": ("auto",), "kv_forms": ("packed",),
                                 "integrations": (), "backends": ("triton",), "baselines": ("torch",),
                                 "baseline_max_batch": 64, "no_graph": False}
EAGER_TAKES: dict[str, object] = {"backends": ("auto",), "baselines": ()}


def add_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("bench", help="time the backends on this GPU (L2 flushed, eager and graph replay)")
    p.add_argument("--layouts", type=names, default=("bfloat16", "fp8_e4m3", "nvfp4"),
                   help="KV-cache layouts to time (comma list; default: bfloat16,fp8_e4m3,nvfp4)")
    p.add_argument("--batches", type=positive_ints, default=(1, 16, 64, 128, 256),
                   help="batch sizes B (comma list; default: 1,16,64,128,256)")
    p.add_argument("--query-lens", type=positive_ints, default=(1,),
                   help="query tokens per request L (comma list; default: 1)")
    p.add_argument("--same-tokens", action="store_true",
                   help="for L > 1 run B // L requests: as many query tokens as L = 1 at batch B")
    p.add_argument("--overlap", type=floats, default=(None,),
                   help="page overlap between consecutive tokens of a request, e.g. 0,0.8 (default: independent)")
    p.add_argument("--strategies", type=names, default=SWEEP_ONLY["strategies"],
                   help="for the triton backend: auto, dedup, per-token (comma list)")
    p.add_argument("--kv-forms", type=names, default=SWEEP_ONLY["kv_forms"],
                   help="cache forms to time on the same data: packed, separate, sglang (split layouts)")
    p.add_argument("--integrations", type=names, default=SWEEP_ONLY["integrations"],
                   help="engine drop-ins to time as well: sglang-dropin (comma list)")
    p.add_argument("--tp", type=positive_ints, default=(1,), help="M3 TP head layouts, e.g. 1,2,4")
    p.add_argument("--context", type=positive_int, default=65536, help="tokens per request (default 65536)")
    p.add_argument("--q-dtype", choices=tuple(Q_DTYPES), default="bf16",
                   help="query dtype (default %(default)s; fp8: e4m3, the kernels' fp8 product)")
    p.add_argument("--backends", type=names, default=SWEEP_ONLY["backends"],
                   help="msa backends to time (comma list; default: triton)")
    p.add_argument("--baselines", type=names, default=SWEEP_ONLY["baselines"],
                   help="baselines to time beside msa: torch, flex (comma list, or empty; default: torch)")
    p.add_argument("--baseline-max-batch", type=positive_int, default=SWEEP_ONLY["baseline_max_batch"],
                   help="largest B at which the baselines run (default 64)")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replays")
    p.add_argument("--eager", action="store_true",
                   help="eager calls instead: host us per call next to one empty Triton launch, and wall time")
    p.add_argument("--reps", type=positive_int, default=50,
                   help="timed repetitions per measurement, median reported (default 50)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for bench.json and bench.png")
    p.add_argument("--plot", type=bench_file, default=None, help="only draw the plot of an existing bench.json")
    p.set_defaults(func=run)


def _check_out(out: Path, names: tuple[str, ...]) -> None:
    """`--out` is a directory (or can become one) where `names` can be written: checked before
    the sweep, not after every measurement."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise MSAInputError("--out", "a directory for the results (or a path to create one)",
                            f"{str(out)!r} ({str(existing)!r} is a file)")
    for made in names:
        if (out / made).is_dir():
            raise MSAInputError("--out", f"a directory where {made} can be written",
                                f"{str(out / made)!r}, a directory")


def _plot(data: dict[str, object], source: Path) -> None:
    """Draw `source`'s plot beside it (a .png of the same name), never over it."""
    from msa.bench.sweep import plot

    target = source.with_suffix(".png")
    if target.resolve() == source.resolve():
        raise MSAInputError("--plot", "a bench.json (its plot is written beside it as .png)",
                            f"{str(source)!r}: the plot would replace it")
    if importlib.util.find_spec("matplotlib") is None:
        raise MSAInputError("--plot", "matplotlib installed (pip install matplotlib)", "no matplotlib")
    try:
        plot(data, target)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # a JSON object, but not msa bench's
        raise MSAInputError(
            "--plot", "a bench.json written by msa bench", f"{str(source)!r} ({type(exc).__name__}: {exc})"
        ) from None
    except OSError as exc:
        raise MSAInputError("--plot", f"a plot file that can be written beside it ({str(target)!r})",
                            exc.strerror or type(exc).__name__) from None


def _check_eager(args: argparse.Namespace) -> None:
    """`--eager` times msa's entry points with backend "auto" (and what they launch): the graph
    sweep's own flags are refused with it, not ignored."""
    for attr, default in SWEEP_ONLY.items():
        given = getattr(args, attr)
        if given not in (default, EAGER_TAKES.get(attr, default)):
            flag = "--" + attr.replace("_", "-")
            shown = ",".join(given) if isinstance(given, tuple) else str(given)
            raise MSAInputError(flag, "its default with --eager (which times msa's entry points with backend "
                                "'auto': drop it, or leave out --eager)", shown)


def run(args: argparse.Namespace) -> int:
    import torch

    from msa.bench.sweep import BenchConfig, check_config, run_sweep, summary_table

    if args.plot is not None:
        _plot(args.plot.data, args.plot.path)
        return 0
    config = BenchConfig(
        layouts=args.layouts, batches=args.batches, query_lens=args.query_lens, tps=args.tp,
        context=args.context, backends=args.backends, baselines=args.baselines,
        baseline_max_batch=args.baseline_max_batch, graph=not args.no_graph,
        same_tokens=args.same_tokens, reps=args.reps, overlaps=args.overlap, strategies=args.strategies,
        kv_forms=args.kv_forms, integrations=args.integrations, q_dtype=Q_DTYPES[args.q_dtype],
    )
    check_config(config)
    if args.eager:
        _check_eager(args)
    _check_out(args.out, ("eager.json",) if args.eager else ("bench.json", "bench.png"))
    if not torch.cuda.is_available():
        print("msa bench: error: needs a CUDA GPU (try `msa demo` on the CPU)", file=sys.stderr)
        return 2
    if args.eager:
        from msa.bench.eager import eager_table, run_eager

        eager = run_eager(config, args.out)
        print(f"one empty Triton launch: {eager['empty_launch_us']:.1f} us of host time")
        print(eager_table(eager))
        print(f"results: {args.out / 'eager.json'}")
        return 0
    result = run_sweep(config, args.out)
    print(summary_table(result))
    print(f"results: {args.out / 'bench.json'}")
    return 0
