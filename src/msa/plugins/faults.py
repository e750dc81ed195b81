"""Containing a plugin's fault: plugin code runs through `guarded`.

A plugin is code msa does not control, run at import, in its hook, in its backend's factory and
in its backend's checks. Whatever it raises there is the plugin's fault and must not stop msa —
`SystemExit` (a `sys.exit()` at import) included. Only `KeyboardInterrupt` passes through: it is
the user stopping the process, not the plugin failing.

`GeneratorExit` is contained like any other fault: msa is inside no generator of its own while
plugin code runs (`guarded` calls, it does not yield), so a `GeneratorExit` seen there was raised
by the plugin, not sent to msa to close it.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["PluginFault", "guarded", "describe", "one_line", "given"]

P = ParamSpec("P")
T = TypeVar("T")

_MAX_LINE = 400
_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60


class PluginFault(Exception):
    """Plugin code raised `cause` (anything but `KeyboardInterrupt`), contained by `guarded`.

    Attributes:
        cause: what the plugin raised (chained by the `MSAPluginError` raised on request).
        error: one line describing it: by default `describe(cause)`, e.g. "OSError: libx.so:
            cannot open shared object file" or "SystemExit (sys.exit(None))".
    """

    def __init__(self, cause: BaseException, error: str | None = None) -> None:
        self.cause = cause
        self.error = describe(cause) if error is None else error
        super().__init__(self.error)


def guarded(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)`: plugin code, whose faults are contained.

    Raises:
        PluginFault: `fn` raised anything but a `KeyboardInterrupt` (chaining it).
        KeyboardInterrupt: passed through untouched.
    """
    try:
        return fn(*args, **kwargs)
    except KeyboardInterrupt:
        raise
    except PluginFault:  # nested plugin code: contained once
        raise
    except BaseException as exc:  # SystemExit, GeneratorExit, ... : the plugin's, not the user's
        raise PluginFault(exc) from exc


def describe(exc: BaseException) -> str:
    """One line naming `exc`'s type and message ("SystemExit (sys.exit(3))" for an exit)."""
    if isinstance(exc, SystemExit):
        return f"SystemExit (sys.exit({given(exc.code, typed=False)}))"
    try:
        message = one_line(str(exc))
    except KeyboardInterrupt:
        raise
    except BaseException:  # a plugin's exception whose __str__ fails
        message = "(its message could not be printed)"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def one_line(text: str) -> str:
    """`text` on one line (whitespace runs collapsed), at most a few hundred characters."""
    line = " ".join(text.split())
    return line if len(line) <= _MAX_LINE else line[: _MAX_LINE - 3] + "..."


def given(value: object, *, typed: bool = True) -> str:
    """A short, one-line repr of a value a plugin gave, with its type: "'high' (a str)"."""
    try:
        text = one_line(_repr.repr(value))
    except KeyboardInterrupt:
        raise
    except BaseException:  # a plugin's object whose __repr__ fails
        text = "(an object whose repr fails)"
    if not typed or value is None:
        return text
    kind = type(value).__name__
    return f"{text} ({'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind})"
