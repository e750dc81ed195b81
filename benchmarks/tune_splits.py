"""Sweep the split count (and tile size) of the Triton decode at M3 TP1 shapes, L2 flushed,
eager and CUDA-graph replay:  PYTHONPATH=src python3 benchmarks/tune_splits.py --out DIR"""

from __future__ import annotations

import argparse
import functools
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
print(f"copy {copy:.0f} GB/s", flush=True)
gen = torch.Generator(device="cuda")
gen.manual_seed(0)
rows = []
for layout in ("fp8_e4m3", "bfloat16", "nvfp4"):
    step = make_decode_step(
        msa.MINIMAX_M3, batch_size=128, context_len=65536, kv_cache_dtype=layout, device="cuda", seed=0
    )
    for batch, options in ((1, (4, 8, 16, 32)), (16, (2, 4, 8, 16)), (64, (1, 2, 4, 8)), (128, (1, 2, 4))):
        kw = _case(step, batch, 1, gen)
        n_bytes = step_bytes(kw, step)
        problem, inputs = check_decode_inputs(**kw)
        tables = StepTables.for_inputs(problem, inputs)
        ref = msa.sparse_decode(**kw, backend="reference")
        assert isinstance(ref, torch.Tensor)
        for splits in options:
            for bn in (32, 64):
                be = TritonBackend(num_splits=splits, block_n=bn)
                plan = be.plan(problem, tables)
                out = torch.empty_like(ref)
                be.run(plan, inputs, out, None)
                err = (out.float() - ref.float()).abs().max().item()
                eager = timer.eager(functools.partial(be.run, plan, inputs, out, None))
                graph = timer.graph(functools.partial(be.run, plan, inputs, out, None))
                row = dict(
                    layout=layout,
                    batch=batch,
                    splits=plan.config.num_splits,
                    block_n=bn,
                    eager=eager,
                    graph=graph,
                    frac=n_bytes / graph / 1e3 / copy,
                    err=err,
                )
                rows.append(row)
                print(
                    f"{layout:9s} B={batch:3d} splits={row['splits']:2d} bn={bn:3d} "
                    f"eager {eager:7.1f} us graph {graph:7.1f} us "
                    f"{row['frac']:.2f} of copy err {err:.1e}",
                    flush=True,
                )
    del step
    torch.cuda.empty_cache()
with open(f"{args.out}/splits.json", "w") as f:
    json.dump(dict(copy=copy, rows=rows), f, indent=1)
