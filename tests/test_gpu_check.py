"""The GPU gate's own logic on the CPU (`tests/gpu_check.py --smoke`): its path matrix through the
interpreter for a few cases, and its record's tree hash against git's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import gpu_check
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_cases_pass_and_the_record_starts_with_the_src_hash(tmp_path: Path) -> None:
    record = tmp_path / "gpu-check.txt"
    assert gpu_check.main(["--smoke", "--only", "6", "--record", str(record)]) == 0
    lines = record.read_text().splitlines()
    assert lines[0] == f"src {gpu_check.src_tree_hash(ROOT / 'src')}"
    assert lines[1].startswith("gpu-check PASSED: paths 6/6")


def test_the_poison_reaches_every_unread_kind_of_byte() -> None:
    import msa

    step = gpu_check._step("nvfp4", "packed", 4, 2, "cpu", msa.Geometry(8, 2, 64, 16, 4), 100, 3)
    assert (step.kv_cache == 0x7F).any() and step.q.isnan().any() and (step.block_table < 0).any()
    step = gpu_check._step("fp8_e4m3", "separate", 4, 2, "cpu", msa.Geometry(8, 2, 64, 16, 4), 100, 3)
    assert all((t.view(torch.uint8) == 0x7F).any() for t in step.kv_cache)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_the_tree_hash_is_gits(tmp_path: Path) -> None:
    """On a committed `src/` (exported from HEAD), the hash is `git rev-parse HEAD:src`."""
    archive = subprocess.run(["git", "archive", "HEAD", "src"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    expected = subprocess.run(["git", "rev-parse", "HEAD:src"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    assert gpu_check.src_tree_hash(tmp_path / "src") == expected


def test_the_forced_cute_shapes_run_on_hopper_only() -> None:
    """`FORCED_CUTE` asks for the wgmma kernel (sm_90a): its cases, beside `auto` and `cute` at
    the same steps, are in the matrix on Hopper and nowhere else."""

    def forced(cute: bool, hopper: bool) -> list[tuple[str, str, str, int, int]]:
        return [c for c in gpu_check._cases(False, cute, hopper) if c[2] in gpu_check.FORCED_CUTE]

    expected = {(layout, "packed", name, 1, batch) for layout, batch in gpu_check.FORCED_CUTE_STEPS
                for name in gpu_check.FORCED_CUTE}
    assert set(forced(True, True)) == expected and len(expected) == 2
    assert forced(True, False) == [] and forced(False, False) == []
