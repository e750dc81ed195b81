"""Ablations of the NVFP4 per-token kernel (GPU): source variants of `kernels.py` and register caps,
each checked against the reference and timed like `tune_kernels.py` (M3 TP1, 64K, B = 64 / 256):

    PYTHONPATH=src python3 benchmarks/nvfp4_ablations.py --out DIR      (writes DIR/ablate.json)

The variants are text patches of the kernel source as it stood when this was written (each
patch asserts that its text is still there): no m_safe in the softmax, q pre-scaled, one packed
register pick per tile, all three, and `maxnreg` caps. Recorded in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
from tune_kernels import check_and_time, prepare_case

import msa
import msa.backends.triton.launch as launch
from msa.backends.triton import TritonBackend
from msa.bench.timing import Timer, copy_bandwidth
from msa.workload import make_decode_step

SOURCE = Path(launch.__file__).with_name("kernels.py").read_text()
SOFTMAX = "            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)\n"
NO_SAFE_MAX = (
    "            m_new = tl.maximum(m_i, tl.max(s, axis=1))\n            alpha = tl.exp2(m_i - m_new)\n"
    "            p = tl.exp2(s - m_new[:, None])\n            l_i = l_i * alpha + tl.sum(p, axis=1)\n"
    "            m_i = m_new\n"
)
Q_LOAD = "    q_even, q_odd, acc_odd = q_even.to(COMPUTE), q_odd.to(COMPUTE), acc_even\n"
Q_SCALED = ("    q_even, q_odd = (q_even.to(tl.float32) * qk).to(COMPUTE), (q_odd.to(tl.float32) * qk).to(COMPUTE)\n"
            "    acc_odd = acc_even\n")
SCORES = "            s = tl.where(visible[None, :], s * qk, float(\"-inf\"))\n"
SCORES_UNSCALED = "            s = tl.where(visible[None, :], s, float(\"-inf\"))\n"
TILE = ("    page = _pick(pages, rank, t).to(tl.int64)\n    tok = (tile % CHUNKS) * BLOCK_N + offs\n"
        "    visible = tok < n - _pick(ids, rank, t).to(tl.int64) * PAGE\n")
PACKED = ("    both = _pick(pages.to(tl.int64) * 4294967296 + ids.to(tl.int64), rank, t)\n    page = both >> 32\n"
          "    tok = (tile % CHUNKS) * BLOCK_N + offs\n    visible = tok < n - (both & 4294967295) * PAGE\n")
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "base": [],
    "no-safe-max": [(SOFTMAX, NO_SAFE_MAX)],
    "q-prescaled": [(Q_LOAD, Q_SCALED), (SCORES, SCORES_UNSCALED)],
    "packed-pick": [(TILE, PACKED)],
    "all-three": [(Q_LOAD, Q_SCALED), (SCORES, SCORES_UNSCALED), (SOFTMAX, NO_SAFE_MAX), (TILE, PACKED)],
}
RUNS = [("base", None), ("no-safe-max", None), ("q-prescaled", None), ("packed-pick", None), ("all-three", None),
        ("base", 168), ("all-three", 168), ("all-three", 192), ("base", 128)]


def variant_kernel(name: str, directory: Path) -> Any:
    source = SOURCE
    for old, new in VARIANTS[name]:
        assert old in source, f"{name}: the kernel source changed ({old.strip()[:50]})"
        source = source.replace(old, new)
    path = directory / f"nvfp4_{name.replace('-', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.nvfp4_decode_kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    timer = Timer(reps=40)
    copy = copy_bandwidth(timer)
    gen = torch.Generator(device="cuda").manual_seed(0)
    step = make_decode_step(msa.MINIMAX_M3, batch_size=256, context_len=65536, kv_cache_dtype="nvfp4",
                            device="cuda", seed=0)
    decode_args = launch.decode_args
    kernels: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for batch in (64, 256):
        n_bytes, ref, problem, inputs, tables, out = prepare_case(step, batch, gen)
        for name, maxnreg in RUNS:
            if name not in kernels:
                kernels[name] = variant_kernel(name, args.out)
            setattr(launch, "nvfp4_decode_kernel", kernels[name])  # noqa: B010 (a patch for this run)
            cap = {"maxnreg": maxnreg} if maxnreg else {}
            launch.decode_args = lambda *a, _cap=cap, **k: dict(decode_args(*a, **k), **_cap)
            _, err, us = check_and_time(TritonBackend(swap_ab=False), problem, inputs, tables, out, ref, timer)
            rows.append(dict(batch=batch, variant=name, maxnreg=maxnreg, us=round(us, 1),
                             frac_copy=round(n_bytes / us / 1e3 / copy, 3), err=err))
            print(json.dumps(rows[-1]), flush=True)
    (args.out / "ablate.json").write_text(json.dumps(dict(copy_gbps=copy, rows=rows), indent=1))


if __name__ == "__main__":
    main()
