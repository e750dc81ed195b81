"""Shared pieces of the adapters for external kernel libraries: finding the library, host scalars,
graph-capture detection, and the index lists rewritten into the form the libraries read.

`TopkCompactor` is what keeps the adapters' `run` within the backend contract: it rewrites the
caller's index lists with device ops into buffers allocated once per plan (`out=` variants and
in-place ops only), so it allocates nothing, never synchronises and can be captured in a CUDA
graph.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

import torch

from msa.errors import MSAUnsupportedError
from msa.planning import RowMetadata
from msa.platform import stream_capturing
from msa.problem import DecodeProblem
from msa.scales import Scale
from msa.semantics import INT32_MAX
from msa.validation import DecodeInputs

__all__ = ["import_first", "library_version", "stream_capturing", "host_scalar", "TopkCompactor"]

#: Sorts after every block id: marks the entries a list drops.
_LAST = INT32_MAX


def import_first(backend: str, modules: tuple[str, ...], attributes: tuple[str, ...]) -> ModuleType:
    """The first of `modules` that imports and has every one of `attributes`.

    Raises:
        MSAUnsupportedError: none does; the message names the backend and every failure.
    """
    failures = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            failures.append(f"{name}: {exc}")
            continue
        missing = [a for a in attributes if not hasattr(module, a)]
        if not missing:
            return module
        failures.append(f"{name}: has no {', '.join(missing)}")
    raise MSAUnsupportedError(
        f"backend {backend!r} needs one of the modules {', '.join(repr(m) for m in modules)}, "
        "none of which imports: " + "; ".join(failures)
    )


def library_version(*distributions: str) -> str:
    """`name version` of the first installed distribution, or "" when none is."""
    for distribution in distributions:
        try:
            return f"{distribution} {importlib.metadata.version(distribution)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def host_scalar(backend: str, name: str, value: Scale, device: torch.device, why: str) -> float:
    """A scale the library takes as a host number (a C++ `double`, a python `float`).

    A one-element tensor is read with `float()` — a device-to-host synchronisation — outside
    graph capture; inside capture that read is impossible, so it raises.

    Raises:
        MSAUnsupportedError: a tensor scale while the stream is capturing.
    """
    if not isinstance(value, torch.Tensor):
        return value
    if stream_capturing(device):
        raise MSAUnsupportedError(
            f"backend {backend!r} takes {name} as a host number ({why}); a tensor would have to be "
            "read on the host, which CUDA-graph capture forbids: pass a python float"
        )
    return float(value)


class TopkCompactor:
    """The index lists of a step in the form kernel libraries read: each list's used entries
    (docs/semantics.md §3) in ascending order, `-1` at the tail, every skipped entry removed —
    so a kernel that trusts "ascending, padded at the end, every id readable" computes exactly
    the step msa defines.

    Every buffer is allocated here, once per plan; `compact` uses `out=` variants and in-place
    device ops only, on operands of one dtype (no temporaries, no host synchronisation:
    capturable). It reads each row's causal position from `rows` (refreshed in place by `plan`),
    and the block table and cache size of the call.

    Args:
        problem: the plan's step shape (uniform query lengths: the adapters take no ragged steps).
        rows: the per-row metadata the plan refreshes (`q_pos`: each row's causal position).
        device: where the buffers live.
    """

    def __init__(self, problem: DecodeProblem, rows: RowMetadata, device: torch.device) -> None:
        if problem.ragged:
            raise ValueError("TopkCompactor: ragged steps are not supported")
        g = problem.geometry
        shape = (g.num_kv_heads, problem.num_rows, g.topk)
        self.page_size = g.page_size
        self.rows = rows
        self.ids = torch.empty(shape, dtype=torch.int32, device=device)
        self.ordered = torch.empty(shape, dtype=torch.int32, device=device)
        self.order = torch.empty(shape, dtype=torch.int64, device=device)
        self.flat = torch.empty(shape, dtype=torch.int64, device=device)
        self.pages = torch.empty(shape, dtype=torch.int32, device=device)
        self.used = torch.empty(shape, dtype=torch.bool, device=device)
        self.mask = torch.empty(shape, dtype=torch.bool, device=device)
        self.limit = torch.empty((problem.num_rows,), dtype=torch.int32, device=device)
        # row r reads table row r // L, which starts at element (r // L) * stride of the table
        self.row_start = rows.row_request.to(torch.int64) * problem.table_stride

    def compact(self, inputs: DecodeInputs, out: torch.Tensor) -> torch.Tensor:
        """Write the lists of `inputs.topk_indices` into `out` (int32 `[Hkv, R, K]`, any strides:
        the transpose of a token-major buffer too). Returns `out`."""
        if self.ids.numel() == 0:
            return out
        table = inputs.block_table
        batch, width = table.shape
        ids, used, mask, flat, pages, limit = self.ids, self.used, self.mask, self.flat, self.pages, self.limit
        ids.copy_(inputs.topk_indices)
        # visible blocks: ceil((q_pos + 1) / P) for q_pos >= -1, never past the table (in int32:
        # the position is first clamped to the table's reach, so adding P cannot overflow)
        size = self.page_size
        torch.clamp(self.rows.q_pos, max=min(width * size, INT32_MAX - size), out=limit)
        limit.add_(size).floor_divide_(size).clamp_(max=width)
        torch.ge(ids, 0, out=used)
        torch.lt(ids, limit.view(1, -1, 1), out=mask)
        used.logical_and_(mask)
        # the page of every entry (of the row's entry 0 for unused ones: inside the table)
        torch.logical_not(used, out=mask)
        flat.copy_(ids)
        flat.masked_fill_(mask, 0)
        flat.add_(self.row_start.view(1, -1, 1))
        flat_table = table.as_strided(((batch - 1) * table.stride(0) + width,), (1,))
        torch.take(flat_table, flat, out=pages)
        torch.ge(pages, 0, out=mask)
        used.logical_and_(mask)
        torch.lt(pages, inputs.problem.num_pages, out=mask)
        used.logical_and_(mask)
        torch.logical_not(used, out=mask)
        ids.masked_fill_(mask, _LAST)
        # ascending order: a full top-k (on CUDA `sort` allocates a temporary even with `out=`)
        torch.topk(ids, ids.shape[-1], dim=-1, largest=False, sorted=True, out=(self.ordered, self.order))
        torch.eq(self.ordered, _LAST, out=mask)
        self.ordered.masked_fill_(mask, -1)
        out.copy_(self.ordered)
        return out
