"""Host cost per eager call of the engines' drop-ins, side by side and interleaved (the host
timings of these shared machines drift by up to 2x between runs: compare within one run).

For each layout and batch, rounds of: the vLLM drop-in, the SGLang drop-in as every layer after
the first of a step calls it (the same step tensors), and as the first layer does (new tensors:
the step's table is made), each `--calls` back-to-back calls; medians over `--rounds`.

    PYTHONPATH=src python3 benchmarks/dropin_host_cost.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import msa
from msa.bench.eager import eager_calls
from msa.bench.integrations import sglang_call
from msa.integrations.vllm import minimax_m3_sparse_attn_decode
from msa.layouts import get_layout
from msa.workload import make_decode_step


def host_us(call: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default="fp8_e4m3,bfloat16")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for layout in args.layouts.split(","):
        for batch in map(int, args.batches.split(",")):
            step = make_decode_step(msa.MINIMAX_M3, batch_size=batch, context_len=args.context, kv_cache_dtype=layout,
                                    device="cuda", seed=batch)
            kw = step.kwargs()
            _, calls = eager_calls(kw)
            entries: dict[str, Callable[[], object]] = {"vllm drop-in": calls["vllm drop-in"],
                                                        "sglang drop-in": calls["sglang drop-in"]}
            # the first layer of a step: two steps' tensors, alternated, so each call's are new
            steps = [sglang_call(dict(kw, seq_lens=kw["seq_lens"].clone()), get_layout(layout)) for _ in range(2)]
            turn = [0]

            def new_step(steps: list[Any] = steps, turn: list[int] = turn) -> object:
                turn[0] ^= 1
                return steps[turn[0]]()

            entries["sglang drop-in, new step"] = new_step
            lens = [kw["seq_lens"].clone() for _ in range(2)]
            out = torch.empty(kw["q"].shape, dtype=torch.bfloat16, device="cuda")
            fp8 = get_layout(layout).quantized
            scales = (kw["k_scale"].reshape(()), kw["v_scale"].reshape(())) if fp8 else (None, None)

            def vllm_new_step(kw: dict[str, Any] = kw, lens: list[torch.Tensor] = lens, out: torch.Tensor = out,
                              scales: Any = scales, turn: list[int] = turn) -> None:
                turn[0] ^= 1
                minimax_m3_sparse_attn_decode(kw["q"], kw["kv_cache"], kw["topk_indices"], kw["block_table"],
                                              lens[turn[0]], 4, 128**-0.5, out, 1, k_scale=scales[0], v_scale=scales[1])

            entries["vllm drop-in, new step"] = vllm_new_step
            for fn in entries.values():
                fn()
            torch.cuda.synchronize()
            samples: dict[str, list[float]] = {name: [] for name in entries}
            for _ in range(args.rounds):
                for name, fn in entries.items():
                    samples[name].append(host_us(fn, args.calls))
            medians = {name: statistics.median(v) for name, v in samples.items()}
            base = medians["vllm drop-in"]
            for name, value in medians.items():
                rows.append(dict(layout=layout, batch=batch, entry=name, host_us=value, vs_vllm=value / base,
                                 spread=[min(samples[name]), max(samples[name])]))
                print(f"{layout:9s} B={batch:3d} {name:26s} {value:7.1f} us  ({value / base:.2f}x the vLLM drop-in; "
                      f"range {min(samples[name]):.1f}-{max(samples[name]):.1f})", flush=True)
    record = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                  rounds=args.rounds, calls=args.calls, context=args.context, rows=rows)
    with open(os.path.join(args.out, "dropin_host_cost.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
