"""Sweep Triton launch configurations at MiniMax-M3 TP1 shapes on the current GPU.

    PYTHONPATH=src python3 benchmarks/tune_triton.py [--out DIR]

For each layout: a 64K-token context per request, B in {1, 64, 256}, L=1; times each config
with L2 flushed (triton.testing.do_bench, median) and checks it against the reference.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from typing import Any

import torch
import triton

import msa
from msa.backends.triton import TritonBackend
from msa.layouts import cache_nbytes
from msa.planning import StepTables
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step


def sub_step(kw: dict[str, Any], batch: int) -> dict[str, Any]:
    out = dict(kw)
    out["q"] = kw["q"][:batch]
    out["seq_lens"] = kw["seq_lens"][:batch]
    out["block_table"] = kw["block_table"][:batch]
    out["topk_indices"] = kw["topk_indices"][:, :batch]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--context", type=int, default=65536)
    args = parser.parse_args()
    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    copy_bw = 2 * src.numel() / copy_ms / 1e6
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    results = []
    variants = [
        dict(block_n=bn, num_stages=st, num_warps=w) for bn, st, w in itertools.product((64, 128), (2, 3, 4), (4, 8))
    ]
    for layout in ("bfloat16", "fp8_e4m3", "nvfp4"):
        t0 = time.time()
        step = make_decode_step(
            msa.MINIMAX_M3, batch_size=256, context_len=args.context, kv_cache_dtype=layout, device="cuda", seed=0
        )
        print(
            f"{layout}: built in {time.time() - t0:.1f}s, "
            f"cache {cache_nbytes(step.kv_cache) / 2**30:.1f} GiB",
            flush=True,
        )
        computes = ("fp16", "bf16") if layout != "bfloat16" else ("fp16",)
        for batch in (1, 64, 256):
            kw = sub_step(step.kwargs(), batch)
            problem, inputs = check_decode_inputs(**kw)
            tables = StepTables.for_inputs(problem, inputs)
            ref = msa.sparse_decode(**kw, backend="reference")
            assert isinstance(ref, torch.Tensor)
            visible = batch * 4 * 16 * 128  # every selected page fully visible but the last one
            n_bytes = visible * step.layout.bytes_per_token(128) + 2 * ref.numel() * 2
            these = (
                variants
                if batch == 64
                else [dict(block_n=64, num_stages=3, num_warps=4), dict(block_n=128, num_stages=2, num_warps=8)]
            )
            for variant, compute in itertools.product(these, computes):
                splits_options = (None,) if batch != 1 else (None, 8, 16, 32)
                for splits in splits_options:
                    be = TritonBackend(compute=compute, num_splits=splits, **variant)
                    try:
                        plan = be.plan(problem, tables)
                        out = torch.empty_like(ref)
                        be.run(plan, inputs, out, None)
                        err = (out.float() - ref.float()).abs().max().item()
                        ms = triton.testing.do_bench(
                            functools.partial(be.run, plan, inputs, out, None), return_mode="median"
                        )
                    except Exception as exc:  # a config that does not compile (shared memory)
                        print(
                            f"  {layout} B={batch} {variant} {compute} splits={splits}: "
                            f"FAILED {type(exc).__name__}: {str(exc)[:120]}",
                            flush=True,
                        )
                        continue
                    row = dict(
                        layout=layout,
                        batch=batch,
                        compute=compute,
                        splits=plan.config.num_splits,
                        us=ms * 1e3,
                        gbps=n_bytes / ms / 1e6,
                        frac=n_bytes / ms / 1e6 / copy_bw,
                        err=err,
                        **variant,
                    )
                    results.append(row)
                    print(
                        f"  {layout:9s} B={batch:3d} bn={variant['block_n']:3d} st={variant['num_stages']} "
                        f"w={variant['num_warps']} {compute} splits={row['splits']:2d} "
                        f"{row['us']:8.1f} us {row['gbps']:6.0f} GB/s {row['frac']:.2f} err={err:.1e}",
                        flush=True,
                    )
        del step
        torch.cuda.empty_cache()
    with open(f"{args.out}/tune.json", "w") as f:
        json.dump(dict(copy_gbps=copy_bw, results=results), f, indent=1)
    print("best per layout and batch:")
    for layout, batch in itertools.product(("bfloat16", "fp8_e4m3", "nvfp4"), (1, 64, 256)):
        rows = [r for r in results if r["layout"] == layout and r["batch"] == batch]
        if rows:
            best = min(rows, key=lambda r: r["us"])
            print(f"  {layout:9s} B={batch:3d}: {best['us']:.1f} us ({best['frac']:.2f} of copy) {best}")


if __name__ == "__main__":
    main()
