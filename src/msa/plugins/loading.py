"""Loading plugins: finding them, importing them, registering their hooks, collecting their
records — and building a backend from its record.

`PluginLoader.load` takes msa's built-in plugin first, then the entry points of the group
`msa.backends` in name order (filtered by `MSA_PLUGINS` / `MSA_DISABLE_PLUGINS`), then plugins
registered in code. Each plugin runs through `guarded` (its import, its hook) and its records
through `check_records`; a plugin that passes is offered to the registry, which accepts it or
refuses it (a name clash). A plugin that fails anywhere is unregistered whole, logged and
recorded in `failures`; nothing it does stops the others from loading — except a
`KeyboardInterrupt`, which passes through, and msa's own built-in plugin failing.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable, Mapping, Sequence

import attrs
import pluggy

from msa.backends.base import AnyBackend
from msa.errors import MSAPluginError
from msa.hooks import BackendRecord, PluginFailure
from msa.plugins.faults import PluginFault, describe, guarded
from msa.plugins.records import RecordError, check_records, checked_backend

__all__ = [
    "ENTRY_POINT_GROUP",
    "BUILTIN_PLUGIN",
    "BUILTIN_SOURCE",
    "Offer",
    "PluginLoader",
    "build_backend",
    "installed_entry_points",
    "entry_point_source",
]

ENTRY_POINT_GROUP = "msa.backends"
BUILTIN_PLUGIN = "msa.builtin"
BUILTIN_SOURCE = "msa (built-in)"

log = logging.getLogger("msa")


def installed_entry_points() -> list[importlib.metadata.EntryPoint]:
    """The installed entry points of the group `msa.backends`."""
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def entry_point_source(ep: importlib.metadata.EntryPoint) -> str:
    """Where `ep` comes from: "dist 1.0 (entry point name = module)"."""
    try:
        dist = ep.dist
        where = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
    except Exception:  # unreadable metadata: still name the entry point
        where = "unknown distribution"
    return f"{where} (entry point {ep.name} = {ep.value})"


@attrs.frozen
class Offer:
    """A plugin that registered and whose records are valid, offered to the registry.

    Attributes:
        plugin: its name (the entry point's, or the name it was registered in code under).
        source: where it comes from; every record's `source` is set to it.
        records: its backends, validated.
        required: named in `MSA_PLUGINS` (or registered in code): `backend="auto"` refuses to
            run while it is broken.
    """

    plugin: str
    source: str
    records: tuple[BackendRecord, ...]
    required: bool


#: The registry's answer to an `Offer`: None when it takes it, else why not (one line).
Accept = Callable[[Offer], str | None]


class PluginLoader:
    """Loads plugins into `manager` and offers each one's records to `accept`.

    Args:
        manager: the pluggy manager the plugins register with (msa's hook specs added).
        accept: the registry's answer to each plugin that loaded (see `Accept`); a refusal fails
            the plugin.

    Attributes:
        failures: plugins that failed to load, by name (see `PluginFailure`).
        not_loaded: entry points left out by `MSA_PLUGINS` / `MSA_DISABLE_PLUGINS`.
    """

    def __init__(self, manager: pluggy.PluginManager, accept: Accept) -> None:
        self.manager = manager
        self.accept = accept
        self.failures: dict[str, PluginFailure] = {}
        self.not_loaded: list[str] = []

    def load(
        self,
        *,
        entry_points: Sequence[importlib.metadata.EntryPoint] | None,
        environ: Mapping[str, str],
        plugins: Sequence[tuple[str, object]],
    ) -> None:
        """msa's built-in plugin, then the entry points (`entry_points`, default: the installed
        ones) that `environ` allows, in name order, then `plugins` (`(name, plugin)`, required).

        Raises:
            MSAPluginError: only when msa's built-in plugin fails.
        """
        from msa import builtin

        failure = self.register(BUILTIN_PLUGIN, builtin, BUILTIN_SOURCE, required=False)
        if failure is not None:  # msa itself is broken: nothing to fall back to
            raise MSAPluginError(f"msa's built-in backends failed to load: {failure.error}") from failure.exception
        allow = {n.strip() for n in environ.get("MSA_PLUGINS", "").split(",") if n.strip()}
        disabled = environ.get("MSA_DISABLE_PLUGINS", "") not in ("", "0")
        if entry_points is None:
            try:
                entry_points = guarded(installed_entry_points)
            except PluginFault as fault:  # a malformed installed distribution
                entry_points = []
                self.fail(ENTRY_POINT_GROUP, "importlib.metadata", fault.cause, required=False, error=fault.error)
        eps = sorted(entry_points, key=lambda e: (e.name, e.value))
        for ep in eps:
            if disabled or (allow and ep.name not in allow):
                self.not_loaded.append(ep.name)
                continue
            source = entry_point_source(ep)
            try:
                plugin = guarded(ep.load)
            except PluginFault as fault:  # a broken third-party plugin must not break msa
                self.fail(ep.name, source, fault.cause, required=ep.name in allow, error=fault.error)
                continue
            self.register(ep.name, plugin, source, required=ep.name in allow)
        if not disabled:
            found = sorted({ep.name for ep in eps})
            for name in sorted(allow - set(found)):
                error = (
                    f"no installed distribution has an entry point {name!r} in the group "
                    f"{ENTRY_POINT_GROUP!r} (found: {', '.join(found) or 'none'})"
                )
                self.fail(name, "not installed", LookupError(error), required=True, error=error)
        for name, plugin in plugins:
            self.register(name, plugin, f"{name} (registered in code)", required=True)

    def register(self, name: str, plugin: object, source: str, *, required: bool) -> PluginFailure | None:
        """Register `plugin`, validate its records and offer them: all or nothing. A failure
        (registering, its hook, its records, the registry's refusal) is recorded, not raised."""
        registered = False
        try:
            guarded(self.manager.register, plugin, name=name)
            registered = True
            guarded(self.manager.check_pending)  # hook implementations without a spec (typos)
        except PluginFault as fault:
            if registered:
                self.manager.unregister(name=name)
            return self.fail(name, source, fault.cause, required=required, error=fault.error)
        try:
            records = self._records(name, source)
        except RecordError as exc:
            self.manager.unregister(name=name)
            return self.fail(name, source, exc, required=required, error=str(exc), names=exc.names)
        except PluginFault as fault:
            self.manager.unregister(name=name)
            error = f"its msa_backends hook raised {fault.error}"
            return self.fail(name, source, fault.cause, required=required, error=error)
        refusal = self.accept(Offer(name, source, records, required))
        if refusal is not None:
            self.manager.unregister(name=name)
            names = tuple(key for r in records for key in (r.name, *r.aliases))
            return self.fail(name, source, MSAPluginError(refusal), required=required, error=refusal, names=names)
        return None

    def _records(self, name: str, source: str) -> tuple[BackendRecord, ...]:
        """The validated records of plugin `name`'s hook implementations, `source` filled in.

        Raises:
            RecordError: a hook returned something invalid.
            PluginFault: a hook raised.
        """
        records: list[BackendRecord] = []
        for impl in self.manager.hook.msa_backends.get_hookimpls():
            if impl.plugin_name == name:
                records += [attrs.evolve(r, source=source) for r in check_records(guarded(impl.function))]
        return tuple(records)

    def fail(
        self,
        name: str,
        source: str,
        exc: BaseException,
        *,
        required: bool,
        error: str | None = None,
        names: tuple[str, ...] = (),
    ) -> PluginFailure:
        """Record (and log) that plugin `name` failed with `exc` (`error`: one line, default
        `describe(exc)`)."""
        failure = PluginFailure(name, source, error or describe(exc), exc, required=required, names=names)
        why = " (named in MSA_PLUGINS: backend='auto' refuses to run until it loads)" if required else ""
        log.warning("msa plugin %r (%s) skipped: %s%s", name, source, failure.error, why)
        self.failures[name] = failure
        return failure


def build_backend(record: BackendRecord) -> AnyBackend:
    """The backend `record.factory` builds, validated (`checked_backend`).

    Raises:
        PluginFault: the factory raised ("its factory raised ..."), or built something that is
            not an msa `Backend` named `record.name` (its cause a `TypeError`).
    """
    try:
        built = guarded(record.factory)
    except PluginFault as fault:  # e.g. a missing shared library
        raise PluginFault(fault.cause, f"its factory raised {fault.error}") from fault.cause
    try:
        return checked_backend(built, record.name)
    except TypeError as exc:
        raise PluginFault(exc, str(exc)) from exc
