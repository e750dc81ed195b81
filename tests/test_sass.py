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


def compiler_env() -> dict[str, str]:
    """This process's environment for a child that compiles Triton kernels for a GPU: without
    `TRITON_INTERPRET`, with src and benchmarks on `PYTHONPATH`."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")])
    return env


def _kernel_sass(*args: str) -> list[str]:
    """The summary lines of `kernel_sass.py` run with `args` (skips where it compiled nothing;
    fails where it compiled some and then failed)."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), *args], env=compiler_env(),
                          capture_output=True, text=True, timeout=900, check=False)
    lines = [x for x in done.stdout.splitlines() if " regs " in x]
    if not lines:
        pytest.skip(f"kernel_sass.py compiled nothing (no ptxas for sm_90?): {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return lines


def _spills(lines: list[str]) -> dict[str, int]:
    """Bytes of stack per compiled kernel ("<kernel> <layout> B=<batch> <variant>": n) of `_kernel_sass` lines."""
    spills = {}
    for line in lines:
        found = re.search(r"spills (-?\d+)", line)
        assert found is not None, line
        spills[" ".join(line.split(" regs ")[0].split())] = int(found.group(1))
    return spills


def _loop(layout: str, q_dtype: str, capability: str = "9.0") -> dict[str, int]:
    """The main loop's instruction count and mix of the M3 TP1 B = 64 step's kernel."""
    lines = _kernel_sass("--layouts", layout, "--batches", "64", "--q-dtype", q_dtype, "--capability", capability)
    line = next((x for x in lines if x.startswith("split_decode_kernel")), None)
    assert line is not None, lines
    summary = line.split("| loop ", 1)[1]
    counts = dict(instructions=int(summary.split()[0]))
    counts.update({name: int(n) for name, n in re.findall(r"\b([A-Z][A-Z0-9.]*) (\d+)\b", summary)})
    return counts


@pytest.mark.parametrize(("layout", "capability"), [("bfloat16", "9.0"), ("float16", "9.0"), ("bfloat16", "8.0")])
def test_an_fp8_query_keeps_the_16_bit_operand_layout(layout: str, capability: str) -> None:
    """An fp8 query over a 16-bit cache meets 16-bit dots: Triton sized the dots' register chunks
    from the fp8 load it traced the query back to, and the key tile was then read with scalar
    shared loads (sm_90: LDS 40, LDSM 12, 507 instructions a tile against LDS 7, LDSM 28, 430
    with a bf16 query; H100: 12-13% slower at M3 TP1 B = 64). `kernels._opaque` hides the fp8
    origin: the loop is the bf16 query's. Below 8.9 the query arrives as bytes decoded to fp16
    (`LaunchConfig.soft_e4m3`), traced back to the byte load just the same (sm_80: 486
    instructions a tile against 406 before the decoded query went through `_opaque` too)."""
    fp8, bf16 = _loop(layout, "fp8", capability), _loop(layout, "bf16", capability)
    assert fp8["LDSM"] == bf16["LDSM"] and fp8["LDS"] <= bf16["LDS"] + 2, (fp8, bf16)
    assert fp8["instructions"] <= bf16["instructions"] + 10, (fp8, bf16)


# bytes of stack (spilled registers) a default kernel may take: a few registers' worth per thread
SPILL_LIMIT = 256


@pytest.mark.parametrize(("triton_of", "tp"), [
    ("here", 1), ("here", 8),  # (CI: the widest and the narrowest head layout; TP2/TP4 with `make test-slow`)
    *[pytest.param("here", tp, marks=pytest.mark.slow) for tp in (2, 4)],
    *[pytest.param("gate", tp, marks=pytest.mark.gpu) for tp in (1, 2, 4, 8)],
])
def test_default_tiles_do_not_spill(triton_of: str, tp: int) -> None:
    """Every default launch of M3's head layouts compiles for sm_90 without heavy spills: the dedup
    program (L = 4, B = 16 with splits and B = 256 in one pass; fp8, NVFP4, bf16) and the per-token
    one (L = 1, B = 64 and 256; every layout). Runs with this machine's Triton and, in the GPU gate
    (`gpu` mark), with the GPU host's: there Triton 3.6 gave the NVFP4 dedup program of M3 TP8
    (32 rows, 128-token tiles) 7080 bytes of stack and a 73x slower step (H100, 17190 us against
    236.9 at B = 256), where this machine's Triton 3.9 gave it 64."""
    lines = _kernel_sass("--layouts", "fp8_e4m3,nvfp4,bfloat16", "--batches", "16,256", "--query-len", "4",
                         "--variant", '{"dedup": true}', "--tp", str(tp))
    lines += _kernel_sass("--layouts", "fp8_e4m3,nvfp4,bfloat16,float16", "--batches", "64,256", "--tp", str(tp))
    spills = _spills(lines)
    assert len(spills) >= 14 and all(n >= 0 for n in spills.values()), spills  # 6 dedup, 8 per-token kernels
    assert max(spills.values()) <= SPILL_LIMIT, {k: n for k, n in spills.items() if n > SPILL_LIMIT}
