"""What a plugin hands msa is validated, and whatever its code raises is contained.

Unit level: `msa.plugins.records` (a record's fields, a hook's result, a check's reasons) and
`msa.plugins.faults` (`guarded`: everything but `KeyboardInterrupt`). Registry and policy level:
plugins registered in code whose checks misbehave are refused with a one-line reason and marked
broken, never breaking the selection of the other backends. (The same faults through real entry
points, with `msa.sparse_decode` and `msa backends`: tests/test_plugin_faults.py.)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch

import msa
from msa.backends.reference import ReferenceBackend
from msa.cli import main
from msa.errors import MSAPluginError
from msa.hooks import BackendRecord, hookimpl
from msa.platform import Platform
from msa.plugins.faults import PluginFault, describe, guarded
from msa.plugins.records import RecordError, check_reasons, check_records, record_problems
from msa.policy import SelectionPolicy
from msa.problem import DecodeProblem
from msa.registry import BackendRegistry, reset_registry

CPU = Platform("cpu")
GOOD = BackendRecord(name="fastkernel", factory=ReferenceBackend, priority=10, aliases=("fk",), description="x")

#: (field, value, the error's fragments: the field, what is expected, what was given)
BAD_FIELDS: list[tuple[str, object, str]] = [
    ("name", "", "name: expected a non-empty str, got ''"),
    ("name", None, "name: expected a non-empty str, got None"),
    ("name", 3, "name: expected a non-empty str, got 3 \\(an int\\)"),
    ("factory", None, "factory: expected a callable that builds the backend \\(e.g. its class\\), got None"),
    ("factory", "ReferenceBackend", "factory: expected a callable .*, got 'ReferenceBackend' \\(a str\\)"),
    ("priority", "high", "priority: expected an int \\(not a bool\\), got 'high' \\(a str\\)"),
    ("priority", True, "priority: expected an int \\(not a bool\\), got True \\(a bool\\)"),
    ("priority", 1.5, "priority: expected an int \\(not a bool\\), got 1.5 \\(a float\\)"),
    ("aliases", "fastk", "aliases: expected a tuple of non-empty str, got 'fastk' \\(a str\\)"),
    ("aliases", ["fk"], "aliases: expected a tuple of non-empty str, got \\['fk'\\] \\(a list\\)"),
    ("aliases", ("",), "aliases: expected a tuple of non-empty str, got \\(''\\,\\) \\(a tuple\\)"),
    ("aliases", ("fk", 2), "aliases: expected a tuple of non-empty str, got \\('fk', 2\\) \\(a tuple\\)"),
    ("aliases", ("fk", "fk"), "aliases: expected names other than the backend's own and each other, got"),
    ("aliases", ("fastkernel",), "aliases: expected names other than the backend's own and each other, got"),
    ("description", None, "description: expected a str, got None"),
]


@pytest.mark.parametrize("field, value, error", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v, _ in BAD_FIELDS])
def test_a_malformed_record_is_refused_naming_the_field(field: str, value: object, error: str) -> None:
    record = attrs.evolve(GOOD, **{field: value})
    problems = record_problems(record)
    assert len(problems) == 1 and re.fullmatch(error + ".*", problems[0]), problems
    with pytest.raises(RecordError, match=error) as info:
        check_records([GOOD, record] if field != "name" else [record])
    assert "\n" not in str(info.value)
    label = "'fastkernel'" if field != "name" else "#0"
    assert f"its msa_backends hook returned an invalid BackendRecord {label}: {field}: expected" in str(info.value)


def test_a_valid_record_passes() -> None:
    assert record_problems(GOOD) == []
    assert check_records([GOOD]) == (GOOD,)
    assert check_records(iter([GOOD])) == (GOOD,), "any iterable of records"
    assert check_records([]) == ()


@pytest.mark.parametrize(
    "returned, error",
    [
        (None, "returned None, expected a list of BackendRecord"),
        (GOOD, "returned BackendRecord\\(.*\\) \\(a BackendRecord\\), expected a list of BackendRecord"),
        ("fastkernel", "returned 'fastkernel' \\(a str\\), expected a list of BackendRecord"),
        ({"fastkernel": GOOD}, "returned \\{.*\\} \\(a dict\\), expected a list of BackendRecord"),
        ([GOOD, "x"], "returned 'x' \\(a str\\) at index 1, expected a BackendRecord"),
    ],
)
def test_a_hook_must_return_a_list_of_records(returned: object, error: str) -> None:
    with pytest.raises(RecordError, match="its msa_backends hook " + error):
        check_records(returned)


def test_a_record_error_keeps_the_names_declared() -> None:
    """So that a request for one of them names the failed plugin."""
    bad = attrs.evolve(GOOD, name="other", aliases="fastk")  # type: ignore[arg-type]
    with pytest.raises(RecordError) as info:
        check_records([GOOD, bad])
    assert info.value.names == ("fastkernel", "fk", "other", "fastk")


def test_guarded_contains_everything_but_a_keyboard_interrupt() -> None:
    def raising(exc: BaseException) -> Callable[[], None]:
        def fn() -> None:
            raise exc
        return fn

    for exc, error in [
        (SystemExit(), "SystemExit (sys.exit(None))"),
        (SystemExit(3), "SystemExit (sys.exit(3))"),
        (GeneratorExit(), "GeneratorExit"),
        (OSError("lib.so:\n  cannot open"), "OSError: lib.so: cannot open"),
    ]:
        with pytest.raises(PluginFault) as info:
            guarded(raising(exc))
        assert info.value.cause is exc and info.value.error == error and describe(exc) == error
        assert info.value.__cause__ is exc
    with pytest.raises(KeyboardInterrupt):
        guarded(raising(KeyboardInterrupt()))
    assert guarded(int, "7") == 7


def test_reasons_must_be_a_list_of_str() -> None:
    assert check_reasons(["a", "b"], "m") == ("a", "b")
    assert check_reasons((r for r in ["a"]), "m") == ("a",)
    assert check_reasons([], "m") == ()
    for returned, error in [
        (None, "its m returned None, expected a list of str"),
        ("needs cuda", "its m returned 'needs cuda' \\(a str\\), expected a list of str"),
        (["a", None], "its m returned \\['a', None\\] \\(a list\\) holding None, expected a list of str"),
        ([3], "holding 3 \\(an int\\), expected a list of str"),
    ]:
        with pytest.raises(TypeError, match=error):
            check_reasons(returned, "m")

    def exits() -> Iterator[str]:
        yield "a"
        raise SystemExit(1)

    with pytest.raises(PluginFault, match=re.escape("SystemExit (sys.exit(1))")):
        check_reasons(exits(), "m")


# -- registry and policy ----------------------------------------------------------------------


def backend_class(name: str, **methods: Callable[..., Any]) -> type[ReferenceBackend]:
    """The reference under another name, with some methods replaced."""
    return type(name, (ReferenceBackend,), {"name": name, **methods})


def offering(*records: BackendRecord) -> object:
    """A plugin object whose hook returns `records`."""

    class Plugin:
        @hookimpl
        def msa_backends(self) -> list[BackendRecord]:
            return list(records)

    return Plugin()


def raising_hook(exc: BaseException) -> object:
    class Plugin:
        @hookimpl
        def msa_backends(self) -> list[BackendRecord]:
            raise exc

    return Plugin()


def checks(**methods: Callable[..., Any]) -> dict[str, object]:
    """Plugins (registered in code) whose one backend's methods `methods` misbehave."""
    return {
        name: offering(BackendRecord(name=name, factory=backend_class(name, **{name: method}), priority=50))
        for name, method in methods.items()
    }


MISBEHAVING = checks(
    not_supported_reasons=lambda self, problem, platform, *, requested=False: "needs cuda",
    machine_reasons=lambda self, platform, *, requested=False: None,
    extra_reasons=lambda self, problem, platform, *, requested=False: [None],
)
WHY = {
    "not_supported_reasons": "failed: its not_supported_reasons returned 'needs cuda' (a str), expected a list of str",
    "machine_reasons": "failed: its not_supported_reasons raised TypeError: can only concatenate list",
    "extra_reasons": "failed: its not_supported_reasons returned [None] (a list) holding None, expected a list of str",
}


def test_a_misbehaving_check_marks_its_plugin_broken_not_the_selection() -> None:
    registry = BackendRegistry(environ={}, plugins=list(MISBEHAVING.items()))
    policy = SelectionPolicy(registry, environ={})
    problem = None  # the machine alone: extra_reasons is a step check
    selection = policy.evaluate(problem, CPU, "reference")
    assert selection.chosen == "reference"
    verdicts = {v.name: v for v in selection.verdicts}
    for name in ("not_supported_reasons", "machine_reasons"):
        assert verdicts[name].failure is not None and verdicts[name].reasons[0].startswith(WHY[name]), verdicts[name]
        assert name in registry.broken, "a plugin's backend whose checks fail is marked broken"
        with pytest.raises(MSAPluginError, match=re.escape(f"backend {name!r} ({name} (registered in code)) {WHY[name]}")):
            registry.get(name)
        with pytest.raises(MSAPluginError, match=re.escape(WHY[name])):
            policy.evaluate(problem, CPU, name)
    assert "extra_reasons" not in registry.broken
    blocked = policy.evaluate(None, CPU).blocked
    assert blocked is not None and blocked.required, "plugins registered in code are required: auto refuses"


def test_a_misbehaving_step_check_is_caught_too() -> None:
    registry = BackendRegistry(environ={}, plugins=[("extra_reasons", MISBEHAVING["extra_reasons"])])
    policy = SelectionPolicy(registry, environ={})
    cuda = Platform.cuda((10, 0), packages=("fmha_sm100", "flashinfer", "triton"))
    problem = DecodeProblem(
        geometry=msa.Geometry(64, 4, 128, 128, 16), batch_size=64, query_len=1, kv_layout="fp8_e4m3",
        q_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16, device_type="cuda", num_pages=10_000, max_blocks=512,
    )
    selection = policy.evaluate(problem, cuda, "cutlass")
    assert selection.chosen == "cutlass_sm100"
    assert dict((v.name, v.reasons[0]) for v in selection.verdicts if v.failure) == {"extra_reasons": WHY["extra_reasons"]}


def test_a_builtin_whose_check_fails_is_reported_not_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: object, problem: object, platform: object, *, requested: bool = False) -> list[str]:
        raise SystemExit("oops")

    monkeypatch.setattr(ReferenceBackend, "not_supported_reasons", broken)
    registry = BackendRegistry(environ={"MSA_DISABLE_PLUGINS": "1"})
    verdict = SelectionPolicy(registry, environ={}).judge("reference", None, CPU)
    assert verdict.reasons == ("failed: its not_supported_reasons raised SystemExit (sys.exit('oops'))",)
    assert not registry.broken and registry.get("reference").name == "reference"


@pytest.mark.parametrize(
    "exc, error",
    [
        (SystemExit(2), "its msa_backends hook raised SystemExit (sys.exit(2))"),
        (GeneratorExit(), "its msa_backends hook raised GeneratorExit"),
        (RuntimeError("no"), "its msa_backends hook raised RuntimeError: no"),
    ],
)
def test_a_hook_that_raises_fails_its_plugin_only(exc: BaseException, error: str) -> None:
    registry = BackendRegistry(environ={}, plugins=[("hooky", raising_hook(exc)), ("fine", offering(GOOD))])
    assert registry.failures["hooky"].error == error and registry.failures["hooky"].exception is exc
    assert "fastkernel" in registry.names() and not registry.manager.has_plugin("hooky")


def test_a_keyboard_interrupt_in_plugin_code_propagates() -> None:
    with pytest.raises(KeyboardInterrupt):
        BackendRegistry(environ={}, plugins=[("hooky", raising_hook(KeyboardInterrupt()))])

    def interrupt(*args: object, **kwargs: object) -> object:
        raise KeyboardInterrupt

    registry = BackendRegistry(environ={}, plugins=[("slow", offering(attrs.evolve(GOOD, factory=interrupt)))])
    with pytest.raises(KeyboardInterrupt):
        registry.get("fastkernel")
    assert not registry.broken, "an interrupt is not the plugin's failure"
    judged = BackendRegistry(environ={}, plugins=list(checks(not_supported_reasons=interrupt).items()))
    with pytest.raises(KeyboardInterrupt):
        SelectionPolicy(judged, environ={}).evaluate(None, CPU, "reference")


def test_unreadable_entry_points_leave_the_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable() -> list[object]:
        raise ValueError("malformed entry_points.txt")

    monkeypatch.setattr("msa.plugins.loading.installed_entry_points", unreadable)
    registry = BackendRegistry(environ={})
    assert registry.failures["msa.backends"].error == "ValueError: malformed entry_points.txt"
    assert registry.get("reference").name == "reference"


def test_msa_backends_survives_a_version_that_exits(capsys: pytest.CaptureFixture[str]) -> None:
    def version(self: object) -> str:
        raise SystemExit(1)

    plugin = offering(BackendRecord(name="exits", factory=backend_class("exits", version=version), priority=5))
    old = reset_registry(BackendRegistry(environ={}, plugins=[("exits", plugin)]))
    try:
        capsys.readouterr()
        assert main(["backends", "--cpu"]) == 0
    finally:
        reset_registry(old)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("exits "))
    assert "? (SystemExit)" in row
