"""`plan()`'s half of a step: its tables checked, and a cached plan's per-row metadata refreshed
in place from them (one small kernel on CUDA; the buffers keep their addresses)."""

from __future__ import annotations

import torch

from msa.errors import MSAInputError, is_int
from msa.planner.plans import DecodePlan
from msa.validation import check_int32, check_tensor

__all__ = ["check_tables", "check_host_lens", "check_ragged", "refresh"]


def check_tables(
    block_table: object, seq_lens: object, device: torch.device, decode_query_len: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(block_table, seq_lens)` as int32 `[B, max_blocks]` (unit last stride) and `[B]` tensors
    on the planner's device, with `decode_query_len` an int >= 1."""
    table = check_tensor("block_table", block_table, device, "the planner's device")
    check_int32("block_table", table, "[B, max_blocks]", 2)
    lens = check_tensor("seq_lens", seq_lens, device, "the planner's device")
    check_int32("seq_lens", lens, "[B]", 1)
    if table.shape[0] != lens.shape[0] or table.shape[1] < 1:
        expected = f"shape [{lens.shape[0]}, max_blocks >= 1] (B from seq_lens)"
        raise MSAInputError("block_table", expected, tuple(table.shape))
    if table.stride(-1) != 1:
        raise MSAInputError("block_table", "unit stride in the last dimension", table.stride())
    if not is_int(decode_query_len) or decode_query_len < 1:
        raise MSAInputError("decode_query_len", "an int >= 1", repr(decode_query_len))
    return table, lens


def check_host_lens(seq_lens_cpu: object, lens: torch.Tensor) -> torch.Tensor | None:
    """`seq_lens_cpu`, when given: int32 `[B]` on the host, as many entries as `seq_lens` (its
    values are the caller's promise: kernel libraries plan from them)."""
    if seq_lens_cpu is None:
        return None
    host = check_tensor("seq_lens_cpu", seq_lens_cpu, torch.device("cpu"), "the host")
    check_int32("seq_lens_cpu", host, "[B]", 1)
    if host.shape != lens.shape:
        raise MSAInputError("seq_lens_cpu", f"{lens.shape[0]} entries (B from seq_lens)", host.shape[0])
    return host


def check_ragged(query_start_loc: object, num_rows: object, batch: int, device: torch.device) -> int | None:
    """The rows of a ragged step (`query_start_loc` int32 `[B+1]` with `num_rows` the rows of q),
    or None for a uniform one."""
    if query_start_loc is None:
        if num_rows is not None:
            raise MSAInputError("num_rows", "None for a uniform step (it is B * decode_query_len)", num_rows)
        return None
    starts = check_tensor("query_start_loc", query_start_loc, device, "the planner's device")
    check_int32("query_start_loc", starts, "[B+1]", 1)
    if starts.shape[0] != batch + 1:
        raise MSAInputError("query_start_loc", f"{batch + 1} entries (B+1, B from seq_lens)", starts.shape[0])
    if not is_int(num_rows) or num_rows < 0:
        raise MSAInputError("num_rows", "the rows of q (an int >= 0) for a ragged step", repr(num_rows))
    return num_rows


def refresh(
    plan: DecodePlan,
    table: torch.Tensor,
    lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens_cpu: torch.Tensor | None,
    *,
    reuse: bool = False,
) -> None:
    """Point `plan` at this step's tables and refresh its per-row metadata (and the backend's own
    plan) in place. With `reuse`, a plan whose tables are these very tensors, unchanged since its
    last refresh (`StepTables.holds`), is left as it is: the later layers of an eager step."""
    if reuse and plan.tables.holds(table, lens, query_start_loc, seq_lens_cpu):
        return
    plan.tables.update(table, lens, query_start_loc=query_start_loc, seq_lens_cpu=seq_lens_cpu)
    plan.backend.refresh(plan.backend_plan, plan.tables)
