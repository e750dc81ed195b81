"""Quick GPU check: the Triton decode at M3 TP1 shapes, correctness and a first timing."""

from __future__ import annotations

import sys

import torch
import triton

import msa
from msa.backends.triton import TritonBackend
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step

for layout in ("bfloat16", "fp8_e4m3", "nvfp4"):
    step = make_decode_step(msa.MINIMAX_M3, batch_size=64, context_len=65536, kv_cache_dtype=layout, device="cuda", seed=0)
    kw = step.kwargs()
    problem, inputs = check_decode_inputs(**kw, return_lse=True)
    ref, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
    for splits in (None, 1, 2, 4):
        be = TritonBackend() if splits is None else TritonBackend(num_splits=splits)
        plan = be.plan(problem, inputs)
        out = torch.empty_like(ref)
        lse = torch.empty_like(ref_lse)
        be.run(plan, inputs, out, lse)
        err = (out.float() - ref.float()).abs().max().item()
        lerr = (lse - ref_lse).abs().max().item()
        ms = triton.testing.do_bench(lambda: be.run(plan, inputs, out, None), return_mode="median")
        visible = 64 * 4 * 16 * 128
        nbytes = visible * step.layout.bytes_per_token(128) + 2 * out.numel() * 2
        print(f"{layout:9s} splits={plan.config.num_splits:2d} err={err:.2e} lse_err={lerr:.2e} {ms*1e3:8.1f} us {nbytes/ms/1e6:7.0f} GB/s", flush=True)
sys.exit(0)
