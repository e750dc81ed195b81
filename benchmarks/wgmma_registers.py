"""Registers and spills of wgmma-kernel variants, compiled for sm_90a on a machine without a GPU
(`nvidia-cutlass-dsl` for the PTX, Triton's bundled ptxas for the rest):

    python3 benchmarks/wgmma_registers.py --spec '{"stages": 2, "wgs": 2, "vreg": true}' [--spec ...] \\
        [--min-ctas 0,2]

Each `--spec` is `Sm90Spec` keyword arguments over an M3 TP1 one-split fp8 kernel (128-token
pages, bf16 query and output, 16 heads, keys in registers). `--min-ctas N` (N > 0) adds the launch
bound `.minnctapersm N` to the kernel's PTX first, as `CuteBackend(min_ctas=N)` does through the
DSL (whose own compile of that needs a GPU driver). With the threads of a CTA, the registers
(allocated 8 a thread at a time) say how many CTAs an SM can hold (65536 registers an SM).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from ptx_same import sm90a_ptx

BASE = dict(page_size=128, q_kind="bf16", out_kind="bf16", final=True, write_lse=False, nc=16, stages=3, kind="fp8",
            kreg=True)
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", action="append", default=[], help="JSON Sm90Spec overrides (repeatable)")
    parser.add_argument("--min-ctas", default="0", help="comma-separated launch bounds to compile each with")
    args = parser.parse_args()
    from msa.backends.cute.sm90 import Sm90Spec, build_sm90

    print(f"{'spec':60} {'min_ctas':>8} {'registers':>9} {'spilled B':>9} {'CTAs/SM by registers':>20}")
    for text in args.spec or ["{}"]:
        spec = Sm90Spec(**{**BASE, **json.loads(text)})
        with tempfile.TemporaryDirectory() as tmp:
            ptx = sm90a_ptx(build_sm90(spec), tmp)
            threads = int(re.search(r"\.reqntid (\d+)", ptx).group(1))  # type: ignore[union-attr]
            for bound in (int(b) for b in args.min_ctas.split(",")):
                src = Path(tmp) / f"k{bound}.ptx"
                src.write_text(ptx if bound == 0 else re.sub(r"(\.reqntid [^\n]*)", rf"\1\n.minnctapersm {bound}", ptx))
                out = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", str(src), "-o", str(src.with_suffix(".cubin"))],
                                     capture_output=True, text=True, check=True).stderr
                regs = int(re.findall(r"Used (\d+) registers", out)[-1])
                spill = int(re.findall(r"(\d+) bytes spill stores", out)[-1])
                allocated = -(-regs // 8) * 8  # (registers are allocated 8 a thread at a time)
                print(f"{text:60} {bound:>8} {regs:>9} {spill:>9} {65536 // (allocated * threads):>20}")


if __name__ == "__main__":
    main()
