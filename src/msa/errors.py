"""The exceptions msa raises. Every one names the argument, what was expected and what was given."""

from __future__ import annotations

from typing import TypeGuard

__all__ = ["MSAError", "MSAInputError", "MSAKeyError", "MSAUnsupportedError", "MSAPluginError", "is_int", "check_flag"]


class MSAError(Exception):
    """Base class of every error msa raises on purpose."""


class MSAInputError(MSAError, ValueError):
    """An argument does not meet the contract (shape, dtype, device, stride, value).

    Attributes:
        argument: the name of the offending argument, as the caller spelled it.
        expected: what the contract asks for.
        given: what was passed.
    """

    def __init__(self, argument: str, expected: str, given: object, hint: str = "") -> None:
        self.argument = argument
        self.expected = expected
        self.given = given
        self.hint = hint
        message = f"{argument}: expected {expected}, got {given}"
        if hint:
            message += f". {hint}"
        super().__init__(message)

    def __reduce__(self) -> tuple[type[MSAInputError], tuple[str, str, object, str], dict[str, object]]:
        """Pickled as its arguments and state (an error raised in a worker process reaches its
        parent whole, notes added with `add_note` included)."""
        return type(self), (self.argument, self.expected, self.given, self.hint), dict(vars(self))


class MSAKeyError(MSAInputError, KeyError):
    """A key that one of msa's tables does not hold: an `MSAInputError` that is a `KeyError` too
    (what a mapping raises), with the plain message."""

    __str__ = Exception.__str__


class MSAUnsupportedError(MSAError, NotImplementedError):
    """The inputs are valid but the requested backend (or every backend) cannot serve them.

    Attributes:
        reasons: backend name -> the reasons it refused.
    """

    def __init__(self, message: str, reasons: dict[str, list[str]] | None = None) -> None:
        self.reasons: dict[str, list[str]] = dict(reasons or {})
        self.headline = message
        if self.reasons:
            lines = [message]
            for name, why in self.reasons.items():
                lines.append(f"  {name}: " + "; ".join(why))
            message = "\n".join(lines)
        super().__init__(message)

    def __reduce__(self) -> tuple[type[MSAUnsupportedError], tuple[str, dict[str, list[str]]], dict[str, object]]:
        """Pickled as its arguments and state (see `MSAInputError.__reduce__`)."""
        return type(self), (self.headline, self.reasons), dict(vars(self))


class MSAPluginError(MSAError, RuntimeError):
    """A backend plugin failed to load or declared something invalid."""


def is_int(value: object) -> TypeGuard[int]:
    """Whether an int argument was given one: an int and not a bool (`True == 1`, and
    `2.0 in (1, 2)`, would pass a comparison)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_flag(argument: str, value: object) -> None:
    """A real bool (a string such as "yes" is a mistake, not a truthy value), or an
    `MSAInputError` naming `argument`."""
    if not isinstance(value, bool):
        raise MSAInputError(argument, "True or False", repr(value))
