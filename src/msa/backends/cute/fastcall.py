"""Calling a compiled CuTe DSL host function without the DSL's per-call argument adaptation.

Calling what `cute.compile` returns adapts every argument through the DSL's adapter registry on
every call: ~240 us for the decode kernel's 41 scalars on a 2-core CPU (`generate_execution_args`,
nvidia-cutlass-dsl 4.8.1), which is what made an eager `cute` call cost ~150-300 us on the H200's
host. What the adaptation produces is simple: one pointer per argument, to the argument's value
(an int64, int32 or float32, and the stream's handle). `PackedCall` builds those pointers itself,
into one ctypes structure per call (thread-safe, nothing shared between calls), and hands them to
the DSL's executor for the plan's device (`JitCompiledFunction.to(device).run_compiled_program`).

`packing_matches` checks that equivalence against the DSL's own adaptation, once per compiled
function, with a distinct value in every argument; where it does not hold (another DSL version)
`PackedCall` takes the DSL's own call path instead.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PackedCall", "packing_matches", "probe_values", "arg_struct"]

_CTYPES: dict[str, Any] = {"i64": ctypes.c_int64, "i32": ctypes.c_int32, "f32": ctypes.c_float,
                           "stream": ctypes.c_void_p}


def arg_struct(kinds: Sequence[str]) -> Any:
    """The ctypes structure holding one value per argument kind ("i64", "i32", "f32", "stream")."""
    return type("HostArgs", (ctypes.Structure,), {"_fields_": [(f"a{i}", _CTYPES[k]) for i, k in enumerate(kinds)]})


def probe_values(kinds: Sequence[str]) -> list[int | float]:
    """A distinct value per argument, each exact in its kind and different in every byte that
    kind holds (so a value read at the wrong place, or with the wrong width, differs)."""
    values: list[int | float] = []
    for i, kind in enumerate(kinds):
        if kind == "i64":
            values.append(0x0102030405060708 + (i << 40) + i)
        elif kind == "i32":
            values.append(0x01020304 + (i << 16) + i)
        elif kind == "f32":
            values.append(1.5 + i / 256)
        else:
            values.append(0x00007F0000ABC000 + i)
    return values


def _cu_stream(handle: int) -> Any:
    import cuda.bindings.driver as cuda

    return cuda.CUstream(handle)


def packing_matches(fn: Any, kinds: Sequence[str]) -> bool:
    """Whether the DSL's adaptation of `fn`'s arguments gives, for distinct probe values, exactly
    one pointer per argument to that value in that kind's C type (what `PackedCall` builds)."""
    if not (callable(getattr(fn, "generate_execution_args", None)) and callable(getattr(fn, "to", None))):
        return False
    values = probe_values(kinds)
    try:
        pointers, keep = fn.generate_execution_args(*values[:-1], _cu_stream(int(values[-1])))
    except Exception:  # noqa: BLE001 - any refusal means: use the DSL's own call path
        return False
    if len(pointers) != len(kinds):
        return False
    for pointer, kind, value in zip(pointers, kinds, values, strict=True):
        address = pointer.value if isinstance(pointer, ctypes.c_void_p) else pointer
        if type(address) is not int or address == 0:
            return False
        if _CTYPES[kind].from_address(address).value != value:
            return False
    del keep
    return True


class PackedCall:
    """A compiled host function `fn` whose arguments are `kinds` (the last the stream), with its
    arguments packed by msa when `packed` (see `packing_matches`), else through the DSL's own call
    path. `launcher(device)` is the callable for one CUDA device: `launch(*values)` takes the
    values in argument order, the stream as its integer handle."""

    def __init__(self, fn: Any, kinds: Sequence[str], packed: bool) -> None:
        self.fn = fn
        self.kinds = tuple(kinds)
        self.packed = packed
        self._struct = arg_struct(self.kinds)
        self._offsets = tuple(getattr(self._struct, f"a{i}").offset for i in range(len(self.kinds)))
        self._launchers: dict[int, Callable[..., None]] = {}
        self._lock = threading.Lock()

    def launcher(self, device: int) -> Callable[..., None]:
        """The launch on CUDA device `device` through the DSL's executor there (its kernels
        fetched and their attributes set), made once per device, packed or not."""
        with self._lock:
            launch = self._launchers.get(device)
            if launch is None:
                launch = self._launchers[device] = self._make(device)
        return launch

    def _make(self, device: int) -> Callable[..., None]:
        executor = self.fn.to(device)
        if not self.packed:
            def slow(*values: int | float) -> None:
                executor(*values[:-1], _cu_stream(int(values[-1])))
            return slow
        run = executor.run_compiled_program
        struct, offsets = self._struct, self._offsets

        def fast(*values: int | float) -> None:
            args = struct(*values)  # alive until the launch below has copied the values
            base = ctypes.addressof(args)
            run([base + offset for offset in offsets])
        return fast
