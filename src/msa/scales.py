"""Scale arguments: python floats or one-element fp32 tensors (graph-safe: never read on the host)."""

from __future__ import annotations

import math

import torch

from msa.errors import MSAInputError

__all__ = ["Scale", "check_scale", "check_scale_value", "scale_tensor", "apply_scale"]

#: A scale: a python float, or a one-element fp32 tensor on the device of the data it scales.
Scale = float | torch.Tensor


def check_scale(argument: str, value: object, device: torch.device) -> Scale:
    """Validate a scale argument and return it unchanged (ints become floats).

    A python float must be finite and > 0 (checked here); a tensor's value is read only by the
    deep checks (`validate=True`), which never run inside graph capture.

    Raises:
        MSAInputError: not a finite positive number, not a one-element fp32 tensor, or on
            another device.
    """
    if isinstance(value, bool):
        raise MSAInputError(argument, "a float or a one-element fp32 tensor", repr(value))
    if isinstance(value, (int, float)):
        try:
            x = float(value)
        except OverflowError:  # an int past float's range
            bits = value.bit_length() if isinstance(value, int) else "?"
            raise MSAInputError(argument, "a finite scale > 0", f"an int of {bits} bits") from None
        if not math.isfinite(x) or x <= 0:
            raise MSAInputError(argument, "a finite scale > 0", repr(value))
        return x
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.float32:
            raise MSAInputError(
                argument,
                "a one-element float32 tensor",
                f"a {value.dtype} tensor of shape {tuple(value.shape)}",
            )
        if value.device != device:
            raise MSAInputError(
                argument,
                f"a tensor on {device} (the device of the data it scales)",
                f"a tensor on {value.device}",
            )
        return value
    raise MSAInputError(argument, "a float or a one-element fp32 tensor", type(value).__name__)


def check_scale_value(argument: str, value: Scale) -> None:
    """The deep check of a checked scale: a tensor's value, read on the host, finite and > 0
    (a python float was checked by `check_scale`). Synchronises; never inside graph capture.

    Raises:
        MSAInputError: a tensor holding NaN, +-Inf, 0 or a negative value.
    """
    if isinstance(value, torch.Tensor):
        x = float(value)
        if not math.isfinite(x) or x <= 0:
            raise MSAInputError(argument, "a finite scale > 0", f"a tensor holding {x}")


def scale_tensor(value: Scale, device: torch.device) -> torch.Tensor:
    """The scale as a 0-d fp32 tensor on `device` (no host synchronisation)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(()).to(device=device, dtype=torch.float32)
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def apply_scale(x: torch.Tensor, value: Scale) -> torch.Tensor:
    """`x * value` without a host-to-device copy for python floats (capturable)."""
    if isinstance(value, torch.Tensor):
        return x * value.reshape(()).to(dtype=torch.float32)
    return x * value if value != 1.0 else x
