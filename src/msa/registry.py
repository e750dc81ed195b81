"""The backend registry: pluggy hooks under the project name "msa".

Every backend — built-in or third-party — arrives through the same hook, `msa_backends`, which
returns `BackendRecord`s. Built-ins are registered first (the plugin `msa.backends.builtin`),
then the plugins of the entry-point group `msa.backends`:

    # a third party's pyproject.toml
    [project.entry-points."msa.backends"]
    mykernel = "mykernel.msa_plugin"

    # mykernel/msa_plugin.py
    import msa.registry
    @msa.registry.hookimpl
    def msa_backends():
        return [msa.registry.BackendRecord(name="mykernel", factory=MyBackend, priority=150)]

Environment: `MSA_PLUGINS=a,b` loads only those entry points; `MSA_DISABLE_PLUGINS=1` loads none.
A plugin that fails to load is logged, listed by `msa backends` and skipped — unless it is
requested (named in `MSA_PLUGINS`, or as `backend=`), which raises with its error.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pluggy

from msa.backends.base import Backend
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
            group).
        environ: where to read `MSA_PLUGINS` / `MSA_DISABLE_PLUGINS` (default: `os.environ`).
        plugins: extra plugin objects (modules or instances with hook implementations),
            registered after the entry points, as `(name, plugin)`.

    Raises:
        MSAPluginError: two backends share a name; a plugin named in `MSA_PLUGINS` fails.
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
        self.not_loaded: list[str] = []
        self._sources: dict[str, str] = {}
        self._records: dict[str, BackendRecord] = {}
        self._aliases: dict[str, str] = {}
        self._instances: dict[str, Backend] = {}

        from msa import builtin

        self._register("msa.builtin", builtin, BUILTIN_SOURCE, required=True)
        allow = {n.strip() for n in env.get("MSA_PLUGINS", "").split(",") if n.strip()}
        disabled = env.get("MSA_DISABLE_PLUGINS", "") not in ("", "0")
        eps = _entry_points() if entry_points is None else list(entry_points)
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
        for name, plugin in plugins:
            self._register(name, plugin, f"{name} (registered in code)", required=True)

    # -- loading ------------------------------------------------------------------------------
    def _fail(self, name: str, source: str, exc: BaseException, *, required: bool) -> None:
        error = f"{type(exc).__name__}: {exc}"
        if required:
            raise MSAPluginError(f"msa plugin {name!r} ({source}) failed to load: {error}") from exc
        log.warning("msa plugin %r (%s) skipped: %s", name, source, error)
        self.failures[name] = PluginFailure(name, source, error, exc)

    def _register(self, name: str, plugin: object, source: str, *, required: bool) -> None:
        try:
            self.manager.register(plugin, name=name)
            self.manager.check_pending()  # hook implementations without a spec (typos)
        except Exception as exc:
            if self.manager.is_registered(plugin):
                self.manager.unregister(plugin)
            self._fail(name, source, exc, required=required)
            return
        self._sources[name] = source
        hook = self.manager.hook.msa_backends
        for impl in hook.get_hookimpls():
            if impl.plugin_name != name:
                continue
            try:
                returned: Any = impl.function()
                records = list(returned)
                for record in records:
                    if not isinstance(record, BackendRecord):
                        raise TypeError(f"msa_backends returned {record!r}, not a BackendRecord")
            except Exception as exc:
                self.manager.unregister(plugin)
                self._fail(name, source, exc, required=required)
                return
            for record in records:
                self._add(attrs.evolve(record, source=source))

    def _add(self, record: BackendRecord) -> None:
        for key in (record.name,) + record.aliases:
            owner = self._aliases.get(key)
            if owner is not None:
                raise MSAPluginError(
                    f"two msa backends are named {key!r}: one from {self._records[owner].source}, "
                    f"one from {record.source}. Uninstall one, or limit plugins with MSA_PLUGINS."
                )
        self._records[record.name] = record
        for key in (record.name,) + record.aliases:
            self._aliases[key] = record.name

    # -- queries ------------------------------------------------------------------------------
    def records(self) -> list[BackendRecord]:
        """Every record, highest priority first (ties by name)."""
        return sorted(self._records.values(), key=lambda r: (-r.priority, r.name))

    def names(self) -> list[str]:
        return [r.name for r in self.records()]

    def resolve(self, name: str) -> str:
        """The canonical backend name for `name` or one of its aliases.

        Raises:
            MSAPluginError: `name` is a plugin that failed to load (with its error).
            MSAInputError: an unknown name.
        """
        if name in self._aliases:
            return self._aliases[name]
        if name in self.failures:
            failure = self.failures[name]
            raise MSAPluginError(
                f"backend {name!r} was requested but its plugin ({failure.source}) failed to load: "
                f"{failure.error}"
            ) from failure.exception
        raise MSAInputError(
            "backend", "'auto' or one of " + ", ".join(repr(n) for n in self.names()), repr(name)
        )

    def record(self, name: str) -> BackendRecord:
        return self._records[self.resolve(name)]

    def get(self, name: str) -> Backend:
        """The backend instance for `name` (built on first use)."""
        canonical = self.resolve(name)
        if canonical not in self._instances:
            backend = self._records[canonical].factory()
            if not isinstance(backend, Backend):
                raise MSAPluginError(
                    f"the factory of backend {canonical!r} ({self._records[canonical].source}) "
                    f"returned {type(backend).__name__}, not an msa Backend"
                )
            self._instances[canonical] = backend
        return self._instances[canonical]

    def backends(self) -> list[Backend]:
        """Every backend, highest priority first."""
        return [self.get(name) for name in self.names()]

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


