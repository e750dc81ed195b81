"""The Triton kernel the eager benchmark measures launch cost with."""

from __future__ import annotations

import triton


@triton.jit
def empty_kernel(x_ptr):
    """Does nothing: its launch is pure launch overhead."""
    pass
