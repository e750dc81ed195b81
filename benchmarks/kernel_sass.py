"""Compile msa's Triton decode kernels for Hopper (sm_90, or another GPU: `--capability`) without a
GPU and summarise the machine code: registers, spills, shared memory, and the instruction mix of
the main loop.

    PYTHONPATH=src python3 benchmarks/kernel_sass.py [--layouts nvfp4] [--batches 64,256] [--query-len 4] \
        [--q-dtype bf16|fp16|fp8] [--tp 1|2|4|8] [--capability 9.0] [--variant '{"block_n": 64}'] [--jobs N] \
        [--dump DIR]

The kernel, its constants and its argument types are exactly those `msa` launches for the M3 TP1
step (or another TP layout's, `--tp`; the launcher's own `decode_args`, and the configuration the backend
picks for the capability); integer arguments get the
16-divisibility Triton would specialise them for. Needs only the `triton` package (its bundled
ptxas): the evidence behind the profile summaries in benchmarks/RESULTS.md comes from here and from
`ncu` on the H200.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import multiprocessing
import os
import re
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import msa
from msa.backends.triton import TritonBackend
from msa.backends.triton.config import choose_config
from msa.backends.triton.launch import Workspace, _kernel_constants, _launches, decode_args
from msa.cli.defaults import Q_DTYPES
from msa.planning import StepTables
from msa.validation import check_decode_inputs
from msa.workload import make_decode_step

_PATTERNS = {
    "HGMMA": r"\bHGMMA\.", "HMMA": r"\bHMMA\.", "LDS": r"\bLDS(\.[A-Z0-9]+)*\b", "LDSM": r"\bLDSM\.",
    "STS": r"\bSTS(\.[A-Z0-9]+)*\b", "LDG": r"\bLDG(\.[A-Z0-9]+)*\b", "LDG.128": r"\bLDG\.E\.128",
    "LDGSTS": r"\bLDGSTS", "BAR": r"\bBAR\.", "SHFL": r"\bSHFL\.", "F2FP": r"\bF2FP\.", "HMUL2": r"\bHMUL2\b",
    "MUFU": r"\bMUFU\.", "LDL": r"\bLDL(\.[A-Z0-9]+)*\b", "STL": r"\bSTL(\.[A-Z0-9]+)*\b",
}

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}


def _signature(fn: Any, args: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any], dict[Any, Any]]:
    sig: dict[str, str] = {}
    constants: dict[str, Any] = {}
    attrs: dict[Any, Any] = {}
    for i, name in enumerate(fn.arg_names):
        value = args[name] if name in args else fn.params[i].default  # a constexpr left at its default
        if fn.params[i].is_constexpr:
            sig[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, int):  # bool included
            if value == 1:  # Triton specialises integer 1 to a constant
                sig[name], constants[name] = "constexpr", 1
                continue
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return sig, constants, attrs


def _resources(cubin: bytes) -> dict[str, int]:
    """Registers and spill bytes of a cubin (`cuobjdump --dump-resource-usage`, bundled with Triton)."""
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    reg = re.search(r"REG:(\d+)", text)
    spill = re.search(r"STACK:(\d+)", text)
    return {"registers": int(reg.group(1)) if reg else -1, "spills": int(spill.group(1)) if spill else -1}


def loop_summary(sass: str) -> dict[str, Any]:
    """The instruction mix of the largest backward-branch region (the main loop)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(LBB\d+):", line.strip()))}
    best: tuple[int, int] | None = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA (LBB\d+);", line)
        start = labels.get(m.group(1), i) if m else i
        if start < i and (best is None or i - start > best[1] - best[0]):
            best = (start, i)
    if best is None:
        return {}
    body = "\n".join(lines[best[0]:best[1] + 1])
    ops: collections.Counter[str] = collections.Counter()
    for line in lines[best[0]:best[1] + 1]:
        m = re.match(r"^[^\t]*\t(@!?U?P\w+ )?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(2)] += 1
    counts = {k: len(re.findall(p, body)) for k, p in _PATTERNS.items()}
    return {"instructions": sum(ops.values()), **counts, "top": dict(ops.most_common(10))}


def compile_step(layout: str, batch: int, overrides: dict[str, Any], sm_count: int = 132,
                 query_len: int = 1, q_dtype: torch.dtype = torch.bfloat16, tp: int = 1,
                 capability: tuple[int, int] = (9, 0)) -> list[dict[str, Any]]:
    overrides = dict(overrides)
    options = {k: overrides.pop(k) for k in ("maxnreg",) if k in overrides}
    step = make_decode_step(msa.MINIMAX_M3_TP[tp], batch_size=batch, decode_query_len=query_len, context_len=2048,
                            kv_cache_dtype=layout, q_dtype=q_dtype, seed=0)
    problem, inputs = check_decode_inputs(**step.kwargs())
    tables = StepTables.for_inputs(problem, inputs)
    config = choose_config(problem.geometry, problem.num_rows, sm_count, layout=problem.layout,
                           batch_size=problem.batch_size, query_len=problem.query_len, capability=capability,
                           **overrides)
    workspace = Workspace(problem, config, torch.device("cpu"))
    out = torch.empty(inputs.q.shape, dtype=torch.bfloat16 if q_dtype == torch.float8_e4m3fn else q_dtype)
    rows = TritonBackend(**overrides).plan(problem, tables).rows
    args = decode_args(problem, inputs, rows, out, None, config, workspace)
    args.update(_kernel_constants(problem, config))
    results = []
    for kernel, kernel_args in _launches(problem, rows, config, workspace, False):
        kargs = kernel_args(args)
        num_warps, num_stages = kargs.pop("num_warps", 4), kargs.pop("num_stages", 3)
        sig, constants, attrs = _signature(kernel.fn, kargs)
        target = GPUTarget("cuda", 10 * capability[0] + capability[1], 32)
        compiled = triton.compile(ASTSource(kernel.fn, sig, constants, attrs), target=target,
                                  options={"num_warps": num_warps, "num_stages": num_stages, **options})
        sass = compiled.asm["sass"]
        results.append(dict(
            kernel=kernel.fn.__name__, layout=layout, batch=batch, variant=overrides,
            config=dict(block_n=config.block_n, warps=num_warps, stages=num_stages, splits=config.num_splits),
            **_resources(compiled.asm["cubin"]), shared=compiled.metadata.shared,
            loop=loop_summary(sass), sass=sass, ttgir=compiled.asm["ttgir"],
        ))
    return results


def _compile_case(case: tuple[str, int, dict[str, Any], int, str, int, tuple[int, int]]) -> list[dict[str, Any]]:
    layout, batch, overrides, query_len, q_dtype, tp, capability = case
    return compile_step(layout, batch, overrides, query_len=query_len, q_dtype=getattr(torch, q_dtype), tp=tp,
                        capability=capability)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="nvfp4")
    parser.add_argument("--batches", default="64")
    parser.add_argument("--query-len", type=int, default=1)
    parser.add_argument("--variant", action="append", default=[], help="JSON overrides of the launch config")
    parser.add_argument("--q-dtype", choices=tuple(Q_DTYPES), default="bf16", help="the query's dtype")
    parser.add_argument("--tp", type=int, choices=sorted(msa.MINIMAX_M3_TP), default=1,
                        help="M3's tensor-parallel head layout (1: 64/4 ... 8: 8/1)")
    parser.add_argument("--capability", default="9.0", help="the GPU's compute capability (major.minor)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="steps compiled at once, each in a process of its own (default: every core)")
    parser.add_argument("--dump", type=Path)
    args = parser.parse_args()
    variants = [json.loads(v) for v in args.variant] or [{}]
    major, _, minor = args.capability.partition(".")
    capability = (int(major), int(minor or 0))
    cases = [(layout, int(batch), overrides, args.query_len, Q_DTYPES[args.q_dtype], args.tp, capability)
             for layout in args.layouts.split(",") for batch in args.batches.split(",") for overrides in variants]
    with concurrent.futures.ProcessPoolExecutor(max(1, min(args.jobs, len(cases))),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        for (layout, batch, overrides, *_), results in zip(cases, pool.map(_compile_case, cases), strict=True):
            for r in results:
                if args.dump:
                    args.dump.mkdir(parents=True, exist_ok=True)
                    tag = f"{r['kernel']}-{layout}-B{batch}-{abs(hash(json.dumps(overrides))) % 10**6}"
                    (args.dump / f"{tag}.sass").write_text(r["sass"])
                    (args.dump / f"{tag}.ttgir").write_text(r["ttgir"])
                loop = r["loop"]
                print(f"{r['kernel']:22s} {layout:9s} B={batch:3d} {json.dumps(overrides):40s} "
                      f"regs {r['registers']:3d} spills {r['spills']} smem {r['shared']:6d} | loop "
                      f"{loop.get('instructions', 0)} instr: " + " ".join(
                          f"{k} {loop[k]}" for k in _PATTERNS if loop.get(k)), flush=True)


if __name__ == "__main__":
    main()
