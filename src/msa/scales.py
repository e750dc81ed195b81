"""Scale arguments: python floats or one-element fp32 tensors (graph-safe: never read on the host)."""

from __future__ import annotations

import math

import torch

from msa.errors import MSAInputError

__all__ = ["Scale", "check_scale", "check_scale_value", "check_score_factor", "scale_tensor", "apply_scale",
           "FP32_SCALE_RANGE"]

#: A scale: a python float, or a one-element fp32 tensor on the device of the data it scales.
Scale = float | torch.Tensor

#: The scales every backend takes (and their product, the scores' factor, with a factor of 2 to
#: spare): float32's normal range. Past it a scale is inf or loses its bits in float32, where the
#: kernels and the reference compute (a finite python double such as 1e39 turned every output NaN).
FP32_SCALE_RANGE = (2.0**-125, float(torch.finfo(torch.float32).max) / 2)
_RANGE = "float32's normal range [2^-125, 1.7e38]"
_RANGE_TEXT = f"a finite scale > 0 within {_RANGE}"


def _in_range(x: float) -> bool:
    return math.isfinite(x) and FP32_SCALE_RANGE[0] <= x <= FP32_SCALE_RANGE[1]


def check_scale(argument: str, value: object, device: torch.device) -> Scale:
    """Validate a scale argument and return it unchanged (ints become floats).

    A python float must be finite, > 0 and within `FP32_SCALE_RANGE` (checked here); a tensor's
    value is read only by the deep checks (`validate=True`), which never run inside graph capture.

    Raises:
        MSAInputError: not a positive number within `FP32_SCALE_RANGE`, not a one-element fp32
            tensor, or on another device.
    """
    if isinstance(value, bool):
        raise MSAInputError(argument, "a float or a one-element fp32 tensor", repr(value))
    if isinstance(value, (int, float)):
        try:
            x = float(value)
        except OverflowError:  # an int past float's range
            bits = value.bit_length() if isinstance(value, int) else "?"
            raise MSAInputError(argument, _RANGE_TEXT, f"an int of {bits} bits") from None
        if not _in_range(x):
            raise MSAInputError(argument, _RANGE_TEXT, repr(value))
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
    """The deep check of a checked scale: a tensor's value, read on the host, within
    `FP32_SCALE_RANGE` (a python float was checked by `check_scale`). Synchronises; never inside
    graph capture.

    Raises:
        MSAInputError: a tensor holding NaN, +-Inf, 0, a negative value or one out of that range.
    """
    if isinstance(value, torch.Tensor):
        x = float(value)
        if not _in_range(x):
            raise MSAInputError(argument, _RANGE_TEXT, f"a tensor holding {x}")


def check_score_factor(sm_scale: Scale, q_scale: Scale, k_scale: Scale) -> None:
    """The scores' factor `sm_scale * q_scale * k_scale` within `FP32_SCALE_RANGE` (each a
    checked scale; a tensor's value is read on the host, so call this only where reading is
    allowed or every one is a python float).

    Raises:
        MSAInputError: naming the product, with its value.
    """
    x = float(sm_scale) * float(q_scale) * float(k_scale)
    if not _in_range(x):
        raise MSAInputError("sm_scale * q_scale * k_scale",
                            f"a product within {_RANGE} (the scores' factor)", repr(x))


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
