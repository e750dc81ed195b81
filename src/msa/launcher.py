"""Launching Triton kernels at the cost of the launch itself: the first launch of a kernel goes
through Triton (which binds, specialises and compiles), later ones straight through the compiled
kernel's launcher, skipping Triton's per-call Python binding (tens of microseconds a call, which
eager callers — serving engines run attention between CUDA-graph pieces — pay on every layer).

`MSA_TRITON_DIRECT_LAUNCH=0` turns the direct path off; the Triton interpreter never takes it.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "interpreting", "direct_launch_enabled", "kernel_parameters", "bind_arguments", "DirectKernel", "unit_stride",
]


def interpreting() -> bool:
    """True when Triton kernels run on the CPU through the interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def direct_launch_enabled() -> bool:
    """Whether launches may skip Triton's binder (a GPU, and not `MSA_TRITON_DIRECT_LAUNCH=0`)."""
    return not interpreting() and os.environ.get("MSA_TRITON_DIRECT_LAUNCH", "1") != "0"


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """`t` `[n]` with its elements one apart: `t` itself, or a copy of a strided or expanded view.
    Msa's Triton kernels read a 1-D argument (`seq_lens`, `slot_mapping`, `slot_ids`) at element
    `i` as `ptr + i`, so every such tensor passes through here before a launch."""
    return t if t.numel() <= 1 or t.stride(0) == 1 else t.contiguous()


@functools.cache
def kernel_parameters(fn: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    """A Triton kernel's parameter names in order and the defaults of those that have one (from
    the Python function under the `@triton.jit` wrapper, compiled or interpreted alike; read once
    per kernel)."""
    params = inspect.signature(fn.fn).parameters
    names = tuple(params)
    defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    return names, defaults


def bind_arguments(fn: Any, args: dict[str, Any]) -> list[Any]:
    """The values of a kernel's parameters in order, as its compiled launcher takes them: each
    from `args`, else the parameter's default. Raises `TypeError` naming every parameter neither
    gives (a launcher/kernel mismatch), as Triton's own launch path would."""
    names, defaults = kernel_parameters(fn)
    missing = [n for n in names if n not in args and n not in defaults]
    if missing:
        raise TypeError(f"{fn.fn.__name__}: no value for parameter(s) {', '.join(missing)}")
    return [args[n] if n in args else defaults[n] for n in names]


class DirectKernel:
    """One Triton kernel on one grid, for calls whose non-tensor arguments never change (a call
    signature: Triton specialises on integer values, so a new value needs a new `DirectKernel`):
    launched through Triton the first time (which compiles it), then directly through its
    compiled launcher while the pointer alignments (Triton specialises on 16-byte alignment) are
    the same. Which arguments are tensors is fixed by the call signature, so their positions are
    found once. Parameters the arguments leave out take the kernel's own defaults
    (`bind_arguments`), on both paths."""

    def __init__(self, fn: Any, grid: tuple[int, ...]) -> None:
        self.fn = fn
        self.grid = (grid + (1, 1))[:3]
        self.compiled: dict[tuple[bool, ...], Any] = {}
        self.tensor_positions: tuple[int, ...] | None = None
        self.stream: Callable[[], int] | None = None

    def __call__(self, args: dict[str, Any], direct: bool) -> None:
        if not direct:
            self.fn[self.grid](**args)
            return
        values = bind_arguments(self.fn, args)
        positions = self.tensor_positions
        if positions is None:
            positions = tuple(i for i, v in enumerate(values) if isinstance(v, torch.Tensor))
        aligned = tuple(values[i].data_ptr() % 16 == 0 for i in positions)
        compiled = self.compiled.get(aligned)
        if compiled is None or self.stream is None:
            compiled = self.fn[self.grid](**args)
            if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
                self.compiled[aligned] = compiled
                self.tensor_positions = positions
                self.stream = _stream_getter()
            return
        from triton import knobs

        stream = self.stream()
        runtime = knobs.runtime
        g0, g1, g2 = self.grid
        compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(self.grid, stream, *values), runtime.launch_enter_hook,
                     runtime.launch_exit_hook, *values)


def _stream_getter() -> Callable[[], int]:
    """The raw handle of the current stream of the current device, as Triton's launcher wants it."""
    from triton.runtime import driver

    active = driver.active
    get_stream, get_device = active.get_current_stream, active.get_current_device
    return lambda: get_stream(get_device())
