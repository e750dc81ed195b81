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

A faulty plugin never disables msa. A plugin that fails — at import, in its hook, by a name or
alias that another backend already holds (the built-in, or the plugin registered first, keeps
it), or later in its factory (raises, or returns something that is not a `Backend`) — is logged
(logger "msa", warning), recorded (`failures`, `broken`), listed by `msa backends`, and skipped
by `backend="auto"`. It raises `MSAPluginError` (with its source and error, chaining the original
exception) only when requested: by name (`backend=` or `MSA_BACKEND`), or — for a plugin named in
`MSA_PLUGINS`, which is *required* — by `backend="auto"`, which refuses to run without it. A name
in `MSA_PLUGINS` that no entry point provides is such a required failure. The registry's
constructor never raises for a plugin's fault; only msa's own built-in plugin failing does.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pluggy

from msa.backends.base import AnyBackend, Backend
from msa.errors import MSAInputError, MSAPluginError
from msa.hooks import PROJECT, BackendRecord, MSAHookSpecs, PluginFailure, hookimpl, hookspec

__all__ = [
    "PROJECT",
    "ENTRY_POINT_GROUP",
    "hookspec",
    "hookimpl",
    "BackendRecord",
    "PluginFailure",
    "MSAHookSpecs",
    "BackendRegistry",
    "get_registry",
    "reset_registry",
]

ENTRY_POINT_GROUP = "msa.backends"
BUILTIN_SOURCE = "msa (built-in)"

log = logging.getLogger("msa")


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _ep_source(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    where = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
    return f"{where} (entry point {ep.name} = {ep.value})"


class BackendRegistry:
    """Every backend known to this process, built-ins first, then entry-point plugins.

    Args:
        entry_points: the entry points to consider (default: the installed `msa.backends`
            group). They load in name order, so the first to claim a name keeps it.
        environ: where to read `MSA_PLUGINS` / `MSA_DISABLE_PLUGINS` (default: `os.environ`).
        plugins: extra plugin objects (modules or instances with hook implementations),
            registered after the entry points, as `(name, plugin)`; they are required.

    Attributes:
        failures: plugins that failed to load, by entry-point name (their backends are absent).
        broken: backends whose factory failed, by backend name (their records stay listed).
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
        env = os.environ if environ is None else environ
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(MSAHookSpecs)
        self.failures: dict[str, PluginFailure] = {}
        self.broken: dict[str, PluginFailure] = {}
        self.not_loaded: list[str] = []
        self._records: dict[str, BackendRecord] = {}
        self._aliases: dict[str, str] = {}
        self._instances: dict[str, AnyBackend] = {}
        self._plugin_of: dict[str, str] = {}  # backend name -> the plugin that offered it
        self._required: set[str] = set()  # plugins named in MSA_PLUGINS or registered in code

        from msa import builtin

        failure = self._register("msa.builtin", builtin, BUILTIN_SOURCE, required=False)
        if failure is not None:  # msa itself is broken: nothing to fall back to
            raise MSAPluginError(f"msa's built-in backends failed to load: {failure.error}") from failure.exception
        allow = {n.strip() for n in env.get("MSA_PLUGINS", "").split(",") if n.strip()}
        disabled = env.get("MSA_DISABLE_PLUGINS", "") not in ("", "0")
        eps = sorted(_entry_points() if entry_points is None else entry_points, key=lambda e: (e.name, e.value))
        for ep in eps:
            if disabled or (allow and ep.name not in allow):
                self.not_loaded.append(ep.name)
                continue
            source = _ep_source(ep)
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party plugin must not break msa
                self._fail(ep.name, source, exc, required=ep.name in allow)
                continue
            self._register(ep.name, plugin, source, required=ep.name in allow)
        if not disabled:
            found = sorted({ep.name for ep in eps})
            for name in sorted(allow - set(found)):
                error = (
                    f"no installed distribution has an entry point {name!r} in the group "
                    f"{ENTRY_POINT_GROUP!r} (found: {', '.join(found) or 'none'})"
                )
                self._fail(name, "not installed", LookupError(error), required=True, error=error)
        for name, plugin in plugins:
            self._register(name, plugin, f"{name} (registered in code)", required=True)

    # -- loading ------------------------------------------------------------------------------
    def _fail(
        self,
        name: str,
        source: str,
        exc: BaseException,
        *,
        required: bool,
        error: str | None = None,
        names: tuple[str, ...] = (),
    ) -> PluginFailure:
        failure = PluginFailure(
            name, source, error or f"{type(exc).__name__}: {exc}", exc, required=required, names=names
        )
        why = " (named in MSA_PLUGINS: backend='auto' refuses to run until it loads)" if required else ""
        log.warning("msa plugin %r (%s) skipped: %s%s", name, source, failure.error, why)
        self.failures[name] = failure
        return failure

    def _register(self, name: str, plugin: object, source: str, *, required: bool) -> PluginFailure | None:
        """Register `plugin` and add its records, all or none; a failure is recorded, not raised."""
        try:
            self.manager.register(plugin, name=name)
            self.manager.check_pending()  # hook implementations without a spec (typos)
        except Exception as exc:
            if self.manager.is_registered(plugin):
                self.manager.unregister(plugin)
            return self._fail(name, source, exc, required=required)
        records: list[BackendRecord] = []
        for impl in self.manager.hook.msa_backends.get_hookimpls():
            if impl.plugin_name != name:
                continue
            try:
                returned: Any = impl.function()
                for record in returned:
                    if not isinstance(record, BackendRecord):
                        raise TypeError(f"msa_backends returned {record!r}, not a BackendRecord")
                    records.append(attrs.evolve(record, source=source))
            except Exception as exc:
                self.manager.unregister(plugin)
                return self._fail(name, source, exc, required=required)
        clash = self._clash(records)
        if clash is not None:
            self.manager.unregister(plugin)
            names = tuple(key for r in records for key in (r.name,) + r.aliases)
            return self._fail(name, source, MSAPluginError(clash), required=required, error=clash, names=names)
        if required:
            self._required.add(name)
        for record in records:
            self._records[record.name] = record
            self._plugin_of[record.name] = name
            for key in (record.name,) + record.aliases:
                self._aliases[key] = record.name
        return None

    def _clash(self, records: Sequence[BackendRecord]) -> str | None:
        """The error if one of `records` claims a name (or alias) already taken, else None."""
        taken = {key: self._records[owner].source for key, owner in self._aliases.items()}
        taken["auto"] = "msa (reserved: backend='auto' selects)"
        for record in records:
            for key in (record.name,) + record.aliases:
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
            MSAPluginError: the backend's plugin failed to load, or its factory raised or
                returned something that is not an msa `Backend` of that name (recorded in
                `broken` on the first call, so a broken factory runs once).
            MSAInputError: an unknown name.
        """
        canonical = self.resolve(name)
        if canonical not in self._instances and canonical not in self.broken:
            record = self._records[canonical]
            try:
                built: object = record.factory()
            except Exception as exc:  # e.g. a missing shared library
                self._break(record, f"its factory raised {type(exc).__name__}: {exc}", exc)
            else:
                if not isinstance(built, Backend):
                    error = f"its factory returned {type(built).__name__}, not an msa Backend"
                    self._break(record, error, TypeError(error))
                elif getattr(built, "name", None) != canonical:  # selection finds backends by name
                    error = f"its factory returned a backend named {getattr(built, 'name', None)!r}, not {canonical!r}"
                    self._break(record, error, TypeError(error))
                else:
                    self._instances[canonical] = built
        failure = self.broken.get(canonical)
        if failure is not None:
            raise MSAPluginError(
                f"backend {canonical!r} ({failure.source}) failed to load: {failure.error}"
            ) from failure.exception
        return self._instances[canonical]

    def _break(self, record: BackendRecord, error: str, exc: BaseException) -> None:
        required = self._plugin_of.get(record.name) in self._required
        self.broken[record.name] = PluginFailure(record.name, record.source, error, exc, required=required)
        log.warning("msa backend %r (%s) skipped: %s", record.name, record.source, error)

    def backends(self) -> list[AnyBackend]:
        """Every backend that loads, highest priority first (broken factories skipped)."""
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


