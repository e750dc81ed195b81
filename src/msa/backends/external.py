"""Shared pieces of the adapters for external kernel libraries."""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

import torch

from msa.errors import MSAUnsupportedError
from msa.scales import Scale

__all__ = ["import_library", "library_version", "host_float"]


def import_library(backend: str, module: str) -> ModuleType:
    """Import an external kernel library, or raise an `MSAUnsupportedError` naming the backend."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MSAUnsupportedError(
            f"backend {backend!r} needs the {module!r} package, which failed to import: {exc}"
        ) from exc


def library_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def host_float(value: Scale) -> float:
    """A scale as a python float (a tensor is read from the device: not inside graph capture)."""
    return float(value) if isinstance(value, torch.Tensor) else value
