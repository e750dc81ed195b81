"""Pipeline depth and tile size of the fused (one split) Triton decode for quantized caches at
M3 TP1, L2 flushed, graph replays:  PYTHONPATH=src python3 benchmarks/tune_stages.py --out DIR"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

import msa
from msa.backends.triton import TritonBackend
from msa.bench.sweep import _case, step_bytes
from msa.bench.timing import Timer, copy_bandwidth
from msa.planning import StepTables
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step

parser = argparse.ArgumentParser()
parser.add_argument("--out", default=".")
args = parser.parse_args()
timer = Timer(reps=30)
copy = copy_bandwidth(timer)
gen = torch.Generator(device="cuda")
gen.manual_seed(0)
rows = []
for layout in ("fp8_e4m3", "nvfp4"):
    step = make_decode_step(
        msa.MINIMAX_M3, batch_size=256, context_len=65536, kv_cache_dtype=layout, device="cuda", seed=0
    )
    for batch in (64, 256):
        kw = _case(step, batch, 1, gen)
        n_bytes = step_bytes(kw, step)
        problem, inputs = check_decode_inputs(**kw)
        tables = StepTables.for_inputs(problem, inputs)
        out = torch.empty(kw["q"].shape, dtype=torch.bfloat16, device="cuda")
        for bn, st, w in itertools.product((32, 64, 128), (3, 4, 6), (4, 8)):
            be = TritonBackend(num_splits=1, block_n=bn, num_stages=st, num_warps=w)
            try:
                plan = be.plan(problem, tables)
                us = timer.graph(functools.partial(be.run, plan, inputs, out, None))
            except Exception as exc:
                print(f"{layout} B={batch} bn={bn} st={st} w={w}: {type(exc).__name__}", flush=True)
                continue
            rows.append(
                dict(layout=layout, batch=batch, block_n=bn, stages=st, warps=w, us=us, frac=n_bytes / us / 1e3 / copy)
            )
            print(
                f"{layout:9s} B={batch:3d} bn={bn:3d} st={st} w={w} {us:7.1f} us {rows[-1]['frac']:.2f} of copy",
                flush=True,
            )
    del step
    torch.cuda.empty_cache()
with open(f"{args.out}/stages.json", "w") as f:
    json.dump(dict(copy=copy, rows=rows), f, indent=1)
for layout, batch in itertools.product(("fp8_e4m3", "nvfp4"), (64, 256)):
    best = min((r for r in rows if r["layout"] == layout and r["batch"] == batch), key=lambda r: r["us"])
    print("best", best)
