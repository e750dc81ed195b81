"""Backends: one module each, registered through the `msa_backends` hook (see `msa.registry`)."""

from __future__ import annotations

from msa.backends.base import Backend
from msa.backends.capabilities import Capabilities

__all__ = ["Backend", "Capabilities"]
