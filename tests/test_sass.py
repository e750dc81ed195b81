"""The Triton kernels compiled for Hopper (sm_90) on this machine, no GPU needed
(`benchmarks/kernel_sass.py`, in a process of its own: the tests run under the interpreter)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _loop(layout: str, q_dtype: str) -> dict[str, int]:
    """The main loop's instruction count and mix of the M3 TP1 B = 64 step's kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")])
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--layouts", layout,
                           "--batches", "64", "--q-dtype", q_dtype], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("split_decode_kernel")), None)
    if line is None:
        pytest.skip(f"kernel_sass.py compiled nothing (no ptxas for sm_90?): {done.stderr[-300:]}")
    summary = line.split("| loop ", 1)[1]
    counts = dict(instructions=int(summary.split()[0]))
    counts.update({name: int(n) for name, n in re.findall(r"\b([A-Z][A-Z0-9.]*) (\d+)\b", summary)})
    return counts


@pytest.mark.parametrize("layout", ["bfloat16", "float16"])
def test_an_fp8_query_keeps_the_16_bit_operand_layout(layout: str) -> None:
    """An fp8 query over a 16-bit cache meets 16-bit dots: Triton sized the dots' register chunks
    from the fp8 load it traced the query back to, and the key tile was then read with scalar
    shared loads (sm_90: LDS 40, LDSM 12, 507 instructions a tile against LDS 7, LDSM 28, 430
    with a bf16 query; H100: 12-13% slower at M3 TP1 B = 64). `kernels._opaque` hides the fp8
    origin: the loop is the bf16 query's."""
    fp8, bf16 = _loop(layout, "fp8"), _loop(layout, "bf16")
    assert fp8["LDSM"] == bf16["LDSM"] and fp8["LDS"] <= bf16["LDS"] + 2, (fp8, bf16)
    assert fp8["instructions"] <= bf16["instructions"] + 10, (fp8, bf16)
