"""The `msa` command."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from plugin_site import install_plugins

import msa
from msa.cli import main
from msa.registry import reset_registry


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

    import msa.api
    from msa.errors import MSAUnsupportedError

    args = ["demo", "--layout", "bfloat16", "--batch", "1", "--context", "300", "--seed", "1"]
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert main(args) == 0
        assert "triton (interpreter" in capsys.readouterr().out

    real = msa.api.select_backend  # the demo imports it when it runs

    def no_triton(problem: object, name: str = "auto") -> object:
        if name == "triton":
            raise MSAUnsupportedError("backend 'triton' cannot run this step: pretend")
        return real(problem, name)  # type: ignore[arg-type]

    monkeypatch.setattr(msa.api, "select_backend", no_triton)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "nothing (Triton cannot run here)" in out and "OK: outputs within" in out


@pytest.mark.parametrize("argv, message", [
    (["--backend", "nope"], "backend: expected 'auto' or one of"),
    (["--backend", "cutlass_sm100", "--device", "cpu"], "backend 'cutlass_sm100' cannot run this step"),
])
def test_demo_checks_its_arguments_before_printing(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A backend the demo cannot use is one error line and exit 2, with no header and no
    progress line before it."""
    assert main(["demo", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "", out
    assert len(err.splitlines()) == 1 and err.startswith("msa demo: error: ") and message in err, err


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


def test_backends_shows_each_backends_version(capsys: pytest.CaptureFixture[str]) -> None:
    """The version column: msa's for a built-in that needs no package, the declared package's
    (triton, nvidia-cutlass-dsl) for those that run on one, "-" only where nothing is installed."""
    assert main(["backends", "--cpu"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert rows["reference"][3] == f"msa {msa.__version__}"
    assert rows["triton"][3] == f"triton {importlib.metadata.version('triton')}"
    try:
        dsl = f"nvidia-cutlass-dsl {importlib.metadata.version('nvidia-cutlass-dsl')}"
    except importlib.metadata.PackageNotFoundError:
        dsl = "-"
    assert rows["cute"][3] == dsl


#: Plugins for the version column: one declaring a library version, one needing triton, one plain.
VERSION_PLUGINS = {
    name: textwrap.dedent(f'''
        import msa.registry
        from msa.backends.base import Backend
        from msa.backends.capabilities import Capabilities

        class Mine(Backend):
            name = "{name}"
            capabilities = Capabilities(device_types=frozenset({{"cpu"}}), packages={packages!r})
            def version(self):
                return {version!r}
            def plan(self, problem, inputs):
                return problem
            def run(self, plan, inputs, out, lse):
                raise NotImplementedError

        @msa.registry.hookimpl
        def msa_backends():
            return [msa.registry.BackendRecord(name="{name}", factory=Mine, priority=1)]
    ''')
    for name, packages, version in (
        ("verlibplug", (), "mylib 2.3"), ("vertritonplug", ("triton",), ""), ("verplainplug", (), ""),
    )
}


@pytest.fixture
def version_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    install_plugins(tmp_path, VERSION_PLUGINS, VERSION_PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MSA_PLUGINS", raising=False)
    monkeypatch.delenv("MSA_DISABLE_PLUGINS", raising=False)
    importlib.invalidate_caches()
    reset_registry(None)
    yield tmp_path
    for name in VERSION_PLUGINS:
        sys.modules.pop(name, None)
    reset_registry(None)


def test_backends_shows_a_plugins_version(version_plugins: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plugin's backend: the library it names, else its declared packages', else the version of
    the distribution that installed the plugin."""
    assert main(["backends", "--cpu"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert rows["verlibplug"][3] == "mylib 2.3"
    assert rows["vertritonplug"][3] == f"triton {importlib.metadata.version('triton')}"
    assert rows["verplainplug"][3] == "verplainplug 1.0"


def test_readme_lists_every_demo_flag() -> None:
    """The README's "Flags:" paragraph for `msa demo` names exactly the demo's options."""
    import argparse

    from msa.cli import build_parser

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    paragraph = readme.split("\nFlags: ", 1)[1].split("\n\n", 1)[0]
    listed = set(re.findall(r"`(--[a-z-]+)", paragraph))
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = {a.option_strings[-1] for a in sub.choices["demo"]._actions if a.option_strings} - {"--help"}
    assert listed == options, (sorted(options - listed), sorted(listed - options))


def test_explain_says_how_triton_runs_a_step_and_why_not_dedup(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`--dcp-size`: a rank holding a share of each selection gets the per-token kernel where the
    whole selection would get the dedup one, and explain says so."""
    monkeypatch.delenv("MSA_BACKEND", raising=False)
    monkeypatch.delenv("MSA_TRITON_DEDUP", raising=False)
    step = ["explain", "--capability", "9.0", "--sm-count", "132", "--kv-dtype", "fp8", "--batch", "64", "--query-len", "4",
            "--backend", "triton"]
    assert main(step) == 0
    assert "triton runs it with the dedup kernel (4 tokens of a request per program" in capsys.readouterr().out
    assert main([*step, "--dcp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "DCP over 2 ranks" in out
    assert "triton runs it with the per-token kernel (not dedup: a rank of 2 holds a share of each selection)" in out


def test_explain_takes_a_strided_view_of_an_nvfp4_cache(capsys: pytest.CaptureFixture[str]) -> None:
    """NVFP4 keeps K and V in one tensor: `--kv-form separate` is refused, but a strided view of
    that tensor (form "strided", which the API runs) is explained."""
    assert main(["explain", "--cpu", "--kv-dtype", "nvfp4", "--kv-form", "strided"]) == 0
    out = capsys.readouterr().out
    assert "K/V strided" in out and "runs on 'reference'" in out


def test_a_table_keeps_each_row_on_one_line() -> None:
    """format_table: a cell holding line breaks (a plugin's name, version or reasons) stays on its
    row (it split the row in `msa backends` / `msa explain`); numbers right-aligned, text left."""
    from msa.display import format_table

    table = format_table(["name", "us"], [["evil\nplugin", 1.5], ["ok\r\u2028", 12.25]])
    lines = table.splitlines()
    assert len(lines) == 4, table  # header, rule, two rows
    assert lines[2].startswith("evil plugin") and lines[2].endswith(" 1.500") and lines[3].endswith("12.250")


def test_explain_shows_the_machine_code_of_the_triton_kernels() -> None:
    """`msa explain --machine-code` compiles the step's Triton kernels for the pretend GPU (no
    GPU here) and tabulates them: here M3 TP1's fp8 per-token kernel for sm_90 (B = 64, one
    pass), its tensor-core loop over tiles and few bytes of stack. Run as a child: the compiler needs
    `TRITON_INTERPRET` unset."""
    import triton
    from test_sass import compiler_env

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file():
        pytest.skip("this Triton bundles no ptxas")
    argv = ["explain", "--capability", "9.0", "--sm-count", "132", "--packages", "triton", "--machine-code"]
    done = subprocess.run([sys.executable, "-m", "msa", *argv], env=compiler_env(), capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compiling the Triton kernels for sm_90" in done.stderr
    rows = table_rows(done.stdout)
    assert "split_decode_kernel" in rows, done.stdout
    kernel = rows["split_decode_kernel"]  # name, grid, tile, warps, stages, splits, registers, stack, shared, loop, mix
    assert kernel[1] == "256x1x1", kernel  # (a program per request and KV head, one split)
    assert 0 < int(kernel[6]) <= 255 and 0 <= int(kernel[7]) <= 256 and int(kernel[8]) > 0 and int(kernel[9]) > 100
    assert "MMA" in " ".join(kernel[10:]), kernel


_HOPPER_TRITON = ["--capability", "9.0", "--packages", "triton"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--cpu"], "--machine-code: expected a CUDA platform"),  # no GPU to compile for
    (_HOPPER_TRITON, "TRITON_INTERPRET: expected unset"),
    ([*_HOPPER_TRITON, "--kv-form", "separate"], "--machine-code: expected a packed cache"),
    ([*_HOPPER_TRITON, "--dcp-size", "2"], "--machine-code: expected a step on one rank"),
    ([*_HOPPER_TRITON, "--batch", "513"], "--batch: expected 1..512 requests"),
])
def test_explain_machine_code_refuses_in_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (the JIT's functions are then not compilable)
    assert main(["explain", "--machine-code", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_explain_machine_code_says_which_backend_runs_the_step(capsys: pytest.CaptureFixture[str]) -> None:
    """On Hopper with the CuTe DSL, the wgmma kernel runs M3's fp8 step: no Triton table, and the line says so."""
    assert main(["explain", "--capability", "9.0", "--sm-count", "132", "--packages", "cutlass_dsl,triton",
                 "--machine-code"]) == 0
    out = capsys.readouterr().out
    assert "machine code: shown for the Triton backend's kernels; cute runs this step" in out
    assert "loop instr" not in out


def test_explain_machine_code_reports_a_compiler_failure_in_one_line(capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """ptxas, cuobjdump or Triton failing is one line naming the flag, exit 2, no traceback."""
    from msa.bench import machine_code

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("PTXASError: ptxas fatal : unknown target\nmore lines")

    monkeypatch.setattr(machine_code, "check_compiler", lambda: None)
    monkeypatch.setattr(machine_code, "compile_step", broken)
    assert main(["explain", "--machine-code", *_HOPPER_TRITON]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("msa explain: error: --machine-code: expected kernels Triton compiles for sm_90 here, got "
                       "RuntimeError: PTXASError: ptxas fatal : unknown target"), err
    assert not any("Traceback" in line for line in err)


def test_explain_takes_the_pretend_device_name_whose_rules_differ(capsys: pytest.CaptureFixture[str]) -> None:
    """`--device-name` names the pretend device: M3 fp8 at B = 40 (160 programs on 132 SMs) takes
    two splits on an H200 and one elsewhere, and the platform line shows the name."""
    step = ["explain", "--capability", "9.0", "--sm-count", "132", "--packages", "cutlass_dsl,triton", "--batch", "40"]
    assert main([*step, "--device-name", "NVIDIA H200"]) == 0
    h200 = capsys.readouterr().out
    assert "platform: NVIDIA H200 (sm_90, 132 SMs)" in h200 and "wgmma kernel" in h200 and "2 splits" in h200
    assert main(step) == 0
    other = capsys.readouterr().out
    assert "pretend CUDA device" in other and "1 split," in other


def test_explain_refuses_a_device_name_without_a_pretend_capability(capsys: pytest.CaptureFixture[str]) -> None:
    """A name is for a pretend device only: without `--capability` it is one line naming the flag, exit 2."""
    assert main(["explain", "--device-name", "NVIDIA H200"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--device-name" in err and "--capability" in err and len(err.splitlines()) == 1, err
