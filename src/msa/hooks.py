"""The hooks msa specifies and the record a plugin returns (see `msa.registry`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
import pluggy

from msa.backends.base import Backend

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
    factory: Callable[[], Backend]
    priority: int = 0
    source: str = ""
    aliases: tuple[str, ...] = ()
    description: str = ""


@attrs.frozen
class PluginFailure:
    """A plugin that could not be loaded: its entry-point name, source and error."""

    name: str
    source: str
    error: str
    exception: BaseException = attrs.field(eq=False, repr=False)


class MSAHookSpecs:
    """The hooks msa calls. Plugins implement them with `@msa.registry.hookimpl`."""

    @hookspec
    def msa_backends(self) -> Iterable[BackendRecord]:  # type: ignore[empty-body]
        """Return the backends this plugin offers."""
