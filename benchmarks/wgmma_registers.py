"""Registers, spills and main-loop instructions of wgmma-kernel variants, compiled for sm_90a on a
machine without a GPU (`nvidia-cutlass-dsl` for the PTX, Triton's bundled ptxas and cuobjdump for
the rest):

    python3 benchmarks/wgmma_registers.py --spec '{"stages": 2, "wgs": 2, "vreg": true}' [--spec ...] \\
        [--min-ctas 0,2] [--defaults] [--mix]

Each `--spec` is `Sm90Spec` keyword arguments over an M3 TP1 one-split fp8 kernel (128-token pages,
bf16 query and output, 16 heads, keys in registers); `--defaults` adds every kernel `CuteBackend()`
launches by default for M3 on an H200 (`ptx_same.default_specs`: this tree's policy, as their
`Sm90Spec` arguments). `--min-ctas N` (N > 0) adds the launch bound `.minnctapersm N` to the
kernel's PTX first, as `CuteBackend(min_ctas=N)` does through the DSL (whose own compile of that
needs a GPU driver). With the threads of a CTA, the registers (allocated 8 a thread at a time) say
how many CTAs an SM can hold (65536 registers an SM). `serial` counts ptxas's notes that it
serialised the kernel's wgmma instructions (C7510-C7519: they then wait for each other). `loop` is
the instructions of the main loop (the smallest backward branch around the tile's wgmma
instructions; a tile runs the blocks of it that its branches take, a rarely taken one included
here), `--mix` adds its most common opcodes."""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from ptx_same import default_specs, sm90a_ptx

BASE = dict(page_size=128, q_kind="bf16", out_kind="bf16", final=True, write_lse=False, nc=16, stages=3, kind="fp8",
            kreg=True)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
PTXAS = BIN / "ptxas"


def main_loop(sass: str) -> collections.Counter[str]:
    """The opcodes (predicates and modifiers dropped) of the smallest region of a conditional
    backward branch (a loop's back edge, not the unconditional jump back from an mbarrier wait's
    retry block) that holds a wgmma (`HGMMA`) instruction, from `cuobjdump -sass` text."""
    ops = [(int(m.group(1), 16), m.group(2)) for line in sass.splitlines()
           if (m := re.match(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line))]
    spans = []
    for address, text in ops:
        branch = re.search(r"^@!?U?P\w+\s+BRA (?:`\(\.L_x_\d+\) )?(0x[0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            span = [t for a, t in ops if int(branch.group(1), 16) <= a <= address]
            if any("HGMMA" in t for t in span):
                spans.append(span)
    mix: collections.Counter[str] = collections.Counter()
    for text in min(spans, key=len, default=[]):
        mix[re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]] += 1
    return mix


def compile_variant(ptx: str, bound: int, tmp: Path) -> dict[str, Any]:
    """ptxas's registers, spills and serialisation notes for `ptx` (with the launch bound `bound`
    CTAs an SM when > 0), and the main loop of its machine code."""
    src = tmp / f"k{bound}.ptx"
    src.write_text(ptx if bound == 0 else re.sub(r"(\.reqntid [^\n]*)", rf"\1\n.minnctapersm {bound}", ptx))
    cubin = src.with_suffix(".cubin")
    out = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", str(src), "-o", str(cubin)],
                         capture_output=True, text=True, check=True).stderr
    sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    return dict(registers=int(re.findall(r"Used (\d+) registers", out)[-1]),
                spilled=int(re.findall(r"(\d+) bytes spill stores", out)[-1]),
                serial=len(re.findall(r"\(C751\d\)", out)), loop=main_loop(sass))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", action="append", default=[], help="JSON Sm90Spec overrides (repeatable)")
    parser.add_argument("--defaults", action="store_true", help="also every default M3 kernel (full arguments)")
    parser.add_argument("--min-ctas", default="0", help="comma-separated launch bounds to compile each with")
    parser.add_argument("--mix", action="store_true", help="print the main loop's most common opcodes too")
    args = parser.parse_args()
    from msa.backends.cute.sm90 import Sm90Spec, build_sm90

    variants = [(text, {**BASE, **json.loads(text)}) for text in args.spec or ([] if args.defaults else ["{}"])]
    if args.defaults:
        variants += [(json.dumps(spec, sort_keys=True), spec) for spec in default_specs()]
    width = max(len(text) for text, _ in variants)
    print(f"{'spec':{width}} {'min_ctas':>8} {'registers':>9} {'spilled B':>9} {'CTAs/SM by registers':>20} "
          f"{'serial':>6} {'loop':>5}")
    for text, kwargs in variants:
        with tempfile.TemporaryDirectory() as tmp:
            ptx = sm90a_ptx(build_sm90(Sm90Spec(**kwargs)), tmp)
            threads = int(re.search(r"\.reqntid (\d+)", ptx).group(1))  # type: ignore[union-attr]
            for bound in (int(b) for b in args.min_ctas.split(",")):
                made = compile_variant(ptx, bound, Path(tmp))
                allocated = -(-made["registers"] // 8) * 8  # (registers are allocated 8 a thread at a time)
                print(f"{text:{width}} {bound:>8} {made['registers']:>9} {made['spilled']:>9} "
                      f"{65536 // (allocated * threads):>20} {made['serial']:>6} {sum(made['loop'].values()):>5}")
                if args.mix:
                    print("    " + ", ".join(f"{k} {v}" for k, v in made["loop"].most_common(16)))


if __name__ == "__main__":
    main()
