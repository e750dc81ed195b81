"""Whether the wgmma kernel compiles to the same PTX at this tree's src/ as at another revision's
(CPU, `nvidia-cutlass-dsl`; no GPU needed):

    python3 benchmarks/ptx_same.py --against REV [--sample N] [--seed S]

A change that says it leaves the kernels it does not opt into alone can show it here. A grid of
`Sm90Spec` variants (fp8 and NVFP4; bf16, f16 and fp8 queries; 8 and 16 heads; one split,
fused splits, a cluster; the ring, register and warpgroup shapes the policy takes; programs of
several rows; `lag`) is compiled for sm_90a at both trees, each in its own process (REV's src/
checked out into a temporary git worktree). The PTX is compared with its comments stripped.
Prints each differing variant and a summary line; exits 1 when any differs. It says nothing
about what runs on a GPU: it is no substitute for `make gpu-check`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def variants() -> list[dict[str, Any]]:
    """The grid of `Sm90Spec` keyword arguments compared (fields every revision since session 19 has):
    every ring depth (2, 3), values and keys in registers or not, and one or two warpgroups, plus
    the tensor-core key conversion, for each cache, query kind, head count and way of ending a
    split; then programs of several rows, `lag` and 64-token pages."""
    out: list[dict[str, Any]] = []
    shapes = [(st, vreg, kreg, False, wgs) for st in (2, 3) for vreg in (False, True) for kreg in (False, True)
              for wgs in (1, 2)] + [(3, False, True, True, 1), (2, True, True, True, 1)]
    for kind in ("fp8", "nvfp4"):
        for q in ("bf16", "f16", "e4m3"):
            for nc in (8, 16):
                for final, fused, cluster in ((True, False, 0), (False, True, 0), (False, True, 4)):
                    for stages, vreg, kreg, tconv, wgs in shapes:
                        if kind == "nvfp4" and (not vreg or not kreg or tconv):
                            continue
                        out.append(dict(page_size=128, q_kind=q, out_kind="bf16", final=final, write_lse=final,
                                        nc=nc, stages=stages, fused=fused, wgs=wgs, vreg=vreg, kind=kind, kreg=kreg,
                                        tconv=tconv, cluster=cluster))
    out += [dict(page_size=128, q_kind="bf16", out_kind="bf16", final=False, write_lse=True, nc=32, stages=3,
                 fused=True, kind="fp8", kreg=True, tokens=2),
            dict(page_size=128, q_kind="e4m3", out_kind="bf16", final=False, write_lse=False, nc=32, stages=2,
                 fused=True, kind="fp8", kreg=False, tokens=4),
            dict(page_size=128, q_kind="bf16", out_kind="f16", final=True, write_lse=True, nc=16, stages=3, lag=True,
                 kind="fp8", kreg=True),
            dict(page_size=64, q_kind="f16", out_kind="bf16", final=False, write_lse=True, nc=32, stages=2,
                 fused=True, vreg=True, kind="nvfp4", kreg=True, tokens=4)]
    return out


def emit(src: Path, chosen: list[dict[str, Any]], out: Path) -> None:
    """Compile `chosen` with the `msa` of `src` and write {spec JSON: PTX sha256} to `out`."""
    sys.path.insert(0, str(src))
    import cutlass.cute as cute

    from msa.backends.cute.kernel import compile_args
    from msa.backends.cute.sm90 import Sm90Spec, build_sm90

    hashes = {}
    with tempfile.TemporaryDirectory() as dump:
        for i, spec in enumerate(chosen):
            key = json.dumps(spec, sort_keys=True)
            try:
                host = build_sm90(Sm90Spec(**spec))
            except ValueError as exc:  # a combination the kernel refuses (the same at both trees, or it differs)
                hashes[key] = f"refused: {exc}"
                continue
            fn = cute.compile(host, *compile_args(), options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {dump}")
            ptx = fn.__ptx__.decode() if isinstance(fn.__ptx__, bytes) else str(fn.__ptx__)
            body = "\n".join(line for line in ptx.splitlines() if not line.strip().startswith("//"))
            hashes[key] = hashlib.sha256(body.encode()).hexdigest()
            print(f"\r{src.parent.name or src}: {i + 1}/{len(chosen)} compiled", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    out.write_text(json.dumps(hashes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="a git revision whose src/ to compare with this tree's")
    parser.add_argument("--sample", type=int, default=0, help="compare this many variants drawn at random (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--emit", nargs=2, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--specs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.emit:
        emit(Path(args.emit[0]), json.loads(args.specs), Path(args.emit[1]))
        return
    grid = variants()
    if 0 < args.sample < len(grid):
        grid = random.Random(args.seed).sample(grid, args.sample)
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "other"
        add = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), args.against],
                             capture_output=True, text=True)
        if add.returncode:
            raise SystemExit(f"ptx_same: cannot check out {args.against!r}: {add.stderr.strip().splitlines()[-1]}")
        try:
            results = []
            for name, tree in (("this", ROOT), ("other", other)):
                out = Path(tmp) / f"{name}.json"
                subprocess.run([sys.executable, __file__, "--against", args.against, "--emit", str(tree / "src"),
                                str(out), "--specs", json.dumps(grid)], check=True)
                results.append(json.loads(out.read_text()))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], capture_output=True)
    here, there = results
    differ = [spec for spec in here if here[spec] != there.get(spec)]
    for spec in differ:
        print(f"differs: {spec}")
    refused = sum(str(v).startswith("refused") for v in here.values())
    print(f"{len(here) - len(differ)} of {len(here)} wgmma kernel variants compile to the same PTX here as at "
          f"{args.against} (comments stripped; {refused} of them refused alike by both)")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
