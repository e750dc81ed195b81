"""The `msa` command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from msa.cli import main


def test_demo_runs_and_checks(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--batch", "2", "--query-len", "2", "--context", "700", "--tp", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    for layout in ("bfloat16", "fp8_e4m3", "nvfp4"):
        assert f"reference  {layout}" in out
    assert "4x16x128" in out  # B*L rows x TP4 query heads x D
    assert "OK: outputs within" in out


def test_demo_single_layout_without_oracle(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--layout", "fp8", "--batch", "1", "--context", "300", "--no-oracle", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "fp8_e4m3" in out and "nvfp4" not in out
    assert out.splitlines()[3].split()[-2:] == ["-", "-"], "oracle columns left empty"


def test_layouts_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layouts"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4" in out and "144" in out and "[pages, 2*Hkv, P, 72]" in out
    assert main(["version"]) == 0
    assert "backends: cutlass_sm100, flashinfer, triton, reference" in capsys.readouterr().out


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_python_dash_m() -> None:
    result = subprocess.run([sys.executable, "-m", "msa", "layouts"], capture_output=True, text=True)
    assert result.returncode == 0 and "fp8_e4m3" in result.stdout
