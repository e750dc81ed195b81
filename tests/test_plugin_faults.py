"""One faulty plugin must not disable msa: every fault through a REAL entry point.

Each case installs plugin modules and `*.dist-info` entry points into a temporary directory on
`sys.path`, builds the process-wide registry from the environment, and checks the contract:
the fault is logged and shown by `msa backends` (exit 0, no traceback); `backend="reference"`
and `backend="auto"` still run; requesting the broken backend by name (`backend=` or
`MSA_BACKEND`) raises `MSAPluginError` naming the plugin's source and chaining its error. The
faults include malformed records (`aliases="fastk"`, `priority="high"`), checks that return
`None`, and `sys.exit()` at import, in the hook or in the factory; a `KeyboardInterrupt` is the
one thing a plugin raises that passes through.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch
from plugin_site import install_plugins

import msa
from msa.cli import main
from msa.errors import MSAPluginError
from msa.registry import BUILTIN_SOURCE, BackendRegistry, get_registry, reset_registry
from msa.workload import DecodeStep, make_decode_step

HEADER = '''
import msa.registry
from msa.backends.reference import ReferenceBackend

def plugged(name):
    """The reference under another name (so `auto` may pick it and still match the reference)."""
    return type(name, (ReferenceBackend,), {"name": name})
'''


def offers(*records: str) -> str:
    """A plugin module whose hook returns the given `BackendRecord(...)` argument lists."""
    body = ", ".join(f"msa.registry.BackendRecord({r})" for r in records)
    return HEADER + f"\n@msa.registry.hookimpl\ndef msa_backends():\n    return [{body}]\n"


PLUGINS = {
    "raisefactory": HEADER + textwrap.dedent('''
        CALLS = []
        def factory():
            CALLS.append(1)
            raise OSError("libraisefactory.so: cannot open shared object file")
        @msa.registry.hookimpl
        def msa_backends():
            return [msa.registry.BackendRecord(name="raisefactory", factory=factory, priority=50)]
    '''),
    "junkfactory": offers('name="junkfactory", factory=lambda: object(), priority=50'),
    "misnamed": offers('name="misnamed", factory=plugged("reference"), priority=50'),
    "judgeraises": HEADER + textwrap.dedent('''
        class Judge(plugged("judgeraises")):
            def not_supported_reasons(self, problem, platform, *, requested=False, rules=()):
                raise RuntimeError("capability table corrupt")
        @msa.registry.hookimpl
        def msa_backends():
            return [msa.registry.BackendRecord(name="judgeraises", factory=Judge, priority=50)]
    '''),
    "clashbuiltin": offers('name="reference", factory=plugged("reference"), priority=50'),
    "clashalias": offers('name="clashalias", factory=plugged("clashalias"), aliases=("cutlass",), priority=-1'),
    "autoplug": offers('name="mine", factory=plugged("mine"), aliases=("auto",)'),
    "clasha": offers('name="shared", factory=plugged("shared"), priority=-1'),
    "clashb": offers('name="shared", factory=plugged("shared"), priority=-2', 'name="bonly", factory=plugged("bonly")'),
    # malformed records: each must fail its plugin, never the registry
    "stralias": offers('name="fastkernel", factory=plugged("fastkernel"), aliases="fastk", priority=50'),
    "wordpriority": offers('name="wordpriority", factory=plugged("wordpriority"), priority="high"'),
    "nonereasons": HEADER + textwrap.dedent('''
        class Judge(plugged("nonereasons")):
            def not_supported_reasons(self, problem, platform, *, requested=False):
                return None
        @msa.registry.hookimpl
        def msa_backends():
            return [msa.registry.BackendRecord(name="nonereasons", factory=Judge, priority=50)]
    '''),
    "badstrategy": HEADER + textwrap.dedent('''
        class Raises(plugged("raisestrategy")):
            def strategy(self, problem, platform):
                raise RuntimeError("strategy table corrupt")
        class Dict(plugged("dictstrategy")):
            def strategy(self, problem, platform):
                return {"not": "a str"}
        @msa.registry.hookimpl
        def msa_backends():
            return [msa.registry.BackendRecord(name="raisestrategy", factory=Raises, priority=500),
                    msa.registry.BackendRecord(name="dictstrategy", factory=Dict, priority=499)]
    '''),
    "planrun": HEADER + textwrap.dedent('''
        class PlanRaises(plugged("planraises")):
            def plan(self, problem, tables):
                raise RuntimeError("plan exploded")
        class RunRaises(plugged("runraises")):
            def run(self, plan, inputs, out, lse):
                raise RuntimeError("run exploded")
        @msa.registry.hookimpl
        def msa_backends():
            return [msa.registry.BackendRecord(name="planraises", factory=PlanRaises, priority=500),
                    msa.registry.BackendRecord(name="runraises", factory=RunRaises, priority=499)]
    '''),
    "exitimport": "import sys\nsys.exit()\n",
    "exitfactory": HEADER + textwrap.dedent('''
        import sys
        def factory():
            sys.exit(3)
        @msa.registry.hookimpl
        def msa_backends():
            return [msa.registry.BackendRecord(name="exitfactory", factory=factory, priority=50)]
    '''),
    "exithook": HEADER + textwrap.dedent('''
        @msa.registry.hookimpl
        def msa_backends():
            raise SystemExit("plugin gave up")
    '''),
    "interruptimport": "raise KeyboardInterrupt\n",
}


@attrs.frozen
class Fault:
    """One fault: the plugins to install, the environment, the name to request, the error."""

    plugins: tuple[str, ...]
    broken: str
    error: str
    cause: type[BaseException]
    env: tuple[tuple[str, str], ...] = ()


FAULTS = {
    "factory raises": Fault(
        ("raisefactory",), "raisefactory",
        r"backend 'raisefactory' \(raisefactory 1.0 \(entry point raisefactory = raisefactory\)\) failed to "
        r"load: its factory raised OSError: libraisefactory.so: cannot open",
        OSError,
    ),
    "factory returns junk": Fault(
        ("junkfactory",), "junkfactory",
        r"backend 'junkfactory' \(junkfactory 1.0 .*\) failed to load: its factory returned object, "
        r"not an msa Backend",
        TypeError,
    ),
    "factory returns a backend of another name": Fault(
        ("misnamed",), "misnamed",
        r"backend 'misnamed' \(misnamed 1.0 .*\) failed to load: its factory returned a backend named "
        r"'reference', not 'misnamed'",
        TypeError,
    ),
    "not_supported_reasons raises": Fault(
        ("judgeraises",), "judgeraises",
        r"backend 'judgeraises' \(judgeraises 1.0 .*\) failed: its not_supported_reasons raised "
        r"RuntimeError: capability table corrupt",
        RuntimeError,
    ),
    "name clash with a built-in": Fault(
        ("clashbuiltin",), "clashbuiltin",
        r"backend 'clashbuiltin' was requested but its plugin \(clashbuiltin 1.0 .*\) failed to load: two msa "
        r"backends are named 'reference': one from msa \(built-in\), one from clashbuiltin 1.0",
        MSAPluginError,
    ),
    "alias clash": Fault(
        ("clashalias",), "clashalias",
        r"two msa backends are named 'cutlass': one from msa \(built-in\), one from clashalias 1.0",
        MSAPluginError,
    ),
    "clash between two plugins": Fault(
        ("clashb", "clasha"), "clashb",
        r"two msa backends are named 'shared': one from clasha 1.0 \(entry point clasha = clasha\), "
        r"one from clashb 1.0 \(entry point clashb = clashb\)",
        MSAPluginError,
    ),
    "MSA_PLUGINS names a missing plugin": Fault(
        (), "ghostplug",
        r"backend 'ghostplug' was requested but its plugin \(not installed\) failed to load: "
        r"no installed distribution has an entry point 'ghostplug' in the group 'msa.backends'",
        LookupError,
        env=(("MSA_PLUGINS", "ghostplug"),),
    ),
    "aliases is a str": Fault(
        ("stralias",), "stralias",
        r"backend 'stralias' was requested but its plugin \(stralias 1.0 .*\) failed to load: its msa_backends "
        r"hook returned an invalid BackendRecord 'fastkernel': aliases: expected a tuple of non-empty str, "
        r"got 'fastk' \(a str\)$",
        MSAPluginError,
    ),
    "priority is a word": Fault(
        ("wordpriority",), "wordpriority",
        r"its plugin \(wordpriority 1.0 .*\) failed to load: its msa_backends hook returned an invalid "
        r"BackendRecord 'wordpriority': priority: expected an int \(not a bool\), got 'high' \(a str\)$",
        MSAPluginError,
    ),
    "not_supported_reasons returns None": Fault(
        ("nonereasons",), "nonereasons",
        r"backend 'nonereasons' \(nonereasons 1.0 .*\) failed: its not_supported_reasons returned None, "
        r"expected a list of str$",
        TypeError,
    ),
    "sys.exit() at import": Fault(
        ("exitimport",), "exitimport",
        r"backend 'exitimport' was requested but its plugin \(exitimport 1.0 .*\) failed to load: "
        r"SystemExit \(sys.exit\(None\)\)$",
        SystemExit,
    ),
    "sys.exit() in the factory": Fault(
        ("exitfactory",), "exitfactory",
        r"backend 'exitfactory' \(exitfactory 1.0 .*\) failed to load: its factory raised SystemExit "
        r"\(sys.exit\(3\)\)$",
        SystemExit,
    ),
    "the hook raises SystemExit": Fault(
        ("exithook",), "exithook",
        r"its plugin \(exithook 1.0 .*\) failed to load: its msa_backends hook raised SystemExit "
        r"\(sys.exit\('plugin gave up'\)\)$",
        SystemExit,
    ),
}

#: Registries built by these tests, kept alive: `msa.api` keys its one-shot planners by
#: `id(get_registry())`, and a collected registry's id may be reused by the next one.
_ALIVE: list[object] = []


def install(site: Path, names: tuple[str, ...]) -> None:
    """Install the plugins `names` of this file into `site`."""
    install_plugins(site, names, PLUGINS)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("MSA_PLUGINS", "MSA_DISABLE_PLUGINS", "MSA_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    importlib.invalidate_caches()
    _ALIVE.append(reset_registry(None))
    yield tmp_path
    for name in PLUGINS:
        sys.modules.pop(name, None)
    _ALIVE.append(reset_registry(None))


@pytest.fixture(scope="module")
def step() -> DecodeStep:
    return make_decode_step(msa.Geometry(8, 2, 64, 16, 4), batch_size=2, context_len=100, seed=2)


def run(step: DecodeStep, backend: str) -> torch.Tensor:
    out = msa.sparse_decode(**step.kwargs(), backend=backend)
    assert isinstance(out, torch.Tensor)
    return out


@pytest.mark.parametrize("case", list(FAULTS))
def test_a_faulty_plugin_leaves_msa_working(
    case: str,
    site: Path,
    step: DecodeStep,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fault = FAULTS[case]
    install(site, fault.plugins)
    for key, value in fault.env:
        monkeypatch.setenv(key, value)
    with caplog.at_level(logging.WARNING, logger="msa"):
        registry = get_registry()  # never raises: failures are recorded
        reference = run(step, "reference")
        if "MSA_PLUGINS" not in dict(fault.env):
            assert torch.equal(run(step, "auto"), reference), "auto skips the broken plugin"
        available = [b.name for b in msa.available_backends()]
        assert "reference" in available and fault.broken not in available, "a plugin's fault marks it broken"
    assert fault.broken in caplog.text, "the failure is logged on the 'msa' logger"
    assert registry.get("reference").name == "reference", "the built-in keeps its name"

    with pytest.raises(MSAPluginError, match=fault.error) as info:
        run(step, fault.broken)
    assert isinstance(info.value.__cause__, fault.cause)
    monkeypatch.setenv("MSA_BACKEND", fault.broken)
    with pytest.raises(MSAPluginError, match=fault.error):
        run(step, "auto")
    monkeypatch.delenv("MSA_BACKEND")

    capsys.readouterr()
    assert main(["backends"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    row = next((line for line in out.splitlines() if line.startswith(fault.broken + " ")), "")
    assert re.search(r"\bbroken\b", row) and "fail" in row, out


def test_the_first_plugin_keeps_a_clashing_name(site: Path) -> None:
    install(site, ("clashb", "clasha"))
    registry = BackendRegistry(environ={})
    assert registry.record("shared").source.startswith("clasha 1.0"), "entry points load in name order"
    assert "clasha" not in registry.failures and "clashb" in registry.failures
    assert "bonly" not in registry.names(), "a clashing plugin is refused whole"
    with pytest.raises(MSAPluginError, match="its plugin \\(clashb 1.0"):
        registry.resolve("bonly")


def test_clash_with_a_builtin_keeps_the_builtin(site: Path) -> None:
    install(site, ("clashbuiltin", "clashalias"))
    registry = BackendRegistry(environ={})
    assert registry.record("reference").source == BUILTIN_SOURCE
    assert registry.resolve("cutlass") == "cutlass_sm100"
    assert set(registry.failures) == {"clashbuiltin", "clashalias"}


def test_a_broken_factory_runs_once(site: Path) -> None:
    install(site, ("raisefactory",))
    registry = BackendRegistry(environ={})
    for _ in range(3):
        with pytest.raises(MSAPluginError, match="its factory raised OSError"):
            registry.get("raisefactory")
    assert [b.name for b in registry.backends()] == ["cutlass_sm100", "flashinfer", "cute", "triton", "reference"]
    assert len(sys.modules["raisefactory"].CALLS) == 1, "the failure is recorded, the factory not re-run"
    assert registry.broken["raisefactory"].error.startswith("its factory raised OSError")


def test_a_required_plugin_that_fails_blocks_auto_only(site: Path, step: DecodeStep, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Named in MSA_PLUGINS: `auto` refuses to run without it (no silent fallback); a backend
    requested by name still runs, and `msa backends` shows the failure."""
    install(site, ("raisefactory",))
    monkeypatch.setenv("MSA_PLUGINS", "raisefactory")
    assert torch.equal(run(step, "reference"), run(step, "reference"))
    with pytest.raises(MSAPluginError, match="msa plugin 'raisefactory' .* is named in MSA_PLUGINS but failed") as info:
        run(step, "auto")
    assert isinstance(info.value.__cause__, OSError)
    assert get_registry().broken["raisefactory"].required
    assert main(["backends"]) == 0
    assert "named in MSA_PLUGINS" in capsys.readouterr().out


def test_missing_plugin_in_msa_plugins_blocks_auto(site: Path, step: DecodeStep, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSA_PLUGINS", "ghostplug")
    with pytest.raises(MSAPluginError, match="msa plugin 'ghostplug' \\(not installed\\) is named in MSA_PLUGINS but failed to load: no installed"):
        run(step, "auto")
    failure = get_registry().failures["ghostplug"]
    assert failure.required and isinstance(failure.exception, LookupError)


def test_auto_is_not_a_backend_name(site: Path) -> None:
    install(site, ("autoplug",))
    registry = BackendRegistry(environ={})
    assert "two msa backends are named 'auto'" in registry.failures["autoplug"].error
    assert "mine" not in registry.names()


def test_a_keyboard_interrupt_at_import_propagates(site: Path) -> None:
    """Only a plugin's faults are contained: Ctrl-C while a plugin imports still stops the
    process (a naive `except BaseException` would swallow it)."""
    install(site, ("interruptimport", "raisefactory"))
    with pytest.raises(KeyboardInterrupt):
        BackendRegistry(environ={})
    with pytest.raises(KeyboardInterrupt):
        get_registry()
    assert "interruptimport" not in sys.modules


def test_names_declared_by_a_malformed_record_name_its_plugin(site: Path) -> None:
    """`aliases="fastk"` is one bad alias, not four: the plugin fails, and each name it
    declared raises `MSAPluginError` naming the plugin, not "unknown backend"."""
    install(site, ("stralias",))
    registry = BackendRegistry(environ={})
    assert "fastkernel" not in registry.names() and "stralias" in registry.failures
    for name in ("stralias", "fastkernel", "fastk"):
        with pytest.raises(MSAPluginError, match=r"its plugin \(stralias 1.0 .*aliases: expected a tuple"):
            registry.resolve(name)
    for letter in "fastk":
        with pytest.raises(msa.MSAInputError, match="backend: expected 'auto' or one of"):
            registry.resolve(letter)


def test_msa_explain_lists_a_broken_plugin(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    install(site, ("exitimport", "exitfactory", "nonereasons"))
    capsys.readouterr()
    assert main(["explain", "--cpu", "--head-dim", "64", "--heads", "8/2", "--topk", "4"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert re.search(r"exitimport +broken +failed to load: SystemExit \(sys.exit\(None\)\)", out), out
    assert re.search(r"exitfactory +broken +failed to load: its factory raised SystemExit", out), out
    assert re.search(r"nonereasons +broken +failed: its not_supported_reasons returned None", out), out
    assert main(["explain", "--cpu", "--backend", "exitimport"]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and len(err.splitlines()) == 1
    assert "msa explain: error: backend 'exitimport' was requested but its plugin (exitimport 1.0" in err


def test_msa_explain_reports_a_plugins_faulty_strategy(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`Backend.strategy` is plugin code too: a fault, or a value that is not a str, is said on its
    line (exit 0), never a traceback (it was one) or the value printed as a strategy."""
    install(site, ("badstrategy",))
    capsys.readouterr()
    assert main(["explain", "--cpu", "--head-dim", "64", "--heads", "8/2", "--topk", "4"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "runs on 'raisestrategy'" in out
    assert "raisestrategy: strategy() failed: RuntimeError: strategy table corrupt" in out
    assert main(["explain", "--cpu", "--head-dim", "64", "--heads", "8/2", "--topk", "4", "--backend", "dictstrategy"]) == 0
    out, err = capsys.readouterr()
    assert "dictstrategy: strategy() returned" in out and "not a str" in out and "runs it with" not in out


def test_the_documented_exact_cute_backend_loads_as_a_plugin(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/integrations.md's recipe for `CuteBackend(kreg=True)` under its own name, as written
    there, loads through a real entry point (its first form, the factory returning a plain
    `CuteBackend`, was refused: "its factory returned a backend named 'cute'")."""
    pytest.importorskip("cutlass")
    text = (Path(__file__).parents[1] / "docs" / "integrations.md").read_text()
    recipe = re.search(r"registers a `CuteBackend` under its own name.*?```python\n(.*?)```", text, re.S)
    assert recipe is not None, "the recipe moved: update this test"
    source = "import msa.registry\nfrom msa.backends.cute import CuteBackend\n" + textwrap.dedent(recipe[1])
    install_plugins(site, ("cuteexact",), {"cuteexact": source})
    registry = get_registry()
    assert not registry.broken, registry.broken
    backend = registry.get("cute_exact")
    assert type(backend).__name__ == "ExactCute" and backend.kreg is True
    capsys.readouterr()
    assert main(["explain", "--capability", "9.0", "--sm-count", "132", "--packages", "cutlass_dsl,triton",
                 "--batch", "128", "--backend", "cute_exact"]) == 0
    out, _ = capsys.readouterr()
    assert "runs on 'cute_exact'" in out, out
    # `auto` takes it where `cute` would run (its priority is above the built-in's), and leaves
    # a step its options do not fit to the next backend
    hopper = ["--capability", "9.0", "--sm-count", "132", "--packages", "cutlass_dsl,triton", "--batch", "128"]
    assert main(["explain", *hopper]) == 0
    assert "runs on 'cute_exact'" in capsys.readouterr().out
    registry.get("cute_exact").kreg = False  # (an NVFP4 step decodes its keys in registers: refused)
    assert main(["explain", *hopper, "--kv-dtype", "nvfp4"]) == 0
    out, _ = capsys.readouterr()
    assert "runs on 'cute'" in out and "kreg: expected True (or None) for nvfp4" in out, out
    sys.modules.pop("cuteexact", None)


def test_a_fault_in_a_chosen_plugins_plan_or_run_reaches_the_caller(site: Path, step: DecodeStep) -> None:
    """README: a fault in the chosen backend's own plan or run is the step's error, raised as is;
    the backend is not marked broken, and other backends still run the step by name."""
    install(site, ("planrun",))
    ref = msa.sparse_decode(**step.kwargs(), backend="reference")
    for name, message in (("auto", "plan exploded"), ("planraises", "plan exploded"), ("runraises", "run exploded")):
        with pytest.raises(RuntimeError, match=message):
            msa.sparse_decode(**step.kwargs(), backend=name)
        assert torch.equal(msa.sparse_decode(**step.kwargs(), backend="reference"), ref)
    assert not get_registry().broken
    with pytest.raises(RuntimeError, match="plan exploded"):
        msa.sparse_decode(**step.kwargs())
