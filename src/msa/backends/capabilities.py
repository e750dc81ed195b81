"""What a backend supports, as data, and the rules that turn those data into refusal reasons.

Two kinds of rule, each with one home here: machine rules read the `Platform` alone (device kind,
compute capability, packages) — what `msa backends` shows for this machine; step rules read the
`DecodeProblem` alone (layout, dtypes, geometry, query length, batch, LSE, ragged). Each returns
a sentence or None. `Capabilities.machine_reasons` and `Capabilities.step_reasons` apply them;
`Backend` adds its own checks beside them.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from msa.platform import PACKAGE_INSTALL, Platform
from msa.problem import DecodeProblem

__all__ = ["Capabilities", "MachineRule", "StepRule", "MACHINE_RULES", "STEP_RULES"]


def _names(values: frozenset[int] | frozenset[str] | tuple[int, ...]) -> str:
    return ", ".join(str(v) for v in sorted(values))


@attrs.frozen
class Capabilities:
    """A backend's declared support. `None` means "any".

    Attributes:
        device_types: device kinds it runs on ("cuda", "cpu", ...).
        capability_families: CUDA compute-capability majors (10 = SM100 family).
        compute_capabilities: the exact CUDA compute capabilities `(major, minor)` it runs on,
            for libraries qualified per chip rather than per family (FlashInfer: 10.0, 10.3,
            12.0, 12.1 — not 10.7).
        min_capability: the lowest CUDA compute capability `(major, minor)` (CUDA devices only).
        packages: importable packages it needs.
        kv_layouts: canonical layout names it reads.
        auto_layouts: layouts for which `backend="auto"` may choose it; otherwise it runs only
            when requested by name (None: any of `kv_layouts`).
        q_dtypes: query dtypes.
        head_dims: supported `D`.
        page_sizes: supported `P` (None with `power_of_two_pages` = any power of two >= 16).
        power_of_two_pages: `P` must be a power of two >= 16.
        topks: supported `K`.
        max_q_heads, max_kv_heads, max_group: head limits.
        query_lens: inclusive `(min L, max L)`.
        max_rows: the row budget `B * L * Hq`.
        min_batch: the batch floor `B >= min_batch` ...
        min_batch_exempt_layouts: ... except for these layouts.
        lse: can return the log-sum-exp.
        ragged: takes per-request query lengths (`query_start_loc`).
        uncapturable: why its `run` cannot be captured in a CUDA graph (it allocates, or reads
            device values on the host), or None: `run` allocates nothing and never synchronises.
            Steps whose caller will capture (`DecodeProblem.graph_capture`) are refused.

    Every default claims nothing that was not tested: a backend declares LSE and ragged support
    itself.
    """

    device_types: frozenset[str] | None = None
    capability_families: frozenset[int] | None = None
    compute_capabilities: frozenset[tuple[int, int]] | None = None
    min_capability: tuple[int, int] | None = None
    packages: tuple[str, ...] = ()
    kv_layouts: frozenset[str] = frozenset({"bfloat16", "float16", "fp8_e4m3", "nvfp4"})
    auto_layouts: frozenset[str] | None = None
    q_dtypes: frozenset[torch.dtype] = frozenset({torch.bfloat16, torch.float16})
    head_dims: frozenset[int] | None = None
    page_sizes: frozenset[int] | None = None
    power_of_two_pages: bool = False
    topks: frozenset[int] | None = None
    max_q_heads: int | None = None
    max_kv_heads: int | None = None
    max_group: int | None = None
    query_lens: tuple[int, int] = (1, 32)
    max_rows: int | None = None
    min_batch: int | None = None
    min_batch_exempt_layouts: frozenset[str] = frozenset()
    lse: bool = False
    ragged: bool = False
    uncapturable: str | None = None

    def machine_reasons(self, platform: Platform, requested: bool = False) -> list[str]:
        """Why a backend with these capabilities cannot run on `platform` at all."""
        return [r for rule in MACHINE_RULES if (r := rule(self, platform, requested)) is not None]

    def step_reasons(self, problem: DecodeProblem, requested: bool = False) -> list[str]:
        """Why a backend with these capabilities cannot run the step `problem`."""
        return [r for rule in STEP_RULES if (r := rule(self, problem, requested)) is not None]


#: A machine rule: (capabilities, platform, requested by name) -> reason or None.
MachineRule = Callable[[Capabilities, Platform, bool], "str | None"]
#: A step rule: (capabilities, step, requested by name) -> reason or None.
StepRule = Callable[[Capabilities, DecodeProblem, bool], "str | None"]


def device_rule(c: Capabilities, pf: Platform, requested: bool) -> str | None:
    if c.device_types is not None and pf.device_type not in c.device_types:
        return f"runs on {_names(c.device_types)}, not {pf.device_type}"
    return None


def capability_rule(c: Capabilities, pf: Platform, requested: bool) -> str | None:
    if c.capability_families is None:
        return None
    families = "/".join(f"{f}.x" for f in sorted(c.capability_families))
    if pf.capability is None:
        return f"needs a CUDA device of compute capability {families}"
    if pf.capability[0] not in c.capability_families:
        return f"needs compute capability {families}, this device is {pf.capability[0]}.{pf.capability[1]}"
    return None


def _capability_names(capabilities: frozenset[tuple[int, int]]) -> str:
    return ", ".join(f"{major}.{minor}" for major, minor in sorted(capabilities))


def compute_capability_rule(c: Capabilities, pf: Platform, requested: bool) -> str | None:
    if c.compute_capabilities is None:
        return None
    names = _capability_names(c.compute_capabilities)
    if pf.capability is None:
        return f"needs a CUDA device of compute capability {names}"
    if pf.capability not in c.compute_capabilities:
        return f"needs compute capability {names}, this device is {pf.capability[0]}.{pf.capability[1]}"
    return None


def min_capability_rule(c: Capabilities, pf: Platform, requested: bool) -> str | None:
    if c.min_capability is None or pf.capability is None or pf.capability >= c.min_capability:
        return None
    low, have = c.min_capability, pf.capability
    return f"needs compute capability >= {low[0]}.{low[1]}, this device is {have[0]}.{have[1]}"


def package_rule(c: Capabilities, pf: Platform, requested: bool) -> str | None:
    missing = [name for name in c.packages if not pf.has(name)]
    if missing:
        named = [f"{name} ({PACKAGE_INSTALL[name]})" if name in PACKAGE_INSTALL else name for name in missing]
        return "needs the package(s) " + ", ".join(named) + ", not installed"
    return None


def layout_rule(c: Capabilities, p: DecodeProblem, requested: bool) -> str | None:
    if p.kv_layout not in c.kv_layouts:
        return f"reads {_names(c.kv_layouts)} caches, not {p.kv_layout}"
    if not requested and c.auto_layouts is not None and p.kv_layout not in c.auto_layouts:
        return (
            f"chosen automatically only for {_names(c.auto_layouts)} caches; "
            f"request it by name for {p.kv_layout}"
        )
    return None


def q_dtype_rule(c: Capabilities, p: DecodeProblem, requested: bool) -> str | None:
    if p.q_dtype not in c.q_dtypes:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in c.q_dtypes))
        return f"takes q in {names}, not {str(p.q_dtype).removeprefix('torch.')}"
    return None


def heads_rule(c: Capabilities, p: DecodeProblem, requested: bool) -> str | None:
    g = p.geometry
    if c.max_q_heads is not None and g.num_q_heads > c.max_q_heads:
        return f"needs Hq <= {c.max_q_heads}, got {g.num_q_heads}"
    if c.max_kv_heads is not None and g.num_kv_heads > c.max_kv_heads:
        return f"needs Hkv <= {c.max_kv_heads}, got {g.num_kv_heads}"
    if c.max_group is not None and g.group_size > c.max_group:
        return f"needs a GQA group <= {c.max_group}, got {g.group_size}"
    return None


def head_dim_rule(c: Capabilities, p: DecodeProblem, requested: bool) -> str | None:
    if c.head_dims is not None and p.geometry.head_dim not in c.head_dims:
        return f"needs head dim in {{{_names(c.head_dims)}}}, got {p.geometry.head_dim}"
    return None


def page_size_rule(c: Capabilities, p: DecodeProblem, requested: bool) -> str | None:
    size = p.geometry.page_size
    if c.page_sizes is not None and size not in c.page_sizes:
        return f"needs page size in {{{_names(c.page_sizes)}}}, got {size}"
    if c.power_of_two_pages and (size < 16 or size & (size - 1)):
        return f"needs a power-of-two page size >= 16, got {size}"
    return None


def topk_rule(c: Capabilities, p: DecodeProblem, requested: bool) -> str | None:
    if c.topks is not None and p.geometry.topk not in c.topks:
        return f"needs top-k in {{{_names(c.topks)}}}, got {p.geometry.topk}"
    return None


def query_len_rule(c: Capabilities, p: DecodeProblem, requested: bool) -> str | None:
    low, high = c.query_lens
    if not low <= p.query_len <= high:
        return f"needs {low} <= L <= {high} query tokens per request, got {p.query_len}"
    return None


def row_budget_rule(c: Capabilities, p: DecodeProblem, requested: bool) -> str | None:
    if c.max_rows is None:
        return None
    rows = p.batch_size * p.query_len * p.geometry.num_q_heads
    if rows > c.max_rows:
        return f"needs B*L*Hq <= {c.max_rows} query-head rows, got {rows}"
    return None


def batch_floor_rule(c: Capabilities, p: DecodeProblem, requested: bool) -> str | None:
    if c.min_batch is None or p.kv_layout in c.min_batch_exempt_layouts:
        return None
    if p.batch_size < c.min_batch:
        exempt = (
            f" (unless the cache is {_names(c.min_batch_exempt_layouts)})"
            if c.min_batch_exempt_layouts
            else ""
        )
        return f"needs a batch of >= {c.min_batch} requests{exempt}, got {p.batch_size}"
    return None


def capture_rule(c: Capabilities, p: DecodeProblem, requested: bool) -> str | None:
    if p.graph_capture and c.uncapturable is not None:
        return f"cannot run inside CUDA-graph capture: {c.uncapturable}"
    return None


def lse_rule(c: Capabilities, p: DecodeProblem, requested: bool) -> str | None:
    if p.return_lse and not c.lse:
        return "does not return the log-sum-exp"
    return None


def ragged_rule(c: Capabilities, p: DecodeProblem, requested: bool) -> str | None:
    if p.ragged and not c.ragged:
        return "takes one query length for every request, not ragged ones (query_start_loc)"
    return None


#: Rules that depend on the machine alone (what `msa backends` shows).
MACHINE_RULES: tuple[MachineRule, ...] = (
    device_rule,
    capability_rule,
    compute_capability_rule,
    min_capability_rule,
    package_rule,
)
#: Rules that depend on the step alone.
STEP_RULES: tuple[StepRule, ...] = (
    layout_rule,
    q_dtype_rule,
    heads_rule,
    head_dim_rule,
    page_size_rule,
    topk_rule,
    query_len_rule,
    row_budget_rule,
    batch_floor_rule,
    lse_rule,
    ragged_rule,
    capture_rule,
)
