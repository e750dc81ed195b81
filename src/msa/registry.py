"""The backend registry: pluggy hooks under the project name "msa".

Every backend — built-in or third-party — arrives through the same hook, `msa_backends`, which
returns `BackendRecord`s. Built-ins are registered first (the plugin module `msa.builtin`), then
the plugins of the entry-point group `msa.backends`, in entry-point name order:

    # a third party's pyproject.toml
    [project.entry-points."msa.backends"]
    mykernel = "mykernel.msa_plugin"

    # mykernel/msa_plugin.py
    import msa.registry
    @msa.registry.hookimpl
    def msa_backends():
        return [msa.registry.BackendRecord(name="mykernel", factory=MyBackend, priority=150)]

Environment: `MSA_PLUGINS=a,b` loads only those entry points; `MSA_DISABLE_PLUGINS=1` loads none.

The work is split three ways: `msa.plugins.loading` finds, imports and registers plugins,
`msa.plugins.records` validates what they hand over, and `BackendRegistry` (here) names and
orders the backends that got through and builds them on request.

A faulty plugin never disables msa. A plugin that fails — at import, in its hook, by a record
that is not valid (`msa.plugins.records.record_problems`: a name that is not a non-empty str, a
priority that is not an int, aliases that are not a tuple of str, ...), by a name or alias that
another backend already holds (the built-in, or the plugin registered first, keeps it), later in
its factory (raises, or returns something that is not a `Backend` of that name), or in its
backend's checks (see `msa.policy`) — is logged (logger "msa", warning), recorded (`failures`,
`broken`), listed by `msa backends`, and skipped by `backend="auto"`. Its faults are contained
whatever they raise — `SystemExit` included — except `KeyboardInterrupt`. It raises
`MSAPluginError` (with its source and error, chaining the original exception) only when
requested: by name (`backend=` or `MSA_BACKEND`), or — for a plugin named in `MSA_PLUGINS`, which
is *required* — by `backend="auto"`, which refuses to run without it. A name in `MSA_PLUGINS`
that no entry point provides is such a required failure. The registry's constructor never
raises for a plugin's fault; only msa's own built-in plugin failing does.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Mapping, Sequence

import pluggy

from msa.backends.base import AnyBackend
from msa.errors import MSAInputError, MSAPluginError
from msa.hooks import PROJECT, BackendRecord, MSAHookSpecs, PluginFailure, hookimpl, hookspec
from msa.plugins.faults import PluginFault
from msa.plugins.loading import (
    BUILTIN_PLUGIN,
    BUILTIN_SOURCE,
    ENTRY_POINT_GROUP,
    Offer,
    PluginLoader,
    build_backend,
)

__all__ = [
    "PROJECT",
    "ENTRY_POINT_GROUP",
    "BUILTIN_SOURCE",
    "hookspec",
    "hookimpl",
    "BackendRecord",
    "PluginFailure",
    "MSAHookSpecs",
    "BackendRegistry",
    "get_registry",
    "reset_registry",
]

log = logging.getLogger("msa")


class BackendRegistry:
    """Every backend known to this process, built-ins first, then entry-point plugins.

    Loading is `msa.plugins.loading.PluginLoader`'s job; the registry takes each plugin it
    offers unless one of its names (or aliases) is taken, then answers by name and priority.

    Args:
        entry_points: the entry points to consider (default: the installed `msa.backends`
            group). They load in name order, so the first to claim a name keeps it.
        environ: where to read `MSA_PLUGINS` / `MSA_DISABLE_PLUGINS` (default: `os.environ`).
        plugins: extra plugin objects (modules or instances with hook implementations),
            registered after the entry points, as `(name, plugin)`; they are required.

    Attributes:
        failures: plugins that failed to load, by entry-point name (their backends are absent).
        broken: backends whose factory or checks failed, by backend name (their records stay
            listed).
        not_loaded: entry points left out by `MSA_PLUGINS` / `MSA_DISABLE_PLUGINS`.

    Raises:
        MSAPluginError: only when msa's own built-in plugin fails (a faulty third-party plugin
            is recorded, never raised here).
    """

    def __init__(
        self,
        *,
        entry_points: Sequence[importlib.metadata.EntryPoint] | None = None,
        environ: Mapping[str, str] | None = None,
        plugins: Sequence[tuple[str, object]] = (),
    ) -> None:
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(MSAHookSpecs)
        self.broken: dict[str, PluginFailure] = {}
        self._records: dict[str, BackendRecord] = {}
        self._aliases: dict[str, str] = {}
        self._instances: dict[str, AnyBackend] = {}
        self._plugin_of: dict[str, str] = {}  # backend name -> the plugin that offered it
        self._required: set[str] = set()  # plugins named in MSA_PLUGINS or registered in code
        loader = PluginLoader(self.manager, self._accept)
        self.failures: dict[str, PluginFailure] = loader.failures
        self.not_loaded: list[str] = loader.not_loaded
        env = os.environ if environ is None else environ
        loader.load(entry_points=entry_points, environ=env, plugins=plugins)

    # -- taking plugins in --------------------------------------------------------------------
    def _accept(self, offer: Offer) -> str | None:
        """Take `offer`'s records (validated by the loader), all or none; else why not."""
        clash = self._clash(offer.records)
        if clash is not None:
            return clash
        if offer.required:
            self._required.add(offer.plugin)
        for record in offer.records:
            self._records[record.name] = record
            self._plugin_of[record.name] = offer.plugin
            for key in (record.name, *record.aliases):
                self._aliases[key] = record.name
        return None

    def _clash(self, records: Sequence[BackendRecord]) -> str | None:
        """The error if one of `records` claims a name (or alias) already taken, or "auto"."""
        taken = {key: self._records[owner].source for key, owner in self._aliases.items()}
        taken["auto"] = "msa (reserved: backend='auto' selects)"
        for record in records:
            for key in (record.name, *record.aliases):
                if key in taken:
                    return (
                        f"two msa backends are named {key!r}: one from {taken[key]}, one from "
                        f"{record.source}. Uninstall one, or limit plugins with MSA_PLUGINS."
                    )
                taken[key] = record.source
        return None

    # -- queries ------------------------------------------------------------------------------
    def records(self) -> list[BackendRecord]:
        """Every record, highest priority first (ties by name); broken ones included."""
        return sorted(self._records.values(), key=lambda r: (-r.priority, r.name))

    def names(self) -> list[str]:
        """Every backend name, highest priority first; broken ones included (see `broken`)."""
        return [r.name for r in self.records()]

    def resolve(self, name: str) -> str:
        """The canonical backend name for `name` or one of its aliases.

        Raises:
            MSAPluginError: `name` is a plugin that failed to load, or a backend it declared
                (with its source and error, chaining the original exception).
            MSAInputError: an unknown name.
        """
        if name in self._aliases:
            return self._aliases[name]
        failure = self.failures.get(name) or next(
            (f for f in self.failures.values() if name in f.names), None
        )
        if failure is not None:
            raise MSAPluginError(
                f"backend {name!r} was requested but its plugin ({failure.source}) failed to load: "
                f"{failure.error}"
            ) from failure.exception
        raise MSAInputError(
            "backend", "'auto' or one of " + ", ".join(repr(n) for n in self.names()), repr(name)
        )

    def record(self, name: str) -> BackendRecord:
        return self._records[self.resolve(name)]

    def get(self, name: str) -> AnyBackend:
        """The backend instance for `name`, built by its factory on first use.

        Raises:
            MSAPluginError: the backend's plugin failed to load, its factory raised or returned
                something that is not an msa `Backend` of that name (recorded in `broken` on
                the first call, so a broken factory runs once), or its checks failed (see
                `mark_broken`).
            MSAInputError: an unknown name.
        """
        canonical = self.resolve(name)
        if canonical not in self._instances and canonical not in self.broken:
            try:
                self._instances[canonical] = build_backend(self._records[canonical])
            except PluginFault as fault:
                self.mark_broken(canonical, fault.error, fault.cause)
        failure = self.broken.get(canonical)
        if failure is not None:
            raise MSAPluginError(
                f"backend {canonical!r} ({failure.source}) {self.broken_reason(canonical)}"
            ) from failure.exception
        return self._instances[canonical]

    def mark_broken(self, name: str, error: str, exc: BaseException) -> PluginFailure:
        """Record that backend `name` failed (`error`: one line, e.g. "its factory raised ...");
        from now on `get(name)` raises and `backends()` skips it. Logged."""
        record = self.record(name)
        required = self._plugin_of.get(record.name) in self._required
        failure = PluginFailure(record.name, record.source, error, exc, required=required)
        self.broken[record.name] = failure
        log.warning("msa backend %r (%s) skipped: %s", record.name, record.source, error)
        return failure

    def broken_reason(self, name: str) -> str:
        """Why broken backend `name` does not run: "failed to load: ..." (its factory) or
        "failed: ..." (it loaded, then its checks failed)."""
        canonical = self.resolve(name)
        verb = "failed" if canonical in self._instances else "failed to load"
        return f"{verb}: {self.broken[canonical].error}"

    def from_plugin(self, name: str) -> bool:
        """Whether backend `name` comes from a third-party plugin (not msa's built-ins)."""
        return self._plugin_of.get(self.resolve(name)) != BUILTIN_PLUGIN

    def backends(self) -> list[AnyBackend]:
        """Every backend that loads, highest priority first (broken ones skipped)."""
        found = []
        for name in self.names():
            try:
                found.append(self.get(name))
            except MSAPluginError:
                continue
        return found

    def required(self, name: str) -> bool:
        """Whether backend `name` comes from a required plugin (named in `MSA_PLUGINS`)."""
        return self._plugin_of.get(self.resolve(name)) in self._required

    def required_failures(self) -> list[PluginFailure]:
        """The failures of required plugins: `backend="auto"` refuses to run while any exists."""
        return [f for f in (*self.failures.values(), *self.broken.values()) if f.required]

    def hook_names(self) -> list[str]:
        """The names of the hooks msa specifies."""
        return [n for n in dir(MSAHookSpecs) if n.startswith("msa_")]


_default: BackendRegistry | None = None


def get_registry() -> BackendRegistry:
    """The process-wide registry (built on first use)."""
    global _default
    if _default is None:
        _default = BackendRegistry()
    return _default


def reset_registry(registry: BackendRegistry | None = None) -> BackendRegistry | None:
    """Replace the process-wide registry (None: rebuild on next use). Returns the old one."""
    global _default
    old, _default = _default, registry
    return old
