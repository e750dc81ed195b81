"""Compile the CuTe DSL kernel for sm_90a on any machine (no GPU needed) and report what ptxas made
of it: registers, spills, and the instruction mix of the main loop per 16-token step.

    PYTHONPATH=src:benchmarks python3 benchmarks/cute_sass.py [--kinds nvfp4,fp8] [--out DIR]

Needs `nvidia-cutlass-dsl` (it compiles with its own toolchain) and `triton` (for the bundled
cuobjdump). The common path of a step excludes the rescale block, a 0-or-1-trip loop inside the
main loop that runs only when some row's running maximum moved.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from msa.backends.cute.config import DEFAULT_MIN_CTAS, DEFAULT_QK_CHAINS, DEFAULT_STAGES, max_stages
from msa.bench.machine_code import cubin_resources


def _tool() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _ops(cubin: Path) -> list[tuple[int, str]]:
    """(address, opcode with predicate marker) of every instruction."""
    text = subprocess.run([str(_tool()), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    out = []
    for line in text.splitlines():
        m = re.match(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def _loops(ops: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(start, end) address of every backward branch."""
    found = []
    for address, text in ops:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < address:
            found.append((int(m.group(1), 16), address))
    return found


def _mix(ops: list[tuple[int, str]], lo: int, hi: int, skip: tuple[int, int] | None) -> collections.Counter[str]:
    mix: collections.Counter[str] = collections.Counter()
    for address, text in ops:
        if lo <= address <= hi and not (skip and skip[0] <= address <= skip[1]):
            name = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
            mix[name.split(".")[0]] += 1
    return mix


def analyse(kind: str, dump: Path, qk_chains: int = DEFAULT_QK_CHAINS,
            min_ctas: int = DEFAULT_MIN_CTAS) -> dict[str, Any]:
    """Compile one kernel (bf16 q and output, 128-token pages, one split) into `dump` (the DSL's
    dump directory, set before it is imported) and summarise it."""
    import cutlass.cute as cute

    from msa.backends.cute.kernel import KernelSpec, build, compile_args

    spec = KernelSpec(kind, 128, "bf16", "bf16", True, True, 128, min(DEFAULT_STAGES, max_stages(kind)), qk_chains,
                      min_ctas)
    for old in dump.glob("*.cubin"):
        old.unlink()
    cute.compile(build(spec), *compile_args())
    cubin = next(dump.glob("*.cubin"))
    resources = cubin_resources(cubin.read_bytes())
    ops = _ops(cubin)
    loops = sorted(_loops(ops), key=lambda span: span[1] - span[0])
    main, inner = loops[-1], next((s for s in loops[:-1] if loops[-1][0] <= s[0] and s[1] <= loops[-1][1]), None)
    mix = _mix(ops, *main, inner)
    return dict(kind=kind, spec=repr(spec), **resources, step_instructions=sum(mix.values()),
                rescale_instructions=sum(_mix(ops, *inner, None).values()) if inner else 0,
                top=dict(mix.most_common(14)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="nvfp4,fp8")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--min-ctas", type=int, default=DEFAULT_MIN_CTAS, help="launch bounds: CTAs per SM")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=tmp)
        rows = [analyse(kind, Path(tmp), min_ctas=args.min_ctas) for kind in args.kinds.split(",")]
    for r in rows:
        print(f"{r['kind']:6s} registers {r['registers']} spills {r['spills']}  per 16-token step: "
              f"{r['step_instructions']} instructions (+{r['rescale_instructions']} when a maximum moves)")
        print("        " + ", ".join(f"{k} {v}" for k, v in r["top"].items()))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cute_sass.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
