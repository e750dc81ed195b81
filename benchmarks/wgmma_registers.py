"""Registers, spills and main-loop instructions of wgmma-kernel variants, compiled for sm_90a on a
machine without a GPU (`nvidia-cutlass-dsl` for the PTX, Triton's bundled ptxas and cuobjdump for
the rest):

    python3 benchmarks/wgmma_registers.py --spec '{"stages": 2, "wgs": 2, "vreg": true}' [--spec ...] \\
        [--min-ctas 0,2] [--defaults] [--mix]

Each `--spec` is `Sm90Spec` keyword arguments over an M3 TP1 one-split fp8 kernel (128-token pages,
bf16 query and output, 16 heads, keys in registers; a bf16 or f16 `kind` reads its keys from the
ring instead); `--defaults` adds every kernel `CuteBackend()` launches by default for M3 on an
H200 (`ptx_same.default_specs`: this tree's policy, as their
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
from cute_sass import _loops, _mix, _ops
from ptx_same import default_specs, sm90a_ptx

from msa.backends.cute.config import WIDE_KINDS

BASE = dict(page_size=128, q_kind="bf16", out_kind="bf16", final=True, write_lse=False, nc=16, stages=3, kind="fp8",
            kreg=True)
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _spec(given: dict[str, Any]) -> dict[str, Any]:
    """`BASE` with `given` over it (a 16-bit cache's kernel reads its keys from the ring: no `kreg`)."""
    wide = given.get("kind") in WIDE_KINDS
    return {**BASE, **({"kreg": False} if wide else {}), **given}


def main_loop(ops: list[tuple[int, str]]) -> collections.Counter[str]:
    """The opcodes (predicates and modifiers dropped: `cute_sass._mix`) of the smallest region of a
    conditional backward branch (a loop's back edge, not the unconditional jump back from an
    mbarrier wait's retry block) that holds a wgmma (`HGMMA`) instruction, of `cute_sass._ops`."""
    text = dict(ops)
    spans = [(lo, hi) for lo, hi in _loops(ops) if re.match(r"@!?U?P\w+\s+BRA", text[hi])
             and any(lo <= a <= hi and "HGMMA" in t for a, t in ops)]
    return _mix(ops, *min(spans, key=lambda span: span[1] - span[0]), None) if spans else collections.Counter()


def compile_variant(ptx: str, bound: int, tmp: Path) -> dict[str, Any]:
    """ptxas's registers, spills and serialisation notes for `ptx` (with the launch bound `bound`
    CTAs an SM when > 0), and the main loop of its machine code."""
    src = tmp / f"k{bound}.ptx"
    src.write_text(ptx if bound == 0 else re.sub(r"(\.reqntid [^\n]*)", rf"\1\n.minnctapersm {bound}", ptx))
    cubin = src.with_suffix(".cubin")
    out = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", str(src), "-o", str(cubin)],
                         capture_output=True, text=True, check=True).stderr
    return dict(registers=int(re.findall(r"Used (\d+) registers", out)[-1]),
                spilled=int(re.findall(r"(\d+) bytes spill stores", out)[-1]),
                serial=len(re.findall(r"\(C751\d\)", out)), loop=main_loop(_ops(cubin)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", action="append", default=[], help="JSON Sm90Spec overrides (repeatable)")
    parser.add_argument("--defaults", action="store_true", help="also every default M3 kernel (full arguments)")
    parser.add_argument("--min-ctas", default="0", help="comma-separated launch bounds to compile each with")
    parser.add_argument("--mix", action="store_true", help="print the main loop's most common opcodes too")
    args = parser.parse_args()
    from msa.backends.cute.sm90 import Sm90Spec, build_sm90

    variants = [(text, _spec(json.loads(text))) for text in args.spec or ([] if args.defaults else ["{}"])]
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
