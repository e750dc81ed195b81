"""Bad flags and msa errors end in ONE line on stderr (`msa <command>: error: ...`) and exit code
2: no traceback, no usage dump. Help still works."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from msa.cli import main

LINE = re.compile(r"^msa( [a-z]+)?: error: \S.*$")

#: (argv, the command in the message, fragments the message must contain)
BAD: list[tuple[list[str], str, tuple[str, ...]]] = [
    (["explain", "--heads", "abc"], "explain", ("argument --heads", "Hq/Hkv", "'abc'")),
    (["explain", "--heads", "64/0"], "explain", ("argument --heads", "'64/0'")),
    (["explain", "--heads", "6/4"], "explain", ("argument --heads", "multiple of Hkv", "'6/4'")),
    (["explain", "--heads", "64"], "explain", ("argument --heads", "Hq/Hkv", "'64'", "ambiguous", "64/1")),
    (["explain", "--heads", "64/"], "explain", ("argument --heads", "Hq/Hkv", "'64/'")),
    (["explain", "--capability", "abc"], "explain", ("argument --capability", "10.0", "'abc'")),
    (["explain", "--batch", "0"], "explain", ("argument --batch", "positive integer", "'0'")),
    (["explain", "--head-dim", "-5"], "explain", ("argument --head-dim", "positive integer", "'-5'")),
    (["explain", "--kv-dtype", "int4"], "explain", ("argument --kv-dtype", "'int4'")),
    (["explain", "--backend", "nope"], "explain", ("backend: expected 'auto' or one of", "'nope'")),
    (["demo", "--batch", "0"], "demo", ("argument --batch", "positive integer", "'0'")),
    (["demo", "--query-len", "0"], "demo", ("argument --query-len", "positive integer", "'0'")),
    (["demo", "--device", "bogus"], "demo", ("argument --device", "auto, cpu, cuda", "'bogus'")),
    (["demo", "--backend", "nope"], "demo", ("backend: expected 'auto' or one of", "'nope'")),
    # numbers past what the demo can build: one line before anything is built or printed
    (["demo", "--seed", "9" * 23], "demo", ("argument --seed", "[-2^63, 2^64)", "'" + "9" * 23 + "'")),
    (["demo", "--seed", str(-(2**63) - 1)], "demo", ("argument --seed", "[-2^63, 2^64)", str(-(2**63) - 1))),
    (["demo", "--seed", "x"], "demo", ("argument --seed", "[-2^63, 2^64)", "'x'")),
    (["demo", "--batch", "2000000000", "--layout", "bfloat16"], "demo", ("--batch / --context", "GiB", "lower")),
    (["demo", "--context", "2000000000", "--batch", "1"], "demo", ("--batch / --context", "GiB", "lower")),
    (["demo", "--batch", "99999999999999"], "demo", ("argument --batch", "below 2^31")),
    (["demo", "--query-len", "200", "--context", "128"], "demo", ("--query-len", "at most --context = 128", "200")),
    # steps the layout cannot hold, refused as the API refuses their caches
    (["explain", "--kv-dtype", "nvfp4", "--kv-form", "separate"], "explain", ("--kv-form", "packed or strided", "separate")),
    (["explain", "--kv-dtype", "nvfp4", "--head-dim", "48"], "explain", ("--head-dim", "multiple of 32", "48")),
    (["explain", "--kv-dtype", "nvfp4", "--page-size", "6"], "explain", ("--page-size", "multiple of 4", "6")),
    (["layouts", "--head-dim", "-32"], "layouts", ("argument --head-dim", "positive integer", "'-32'")),
    (["layouts", "--head-dim", "0"], "layouts", ("argument --head-dim", "positive integer", "'0'")),
    (["layouts", "--head-dim", "12"], "layouts", ("argument --head-dim", "multiple of 32", "12")),
    (["bench", "--batches", "1,x"], "bench", ("argument --batches", "positive integers", "'1,x'")),
    (["bench", "--plot", "missing.json"], "bench", ("argument --plot", "missing.json")),
    (["frobnicate"], "", ("argument COMMAND", "'frobnicate'")),
    # sizes past int32, and pages no tensor can have: one line (they were tracebacks)
    (["layouts", "--head-dim", "144115188075855872"], "layouts", ("argument --head-dim", "below 2^31")),
    (["explain", "--head-dim", "9" * 20], "explain", ("argument --head-dim", "below 2^31")),
    (["explain", "--heads", f"{'9' * 20}/{'9' * 20}"], "explain", ("argument --heads", "below 2^31")),
    (["explain", "--head-dim", "1099511627", "--page-size", "1099511627"], "explain",
     ("--heads / --page-size / --head-dim", "a size a tensor can have")),
    # msa bench's names and numbers are checked before anything is measured (even on a CPU)
    (["bench", "--strategies", "bogus,per-tokn"], "bench", ("--strategies", "auto, dedup, per-token", "bogus, per-tokn")),
    (["bench", "--integrations", "bogus"], "bench", ("--integrations", "sglang-dropin", "bogus")),
    (["bench", "--layouts", "fp4"], "bench", ("--layouts", "nvfp4", "fp4")),
    (["bench", "--baselines", "numpy"], "bench", ("--baselines", "torch, flex", "numpy")),
    (["bench", "--kv-forms", "paged"], "bench", ("--kv-forms", "packed", "paged")),
    (["bench", "--overlap", "2,-1"], "bench", ("--overlap", "[0, 1]")),
    (["bench", "--overlap", "inf"], "bench", ("--overlap", "[0, 1]")),
    (["bench", "--overlap", ""], "bench", ("--overlap", "[0, 1]", "got nothing")),
    (["bench", "--tp", "1,3"], "bench", ("--tp", "1, 2, 4, 8", "got 3")),
    (["bench", "--backends", "triton,tritn"], "bench", ("--backends", "auto, ", "reference", "got tritn")),
    # --eager times msa's entry points with backend "auto": the graph sweep's flags are refused
    (["bench", "--eager", "--backends", "cute,triton"], "bench", ("--backends", "with --eager", "got cute,triton")),
    (["bench", "--eager", "--baseline-max-batch", "8"], "bench", ("--baseline-max-batch", "with --eager", "got 8")),
    (["bench", "--eager", "--strategies", "dedup"], "bench", ("--strategies", "with --eager", "dedup")),
    (["bench", "--eager", "--same-tokens"], "bench", ("--same-tokens", "with --eager", "True")),
    (["bench", "--eager", "--baselines", "flex"], "bench", ("--baselines", "with --eager", "got flex")),
    # ... and takes what it does: backend "auto", no baselines (then it needs a GPU)
    (["bench", "--eager", "--backends", "auto", "--baselines", ""], "bench", ("needs a CUDA GPU",)),
]


def check_one_line(err: str, command: str, fragments: tuple[str, ...]) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert LINE.match(lines[0]), err
    assert lines[0].startswith(f"msa {command}: error: " if command else "msa: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)


@pytest.mark.parametrize("argv, command, fragments", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_flag_is_one_line_and_exit_2(
    argv: list[str], command: str, fragments: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "usage:" not in out + err
    assert out == "", "nothing is printed before the error"
    check_one_line(err, command, fragments)


def test_plot_of_a_file_that_is_not_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bench.json"
    path.write_text("this is not json")
    assert main(["bench", "--plot", str(path)]) == 2
    check_one_line(capsys.readouterr().err, "bench", ("argument --plot", "not JSON", str(path)))


def test_bench_out_that_cannot_hold_the_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--out` a file, or holding a directory where bench.json goes: one line, exit 2, before
    anything is measured (a traceback after the whole sweep before)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "out" / "bench.json").mkdir(parents=True)
    for argv, fragments in ((["--out", str(afile)], ("--out", "a file")),
                            (["--out", str(afile / "sub")], ("--out", "is a file")),
                            (["--out", str(tmp_path / "out")], ("--out", "a directory"))):
        assert main(["bench", *argv]) == 2
        check_one_line(capsys.readouterr().err, "bench", fragments)


def test_plot_files_that_cannot_be_read_or_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--plot` of JSON nested past Python's recursion limit; without matplotlib, a clear refusal
    (it exited 0 drawing nothing); with it, a file named .png (its plot would replace it) or a
    plot path that is a directory: one line, exit 2 (a traceback, or a silently replaced input)."""
    import importlib.util

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    assert main(["bench", "--plot", str(deep)]) == 2
    check_one_line(capsys.readouterr().err, "bench", ("argument --plot", str(deep)))
    good = {"rows": [], "copy_gbps": 1.0, "device": "x", "date": "d"}
    png = tmp_path / "data.png"
    png.write_text(json.dumps(good))
    assert main(["bench", "--plot", str(png)]) == 2
    check_one_line(capsys.readouterr().err, "bench", ("--plot", "the plot would replace it"))
    assert json.loads(png.read_text()) == good
    (tmp_path / "taken.json").write_text(json.dumps(good))
    if importlib.util.find_spec("matplotlib") is None:
        assert main(["bench", "--plot", str(tmp_path / "taken.json")]) == 2
        check_one_line(capsys.readouterr().err, "bench", ("--plot", "matplotlib installed"))
        return
    (tmp_path / "taken.png").mkdir()
    assert main(["bench", "--plot", str(tmp_path / "taken.json")]) == 2
    check_one_line(capsys.readouterr().err, "bench", ("--plot", "can be written"))


def test_an_unknown_msa_backend_is_named_as_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MSA_BACKEND", "bogus")
    assert main(["explain", "--cpu"]) == 2
    check_one_line(capsys.readouterr().err, "explain", ("MSA_BACKEND", "'bogus'"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_demo_on_cuda_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--device", "cuda"]) == 2
    check_one_line(capsys.readouterr().err, "demo", ("argument --device", "no CUDA device", "'cuda'"))


@pytest.mark.parametrize("argv", [["--help"], ["explain", "--help"], ["backends", "--help"], ["layouts", "-h"]])
def test_help_still_works(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    assert "usage: msa" in capsys.readouterr().out


def test_through_a_subprocess() -> None:
    """The console entry point: stderr holds exactly one line, the exit code is 2."""
    for argv, fragment in ((["explain", "--heads", "abc"], "argument --heads"),
                           (["layouts", "--head-dim", "12"], "multiple of 32")):
        result = subprocess.run([sys.executable, "-m", "msa", *argv], capture_output=True, text=True)
        assert result.returncode == 2, result
        check_one_line(result.stderr, argv[0], (fragment,))
    ok = subprocess.run([sys.executable, "-m", "msa", "explain", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "--heads" in ok.stdout and not ok.stderr
