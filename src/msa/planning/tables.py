"""What a plan knows of a step: the block table and lengths, and the per-row metadata."""

from __future__ import annotations

import attrs
import torch

from msa.planning.refresh import RowMetadata

__all__ = ["StepTables"]


@attrs.define(eq=False)
class StepTables:
    """The step's tables as of the latest `plan` call.

    Attributes:
        block_table: int32 `[B, max_blocks]` on the device.
        seq_lens: int32 `[B]` on the device.
        seq_lens_cpu: int32 `[B]` on the host, when the caller has it (kernel libraries that
            plan on the host use it; otherwise they read `seq_lens` once, when a shape is first
            planned).
        rows: the per-row metadata, refreshed in place at every `plan`.
        query_start_loc: int32 `[B+1]` of a ragged step, else None.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor | None
    rows: RowMetadata
    query_start_loc: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        decode_query_len: int,
        seq_lens_cpu: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
        num_rows: int | None = None,
    ) -> StepTables:
        """Tables with fresh row metadata (what the planner does for a new shape)."""
        ragged = query_start_loc is not None
        rows = RowMetadata(seq_lens.shape[0], decode_query_len, seq_lens.device, num_rows=num_rows, ragged=ragged)
        rows.refresh(seq_lens, query_start_loc)
        return cls(block_table, seq_lens, seq_lens_cpu, rows, query_start_loc)
