"""The hooks msa specifies and the record a plugin returns (see `msa.registry`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
import pluggy

from msa.backends.base import AnyBackend

__all__ = ["PROJECT", "hookspec", "hookimpl", "BackendRecord", "PluginFailure", "MSAHookSpecs"]

PROJECT = "msa"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@attrs.frozen
class BackendRecord:
    """One backend a plugin offers.

    Attributes:
        name: the name users request (`backend="name"`), unique across plugins.
        factory: builds the backend (called once, on first use).
        priority: higher is tried first by `backend="auto"`.
        source: where it comes from (filled in by the registry: "msa (built-in)" or the plugin's
            distribution and entry point).
        aliases: other names that request it.
        description: one line for `msa backends`.
    """

    name: str
    factory: Callable[[], AnyBackend]
    priority: int = 0
    source: str = ""
    aliases: tuple[str, ...] = ()
    description: str = ""


@attrs.frozen
class PluginFailure:
    """A plugin, or one backend of a plugin, that failed (see `msa.registry`).

    Attributes:
        name: the plugin's entry-point name, or the backend's name when its factory failed.
        source: where it comes from (distribution and entry point; "not installed" for a name
            in `MSA_PLUGINS` that no entry point provides).
        error: what went wrong, one line (e.g. "ModuleNotFoundError: No module named 'x'").
        exception: the original exception (chained by the `MSAPluginError` raised on request).
        required: the plugin is named in `MSA_PLUGINS` (or registered in code):
            `backend="auto"` refuses to run without it.
        names: the other names that request it (the backend names and aliases it declared).
    """

    name: str
    source: str
    error: str
    exception: BaseException = attrs.field(eq=False, repr=False)
    required: bool = False
    names: tuple[str, ...] = ()

    def required_message(self) -> str:
        """Why `backend="auto"` refuses to run while this required plugin is broken."""
        return (
            f"msa plugin {self.name!r} ({self.source}) is named in MSA_PLUGINS but failed to load: "
            f"{self.error}. Fix it, request a backend by name, or remove it from MSA_PLUGINS."
        )


class MSAHookSpecs:
    """The hooks msa calls. Plugins implement them with `@msa.registry.hookimpl`."""

    @hookspec
    def msa_backends(self) -> Iterable[BackendRecord]:  # type: ignore[empty-body]
        """Return the backends this plugin offers."""
