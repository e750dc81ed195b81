"""The `msa` command."""

from __future__ import annotations

import re
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


def test_demo_says_when_it_could_not_cross_check(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the demo's reference is checked against the Triton interpreter; where Triton
    cannot run it says so (and still checks the reference against the dense oracle)."""
    import os

    import msa.cli.demo as demo
    from msa.errors import MSAUnsupportedError

    args = ["demo", "--layout", "bfloat16", "--batch", "1", "--context", "300", "--seed", "1"]
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert main(args) == 0
        assert "triton (interpreter" in capsys.readouterr().out

    real = demo.select_backend

    def no_triton(problem: object, name: str = "auto") -> object:
        if name == "triton":
            raise MSAUnsupportedError("backend 'triton' cannot run this step: pretend")
        return real(problem, name)  # type: ignore[arg-type]

    monkeypatch.setattr(demo, "select_backend", no_triton)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "nothing (Triton cannot run here)" in out and "OK: outputs within" in out


def test_layouts_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layouts"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4" in out and "144" in out and "[pages, 2*Hkv, P, 72]" in out
    assert main(["version"]) == 0
    assert "backends: cutlass_sm100, flashinfer, cute, triton, reference" in capsys.readouterr().out


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_python_dash_m() -> None:
    result = subprocess.run([sys.executable, "-m", "msa", "layouts"], capture_output=True, text=True)
    assert result.returncode == 0 and "fp8_e4m3" in result.stdout


#: Pretend machines: (id, flags, TRITON_INTERPRET).
MACHINES = [
    ("cpu", ["--cpu"], "0"),
    ("cpu interpret", ["--cpu"], "1"),
    ("sm75", ["--capability", "7.5"], "0"),
    ("sm80", ["--capability", "8.0"], "0"),
    ("sm90", ["--capability", "9.0"], "0"),
    ("sm100", ["--capability", "10.0"], "0"),
    ("sm100 without libraries", ["--capability", "10.0", "--packages", "triton"], "0"),
]
#: `msa explain` flags for a step each built-in backend supports (only the machine can refuse).
FRIENDLY = {
    "cutlass_sm100": ["--kv-dtype", "nvfp4", "--q-dtype", "fp8"],
    "flashinfer": ["--kv-dtype", "fp8", "--q-dtype", "fp8", "--kv-form", "separate"],
    "triton": ["--kv-dtype", "fp8"],
    "reference": [],
}


def table_rows(out: str) -> dict[str, list[str]]:
    """`msa backends`' rows by backend name: the cells, split on runs of 2+ spaces."""
    rows = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0].split(" ")[0]] = cells
    return rows


def verdict_line(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"  {name} "))


@pytest.mark.parametrize("machine, flags, interpret", MACHINES, ids=[m[0] for m in MACHINES])
def test_backends_and_explain_agree(
    machine: str, flags: list[str], interpret: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`msa backends` says "yes" exactly when `explain` lets `auto` take a step the backend
    supports, "by name" when only a request qualifies it, and its notes are explain's reasons."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.delenv("MSA_BACKEND", raising=False)
    assert main(["backends", *flags]) == 0
    rows = table_rows(capsys.readouterr().out)
    for name, step in FRIENDLY.items():
        runs_here, notes = rows[name][4], rows[name][5]
        main(["explain", *flags, *step])
        auto = verdict_line(capsys.readouterr().out, name)
        main(["explain", *flags, *step, "--backend", name])
        named = verdict_line(capsys.readouterr().out, name)
        assert (runs_here == "yes") == (auto.split()[1] != "rejected"), (name, runs_here, auto)
        assert (runs_here in ("yes", "by name")) == (named.split()[1] == "chosen"), (name, runs_here, named)
        if runs_here != "yes":
            assert auto.split(" rejected ", 1)[1].strip() == notes, (name, notes, auto)
