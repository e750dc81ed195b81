"""What the machine is: device kind, compute capability, SM count and the optional packages that
backends need. `detect()` reads the real machine; tests build `Platform` values by hand."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import attrs
import torch

from msa.errors import MSAInputError

__all__ = [
    "Platform",
    "detect",
    "triton_available",
    "resolve_device",
    "current_stream_key",
    "package_installed",
    "stream_capturing",
    "OPTIONAL_PACKAGES",
    "PACKAGE_LOCATIONS",
    "PACKAGE_INSTALL",
    "E4M3_MIN_CAPABILITY",
    "e4m3_in_hardware",
]

#: Packages whose presence some backend depends on (looked up, not imported).
OPTIONAL_PACKAGES = ("triton", "fmha_sm100", "flashinfer", "cutlass_dsl")

#: Where each optional package may live, first place first: MSA's CUTLASS kernels (`fmha_sm100`)
#: ship inside vLLM (>= 0.33) as `vllm.third_party.fmha_sm100`; a standalone `fmha_sm100` counts too.
PACKAGE_LOCATIONS: dict[str, tuple[str, ...]] = {
    "fmha_sm100": ("vllm.third_party.fmha_sm100", "fmha_sm100"),
    "cutlass_dsl": ("cutlass.cute",),  # nvidia-cutlass-dsl (the older nvidia-cutlass is `cutlass` too)
}

#: What to install for an optional package whose name on the index is not its import name.
PACKAGE_INSTALL: dict[str, str] = {
    "cutlass_dsl": "pip install nvidia-cutlass-dsl",
    "fmha_sm100": "it ships in vLLM >= 0.33",
}


#: The lowest compute capability with E4M3 in hardware (`cvt` to and from e4m3, Triton's `fp8e4nv`
#: type): Ada and Hopper (8.9, 9.0) and later. Below it (Ampere, 8.0 / 8.6) Triton refuses to compile
#: an fp8 e4m3 tensor, so msa's Triton kernels read such bytes as integers and decode them by bits.
E4M3_MIN_CAPABILITY = (8, 9)


def e4m3_in_hardware(capability: tuple[int, int] | None) -> bool:
    """Whether a GPU of `capability` converts E4M3 in hardware (None: no GPU; the Triton
    interpreter converts it on the CPU)."""
    return capability is None or capability >= E4M3_MIN_CAPABILITY


@attrs.frozen
class Platform:
    """A device and what is installed beside it.

    Attributes:
        device_type: "cuda", "cpu", ...
        capability: CUDA compute capability `(major, minor)`, None off CUDA.
        sm_count: streaming multiprocessors (0 off CUDA).
        device_name: e.g. "NVIDIA H200".
        packages: importable optional packages (see `OPTIONAL_PACKAGES`).
        triton_interpret: `TRITON_INTERPRET=1` is set (Triton kernels run on the CPU).
    """

    device_type: str
    capability: tuple[int, int] | None = None
    sm_count: int = 0
    device_name: str = ""
    packages: frozenset[str] = frozenset()
    triton_interpret: bool = False

    def has(self, package: str) -> bool:
        return package in self.packages

    def describe(self) -> str:
        if self.capability is None:
            where = self.device_type
        else:
            sm = f"sm_{self.capability[0]}{self.capability[1]}"
            where = f"{self.device_name or self.device_type} ({sm}, {self.sm_count} SMs)"
        return where + (", packages: " + ", ".join(sorted(self.packages)) if self.packages else "")

    @classmethod
    def cuda(
        cls,
        capability: tuple[int, int],
        *,
        sm_count: int = 132,
        packages: tuple[str, ...] = ("triton",),
        name: str = "",
    ) -> Platform:
        """A pretend CUDA platform (for tests and `msa explain --capability`)."""
        return cls("cuda", capability, sm_count, name or "pretend CUDA device", frozenset(packages))


def _installed(name: str) -> bool:
    """Whether module `name` can be imported, found without importing it (for a submodule, its
    file is looked up inside the top-level package's directories: its parents are not run)."""
    top, _, rest = name.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if not rest:
        return True
    for root in spec.submodule_search_locations or ():
        path = Path(root, *rest.split("."))
        if (path / "__init__.py").is_file() or path.with_suffix(".py").is_file():
            return True
    return False


def package_installed(package: str) -> bool:
    """Whether the optional `package` is installed in any of its `PACKAGE_LOCATIONS`."""
    return any(_installed(name) for name in PACKAGE_LOCATIONS.get(package, (package,)))


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (the kernels' host code needs it; checked once)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _detect(device_type: str, index: int | None) -> Platform:
    packages = frozenset(p for p in OPTIONAL_PACKAGES if package_installed(p))
    interpret = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
    if device_type == "cuda" and torch.cuda.is_available():
        dev = torch.device("cuda", index if index is not None else torch.cuda.current_device())
        props = torch.cuda.get_device_properties(dev)
        return Platform(
            "cuda", (props.major, props.minor), props.multi_processor_count, props.name, packages, interpret
        )
    return Platform(device_type, None, 0, device_type, packages, interpret)


def detect(device: torch.device | str | None = None) -> Platform:
    """The platform of `device` (default: CUDA if available, else CPU). Cached per device."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    return _detect(dev.type, dev.index)


def current_stream_key(device_index: int) -> int:
    """The current CUDA stream of device `device_index` as a number (0 off CUDA: an index < 0), as
    cheaply as torch offers it: what tells apart work that is ordered (one stream) from work
    that is not."""
    if device_index < 0:
        return 0
    return int(torch._C._cuda_getCurrentRawStream(device_index))


def stream_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream of `device` is capturing a graph (False off CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def resolve_device(device: torch.device | str | None) -> torch.device:
    """`device` as a `torch.device` with an index for CUDA; None means the current CUDA device
    where there is one, else the CPU.

    Raises:
        MSAInputError: not a device, or a CUDA device on a machine without one.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise MSAInputError("device", "a torch.device or a name such as 'cuda' or 'cpu'", repr(device)) from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise MSAInputError("device", "a device this machine has", f"{dev} (no CUDA device is available)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise MSAInputError("device", f"a CUDA index < {torch.cuda.device_count()}", dev)
    return dev
