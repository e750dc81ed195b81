"""Decode context parallelism on 2 GPUs (NCCL): merge cost and long contexts.

    PYTHONPATH=src python3 benchmarks/dcp_bench.py --out benchmarks/results/dcp
    PYTHONPATH=src python3 benchmarks/dcp_bench.py --dry-run      # no GPU: the plan, and the
                                                                  # correctness phase on gloo

Launched by itself: it spawns one process per GPU (torch.multiprocessing, NCCL). Phases:

1. correctness: a small MiniMax-M3 TP1 FP8 step sharded over the 2 ranks, every merge form (planner
   and one-shot) against the single-process reference; the run stops if any differs.
2. merge cost: M3 TP1 FP8, 64K contexts, B = 1, 16, 64 and L = 1, 4: CUDA-graph replays (L2
   flushed before each, both ranks released together by a one-element all-reduce outside the
   timed region, CUDA events) of
   - `local`: the rank-local DecodePlanner.run alone (this rank's half of the pages, LSE on);
   - `merge`: the exchange alone (collectives + combine) for each method;
   - `step`: DistributedDecodePlanner.run (local decode + merge) for each method;
   - `one GPU`: the same batch with all pages on one GPU (no DCP), for scale.
   "adds" = (step - local) / local: the merge's share of the step (target <= 15% at B >= 16).
3. long context: B = 64 requests of the largest context whose per-rank share fits the per-GPU KV
   budget (default 100 GiB), on 2 GPUs, against the same batch halved (B/2 requests, all their
   pages) on one GPU, i.e. what one GPU takes for half the pages (target: within 1.3x).

Each rank writes its measurements as it goes; the parent prints the tables last and writes
`dcp_bench.json` under --out, so a run cut short still reports what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import msa
import msa.distributed as dcp
from msa.bench.timing import capture_graph
from msa.layouts import get_layout
from msa.workload import DEFAULT_SCALES, indexer_topk, make_decode_step

GEOMETRY = msa.MINIMAX_M3  # TP1: 64/4 heads, D=128, P=128, K=16
LAYOUT = "fp8"
WORLD = 2
FORMS: list[tuple[str, bool, torch.dtype | None]] = [  # (method, scatter_heads, reduce_dtype)
    ("all_gather", False, None),
    ("all_to_all", False, None),
    ("all_reduce", False, None),
    ("reduce_scatter", True, None),
    ("reduce_scatter", True, torch.bfloat16),
    ("all_to_all", True, None),
    ("all_gather", True, None),
]
GIB = 2**30


def form_name(form: tuple[str, bool, torch.dtype | None]) -> str:
    method, scatter, reduce_dtype = form
    name = {"all_gather": "ag", "all_to_all": "a2a", "all_reduce": "ar", "reduce_scatter": "rs"}[method]
    if reduce_dtype is not None:
        name += "16"
    return name + ("/s" if scatter else "")


def page_bytes() -> int:
    g = GEOMETRY
    return get_layout(LAYOUT).bytes_per_token(g.head_dim) * g.num_kv_heads * g.page_size


def long_context(budget_gib: float, batch: int, requested: int | None) -> dict[str, Any]:
    """The long-context case: the largest context (a multiple of 64K tokens) whose per-rank share
    of `batch` requests fits the budget, unless one is requested."""
    per_token = page_bytes() // GEOMETRY.page_size  # all KV heads
    budget = budget_gib * GIB
    fitting = int(budget * WORLD // (batch * per_token)) // 65536 * 65536
    context = fitting if requested is None else requested
    blocks = -(-context // GEOMETRY.page_size)
    rank_pages = batch * max(dcp.owned_block_count(blocks, r, WORLD) for r in range(WORLD))
    return {
        "batch": batch, "context": context, "budget_gib": budget_gib,
        "bytes_per_token": per_token,
        "total_gib": batch * blocks * page_bytes() / GIB,
        "per_rank_gib": rank_pages * page_bytes() / GIB,
        "half_batch_gib": (batch // 2) * blocks * page_bytes() / GIB,
        "fits_one_gpu": batch * blocks * page_bytes() <= budget,
        "tokens_per_gpu_dcp": batch * context // WORLD,
        "tokens_per_gpu_half": (batch // 2) * context,
    }


# -- timing ------------------------------------------------------------------------------------------


class SyncedTimer:
    """Median microseconds of CUDA-graph replays, L2 flushed before each, every rank released
    together by a one-element all-reduce outside the timed region (so a collective inside the
    graph does not time the other rank's lateness)."""

    def __init__(self, reps: int, warmup: int, device: torch.device) -> None:
        self.reps, self.warmup = reps, warmup
        self._flush = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
        self._token = torch.zeros(1, device=device)

    def graph(self, fn: Callable[[], object]) -> float:
        graph = capture_graph(fn, self.warmup)
        start = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]  # type: ignore[no-untyped-call]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]  # type: ignore[no-untyped-call]
        for i in range(self.reps):
            self._flush.zero_()
            dist.all_reduce(self._token)
            start[i].record()
            graph.replay()
            end[i].record()
        torch.cuda.synchronize()
        del graph
        return float(statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(start, end, strict=True)))


# -- steps ------------------------------------------------------------------------------------------


class LocalStep:
    """This rank's share of a synthetic step: global top-k lists and lengths, a rank-local table
    (whole pages, rotation `b % W`) over a cache holding only this rank's pages (random bytes)."""

    def __init__(self, batch: int, length: int, context: int, rank: int, device: torch.device, seed: int,
                 all_pages: bool = False) -> None:
        g = GEOMETRY
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        p = g.page_size
        blocks = -(-context // p)
        self.batch, self.length = batch, length
        self.seq_lens = (context - torch.randint(0, p, (batch,), generator=gen, device=device)).clamp(min=length).int()
        self.topk = indexer_topk(self.seq_lens, decode_query_len=length, num_kv_heads=g.num_kv_heads, topk=g.topk,
                                 page_size=p, max_blocks=blocks, generator=gen)
        col = torch.arange(blocks, device=device).view(1, -1)
        rotation = torch.arange(batch, device=device).view(-1, 1) % WORLD
        if all_pages:
            owned = torch.ones((batch, blocks), dtype=torch.bool, device=device)
        else:
            owned = (col + rotation) % WORLD == rank
        count = int(owned.sum())
        table = torch.full((batch, blocks), -1, dtype=torch.int32, device=device)
        table[owned] = torch.randperm(count, generator=gen, device=device).int()
        self.table = table
        layout = get_layout(LAYOUT)
        self.cache = layout.allocate(count + 1, g.num_kv_heads, p, g.head_dim, device=device)
        self.cache.view(torch.uint8).random_(0, 0x78, generator=gen)  # finite fp8 values
        self.scale = torch.full((1,), DEFAULT_SCALES["fp8_e4m3"], device=device)
        self.q = torch.randn((batch * length, g.num_q_heads, g.head_dim), generator=gen, device=device).bfloat16()
        self.cache_gib = self.cache.numel() * self.cache.element_size() / GIB


def local_call(
    planner: dcp.DistributedDecodePlanner, plan: dcp.DistributedDecodePlan, s: LocalStep
) -> Callable[[], None]:
    """The rank-local DecodePlanner.run of a distributed plan, alone (into the exchange's buffers)."""
    ex = plan.exchange
    return lambda: planner.local.run(plan.local, s.q, s.cache, s.topk, out=ex.local_out, lse=ex.local_lse,
                                     k_scale=s.scale, v_scale=s.scale)


def step_call(planner: dcp.DistributedDecodePlanner, plan: dcp.DistributedDecodePlan, s: LocalStep, out: torch.Tensor,
              lse: torch.Tensor) -> Callable[[], None]:
    """The whole distributed step: local decode and merge."""
    return lambda: planner.run(plan, s.q, s.cache, s.topk, out=out, lse=lse, k_scale=s.scale, v_scale=s.scale)


def single_call(planner: msa.DecodePlanner, plan: msa.DecodePlan, s: LocalStep, q: torch.Tensor, topk: torch.Tensor,
                out: torch.Tensor) -> Callable[[], None]:
    """A one-GPU step without DCP."""
    return lambda: planner.run(plan, q, s.cache, topk, out=out, k_scale=s.scale, v_scale=s.scale)


def measure_shape(timer: SyncedTimer, batch: int, length: int, context: int, rank: int, device: torch.device,
                  seed: int, forms: list[tuple[str, bool, torch.dtype | None]], one_gpu: bool) -> dict[str, Any]:
    g = GEOMETRY
    step = LocalStep(batch, length, context, rank, device, seed)
    rec: dict[str, Any] = {"B": batch, "L": length, "context": context, "cache_gib": step.cache_gib,
                           "local_pages": int((step.table >= 0).sum()), "merge_us": {}, "step_us": {}}
    for form in forms:
        method, scatter, reduce_dtype = form
        planner = dcp.DistributedDecodePlanner(g, method=method, scatter_heads=scatter, reduce_dtype=reduce_dtype,
                                               kv_cache_dtype=LAYOUT, backend="triton", device=device)
        plan = planner.plan(step.table, step.seq_lens, decode_query_len=length)
        heads = planner.out_heads
        out = torch.empty((batch * length, heads, g.head_dim), dtype=torch.bfloat16, device=device)
        lse = torch.empty((batch * length, heads), device=device)
        if "local_us" not in rec:
            rec["local_us"] = timer.graph(local_call(planner, plan, step))
        name = form_name(form)
        rec["step_us"][name] = timer.graph(step_call(planner, plan, step, out, lse))
        rec["merge_us"][name] = timer.graph(partial(plan.exchange.merge, out, lse))
    del step
    if one_gpu:  # the same batch, every page on this GPU, no DCP (a single-GPU engine: no LSE)
        full = LocalStep(batch, length, context, rank, device, seed, all_pages=True)
        single = msa.DecodePlanner(g, kv_cache_dtype=LAYOUT, backend="triton", device=device)
        plan1 = single.plan(full.table, full.seq_lens, decode_query_len=length)
        out1 = torch.empty((batch * length, g.num_q_heads, g.head_dim), dtype=torch.bfloat16, device=device)
        rec["one_gpu_us"] = timer.graph(single_call(single, plan1, full, full.q, full.topk, out1))
        del full
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def measure_long(timer: SyncedTimer, case: dict[str, Any], lengths: list[int], rank: int, device: torch.device,
                 seed: int) -> dict[str, Any]:
    g = GEOMETRY
    batch, context = case["batch"], case["context"]
    rec: dict[str, Any] = dict(case, runs=[])
    forms = [f for f in FORMS if f in (("all_gather", False, None), ("reduce_scatter", True, None),
                                       ("all_to_all", True, None))]
    step = LocalStep(batch, 1, context, rank, device, seed)
    rec["dcp_cache_gib"] = step.cache_gib
    for length in lengths:
        if length != step.length:
            step.length = length
            gen = torch.Generator(device=device)
            gen.manual_seed(seed + length)
            step.topk = indexer_topk(step.seq_lens, decode_query_len=length, num_kv_heads=g.num_kv_heads,
                                     topk=g.topk, page_size=g.page_size, max_blocks=step.table.shape[1], generator=gen)
            step.q = torch.randn((batch * length, g.num_q_heads, g.head_dim), generator=gen,
                                 device=device).bfloat16()
        run: dict[str, Any] = {"L": length, "step_us": {}}
        for form in forms:
            method, scatter, reduce_dtype = form
            planner = dcp.DistributedDecodePlanner(g, method=method, scatter_heads=scatter, reduce_dtype=reduce_dtype,
                                                   kv_cache_dtype=LAYOUT, backend="triton", device=device)
            plan = planner.plan(step.table, step.seq_lens, decode_query_len=length)
            out = torch.empty((batch * length, planner.out_heads, g.head_dim), dtype=torch.bfloat16, device=device)
            lse = torch.empty((batch * length, planner.out_heads), device=device)
            if "local_us" not in run:
                run["local_us"] = timer.graph(local_call(planner, plan, step))
            run["step_us"][form_name(form)] = timer.graph(step_call(planner, plan, step, out, lse))
        rec["runs"].append(run)
    del step
    gc.collect()
    torch.cuda.empty_cache()
    half = LocalStep(batch // 2, 1, context, rank, device, seed + 1, all_pages=True)
    rec["half_cache_gib"] = half.cache_gib
    single = msa.DecodePlanner(g, kv_cache_dtype=LAYOUT, backend="triton", device=device)
    for run in rec["runs"]:
        length = run["L"]
        gen = torch.Generator(device=device)
        gen.manual_seed(seed + 7 * length)
        topk = indexer_topk(half.seq_lens, decode_query_len=length, num_kv_heads=g.num_kv_heads, topk=g.topk,
                            page_size=g.page_size, max_blocks=half.table.shape[1], generator=gen)
        q = torch.randn((half.batch * length, g.num_q_heads, g.head_dim), generator=gen, device=device).bfloat16()
        plan1 = single.plan(half.table, half.seq_lens, decode_query_len=length)
        out1 = torch.empty_like(q)
        run["half_batch_one_gpu_us"] = timer.graph(single_call(single, plan1, half, q, topk, out1))
    del half
    gc.collect()
    torch.cuda.empty_cache()
    return rec


# -- correctness ----------------------------------------------------------------------------------------


def correctness(rank: int, device: torch.device, backend: str) -> list[str]:
    """Every merge form at a small M3 TP1 FP8 step against the single-process reference."""
    g = GEOMETRY
    step = make_decode_step(g, batch_size=3, decode_query_len=2, context_len=128 * 24 - 50, kv_cache_dtype=LAYOUT,
                            device=device, seed=1234)
    kw = step.kwargs()
    ref_out, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
    cache, table = dcp.shard_cache(LAYOUT, step.kv_cache, step.block_table, rank, WORLD,
                                   rotation=torch.arange(3, device=device))
    local = dict(kw, kv_cache=cache, block_table=table)
    part, part_lse = msa.sparse_decode(**local, backend="reference", return_lse=True)
    outs, lses = [torch.empty_like(part) for _ in range(WORLD)], [torch.empty_like(part_lse) for _ in range(WORLD)]
    dist.all_gather(outs, part)
    dist.all_gather(lses, part_lse)
    scale, _ = dcp.combine_partials(torch.stack(outs).abs(), torch.stack(lses))
    failures = []
    for form in FORMS:
        method, scatter, reduce_dtype = form
        heads = g.num_q_heads // WORLD if scatter else g.num_q_heads
        mine = slice(rank * heads, (rank + 1) * heads) if scatter else slice(None)
        planner = dcp.DistributedDecodePlanner(g, method=method, scatter_heads=scatter, reduce_dtype=reduce_dtype,
                                               kv_cache_dtype=LAYOUT, backend=backend, device=device)
        plan = planner.plan(table, step.seq_lens, decode_query_len=2)
        out = torch.full((ref_out.shape[0], heads, g.head_dim), float("nan"), dtype=torch.bfloat16, device=device)
        lse = torch.full((ref_out.shape[0], heads), float("nan"), device=device)
        planner.run(plan, step.q, cache, step.topk_indices, out=out, lse=lse, k_scale=step.k_scale,
                    v_scale=step.v_scale)
        one, one_lse = dcp.sparse_decode(**local, method=method, scatter_heads=scatter, reduce_dtype=reduce_dtype,
                                         backend=backend, return_lse=True)
        slack = 2.0**-9 * 4 if reduce_dtype is not None else 2.0**-8
        bound = 2.0**-7 * ref_out[:, mine].float().abs() + 2e-3 + slack * scale[:, mine]
        for what, o, ls in (("planner", out, lse), ("sparse_decode", one, one_lse)):
            err = (o.float() - ref_out[:, mine].float()).abs()
            empty = torch.isneginf(ref_lse[:, mine])
            ok = bool((err <= bound).all()) and bool(torch.equal(torch.isneginf(ls), empty))
            lse_err = (ls[~empty] - ref_lse[:, mine][~empty]).abs().max().item() if (~empty).any() else 0.0
            if not ok or lse_err > 1e-4:
                failures.append(f"rank {rank}: {form_name(form)} {what}: max out error {err.max().item():.3g}, "
                                f"LSE error {lse_err:.3g}")
    return failures


# -- processes ------------------------------------------------------------------------------------------


def worker(rank: int, config: dict[str, Any], init_file: str, out_dir: str) -> None:
    path = Path(out_dir, f"rank{rank}.json")
    result: dict[str, Any] = {"rank": rank, "phases": [], "errors": []}

    def save() -> None:
        path.write_text(json.dumps(result, indent=1))

    dry = config["dry_run"]
    try:
        if dry:
            device = torch.device("cpu")
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                                    timeout=timedelta(seconds=120))
        else:
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                                    timeout=timedelta(seconds=300), device_id=device)
            result["device"] = torch.cuda.get_device_name(device)
            result["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
        result["torch"] = torch.__version__
        started = time.perf_counter()
        result["correctness"] = correctness(rank, device, "reference" if dry else "triton")
        result["phases"].append(("correctness", time.perf_counter() - started))
        save()
        failed = [None] * WORLD
        dist.all_gather_object(failed, bool(result["correctness"]))
        if any(failed) or dry:
            dist.destroy_process_group()
            return
        timer = SyncedTimer(config["reps"], 3, device)
        result["shapes"] = []
        for batch in config["batches"]:
            for length in config["query_lens"]:
                result["shapes"].append(measure_shape(timer, batch, length, config["context"], rank, device,
                                                      seed=batch * 31 + length, forms=FORMS, one_gpu=True))
                save()
        result["phases"].append(("merge cost", time.perf_counter() - started))
        if config["long"] is not None:
            result["long"] = measure_long(timer, config["long"], config["long_query_lens"], rank, device, seed=99)
            result["phases"].append(("long context", time.perf_counter() - started))
        save()
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported by the parent
        result["errors"].append(traceback.format_exc())
    finally:
        save()


def print_tables(ranks: list[dict[str, Any]]) -> None:
    r0 = ranks[0]
    print(f"\ndevice: {r0.get('device', 'cpu')}, torch {r0.get('torch')}, NCCL {r0.get('nccl', '-')}; W={WORLD}; "
          f"{GEOMETRY.describe()} {LAYOUT}")
    for r in ranks:
        for failure in r.get("correctness", []):
            print("CORRECTNESS FAILURE:", failure)
        for error in r.get("errors", []):
            print(f"rank {r['rank']} ERROR:\n{error}")
    shapes = [r.get("shapes", []) for r in ranks]
    if shapes and shapes[0]:
        names = list(shapes[0][0]["step_us"])
        print("\nmerge cost per step, microseconds (slowest rank), 64K contexts; adds = (step - local) / local")
        head = f"{'B':>3} {'L':>2} {'local':>7} {'1 GPU':>7} | " + " ".join(f"{'merge ' + n:>10}" for n in names)
        head += " | " + " ".join(f"{'step ' + n:>9}" for n in names) + " | best adds"
        print(head)
        for i, rec in enumerate(shapes[0]):
            recs = [s[i] for s in shapes if len(s) > i]
            local = max(x["local_us"] for x in recs)
            one = max(x.get("one_gpu_us", 0.0) for x in recs)
            merge = {n: max(x["merge_us"][n] for x in recs) for n in names}
            step = {n: max(x["step_us"][n] for x in recs) for n in names}
            best = min(step, key=lambda n: step[n])
            print(f"{rec['B']:>3} {rec['L']:>2} {local:>7.1f} {one:>7.1f} | "
                  + " ".join(f"{merge[n]:>10.1f}" for n in names) + " | "
                  + " ".join(f"{step[n]:>9.1f}" for n in names)
                  + f" | {best} {100 * (step[best] - local) / local:+.0f}%")
    longs = [r["long"] for r in ranks if "long" in r]
    if longs:
        lc = longs[0]
        print(f"\nlong context: B={lc['batch']} x {lc['context']:,} tokens ({lc['total_gib']:.0f} GiB of KV; "
              f"{'fits' if lc['fits_one_gpu'] else 'does not fit'} one GPU's {lc['budget_gib']:.0f} GiB budget)")
        print(f"  2 GPUs: {lc['per_rank_gib']:.1f} GiB and {lc['tokens_per_gpu_dcp']:,} tokens of context per GPU; "
              f"1 GPU, B={lc['batch'] // 2}: {lc['half_batch_gib']:.1f} GiB, {lc['tokens_per_gpu_half']:,} tokens")
        print(f"  {'L':>2} {'local':>8} " + " ".join(f"{'step ' + n:>10}" for n in lc["runs"][0]["step_us"])
              + f" {'1 GPU B/2':>10} {'best / 1 GPU B/2':>17}")
        for i, run in enumerate(lc["runs"]):
            runs = [x["runs"][i] for x in longs if len(x["runs"]) > i]
            local = max(x["local_us"] for x in runs)
            step = {n: max(x["step_us"][n] for x in runs) for n in run["step_us"]}
            half = max(x.get("half_batch_one_gpu_us", float("nan")) for x in runs)
            print(f"  {run['L']:>2} {local:>8.1f} " + " ".join(f"{v:>10.1f}" for v in step.values())
                  + f" {half:>10.1f} {min(step.values()) / half:>16.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/dcp"))
    ap.add_argument("--dry-run", action="store_true", help="no GPU: print the plan, run the correctness phase on gloo")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--query-lens", default="1,4")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--kv-budget-gib", type=float, default=100.0, help="KV budget per GPU for the long-context case")
    ap.add_argument("--long-batch", type=int, default=64)
    ap.add_argument("--long-context", type=int, default=None,
                    help="tokens per request (default: the largest that fits)")
    ap.add_argument("--long-query-lens", default="1,4")
    ap.add_argument("--skip-long", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=450.0, help="seconds before the ranks are stopped")
    args = ap.parse_args()
    ints = [int(x) for x in args.batches.split(",")], [int(x) for x in args.query_lens.split(",")]
    long_case = None if args.skip_long else long_context(args.kv_budget_gib, args.long_batch, args.long_context)
    config = {
        "dry_run": args.dry_run, "batches": ints[0], "query_lens": ints[1], "context": args.context,
        "reps": args.reps, "long": long_case,
        "long_query_lens": [int(x) for x in args.long_query_lens.split(",")],
    }
    print(f"plan: {GEOMETRY.describe()}, {LAYOUT} ({page_bytes() // 1024} KiB per page, all KV heads), W={WORLD}")
    for b in config["batches"]:
        for length in config["query_lens"]:
            blocks = -(-args.context // GEOMETRY.page_size)
            pages = b * max(dcp.owned_block_count(blocks, r, WORLD) for r in range(WORLD))
            print(f"  B={b:>3} L={length}: {args.context // 1024}K context, {pages} pages "
                  f"({pages * page_bytes() / GIB:.2f} GiB) per rank; selected pages per step "
                  f"{b * length * GEOMETRY.num_kv_heads * GEOMETRY.topk}; forms {', '.join(map(form_name, FORMS))}")
    if long_case is not None:
        lc = long_case
        print(f"  long context: B={lc['batch']} x {lc['context']:,} tokens = {lc['total_gib']:.0f} GiB "
              f"({'fits' if lc['fits_one_gpu'] else 'does not fit'} one GPU's {lc['budget_gib']:.0f} GiB); "
              f"{lc['per_rank_gib']:.1f} GiB per rank on {WORLD} GPUs; 1 GPU with B={lc['batch'] // 2}: "
              f"{lc['half_batch_gib']:.1f} GiB")
    if not args.dry_run and torch.cuda.device_count() < WORLD:
        sys.exit(f"needs {WORLD} CUDA devices (found {torch.cuda.device_count()}); --dry-run runs without them")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import tempfile

    from torch.multiprocessing.spawn import start_processes

    with tempfile.TemporaryDirectory() as tmp:
        ctx = start_processes(worker, args=(config, str(Path(tmp, "rendezvous")), tmp), nprocs=WORLD,
                              join=False, start_method="spawn")  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + args.timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    print(f"stopping the ranks after {args.timeout:.0f} s")
                    break
        except Exception as exc:  # noqa: BLE001
            print(f"a rank failed: {exc}")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        ranks: list[dict[str, Any]] = []
        for rank in range(WORLD):
            path = Path(tmp, f"rank{rank}.json")
            ranks.append(json.loads(path.read_text()) if path.exists() else {"rank": rank, "errors": ["no result"]})
    report = {"config": {k: v for k, v in config.items()}, "ranks": ranks}
    if not args.dry_run:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "dcp_bench.json").write_text(json.dumps(report, indent=1))
    print_tables(ranks)
    if args.dry_run:
        bad = [f for r in ranks for f in r.get("correctness", []) + r.get("errors", [])]
        print("\ndry run: correctness phase on gloo (reference backend): " + ("FAILED" if bad else "ok"))
        sys.exit(1 if bad else 0)
    print(f"\nwrote {args.out / 'dcp_bench.json'}")


if __name__ == "__main__":
    main()
