"""The selection policy: which backend runs a step, and why every other one does not.

`SelectionPolicy` holds the priority order (the registry's, highest priority first, unless
given) and asks each backend for its reasons (`Backend.not_supported_reasons`: what the machine
lacks, then what the step asks for). `backend="auto"` takes the first backend with no reasons;
a named backend (or `MSA_BACKEND=name` in the environment) must qualify or the call raises with
its reasons — never a silent fallback.

A plugin's fault never breaks selection: a backend whose factory failed, or whose
`not_supported_reasons` (with the `machine_reasons` and capability checks it calls) raised —
anything, `SystemExit` included, but `KeyboardInterrupt` — or returned something other than a
list of str, gets a "failed ..." verdict and is skipped by `auto`; a plugin's backend is then
marked broken in the registry (`BackendRegistry.mark_broken`). Requested by name, it raises
`MSAPluginError`. While a plugin named in `MSA_PLUGINS` is broken, `auto` refuses to run
(`Selection.blocked`) rather than silently run without it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import attrs

from msa.backends.base import AnyBackend
from msa.errors import MSAInputError, MSAPluginError, MSAUnsupportedError
from msa.hooks import PluginFailure
from msa.platform import Platform
from msa.plugins.faults import PluginFault, guarded
from msa.plugins.records import check_reasons
from msa.problem import DecodeProblem
from msa.registry import BackendRegistry, get_registry

__all__ = ["Verdict", "Selection", "SelectionPolicy", "default_policy"]

log = logging.getLogger("msa")


@attrs.frozen
class Verdict:
    """One backend's answer for a step: its reasons for refusing (empty: it can run it).

    Attributes:
        failure: set when the backend failed (its factory, or its `not_supported_reasons`
            raised or returned something other than a list of str); `reasons` then holds one
            "failed ..." line.
    """

    name: str
    reasons: tuple[str, ...]
    priority: int
    source: str
    failure: PluginFailure | None = attrs.field(default=None, eq=False)

    @property
    def qualified(self) -> bool:
        return not self.reasons


@attrs.frozen
class Selection:
    """The outcome of selection.

    Attributes:
        requested: what was asked for ("auto" or a name).
        chosen: the backend that runs the step, or None when none can.
        verdicts: every backend's verdict, in priority order.
        via_environment: the request came from `MSA_BACKEND`.
        blocked: for "auto", a required plugin (named in `MSA_PLUGINS`) that failed: nothing
            is chosen while it is broken.
    """

    requested: str
    chosen: str | None
    verdicts: tuple[Verdict, ...]
    via_environment: bool = False
    blocked: PluginFailure | None = attrs.field(default=None, eq=False)

    @property
    def rejected(self) -> dict[str, list[str]]:
        """Every backend that cannot run the step, with its reasons."""
        return {v.name: list(v.reasons) for v in self.verdicts if v.reasons}

    def explain(self) -> str:
        """A readable account: the choice, then each backend's verdict."""
        how = f"{self.requested!r}" + (" (from MSA_BACKEND)" if self.via_environment else "")
        if self.blocked is not None:
            head = f"requested {how}: refused: {self.blocked.required_message()}"
        elif self.chosen:
            head = f"requested {how}: runs on {self.chosen!r}"
        elif self.requested == "auto":
            head = f"requested {how}: no backend can run this step"
        else:
            head = f"requested {how}: it cannot run this step"
        lines = [head]
        for v in self.verdicts:
            status = "chosen" if v.name == self.chosen else (
                "qualifies" if v.qualified else "broken" if v.failure else "rejected"
            )
            lines.append(f"  {v.name:<16} {status:<10} " + "; ".join(v.reasons))
        return "\n".join(line.rstrip() for line in lines)


class SelectionPolicy:
    """Priority order + every backend's reasons -> `Selection`.

    Args:
        registry: where backends come from (default: the process-wide registry).
        order: backend names in the order to try (default: the registry's priorities).
        environ: where to read `MSA_BACKEND` (default: `os.environ`).
    """

    def __init__(
        self,
        registry: BackendRegistry | None = None,
        *,
        order: Sequence[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.registry = registry if registry is not None else get_registry()
        self._order = [self.registry.resolve(n) for n in order] if order is not None else None
        self.environ = environ

    def order(self) -> list[str]:
        """Backend names in the order `backend="auto"` tries them."""
        return list(self._order) if self._order is not None else self.registry.names()

    def judge(
        self, name: str, problem: DecodeProblem | None, platform: Platform, *, requested: bool = False
    ) -> Verdict:
        """Backend `name`'s verdict on `problem` (None: the machine alone) and `platform`.

        Never raises for the backend's fault: a factory that failed, or a `not_supported_reasons`
        that raised (anything but `KeyboardInterrupt`) or returned something other than a list
        (or other iterable) of str, gives a verdict with `failure` set and one "failed ..."
        reason. A plugin's backend that fails so is marked broken in the registry; a built-in's
        failure is reported on this verdict only.
        """
        record = self.registry.record(name)
        try:
            backend = self.registry.get(name)
        except MSAPluginError:
            if record.name not in self.registry.broken:
                raise
            failure = self.registry.broken[record.name]
            reason = self.registry.broken_reason(record.name)
            return Verdict(record.name, (reason,), record.priority, record.source, failure)
        try:
            returned = guarded(backend.not_supported_reasons, problem, platform, requested=requested)
            reasons = check_reasons(returned, "not_supported_reasons")
            return Verdict(record.name, reasons, record.priority, record.source)
        except PluginFault as fault:  # a plugin's bug must not break selection
            error, cause = f"its not_supported_reasons raised {fault.error}", fault.cause
        except TypeError as exc:  # check_reasons: not a list of str
            error, cause = str(exc), exc
        if self.registry.from_plugin(record.name):
            failure = self.registry.mark_broken(record.name, error, cause)
        else:
            log.warning("msa backend %r (%s) skipped: %s", record.name, record.source, error)
            failure = PluginFailure(record.name, record.source, error, cause, self.registry.required(record.name))
        return Verdict(record.name, (f"failed: {error}",), record.priority, record.source, failure)

    def evaluate(
        self, problem: DecodeProblem | None, platform: Platform, backend: str = "auto"
    ) -> Selection:
        """Every backend's verdict and the choice, without raising for a refusal.

        Raises:
            MSAInputError: `backend` names no registered backend.
            MSAPluginError: `backend` names a plugin or backend that failed (with its source and
                error, chaining the original exception).
        """
        env = os.environ if self.environ is None else self.environ
        via_env = False
        if backend == "auto" and env.get("MSA_BACKEND", "") not in ("", "auto"):
            backend, via_env = env["MSA_BACKEND"], True
        try:
            requested = None if backend == "auto" else self.registry.resolve(backend)
        except MSAInputError as exc:
            if not via_env:
                raise
            raise MSAInputError("MSA_BACKEND", exc.expected, exc.given) from None
        names = self.order()
        if requested is not None and requested not in names:  # named but outside a custom order
            names.append(requested)
        verdicts = tuple(self.judge(n, problem, platform, requested=n == requested) for n in names)
        blocked = None
        if requested is not None:
            verdict = next(v for v in verdicts if v.name == requested)
            if verdict.failure is not None:
                raise MSAPluginError(
                    f"backend {requested!r} ({verdict.source}) {verdict.reasons[0]}"
                ) from verdict.failure.exception
            chosen = requested if verdict.qualified else None
        else:
            failed = [v.failure for v in verdicts if v.failure is not None and v.failure.required]
            blocked = next(iter(self.registry.required_failures() + failed), None)
            chosen = None if blocked else next((v.name for v in verdicts if v.qualified), None)
        return Selection(backend, chosen, verdicts, via_env, blocked)

    def select(
        self, problem: DecodeProblem, platform: Platform, backend: str = "auto"
    ) -> tuple[AnyBackend, Selection]:
        """The backend that runs `problem`, and the selection that chose it.

        Raises:
            MSAUnsupportedError: the named backend — or for "auto", every backend — cannot run
                the step; the message lists each one's reasons.
            MSAPluginError: the named backend failed (see `evaluate`), or for "auto", a plugin
                named in `MSA_PLUGINS` failed (`Selection.blocked`).
        """
        selection = self.evaluate(problem, platform, backend)
        if selection.blocked is not None:
            raise MSAPluginError(selection.blocked.required_message()) from selection.blocked.exception
        if selection.chosen is None:
            if selection.requested == "auto":
                raise MSAUnsupportedError(
                    f"no msa backend can run this step on {platform.describe()}:", selection.rejected
                )
            name = self.registry.resolve(selection.requested)
            source = " (from MSA_BACKEND)" if selection.via_environment else ""
            raise MSAUnsupportedError(
                f"backend {name!r}{source} cannot run this step on {platform.describe()}:",
                {name: selection.rejected.get(name, [])},
            )
        return self.registry.get(selection.chosen), selection


_default: SelectionPolicy | None = None


def default_policy() -> SelectionPolicy:
    """The policy `msa.sparse_decode` uses: the process-wide registry, its priorities."""
    global _default
    if _default is None or _default.registry is not get_registry():
        _default = SelectionPolicy()
    return _default
