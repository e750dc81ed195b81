"""The benchmark sweep: layouts x TP head layouts x batch sizes x query lengths, each timed for
every requested backend and baseline, eager and as CUDA-graph replays, with L2 flushed."""

from __future__ import annotations

import datetime
import importlib
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from msa.bench.baselines import flex_attend, torch_gather_attend
from msa.bench.integrations import INTEGRATIONS
from msa.bench.timing import Timer, copy_bandwidth
from msa.display import format_table
from msa.errors import MSAInputError, MSAUnsupportedError
from msa.layouts import LAYOUT_NAMES, cache_nbytes
from msa.planner import DecodePlanner
from msa.planning import StepTables, resolve_entries
from msa.problem import MINIMAX_M3_TP
from msa.registry import get_registry
from msa.validation import check_decode_inputs
from msa.workload import KV_FORMS, DecodeStep, as_kv_form, indexer_topk, make_decode_step

__all__ = ["BenchConfig", "STRATEGIES", "check_config", "run_sweep", "step_bytes", "plot"]

BASELINES: dict[str, Callable[..., Callable[[], torch.Tensor]]] = {"torch": torch_gather_attend, "flex": flex_attend}
#: The triton backend's strategies a sweep may force ("auto": its own policy).
STRATEGIES = ("auto", "dedup", "per-token")


@attrs.frozen
class BenchConfig:
    """What to sweep. `same_tokens`: for L > 1, use `B // L` requests so that every query
    length runs the same number of query tokens as L = 1 at batch B. `overlaps`: how much
    consecutive tokens of a request share their pages (None: independent draws). `strategies`
    for the triton backend: "auto" (its policy), "dedup", "per-token". `kv_forms`: the cache
    forms of `msa.workload.KV_FORMS` to time on the same data (split layouts; NVFP4 is packed).
    `integrations`: engine drop-ins of `msa.bench.integrations.INTEGRATIONS` to time as well."""

    layouts: tuple[str, ...] = ("bfloat16", "fp8_e4m3", "nvfp4")
    batches: tuple[int, ...] = (1, 16, 64, 128, 256)
    query_lens: tuple[int, ...] = (1,)
    tps: tuple[int, ...] = (1,)
    context: int = 65536
    backends: tuple[str, ...] = ("triton",)
    baselines: tuple[str, ...] = ("torch",)
    baseline_max_batch: int = 64
    graph: bool = True
    same_tokens: bool = False
    reps: int = 50
    seed: int = 0
    overlaps: tuple[float | None, ...] = (None,)
    strategies: tuple[str, ...] = ("auto",)
    kv_forms: tuple[str, ...] = ("packed",)
    integrations: tuple[str, ...] = ()
    q_dtype: str = "bfloat16"


def check_config(config: BenchConfig) -> None:
    """Every name and number of `config` is one the sweep takes, checked before anything is
    measured (a typo once ended a sweep in a KeyError after its first cache, or labelled rows
    with a strategy that was not run).

    Raises:
        MSAInputError: naming the option (as `msa bench` spells it).
    """
    for flag, given, known in (("--layouts", config.layouts, LAYOUT_NAMES),
                               ("--strategies", config.strategies, STRATEGIES),
                               ("--kv-forms", config.kv_forms, KV_FORMS), ("--baselines", config.baselines, BASELINES),
                               ("--integrations", config.integrations, INTEGRATIONS)):
        unknown = [name for name in given if name not in known]
        if unknown:
            raise MSAInputError(flag, "names among " + ", ".join(known), ", ".join(unknown))
    if not config.overlaps or any(x is not None and not 0.0 <= x <= 1.0 for x in config.overlaps):
        raise MSAInputError("--overlap", "fractions in [0, 1] (e.g. 0,0.8)",
                            ", ".join(map(str, config.overlaps)) or "nothing")
    for name in config.backends:
        if name != "auto":
            try:
                get_registry().resolve(name)
            except MSAInputError as exc:
                raise MSAInputError("--backends", f"names among auto, {', '.join(get_registry().names())}",
                                    name) from exc
    unknown_tp = [tp for tp in config.tps if tp not in MINIMAX_M3_TP]
    if unknown_tp:
        raise MSAInputError("--tp", "M3 TP sizes among " + ", ".join(map(str, MINIMAX_M3_TP)),
                            ", ".join(map(str, unknown_tp)))


def step_bytes(kw: dict[str, Any], step: DecodeStep) -> int:
    """Bytes a step must move: the visible tokens of the selected pages (K + V, scales included)
    plus q and out."""
    g, layout = step.geometry, step.layout
    used, block, _, visible = resolve_entries(check_decode_inputs(**kw)[1])
    tokens = (visible.view(1, -1, 1) - block * g.page_size).clamp(0, g.page_size) * used
    q = kw["q"]
    return int(int(tokens.sum()) * layout.bytes_per_token(g.head_dim) + q.numel() * q.element_size() + q.numel() * 2)


def unique_bytes(kw: dict[str, Any], step: DecodeStep) -> tuple[int, float]:
    """(bytes of each (request, KV head, page) read once — the tokens visible to any of the
    request's rows — plus q and out; the realized overlap: the fraction of a token's selected
    blocks the previous token of its request also selected)."""
    g, length = step.geometry, kw["decode_query_len"]
    used, block, _, visible = resolve_entries(check_decode_inputs(**kw)[1])
    hkv, rows, k = used.shape
    batch = rows // length
    tokens = (visible.view(1, -1, 1) - block * g.page_size).clamp(0, g.page_size) * used
    key = torch.where(used, block, -1).reshape(hkv, batch, length * k)
    per_request = torch.zeros((hkv, batch, kw["block_table"].shape[1] + 1), dtype=torch.long, device=key.device)
    per_request.scatter_reduce_(2, torch.where(key >= 0, key, per_request.shape[2] - 1),
                                tokens.reshape(hkv, batch, length * k), reduce="amax")
    unique = int(per_request[..., :-1].sum())
    q = kw["q"]
    n_bytes = unique * step.layout.bytes_per_token(g.head_dim) + q.numel() * (q.element_size() + 2)
    if length == 1:
        return n_bytes, 0.0
    ids = torch.where(used, block, -1).reshape(hkv, batch, length, k)
    shared = (ids[:, :, 1:, :, None] == ids[:, :, :-1, None, :]).any(-1) & (ids[:, :, 1:] >= 0)
    total = (ids[:, :, 1:] >= 0).sum().clamp(min=1)
    return n_bytes, float(shared.sum() / total)


def _case(
    step: DecodeStep, batch: int, length: int, generator: torch.Generator, overlap: float | None = None
) -> dict[str, Any]:
    """The first `batch` requests of `step`, with `length` query tokens each: fresh q and indices."""
    kw = step.kwargs()
    seq_lens = step.seq_lens[:batch]
    table = step.block_table[:batch]
    g = step.geometry
    kw.update(
        seq_lens=seq_lens,
        block_table=table,
        decode_query_len=length,
        q=torch.randn(
            (batch * length, g.num_q_heads, g.head_dim), device=seq_lens.device, generator=generator
        ).to(step.q.dtype),
        topk_indices=indexer_topk(
            seq_lens, decode_query_len=length, num_kv_heads=g.num_kv_heads, topk=g.topk,
            page_size=g.page_size, max_blocks=table.shape[1], generator=generator, overlap=overlap,
        ),
    )
    return kw


def _time_strategy(
    strategy: str, kw: dict[str, Any], timer: Timer, graph: bool
) -> tuple[dict[str, float], torch.Tensor]:
    """Time the triton backend forced to one strategy ("dedup" or "per-token")."""
    from msa.backends.triton import TritonBackend

    backend = TritonBackend(dedup=strategy == "dedup")
    problem, inputs = check_decode_inputs(**kw)
    plan = backend.plan(problem, StepTables.for_inputs(problem, inputs))
    out = torch.full(kw["q"].shape, float("nan"), dtype=problem.out_dtype, device=kw["q"].device)

    return _eager_and_graph(lambda: backend.run(plan, inputs, out, None), timer, graph), out


def planned_step(name: str, kw: dict[str, Any]) -> tuple[Callable[[], object], torch.Tensor]:
    """`DecodePlanner.run` of a planned step (what a serving engine captures) as a call, and its NaN-poisoned output."""
    q = kw["q"]
    problem, _ = check_decode_inputs(**kw)
    planner = DecodePlanner(
        problem.geometry, kv_cache_dtype=problem.kv_layout, backend=name, device=q.device, q_dtype=q.dtype
    )
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=kw["decode_query_len"])
    out = torch.full(q.shape, float("nan"), dtype=problem.out_dtype, device=q.device)
    args = (plan, q, kw["kv_cache"], kw["topk_indices"])
    scales = {"k_scale": kw["k_scale"], "v_scale": kw["v_scale"]}
    return lambda: planner.run(*args, out=out, **scales), out


def _time_backend(name: str, kw: dict[str, Any], timer: Timer, graph: bool) -> tuple[dict[str, float], torch.Tensor]:
    """Time `DecodePlanner.run` of a planned step."""
    call, out = planned_step(name, kw)
    return _eager_and_graph(call, timer, graph), out


def _eager_and_graph(call: Callable[[], object], timer: Timer, graph: bool) -> dict[str, float]:
    times = {"eager": timer.eager(call)}
    if graph:
        times["graph"] = timer.graph(call)
    return times


def run_sweep(config: BenchConfig, out_dir: Path | None = None, log: Any = sys.stderr) -> dict[str, Any]:
    """Run the sweep; returns (and writes as JSON under `out_dir`) every measurement."""
    timer = Timer(reps=config.reps)
    copy_gbps = copy_bandwidth(timer)
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)", file=log, flush=True)
    generator = torch.Generator(device="cuda")
    generator.manual_seed(config.seed)
    rows: list[dict[str, Any]] = []
    cases = [(layout, tp) for layout in config.layouts for tp in config.tps]
    for n_case, (layout, tp) in enumerate(cases, 1):
        geometry = MINIMAX_M3_TP[tp]
        step = make_decode_step(
            geometry, batch_size=max(config.batches), context_len=config.context, kv_cache_dtype=layout,
            q_dtype=getattr(torch, config.q_dtype), device="cuda", seed=config.seed,
        )
        cache_gib = cache_nbytes(step.kv_cache) / 2**30
        print(f"[{n_case}/{len(cases)}] {layout} TP{tp}: cache {cache_gib:.1f} GiB, q {config.q_dtype}", file=log,
              flush=True)
        forms = [f for f in config.kv_forms if f == "packed" or step.layout.separable]
        shapes = itertools.product(config.batches, config.query_lens, config.overlaps, forms)
        for batch, length, overlap, form in shapes:
                requests = max(batch // length, 1) if config.same_tokens else batch
                kw = _case(step, requests, length, generator, overlap)
                kw["kv_cache"] = as_kv_form(step.layout, step.kv_cache, form)
                n_bytes = step_bytes(kw, step)
                n_unique, realized = unique_bytes(kw, step)
                shape = StepShape(layout, tp, geometry.num_q_heads, geometry.num_kv_heads, requests, length,
                                  n_bytes, n_unique, overlap, realized, copy_gbps)
                ref_out = _reference(kw)
                runs = [(name, "auto") for name in config.backends if name != "triton" or "auto" in config.strategies]
                if "triton" in config.backends:
                    runs += [("triton", s) for s in config.strategies if s != "auto"]
                for name, strategy in runs:
                    if strategy == "auto":
                        try:
                            times, out = _time_backend(name, kw, timer, config.graph)
                        except MSAUnsupportedError as exc:  # a backend named for some layouts only
                            print(f"  {layout} B={requests} L={length} {name}: skipped ({exc})", file=log, flush=True)
                            continue
                    else:
                        times, out = _time_strategy(strategy, kw, timer, config.graph)
                    err = (out.float() - ref_out.float()).abs().max().item()
                    for mode, micros in times.items():
                        rows.append(shape.row(name, mode, micros, err, strategy=strategy, kv_form=form))
                        _print(rows[-1], log)
                for name in config.integrations if form == "packed" else ():
                    call = INTEGRATIONS[name](kw, step.layout)
                    if call is None:
                        continue
                    times = _eager_and_graph(call, timer, config.graph)
                    err = (call().float() - ref_out.float()).abs().max().item()
                    for mode, micros in times.items():
                        rows.append(shape.row(name, mode, micros, err, kv_form=name))
                        _print(rows[-1], log)
                for base in config.baselines:
                    if batch > config.baseline_max_batch:
                        continue
                    try:
                        fn = BASELINES[base](kw, step.layout)
                        micros = timer.eager(fn)
                        err = (fn().float().reshape(ref_out.shape) - ref_out.float()).abs().max().item()
                    except Exception as exc:  # e.g. FlexAttention that does not compile here
                        print(f"  {base}: unavailable ({type(exc).__name__}: {str(exc)[:160]})", file=log, flush=True)
                        continue
                    rows.append(shape.row(base, "eager", micros, err))
                    _print(rows[-1], log)
        del step
        torch.cuda.empty_cache()
    result = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "config": attrs.asdict(config),
        "copy_gbps": copy_gbps,
        "rows": rows,
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench.json").write_text(json.dumps(result, indent=1))
        plot(result, out_dir / "bench.png", log)
    return result


def _reference(kw: dict[str, Any]) -> torch.Tensor:
    from msa.api import sparse_decode

    out = sparse_decode(**kw, backend="reference")
    assert isinstance(out, torch.Tensor)
    return out


@attrs.frozen
class StepShape:
    """What every row timed on one step shares: its case, its bytes (each token's selected pages,
    `step_bytes`, and each request's pages once, `unique_bytes`), the asked and the realized page
    overlap, and the run's copy bandwidth."""

    layout: str
    tp: int
    hq: int
    hkv: int
    batch: int
    length: int
    n_bytes: int
    n_unique: int
    overlap: float | None
    realized: float
    copy_gbps: float

    def row(self, backend: str, mode: str, micros: float, err: float, **extra: Any) -> dict[str, Any]:
        """One measurement's row (any timed thing: a backend, an engine's kernel, a baseline)."""
        gbps, unique_gbps = self.n_bytes / micros / 1e3, self.n_unique / micros / 1e3
        return dict(layout=self.layout, tp=self.tp, heads=f"{self.hq}/{self.hkv}", batch=self.batch,
                    query_len=self.length, backend=backend, mode=mode, us=micros, bytes=self.n_bytes, gbps=gbps,
                    frac_copy=gbps / self.copy_gbps, us_per_token=micros / (self.batch * self.length), max_err=err,
                    overlap=self.overlap, realized_overlap=self.realized, unique_bytes=self.n_unique,
                    unique_gbps=unique_gbps, unique_frac_copy=unique_gbps / self.copy_gbps, **extra)


def _print(row: dict[str, Any], log: Any) -> None:
    extra = ""
    if "unique_gbps" in row and row["query_len"] > 1:
        extra = (f" [{row.get('strategy', '-')}, overlap {row['realized_overlap']:.2f}, "
                 f"unique {row['unique_gbps']:.0f} GB/s "
                 f"{row['unique_frac_copy']:.2f}]")
    print(f"  {row['layout']:9s} {row['heads']:5s} B={row['batch']:4d} L={row['query_len']:2d} {row['backend']:9s} "
          f"{row.get('kv_form', 'packed'):8s} "
          f"{row['mode']:5s} {row['us']:9.1f} us {row['gbps']:6.0f} GB/s {row['frac_copy']:5.2f} "
          f"err {row['max_err']:.1e}{extra}",
          file=log, flush=True)


def summary_table(result: dict[str, Any]) -> str:
    rows = [
        [r["layout"], r["heads"], r["batch"], r["query_len"], r["backend"], r.get("kv_form", "packed"),
         r.get("strategy", "-"),
         "-" if r.get("overlap") is None else r["overlap"], r["mode"], round(r["us"], 1),
         round(r["gbps"]), round(r["frac_copy"], 2), round(r.get("unique_gbps", r["gbps"])),
         round(r.get("unique_frac_copy", r["frac_copy"]), 2), f"{r['max_err']:.1e}"]
        for r in result["rows"]
    ]
    return format_table(
        ["layout", "heads", "B", "L", "backend", "kv form", "strategy", "overlap", "mode", "us", "GB/s", "x copy",
         "unique GB/s", "unique x copy", "max err"],
        rows,
    )


def plot(result: dict[str, Any], path: Path, log: Any = sys.stderr) -> None:
    """Bandwidth of each request's selected pages read once (`unique_bytes`; at L = 1 every
    token's) against query tokens a step, one line per (layout, heads, L, backend, kv form, mode,
    strategy, and at L > 1 page overlap)."""
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib; msa bench --plot FILE.json)", file=log)
        return
    fig, ax = plt.subplots(figsize=(9, 5.5))
    lines: dict[tuple[Any, ...], list[tuple[int, float]]] = {}
    for r in result["rows"]:
        shared = r["query_len"] > 1 and r.get("overlap") is not None  # (at L = 1 nothing is shared)
        key = (r["layout"], r["heads"], r["query_len"], r["backend"], r.get("kv_form", "packed"), r["mode"],
               r.get("strategy") or "-", r["overlap"] if shared else -1.0)
        lines.setdefault(key, []).append((r["batch"] * r["query_len"], r.get("unique_gbps", r["gbps"])))
    for (layout, heads, length, backend, form, mode, strategy, overlap), points in sorted(lines.items()):
        points.sort()
        how = ("" if strategy in ("auto", "-") else f" {strategy}") + ("" if overlap < 0 else f" overlap {overlap:g}")
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                label=f"{backend} {mode} {layout} {form} {heads} L={length}{how}")
    ax.axhline(result["copy_gbps"], color="black", linestyle="--", label="device copy (read+write)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("query tokens per step (B x L)")
    ax.set_ylabel("GB/s (a request's visible selected K+V once, q, out)")
    ax.set_title(f"msa sparse decode, {result['device']}, {result['date']}")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=log)
