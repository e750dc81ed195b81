"""`msa explain --machine-code`: what ptxas makes of the Triton kernels of the described step,
compiled here for the described GPU (`msa.bench.machine_code`; no GPU needed)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from msa.platform import Platform
    from msa.problem import DecodeProblem

__all__ = ["print_machine_code"]

#: Fewer instructions than this in the largest backward branch: a wait or spin, not a loop over tiles.
_LOOP_MIN = 16


def print_machine_code(problem: DecodeProblem, platform: Platform, chosen: str | None) -> None:
    """Compile and summarise the Triton kernels `problem` launches on `platform` (a CUDA one,
    real or pretend), or say why not: another backend runs the step, the platform is no GPU, the
    cache is not packed, the step spans ranks, or the compiler failed (one `MSAInputError` naming `--machine-code`)."""
    from msa.bench.machine_code import check_batch, check_compiler, compile_step, loop_mix
    from msa.display import format_table
    from msa.errors import MSAError, MSAInputError

    if platform.capability is None:
        raise MSAInputError("--machine-code", "a CUDA platform: this machine's GPU, or --capability X.Y",
                            f"a {platform.device_type} platform")
    if chosen != "triton":
        print(f"machine code: shown for the Triton backend's kernels; {chosen or 'no backend'} runs this step "
              "(see them with --backend triton)")
        return
    if problem.kv_form != "packed":
        raise MSAInputError("--machine-code", "a packed cache (--kv-form packed)", f"--kv-form {problem.kv_form}")
    if problem.dcp_size > 1:
        raise MSAInputError("--machine-code", "a step on one rank (--dcp-size 1)", f"--dcp-size {problem.dcp_size}")
    check_batch(problem.batch_size, "--batch")
    check_compiler()
    major, minor = platform.capability
    print(f"compiling the Triton kernels for sm_{major}{minor} (seconds each) ...", file=sys.stderr, flush=True)
    try:
        codes = compile_step(problem.geometry, problem.kv_layout, problem.batch_size, query_len=problem.query_len,
                             q_dtype=problem.q_dtype, with_lse=problem.return_lse, capability=platform.capability,
                             sm_count=platform.sm_count)
    except MSAError:
        raise
    except Exception as exc:  # (ptxas, cuobjdump or Triton itself: one line, not a traceback)
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise MSAInputError("--machine-code", f"kernels Triton compiles for sm_{major}{minor} here",
                            f"{type(exc).__name__}: {first}") from None
    lse = "LSE written; " if problem.return_lse else ""
    print(f"machine code for sm_{major}{minor}, {platform.sm_count} SMs ({lse}"
          "registers and bytes of stack per thread, shared memory per program, the main loop's instructions per tile):")
    rows = []
    for code in codes:
        looped = code.loop.get("instructions", 0) >= _LOOP_MIN  # (a program of one tile has no loop over tiles)
        mix = loop_mix(code.loop) if looped else "no tile loop"
        config = code.config
        rows.append([code.kernel, "x".join(map(str, code.grid)), config["block_n"], config["warps"], config["stages"],
                     config["splits"], code.registers, code.spills, code.shared,
                     code.loop["instructions"] if looped else "-", mix])
    print(format_table(["kernel", "grid", "tile", "warps", "stages", "splits", "registers", "stack B", "shared B",
                        "loop instr", "loop mix"], rows))
