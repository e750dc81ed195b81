"""msa against FlashInfer's Hopper (SM90) MiniMax-M3 sparse decode, on the same GPU, the same steps
and the same timer (GPU with `nvidia-cutlass-dsl`; FlashInfer's kernel fetched into a git-ignored
folder first, never committed: `bash benchmarks/engine_baselines/flashinfer_sm90.sh`):

    PYTHONPATH=src:benchmarks python3 benchmarks/flashinfer_sm90.py --out DIR \\
        [--rows issue|core|l1|tp|l4|nvfp4|gaps|all] [--reps 30] [--backends cute,triton] [--q-dtype fp8]

FlashInfer's kernel (`flashinfer/msa_ops/cute_dsl/sparse_decode_sm90.py`, newer than any release;
the one vLLM's main branch calls on SM90) reads msa's packed fp8 cache `[pages, Hkv, P, 2D]` as it
is, a bf16 query (which it rounds to fp8 for an fp8 score product), the per-token block ids `[Hkv,
R, K]` (sorted ascending, -1 only as a suffix: the steps here are sorted, which changes nothing for
msa), the block table and the lengths, with softmax scale 1/sqrt(D) and no K/V scales (so the
fp8 cache here holds the tokens' own values and is read with scales of 1; NVFP4 keeps its
workload scales, FlashInfer never reads it). Each step is checked against msa's reference
backend's float32 output (not rounded to bf16): the relative error (max |out - ref| / max |ref|)
is printed beside the time. Times are
medians of L2-flushed CUDA-graph replays (`msa.bench.timing.Timer`), FlashInfer's and msa's (the
planner's `run`, as `msa bench` times it) in the same process, with the copy bandwidth of the run.
NVFP4 and bf16 caches are timed on msa alone (FlashInfer has no Hopper path for them).
With `--q-dtype fp8` msa is given an E4M3 query (no query scale: its fp8 score product is what the
caller asked for) and FlashInfer the same values as bf16 (exactly representable: its own rounding
to fp8 then changes nothing), so that both compute the same fp8 product; the reference reads the
fp8 query too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import msa
from msa.backends.reference import ReferenceBackend
from msa.bench.sweep import planned_step
from msa.bench.timing import Timer, copy_bandwidth
from msa.cli.defaults import Q_DTYPES as QUERY_DTYPE_NAMES
from msa.display import format_table
from msa.validation import check_decode_inputs
from msa.workload import DEFAULT_SCALES, indexer_topk, make_decode_step

ROOT = Path(__file__).resolve().parents[1]
#: Where flashinfer_sm90.sh puts FlashInfer's kernel (MSA_FLASHINFER_SM90 overrides).
KERNEL = Path(os.environ.get("MSA_FLASHINFER_SM90")
              or ROOT / ".baselines" / "flashinfer_sm90" / "sparse_decode_sm90.py")

#: (tp, L, B, overlap, layouts) of each row: the issue's (fp8 against FlashInfer; NVFP4 and bf16 on msa).
Row = tuple[int, int, int, "float | None", tuple[str, ...]]
_FP8, _BOTH = ("fp8_e4m3",), ("fp8_e4m3", "nvfp4")
_L1: list[Row] = [(1, 1, b, None, _FP8) for b in (1, 16, 64, 128, 256)]
_TP: list[Row] = [(tp, 1, b, None, _BOTH) for tp in (8, 4) for b in (16, 64, 256)]
_L4: list[Row] = [(1, 2, 64, 0.0, _FP8), (1, 4, 64, 0.0, _FP8)]
_L4 += [(tp, 4, b, 0.8, _FP8) for tp in (1, 8) for b in (16, 64, 256)]
_NVFP4: list[Row] = [(1, 1, b, None, ("nvfp4",)) for b in (64, 256)]
_NVFP4.append((1, 1, 64, None, ("bfloat16",)))
_CORE: list[Row] = [(tp, 1, b, None, _FP8) for tp, b in ((1, 1), (1, 16), (1, 64), (1, 256), (8, 16), (8, 64),
                                                          (8, 256))]
#: Batches between one and 1.5 programs an SM (vLLM's graph capture sizes step by 8 there).
_GAPS: list[Row] = [(1, 1, b, None, _BOTH) for b in (40, 48)]
_GAPS += [(tp, 1, 160, None, _BOTH) for tp in (4, 8)]
ROWS: dict[str, list[Row]] = {"l1": _L1, "tp": _TP, "l4": _L4, "nvfp4": _NVFP4, "core": _CORE, "gaps": _GAPS}
ROWS["issue"] = ROWS["l1"] + ROWS["tp"] + ROWS["nvfp4"]
ROWS["all"] = ROWS["issue"] + ROWS["l4"]
#: The query dtypes msa can be given here (those whose values are bf16 values: FlashInfer takes bf16).
Q_DTYPES = {name: getattr(torch, QUERY_DTYPE_NAMES[name]) for name in ("bf16", "fp8")}


def load_flashinfer() -> ModuleType:
    """FlashInfer's kernel module, imported from its file."""
    if not KERNEL.is_file():
        sys.exit(f"error: {KERNEL} not found: run benchmarks/engine_baselines/flashinfer_sm90.sh first")
    spec = importlib.util.spec_from_file_location("flashinfer_sparse_decode_sm90", KERNEL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_step(tp: int, length: int, batch: int, overlap: float | None, layout: str, context: int,
              seed: int, q_dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """msa.sparse_decode's arguments for M3 at `tp`: fresh data, lists sorted ascending (-1 last),
    scales of 1 but for NVFP4's (which keeps the workload's), a query of `q_dtype` (an E4M3 one
    unscaled). An fp8 cache holds the tokens' own
    N(0, 1) values (the workload writes them with a scale of 1/16; FlashInfer takes no scale, and
    reading those bytes with a scale of 1 made every K and V 16x and the scores' spread 16 instead
    of 1, outside any model's range: on 2026-12-06 FlashInfer's output was then ~1 relative error
    from the reference, and msa's fp8 score product 2.9e-2)."""
    g = msa.MINIMAX_M3_TP[tp]
    step = make_decode_step(g, batch_size=batch, decode_query_len=length, context_len=context,
                            kv_cache_dtype=layout, q_dtype=q_dtype, device="cuda", seed=seed)
    kw = step.kwargs()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed + 1)
    ids = indexer_topk(step.seq_lens, decode_query_len=length, num_kv_heads=g.num_kv_heads, topk=g.topk,
                       page_size=g.page_size, max_blocks=step.block_table.shape[1], generator=gen, overlap=overlap)
    big = torch.iinfo(torch.int32).max
    ids = torch.where(ids >= 0, ids, big).sort(dim=-1).values
    kw.update(topk_indices=torch.where(ids == big, -1, ids).contiguous())
    if layout == "fp8_e4m3":
        cache = kw["kv_cache"]
        for start in range(0, cache.shape[0], 4096):  # (in place, 4096 pages at a time: B = 256 is 16 GiB)
            cache[start:start + 4096] = (cache[start:start + 4096].float() * DEFAULT_SCALES[layout]).to(cache.dtype)
    if layout != "nvfp4":
        kw.update(k_scale=1.0, v_scale=1.0)
    return kw


def time_msa(backend: str, kw: dict[str, Any], timer: Timer) -> tuple[float, torch.Tensor]:
    """Graph-replay microseconds of the planner's `run` (what `msa bench` times), and its output."""
    call, out = planned_step(backend, kw)
    return timer.graph(call), out


def flashinfer_args(kw: dict[str, Any]) -> tuple[Any, ...]:
    """FlashInfer's `run` arguments for msa's step `kw`, its NaN-filled bf16 output last: the
    query as bf16 (an fp8 query's values exactly), the int32 lists, table and lengths."""
    q = kw["q"].to(torch.bfloat16).contiguous()
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    return (q, kw["kv_cache"], kw["topk_indices"].int().contiguous(), kw["block_table"].int().contiguous(),
            kw["seq_lens"].int().contiguous(), out)


def time_flashinfer(fi: ModuleType, kw: dict[str, Any], timer: Timer) -> tuple[float, torch.Tensor]:
    args = flashinfer_args(kw)
    micros = timer.graph(lambda: fi.run(*args))
    return micros, args[-1]


def reference_f32(kw: dict[str, Any]) -> torch.Tensor:
    """msa's reference backend's output left in float32, not rounded to the query's bf16: an error
    measured against a rounded output is the difference of two roundings, so one bf16 step of the
    largest elements read as 3.9e-3 to 7.8e-3 (2026-12-06: every msa error was such steps)."""
    problem, inputs = check_decode_inputs(**kw)
    out = torch.empty(inputs.q.shape, dtype=torch.float32, device=inputs.q.device)
    ReferenceBackend().run_step(problem, inputs, out)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", choices=sorted(ROWS), default="issue")
    parser.add_argument("--backends", default="cute,triton", help="msa backends timed beside `auto`")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--q-dtype", choices=sorted(Q_DTYPES), default="bf16",
                        help="the query msa is given (fp8: E4M3, FlashInfer the same values as bf16)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fi = load_flashinfer()
    timer = Timer(reps=args.reps)
    copy = copy_bandwidth(timer)
    backends = ["auto", *[b for b in args.backends.split(",") if b]]
    results: list[dict[str, Any]] = []
    name = torch.cuda.get_device_name()

    def save(rows: list[dict[str, Any]]) -> None:
        record = dict(device=name, copy_gbps=copy, seed=args.seed, reps=args.reps, q_dtype=args.q_dtype, rows=rows)
        part = args.out / "flashinfer_sm90.json.part"  # (replaced whole: a run stopped mid-write keeps the last)
        part.write_text(json.dumps(record, indent=1))
        os.replace(part, args.out / "flashinfer_sm90.json")

    for tp, length, batch, overlap, layouts in ROWS[args.rows]:
        for layout in layouts:
            kw = make_step(tp, length, batch, overlap, layout, args.context, args.seed, Q_DTYPES[args.q_dtype])
            ref = reference_f32(kw)
            row: dict[str, Any] = dict(tp=tp, L=length, B=batch, overlap=overlap, layout=layout)
            if layout == "fp8_e4m3":
                try:
                    micros, out = time_flashinfer(fi, kw, timer)
                    row["flashinfer"] = (micros, rel_err(out, ref))
                except Exception as exc:  # (its DSL version may differ from ours: say so, time msa anyway)
                    print(f"flashinfer failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            for backend in backends:
                try:
                    micros, out = time_msa(backend, kw, timer)
                    row[backend] = (micros, rel_err(out, ref))
                except msa.MSAError as exc:
                    row[backend] = (float("nan"), str(exc).splitlines()[0])
            results.append(row)
            print(json.dumps(row), flush=True)
            save(results)  # (after every row: a run stopped at its time limit keeps what it measured)
            del kw, ref
            torch.cuda.empty_cache()
    header = ["case", "layout", "FlashInfer us (err)", *[f"msa {b} us (err)" for b in backends], "auto / FI"]
    table = []
    for r in results:
        fi_us = r.get("flashinfer", (float("nan"), 0.0))[0]
        cells = [f"{r[b][0]:.1f} ({r[b][1]:.1e})" if isinstance(r[b][1], float) else f"- ({r[b][1][:30]})"
                 for b in backends]
        fi_cell = f"{fi_us:.1f} ({r['flashinfer'][1]:.1e})" if "flashinfer" in r else "-"
        ov = "" if r["overlap"] is None else f" {r['overlap']:.0%}"
        table.append([f"TP{r['tp']} L{r['L']}{ov} B={r['B']}", r["layout"], fi_cell, *cells,
                      f"{r['auto'][0] / fi_us:.2f}" if "flashinfer" in r else "-"])
    print(f"{name}, copy {copy:.0f} GB/s, {args.reps} graph replays a time (median, L2 flushed), seed {args.seed}, "
          f"{args.q_dtype} query")
    print(format_table(header, table))


if __name__ == "__main__":
    main()
