"""msa.distributed on GPUs: NCCL, 2 ranks (one process per GPU).

    PYTHONPATH=src python3 -m pytest -m gpu tests/test_distributed_gpu.py

- every scenario of tests/distributed_cases.py with the Triton backend and "auto" equals the
  single-process reference over the unsharded cache;
- the planner form captured in a CUDA graph (NCCL collectives inside) and replayed over 20 steps
  while seq_lens, block tables, rotations, top-k lists and q change in place equals the reference
  at every step;
- the agreement cases of tests/test_distributed.py (an error on one rank raised on both, steps of
  no rows, validate=True on padded tables) over NCCL, where the agreement runs on the GPU.

Sanitizer (every rank is a child process; compute-sanitizer follows them):

    compute-sanitizer --tool memcheck --target-processes all \\
        env PYTHONPATH=src python3 -m pytest -m gpu -x tests/test_distributed_gpu.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from distributed_cases import AGREEMENT_CASES, agreement_worker, graph_worker, spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def _report(results: list[dict[str, object]], minimum: int) -> None:
    failures = [f for r in results for f in r["failures"]]  # type: ignore[attr-defined]
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures)
    checks = [r["checks"] for r in results]
    assert min(checks) == max(checks) >= minimum, f"checks per rank: {checks}"  # type: ignore[type-var]


def test_nccl_ranks_equal_single_process(seed: int, tmp_path: Path) -> None:
    _report(spawn(2, tmp_path, seed, "cuda", ("triton", "auto"), timeout=900.0), 100)


def test_nccl_planner_graph_replays_with_changing_metadata(seed: int, tmp_path: Path) -> None:
    _report(spawn(2, tmp_path, seed, "cuda", ("triton",), timeout=900.0, target=graph_worker), 2 * 4 * 20 * 2)


def test_nccl_errors_agree_and_empty_steps_merge(seed: int, tmp_path: Path) -> None:
    _report(spawn(2, tmp_path, seed, "cuda", ("reference",), timeout=300.0, target=agreement_worker,
                  extra=(list(AGREEMENT_CASES),)), 20)
