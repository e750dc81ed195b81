"""Validating what a plugin hands msa: its records, the backend its factory builds, the reasons
its backend's checks return.

Every error is one line naming the field (or the method), what msa expects and what was given,
e.g. "its msa_backends hook returned an invalid BackendRecord 'fastk': aliases: expected a tuple
of non-empty str, got 'fk' (a str)". The registry records it as the plugin's failure; it never
reaches a caller that did not ask for the plugin.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeGuard

from msa.backends.base import AnyBackend, Backend
from msa.errors import MSAPluginError
from msa.hooks import BackendRecord
from msa.plugins.faults import PluginFault, given, guarded

__all__ = ["RecordError", "check_records", "record_problems", "checked_backend", "check_reasons"]


class RecordError(MSAPluginError):
    """A plugin's `msa_backends` hook returned something that is not a list of valid records.

    Attributes:
        names: the backend names and aliases the records declared (those that are str), so
            that a request for one of them names the failed plugin instead of "unknown backend".
    """

    def __init__(self, message: str, names: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.names = names


def _is_collection(value: object) -> TypeGuard[Iterable[object]]:
    """An iterable other than a str, bytes or mapping (whose iteration would mislead)."""
    return isinstance(value, Iterable) and not isinstance(value, str | bytes | Mapping)


def _items(values: Iterable[object]) -> list[object]:
    return list(values)


def check_records(returned: object) -> tuple[BackendRecord, ...]:
    """What a plugin's `msa_backends` hook returned, validated: an iterable (not a str, bytes or
    mapping) of `BackendRecord`s, each valid (see `record_problems`).

    Raises:
        RecordError: one line for every offending item (with the names the records declared).
        PluginFault: iterating what the hook returned (a generator) raised.
    """
    if not _is_collection(returned):
        raise RecordError(f"its msa_backends hook returned {given(returned)}, expected a list of BackendRecord")
    items = guarded(_items, returned)
    errors = []
    for index, item in enumerate(items):
        if not isinstance(item, BackendRecord):
            errors.append(f"its msa_backends hook returned {given(item)} at index {index}, expected a BackendRecord")
            continue
        problems = record_problems(item)
        if problems:
            label = repr(item.name) if isinstance(item.name, str) and item.name else f"#{index}"
            errors.append(f"its msa_backends hook returned an invalid BackendRecord {label}: " + "; ".join(problems))
    if errors:
        raise RecordError("; ".join(errors), _declared_names(items))
    return tuple(item for item in items if isinstance(item, BackendRecord))


def record_problems(record: BackendRecord) -> list[str]:
    """What is wrong with `record`, one "field: expected ..., got ..." per field (empty: valid).

    Validated: `name` a non-empty str; `factory` callable; `priority` an int (not a bool);
    `aliases` a tuple of non-empty str, none repeating the name or each other (a bare str such
    as "fastk" is an error, not five one-letter aliases); `description` a str. `source` is not:
    the registry fills it in. Names already taken, and "auto", are the registry's to refuse
    (`BackendRegistry`: a name clash).
    """
    problems = []
    if not (isinstance(record.name, str) and record.name):
        problems.append(f"name: expected a non-empty str, got {given(record.name)}")
    if not callable(record.factory):
        problems.append(
            f"factory: expected a callable that builds the backend (e.g. its class), got {given(record.factory)}"
        )
    if not isinstance(record.priority, int) or isinstance(record.priority, bool):
        problems.append(f"priority: expected an int (not a bool), got {given(record.priority)}")
    aliases = record.aliases
    if not (isinstance(aliases, tuple) and all(isinstance(a, str) and a for a in aliases)):
        problems.append(f"aliases: expected a tuple of non-empty str, got {given(aliases)}")
    elif isinstance(record.name, str) and len(set(aliases) | {record.name}) != len(aliases) + 1:
        problems.append(
            f"aliases: expected names other than the backend's own and each other, got {given(aliases)}"
        )
    if not isinstance(record.description, str):
        problems.append(f"description: expected a str, got {given(record.description)}")
    return problems


def _declared_names(items: Iterable[object]) -> tuple[str, ...]:
    """Every str name and alias the records among `items` declare (a bare-str alias counts)."""
    names: list[str] = []
    for item in items:
        if not isinstance(item, BackendRecord):
            continue
        aliases = (item.aliases,) if isinstance(item.aliases, str) else item.aliases
        candidates = (item.name, *aliases) if isinstance(aliases, tuple | list) else (item.name,)
        names += [n for n in candidates if isinstance(n, str) and n and n not in names]
    return tuple(names)


def checked_backend(built: object, name: str) -> AnyBackend:
    """What a record's factory built, validated: an msa `Backend` whose `name` is `name`
    (selection finds backends by name).

    Raises:
        TypeError: one line saying what it built instead.
    """
    if not isinstance(built, Backend):
        raise TypeError(f"its factory returned {type(built).__name__}, not an msa Backend")
    try:
        own = guarded(getattr, built, "name", None)
    except PluginFault as fault:
        raise TypeError(f"its factory returned a backend whose name raised {fault.error}") from fault.cause
    if own != name:
        raise TypeError(f"its factory returned a backend named {given(own, typed=False)}, not {name!r}")
    return built


def check_reasons(returned: object, method: str) -> tuple[str, ...]:
    """The reasons a backend's check `method` (e.g. "not_supported_reasons") returned, validated:
    a list, tuple or other iterable (not a str, bytes or mapping) of str.

    Raises:
        TypeError: one line naming `method`, the expectation and what it returned.
        PluginFault: iterating what it returned (a generator) raised.
    """
    if not _is_collection(returned):
        raise TypeError(f"its {method} returned {given(returned)}, expected a list of str")
    items = guarded(_items, returned)
    reasons = tuple(r for r in items if isinstance(r, str))
    if len(reasons) != len(items):
        bad = next(r for r in items if not isinstance(r, str))
        raise TypeError(f"its {method} returned {given(returned)} holding {given(bad)}, expected a list of str")
    return reasons
