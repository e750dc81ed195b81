"""`msa bench` with the serving engines' own decode kernels timed in the same run (GPU):

    bash benchmarks/engine_baselines/prepare.sh        # once: the engines' files into .baselines/
    PYTHONPATH=src:benchmarks python3 benchmarks/bench_engines.py [msa bench flags...]

Adds vLLM 0.33.0's and SGLang 0.5.23's Triton decode functions (`engine_baselines`) to the
sweep's integrations as "vllm-kernel" and "sglang-kernel", and to `--eager` runs as extra entry
points, then runs the `msa bench` command line.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from engine_baselines import load
from engine_baselines.calls import ENGINE_CALLS

from msa.bench import eager
from msa.bench.integrations import INTEGRATIONS
from msa.cli import main


def _with_engines(kw: dict[str, Any]) -> dict[str, Any]:
    problem_layout = __import__("msa").get_layout(kw["kv_cache_dtype"])
    calls = {name: make(kw, problem_layout) for name, make in ENGINE_CALLS.items()}
    return {name: call for name, call in calls.items() if call is not None}


if __name__ == "__main__":
    if not load.available():
        sys.exit(f"bench_engines: the engines' files are missing ({', '.join(load.missing())}): run prepare.sh")
    INTEGRATIONS.update(ENGINE_CALLS)
    eager.run_eager = functools.partial(eager.run_eager, extra=_with_engines)  # (the engines' rows: "engine")
    sys.exit(main(["bench", *sys.argv[1:]]))
