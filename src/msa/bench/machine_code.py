"""What ptxas makes of msa's Triton decode kernels for a GPU, compiled on any machine (no GPU
needed, Triton's bundled ptxas and cuobjdump): per kernel a step launches, its launch shape,
registers, bytes of stack (spilled registers), shared memory, and the instruction mix of its main
loop. `msa explain --machine-code` and `benchmarks/kernel_sass.py` print it.

The kernels, their constants and argument types are those the Triton backend launches for the
step over a packed cache (the launcher's own `decode_args`, and the configuration it picks for
the GPU's capability and SM count); integer arguments get the 16-divisibility Triton specialises
them for, from a step of 2048-token requests.
"""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

import attrs
import torch

from msa.errors import MSAInputError
from msa.problem import Geometry

__all__ = ["KernelCode", "LOOP_PATTERNS", "MAX_BATCH", "check_batch", "check_compiler", "compile_step",
           "cubin_resources", "loop_mix", "loop_summary"]

#: Instruction classes counted in a main loop (regular expressions over the SASS).
LOOP_PATTERNS = {
    "HGMMA": r"\bHGMMA\.", "HMMA": r"\bHMMA\.", "LDS": r"\bLDS(\.[A-Z0-9]+)*\b", "LDSM": r"\bLDSM\.",
    "STS": r"\bSTS(\.[A-Z0-9]+)*\b", "LDG": r"\bLDG(\.[A-Z0-9]+)*\b", "LDG.128": r"\bLDG\.E\.128",
    "LDGSTS": r"\bLDGSTS", "BAR": r"\bBAR\.", "SHFL": r"\bSHFL\.", "F2FP": r"\bF2FP\.", "HMUL2": r"\bHMUL2\b",
    "MUFU": r"\bMUFU\.", "LDL": r"\bLDL(\.[A-Z0-9]+)*\b", "STL": r"\bSTL(\.[A-Z0-9]+)*\b",
}

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}


@attrs.frozen
class KernelCode:
    """One compiled kernel of a step: its launch shape, resources, main loop and machine code."""

    kernel: str
    grid: tuple[int, ...]  # programs launched (x, y, z)
    config: dict[str, int]  # block_n, warps, stages, splits
    registers: int  # per thread (-1: not reported)
    spills: int  # bytes of stack per thread (-1: not reported)
    shared: int  # bytes of shared memory per program
    loop: dict[str, Any]  # `loop_summary` of the SASS
    sass: str = attrs.field(repr=False)
    ttgir: str = attrs.field(repr=False)


def _signature(fn: Any, args: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any], dict[Any, Any]]:
    """Triton's (signature, constants, attributes) of a launch, as its JIT would specialise it."""
    sig: dict[str, str] = {}
    constants: dict[str, Any] = {}
    attributes: dict[Any, Any] = {}
    for i, name in enumerate(fn.arg_names):
        value = args[name] if name in args else fn.params[i].default  # a constexpr left at its default
        if fn.params[i].is_constexpr:
            sig[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[value.dtype]
            attributes[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, int):  # bool included
            if value == 1:  # Triton specialises integer 1 to a constant
                sig[name], constants[name] = "constexpr", 1
                continue
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attributes[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return sig, constants, attributes


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """Registers and bytes of stack of a cubin (`cuobjdump --dump-resource-usage`, bundled with
    Triton); -1 where it reports none."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    reg = re.search(r"REG:(\d+)", text)
    spill = re.search(r"STACK:(\d+)", text)
    return {"registers": int(reg.group(1)) if reg else -1, "spills": int(spill.group(1)) if spill else -1}


def loop_summary(sass: str) -> dict[str, Any]:
    """The instruction mix of the largest backward-branch region of `sass` (the main loop):
    `instructions`, a count per `LOOP_PATTERNS` class, and the ten commonest opcodes (`top`)."""
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
    counts = {k: len(re.findall(p, body)) for k, p in LOOP_PATTERNS.items()}
    return {"instructions": sum(ops.values()), **counts, "top": dict(ops.most_common(10))}


def loop_mix(loop: dict[str, Any]) -> str:
    """A main loop's (`loop_summary`) instruction classes that occur in it, as "HGMMA 8 LDS 12 ..."."""
    return " ".join(f"{k} {loop[k]}" for k in LOOP_PATTERNS if loop.get(k))


def check_compiler() -> None:
    """Refuse to compile under Triton's interpreter (its JIT functions cannot be compiled)."""
    from msa.launcher import interpreting

    if interpreting():
        raise MSAInputError("TRITON_INTERPRET", "unset (machine code is compiled, not interpreted)", "set")


#: Largest batch compiled: the step is built in host memory (16 pages a request, 2-4 MiB at M3 TP1).
MAX_BATCH = 512


def check_batch(batch: int, argument: str = "batch") -> None:
    """Refuse a batch `compile_step` will not build (`argument`: the name the caller gave it)."""
    if not 1 <= batch <= MAX_BATCH:
        raise MSAInputError(argument, f"1..{MAX_BATCH} requests to compile a step for (it is built in host memory)",
                            batch)


def compile_step(geometry: Geometry, layout: str, batch: int, *, query_len: int = 1,
                 q_dtype: torch.dtype = torch.bfloat16, with_lse: bool = False, capability: tuple[int, int] = (9, 0),
                 sm_count: int = 132, overrides: dict[str, Any] | None = None) -> list[KernelCode]:
    """Compile, for a GPU of `capability` with `sm_count` SMs, every kernel the Triton backend
    launches for a step of `geometry` over a packed `layout` cache (B = `batch` <= `MAX_BATCH`
    requests of 2048 tokens, L = `query_len`, a `q_dtype` query, the LSE written or not;
    `overrides`: `TritonBackend` options, checked as the backend checks them, and `maxnreg` for
    ptxas). The launch config is the one `choose_config` picks on that GPU; the rows are the
    step's own (`StepTables`, which no device changes). Runs on the CPU; Triton's interpreter
    must be off (`TRITON_INTERPRET` unset)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from msa.backends.triton.config import check_overrides, choose_config
    from msa.backends.triton.launch import Workspace, step_launches
    from msa.planning import StepTables
    from msa.validation import check_decode_inputs
    from msa.workload import make_decode_step

    check_compiler()
    check_batch(batch)
    overrides = dict(overrides or {})
    options = {k: overrides.pop(k) for k in ("maxnreg",) if k in overrides}
    check_overrides(overrides)  # (a bad one would compile a config no launch takes)
    step = make_decode_step(geometry, batch_size=batch, decode_query_len=query_len, context_len=2048,
                            kv_cache_dtype=layout, q_dtype=q_dtype, seed=0)
    problem, inputs = check_decode_inputs(**step.kwargs())
    tables = StepTables.for_inputs(problem, inputs)
    config = choose_config(problem.geometry, problem.num_rows, sm_count, layout=problem.layout,
                           batch_size=problem.batch_size, query_len=problem.query_len, capability=capability,
                           **overrides)
    workspace = Workspace(problem, config, torch.device("cpu"))
    out = torch.empty(inputs.q.shape, dtype=problem.out_dtype)
    lse = torch.empty((problem.num_rows, geometry.num_q_heads), dtype=torch.float32) if with_lse else None
    target = GPUTarget("cuda", 10 * capability[0] + capability[1], 32)
    results = []
    for kernel, launch_args in step_launches(problem, inputs, tables.rows, out, lse, config, workspace):
        kargs = dict(launch_args)
        num_warps, num_stages = kargs.pop("num_warps", 4), kargs.pop("num_stages", 3)
        sig, constants, attributes = _signature(kernel.fn, kargs)
        with warnings.catch_warnings():  # (Triton 3.9's notice that its FP-fusion default will change)
            warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION")
            compiled = triton.compile(ASTSource(kernel.fn, sig, constants, attributes), target=target,
                                      options={"num_warps": num_warps, "num_stages": num_stages, **options})
        sass = compiled.asm["sass"]
        resources = cubin_resources(compiled.asm["cubin"])
        results.append(KernelCode(
            kernel=kernel.fn.__name__, grid=kernel.grid,
            config=dict(block_n=config.block_n, warps=num_warps, stages=num_stages, splits=config.num_splits),
            registers=resources["registers"], spills=resources["spills"], shared=compiled.metadata.shared,
            loop=loop_summary(sass), sass=sass, ttgir=compiled.asm["ttgir"],
        ))
    return results
