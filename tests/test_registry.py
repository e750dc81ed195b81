"""The backend registry: built-ins through the hook, third parties through real entry points."""

from __future__ import annotations

import importlib
import logging
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from plugin_site import install_plugins

import msa
from msa.errors import MSAInputError, MSAPluginError
from msa.registry import BUILTIN_SOURCE, BackendRegistry, MSAHookSpecs, reset_registry

PLUGIN_MODULES = ("goodplug", "brokenplug", "dupplug", "typoplug", "badfactory")

GOOD = '''
import torch
import msa.registry
from msa.backends.base import Backend
from msa.backends.capabilities import Capabilities
from msa.backends.reference import ReferenceBackend

CALLS = []

class Doubling(Backend):
    """Runs the reference and records the call, so a test can see it was this backend."""
    name = "goodplug"
    capabilities = Capabilities(device_types=frozenset({"cpu"}))
    def plan(self, problem, inputs):
        return problem
    def run(self, plan, inputs, out, lse):
        CALLS.append(plan)
        ReferenceBackend().run(plan, inputs, out, lse)

@msa.registry.hookimpl
def msa_backends():
    return [msa.registry.BackendRecord(name="goodplug", factory=Doubling, priority=50, description="test plugin")]
'''

PLUGINS = {
    "goodplug": GOOD,
    "brokenplug": "import a_module_that_does_not_exist\n",
    "dupplug": textwrap.dedent('''
        import msa.registry
        from msa.backends.reference import ReferenceBackend
        @msa.registry.hookimpl
        def msa_backends():
            return [msa.registry.BackendRecord(name="reference", factory=ReferenceBackend)]
    '''),
    "typoplug": textwrap.dedent('''
        import msa.registry
        @msa.registry.hookimpl
        def msa_backend():
            return []
    '''),
    "badfactory": textwrap.dedent('''
        import msa.registry
        @msa.registry.hookimpl
        def msa_backends():
            return [msa.registry.BackendRecord(name="badfactory", factory=lambda: object())]
    '''),
}


def install(tmp_path: Path, names: tuple[str, ...]) -> None:
    """Install the plugins `names` of this file into `tmp_path`."""
    install_plugins(tmp_path, names, PLUGINS)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    for name in PLUGIN_MODULES:
        sys.modules.pop(name, None)
    reset_registry(None)


def test_hook_msa_backends_registers_the_builtins_through_the_hook() -> None:
    registry = BackendRegistry(environ={"MSA_DISABLE_PLUGINS": "1"})
    assert registry.manager.is_registered(sys.modules["msa.builtin"])
    assert registry.names() == ["cutlass_sm100", "flashinfer", "cute", "triton", "reference"]
    assert all(r.source == BUILTIN_SOURCE for r in registry.records())
    assert registry.resolve("cutlass") == "cutlass_sm100"
    assert registry.get("reference") is registry.get("reference")


def test_hook_msa_backends_from_a_real_entry_point(site: Path) -> None:
    install(site, ("goodplug",))
    registry = BackendRegistry(environ={})
    assert "goodplug" in registry.names()
    record = registry.record("goodplug")
    assert record.source == "goodplug 1.0 (entry point goodplug = goodplug)" and record.priority == 50
    reset_registry(registry)
    from msa.workload import make_decode_step

    step = make_decode_step(msa.Geometry(8, 2, 64, 16, 4), batch_size=2, context_len=100, seed=2)
    out = msa.sparse_decode(**step.kwargs(), backend="goodplug")
    calls = sys.modules["goodplug"].CALLS
    assert len(calls) == 1
    assert torch.equal(out, msa.sparse_decode(**step.kwargs(), backend="reference"))
    msa.sparse_decode(**step.kwargs())  # auto: priority 50 beats the reference on the CPU
    assert len(calls) == 2


def test_broken_plugin_is_reported_and_skipped(site: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    install(site, ("brokenplug", "goodplug"))
    with caplog.at_level(logging.WARNING, logger="msa"):
        registry = BackendRegistry(environ={})
    assert "goodplug" in registry.names() and "brokenplug" not in registry.names()
    failure = registry.failures["brokenplug"]
    assert "ModuleNotFoundError" in failure.error and "a_module_that_does_not_exist" in failure.error
    assert "msa plugin 'brokenplug'" in caplog.text and "skipped" in caplog.text
    with pytest.raises(MSAPluginError, match="backend 'brokenplug' was requested but its plugin .* failed to load: ModuleNotFoundError") as info:
        registry.resolve("brokenplug")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    reset_registry(registry)
    from msa.cli import main

    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"brokenplug .* broken .*ModuleNotFoundError", out)


def test_broken_plugin_named_in_msa_plugins_blocks_auto(site: Path) -> None:
    """Named in MSA_PLUGINS, a broken plugin is required: the registry records it (it no longer
    raises at construction, so `msa backends` can show it) and `backend="auto"` refuses to run
    without it; a backend requested by name still runs."""
    install(site, ("brokenplug",))
    registry = BackendRegistry(environ={"MSA_PLUGINS": "brokenplug"})
    assert registry.failures["brokenplug"].required
    reset_registry(registry)
    from msa.workload import make_decode_step

    step = make_decode_step(msa.Geometry(8, 2, 64, 16, 4), batch_size=2, context_len=100, seed=2)
    with pytest.raises(MSAPluginError, match="msa plugin 'brokenplug' .* is named in MSA_PLUGINS but failed to load: ModuleNotFoundError") as info:
        msa.sparse_decode(**step.kwargs())
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    msa.sparse_decode(**step.kwargs(), backend="reference")


def test_duplicate_names_are_refused_naming_both_sources(site: Path) -> None:
    """The built-in keeps its name; the clashing plugin is recorded as failed (not raised at
    construction) and raises, naming both sources, when requested."""
    install(site, ("dupplug",))
    registry = BackendRegistry(environ={})
    assert registry.record("reference").source == BUILTIN_SOURCE
    message = r"two msa backends are named 'reference': one from msa \(built-in\), one from dupplug 1.0 \(entry point dupplug = dupplug\)"
    assert re.search(message, registry.failures["dupplug"].error)
    with pytest.raises(MSAPluginError, match=message):
        registry.resolve("dupplug")


def test_allowlist_and_disable(site: Path) -> None:
    install(site, ("goodplug", "brokenplug"))
    only_good = BackendRegistry(environ={"MSA_PLUGINS": "goodplug"})
    assert "goodplug" in only_good.names() and not only_good.failures
    assert only_good.not_loaded == ["brokenplug"]
    none = BackendRegistry(environ={"MSA_DISABLE_PLUGINS": "1"})
    assert "goodplug" not in none.names() and sorted(none.not_loaded) == ["brokenplug", "goodplug"]
    with pytest.raises(MSAInputError, match="backend: expected 'auto' or one of"):
        none.resolve("goodplug")


def test_hook_without_a_spec_is_caught_at_load(site: Path) -> None:
    install(site, ("typoplug", "goodplug"))
    registry = BackendRegistry(environ={})
    assert "msa_backend" in registry.failures["typoplug"].error
    assert "goodplug" in registry.names(), "the other plugins still load"
    assert not registry.manager.has_plugin("typoplug")


def test_factory_must_build_a_backend(site: Path) -> None:
    install(site, ("badfactory",))
    registry = BackendRegistry(environ={})
    with pytest.raises(MSAPluginError, match="backend 'badfactory' .* failed to load: its factory returned object, not an msa Backend"):
        registry.get("badfactory")


def test_every_hookspec_has_a_test() -> None:
    """Meta-test: each hook msa specifies needs a test named `test_hook_<hook>_...` somewhere."""
    specs = [n for n in vars(MSAHookSpecs) if n.startswith("msa_")]
    assert specs == BackendRegistry(environ={"MSA_DISABLE_PLUGINS": "1"}).hook_names()
    source = "\n".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    missing = [n for n in specs if not re.search(rf"def test_hook_{n}\w*\(", source)]
    assert not missing, f"hookspecs without a test: {missing}"
