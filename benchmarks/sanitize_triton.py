"""Run the Triton decode and writers on malformed inputs, for `compute-sanitizer`:

    compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py

Indices hold -1s anywhere, ids far past the table (2**30), negative ids, pages negative or
past the cache, lengths past the block table and zero; slots past the cache. Nothing may be
read or written out of bounds; the outputs must still equal the reference.
"""

from __future__ import annotations

import itertools

import torch

import msa
from msa.backends.triton import TritonBackend
from msa.planning import StepTables
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step

torch.manual_seed(0)
for layout in ("bfloat16", "fp8_e4m3", "nvfp4"):
    step = make_decode_step(msa.Geometry(16, 2, 128, 64, 8), batch_size=4, decode_query_len=3, context_len=600,
                            kv_cache_dtype=layout, device="cuda", seed=1)
    kw = step.kwargs()
    ids = kw["topk_indices"].clone()
    ids[:, ::2, 1] = 2**30
    ids[:, 1::3, 3] = -1
    ids[:, 2::5, 0] = -(2**30)
    kw["topk_indices"] = ids
    table = kw["block_table"].clone()
    table[0, :4] = -5
    table[1, :3] = kw["kv_cache"].shape[0] + 1000
    table[2, 0] = 2**31 - 1
    kw["block_table"] = table
    kw["seq_lens"] = torch.tensor([10_000, 0, 599, 64], dtype=torch.int32, device="cuda")  # request 0 overruns its table
    problem, inputs = check_decode_inputs(**kw, return_lse=True)
    ref_out, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
    tables = StepTables.build(inputs.block_table, inputs.seq_lens, decode_query_len=3)
    strategies = (False, True) if layout != "nvfp4" else (False,)
    for splits, dedup in itertools.product((1, 3), strategies):
        backend = TritonBackend(num_splits=splits, dedup=dedup)
        out = torch.full_like(ref_out, float("nan"))
        lse = torch.full_like(ref_lse, float("nan"))
        backend.run(backend.plan(problem, tables), inputs, out, lse)
        torch.cuda.synchronize()
        err = (out.float() - ref_out.float()).abs().max().item()
        lerr = (lse - ref_lse).nan_to_num(0.0, posinf=1.0, neginf=1.0).abs().max().item()
        assert err < 5e-3 and torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), (layout, splits, err)
        print(f"{layout:9s} splits={splits} dedup={dedup}: max err {err:.1e}, lse err {lerr:.1e}")
    # writers: slots far past the cache and negative ones are skipped
    key = torch.randn(32, 2, 128, device="cuda").bfloat16()
    slots = torch.arange(32, device="cuda")
    slots[::3] = 2**40
    slots[1::4] = -7
    step.layout.write(step.kv_cache, key, key, slots, k_scale=step.k_scale, v_scale=step.v_scale, kernel=True)
    torch.cuda.synchronize()
    print(f"{layout:9s} writer: ok")
print("sanitize run complete")
