"""Backends: one module each. The built-in set, in priority order, is `builtin_backends()`."""

from __future__ import annotations

from msa.backends.base import Backend
from msa.backends.reference import ReferenceBackend

__all__ = ["Backend", "ReferenceBackend", "builtin_backends"]


def builtin_backends() -> list[Backend]:
    """The built-in backends, fastest first (the reference, which runs anywhere, last)."""
    return [ReferenceBackend()]
