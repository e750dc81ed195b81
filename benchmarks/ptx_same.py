"""Whether the wgmma kernel compiles to the same PTX at this tree's src/ as at another revision's
(CPU, `nvidia-cutlass-dsl`; no GPU needed):

    python3 benchmarks/ptx_same.py --against REV [--sample N] [--seed S]
    python3 benchmarks/ptx_same.py --against-src DIR [--specs JSON]

A change that says it leaves the kernels it does not opt into alone can show it here. The variants
compared are, first, every kernel `CuteBackend()` launches by default for M3's head layouts on an
H200 (TP 1, 2, 4, 8; fp8, NVFP4, bf16 and f16 caches; bf16, f16 and fp8 queries; B 1 .. 512; L 1, 2,
4; with and without LSE; as this tree's policy chooses), then a grid of `Sm90Spec` variants (fp8 and
NVFP4; bf16, f16 and fp8 queries; 8 and 16 heads; one split with and without LSE, fused splits with
and without, clusters of 2 and 8; both ring depths, values and keys in registers or not, one or two
warpgroups, the tensor-core key conversion; programs of several rows, `lag`, 64-token pages). Each
is compiled for sm_90a at both trees, each tree in its own process (REV's src/ checked out into a
temporary git worktree), and the PTX compared with its comments stripped.
Prints each differing variant and a summary line; exits 1 when any differs. It says nothing
about what runs on a GPU: it is no substitute for `make gpu-check`.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: M3 steps whose default kernels are compared: tensor-parallel head layouts, batches, query lengths.
DEFAULT_TPS, DEFAULT_BATCHES, DEFAULT_QUERY_LENS = (1, 2, 4, 8), (1, 2, 4, 8, 16, 32, 64, 128, 256, 512), (1, 2, 4)


def default_specs() -> list[dict[str, Any]]:
    """The `Sm90Spec`s this tree's `CuteBackend()` launches for the M3 steps above on an H200 (132
    SMs, 9.0; bf16, f16 and fp8 queries, outputs of a 16-bit query's type, else bf16), each as the
    keyword arguments that differ from the field defaults (so that a revision without a field this
    tree added at its default still takes it)."""
    import attrs
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    import msa

    if not Path(msa.__file__).resolve().is_relative_to((ROOT / "src").resolve()):
        raise SystemExit(f"ptx_same: msa came from {msa.__file__}, not from {ROOT / 'src'}")
    from msa.backends.cute import CuteBackend
    from msa.backends.cute.launch import spec_for
    from msa.platform import Platform
    from msa.problem import DecodeProblem

    hopper = Platform(device_type="cuda", capability=(9, 0), sm_count=132, packages=frozenset({"cutlass_dsl"}))
    seen: dict[str, dict[str, Any]] = {}
    backend = CuteBackend()
    steps = itertools.product(DEFAULT_TPS, ("fp8_e4m3", "nvfp4", "bfloat16", "float16"),
                              (torch.bfloat16, torch.float16, torch.float8_e4m3fn), DEFAULT_BATCHES, DEFAULT_QUERY_LENS)
    for tp, layout, q, batch, query_len in steps:
        out_dtype = torch.bfloat16 if q == torch.float8_e4m3fn else q
        problem = DecodeProblem(geometry=msa.MINIMAX_M3_TP[tp], batch_size=batch, query_len=query_len, kv_layout=layout,
                                q_dtype=q, out_dtype=out_dtype, device_type="cuda", num_pages=0, max_blocks=0,
                                graph_capture=True)
        if backend.problem_reasons(problem, hopper, requested=False):
            continue
        config = backend.config_on(problem, hopper)
        if config.kernel != "wgmma":
            continue
        for lse in (False, True):
            spec = spec_for(problem, config, torch.bfloat16, lse)
            fields = attrs.fields_dict(type(spec))
            args = {k: v for k, v in attrs.asdict(spec).items() if v != fields[k].default}
            seen[json.dumps(args, sort_keys=True)] = args
    return list(seen.values())


def grid() -> list[dict[str, Any]]:
    """The grid of `Sm90Spec` keyword arguments (fields every revision since session 19 has)."""
    out: list[dict[str, Any]] = []
    shapes = [(st, vreg, kreg, False, wgs) for st in (2, 3) for vreg in (False, True) for kreg in (False, True)
              for wgs in (1, 2)] + [(3, False, True, True, 1), (2, True, True, True, 1)]
    ends = [(True, False, 0, False), (True, False, 0, True), (False, True, 0, False), (False, True, 0, True),
            (False, True, 2, False), (False, True, 8, True)]  # (final, fused, cluster, write_lse)
    for kind in ("fp8", "nvfp4"):
        for q in ("bf16", "f16", "e4m3"):
            for nc in (8, 16):
                for final, fused, cluster, lse in ends:
                    for stages, vreg, kreg, tconv, wgs in shapes:
                        if kind == "nvfp4" and (not vreg or not kreg or tconv):
                            continue
                        out.append(dict(page_size=128, q_kind=q, out_kind="bf16", final=final, write_lse=lse, nc=nc,
                                        stages=stages, fused=fused, wgs=wgs, vreg=vreg, kind=kind, kreg=kreg,
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


def compile_sm90a(host: Any, dump: str | Path, args: tuple[Any, ...] | None = None) -> tuple[Any, str]:
    """A `@cute.jit` host function (a wgmma kernel's, `build_sm90`, unless its `args` are given)
    compiled for sm_90a on this machine (no GPU needed; the DSL's files go to `dump`), and its PTX."""
    import cutlass.cute as cute

    from msa.backends.cute.kernel import compile_args

    Path(dump).mkdir(parents=True, exist_ok=True)  # (without it the DSL writes nothing and `__ptx__` is only a path)
    fn = cute.compile(host, *(compile_args() if args is None else args),
                      options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {dump}")
    ptx = fn.__ptx__.decode() if isinstance(fn.__ptx__, bytes) else str(fn.__ptx__)
    if ".target sm_90a" not in ptx:
        raise RuntimeError(f"no sm_90a PTX from the DSL, only {ptx[:120]!r}")
    return fn, ptx


def sm90a_ptx(host: Any, dump: str | Path) -> str:
    """The PTX of a wgmma kernel's host function compiled for sm_90a (`compile_sm90a`)."""
    return compile_sm90a(host, dump)[1]


def emit(src: Path, chosen: list[dict[str, Any]], out: Path) -> None:
    """Compile `chosen` with the `msa` of `src` and write {spec JSON: PTX sha256, or why the
    kernel refused it} to `out`."""
    sys.path.insert(0, str(src))
    import msa
    from msa.backends.cute.sm90 import Sm90Spec, build_sm90

    if not Path(msa.__file__).resolve().is_relative_to(src.resolve()):
        raise SystemExit(f"ptx_same: msa came from {msa.__file__}, not from {src}")
    hashes = {}
    with tempfile.TemporaryDirectory() as dump:
        for i, spec in enumerate(chosen):
            key = json.dumps(spec, sort_keys=True)
            try:
                made = Sm90Spec(**spec)
            except TypeError as exc:  # a field this revision lacks
                hashes[key] = f"refused: {exc}"
                continue
            try:
                host = build_sm90(made)
            except ValueError as exc:  # a combination this revision refuses
                hashes[key] = f"refused: {exc}"
                continue
            body = "\n".join(line for line in sm90a_ptx(host, dump).splitlines() if not line.strip().startswith("//"))
            hashes[key] = hashlib.sha256(body.encode()).hexdigest()
            print(f"\r{src}: {i + 1}/{len(chosen)} compiled", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    out.write_text(json.dumps(hashes))


def compare(other_src: Path, chosen: list[dict[str, Any]], tmp: Path) -> list[dict[str, str]]:
    """The two trees' results for `chosen` (this tree's first), each compiled in its own process."""
    results = []
    specs = tmp / "specs.json"
    specs.write_text(json.dumps(chosen))
    for name, src in (("this", ROOT / "src"), ("other", other_src)):
        out = tmp / f"{name}.json"
        done = subprocess.run([sys.executable, __file__, "--emit", str(src), str(out), "--specs", f"@{specs}"])
        if done.returncode:
            raise SystemExit(f"ptx_same: compiling at {src} failed (exit {done.returncode}; its message is above)")
        results.append(json.loads(out.read_text()))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    against = parser.add_mutually_exclusive_group()
    against.add_argument("--against", help="a git revision whose src/ to compare with this tree's")
    against.add_argument("--against-src", type=Path, help="a src/ folder to compare with this tree's")
    parser.add_argument("--specs", help="a JSON list of Sm90Spec keyword dicts to compare (instead of the defaults and "
                        "the grid), or @FILE holding one")
    parser.add_argument("--sample", type=int, default=0, help="compare this many variants drawn at random (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--emit", nargs=2, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    given = None
    if args.specs:
        given = json.loads(Path(args.specs[1:]).read_text() if args.specs.startswith("@") else args.specs)
    if args.emit:
        emit(Path(args.emit[0]), given or [], Path(args.emit[1]))
        return
    if args.against is None and args.against_src is None:
        parser.error("one of --against REV or --against-src DIR is required")
    chosen = given if given is not None else default_specs() + grid()
    if 0 < args.sample < len(chosen):
        chosen = random.Random(args.seed).sample(chosen, args.sample)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.against_src is not None:
            here, there = compare(args.against_src, chosen, tmp)
            what = str(args.against_src)
        else:
            other = tmp / "other"
            add = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), args.against],
                                 capture_output=True, text=True)
            if add.returncode:
                raise SystemExit(f"ptx_same: cannot check out {args.against!r}: {add.stderr.strip().splitlines()[-1]}")
            try:
                here, there = compare(other / "src", chosen, tmp)
            finally:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)],
                               capture_output=True)
            what = args.against
    differ = [spec for spec in here if here[spec] != there.get(spec)]
    refused = [spec for spec in here if spec not in differ and here[spec].startswith("refused")]
    for spec in differ:
        print(f"differs: {spec}")
    same = len(here) - len(differ) - len(refused)
    print(f"{same} of {len(here)} wgmma kernel variants compile to the same PTX here as at {what} (comments "
          f"stripped); {len(refused)} refused alike by both, {len(differ)} differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
