"""What a plan knows of a step: the block table and lengths, and the per-row metadata."""

from __future__ import annotations

import attrs
import torch

from msa.planning.refresh import RowMetadata
from msa.problem import DecodeProblem
from msa.validation import DecodeInputs

__all__ = ["StepTables", "tensor_versions"]


@attrs.define(eq=False)
class StepTables:
    """The step's tables as of the latest `plan` call (the shape is the plan's `DecodeProblem`).

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
    versions: tuple[int, ...] = attrs.field(default=(), init=False)

    def __attrs_post_init__(self) -> None:
        self.versions = tensor_versions(self.block_table, self.seq_lens, self.query_start_loc)

    @classmethod
    def build(
        cls,
        problem: DecodeProblem,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        query_start_loc: torch.Tensor | None = None,
        seq_lens_cpu: torch.Tensor | None = None,
    ) -> StepTables:
        """Tables with fresh row metadata for a step of shape `problem` (a new plan)."""
        rows = RowMetadata.for_problem(problem, seq_lens.device)
        rows.refresh(seq_lens, query_start_loc)
        return cls(block_table, seq_lens, seq_lens_cpu, rows, query_start_loc)

    @classmethod
    def for_inputs(cls, problem: DecodeProblem, inputs: DecodeInputs) -> StepTables:
        """The tables of a checked step (`msa.validation.check_decode_inputs`)."""
        return cls.build(problem, inputs.block_table, inputs.seq_lens, query_start_loc=inputs.query_start_loc)

    def update(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        query_start_loc: torch.Tensor | None = None,
        seq_lens_cpu: torch.Tensor | None = None,
    ) -> None:
        """This step's tensors, and the row metadata refreshed from them in place."""
        self.block_table, self.seq_lens, self.seq_lens_cpu = block_table, seq_lens, seq_lens_cpu
        self.query_start_loc = query_start_loc
        self.rows.refresh(seq_lens, query_start_loc)
        self.versions = tensor_versions(block_table, seq_lens, query_start_loc)

    def holds(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None,
        seq_lens_cpu: torch.Tensor | None = None,
    ) -> bool:
        """These are the very tensors of the last refresh, and torch has not changed them in
        place since (their version counters). Inference tensors have none: for them the same
        objects hold (an engine under `torch.inference_mode()` passes each step's tables as new
        tensor objects; one that rewrites the same objects in place must pass fresh views)."""
        return (
            self.block_table is block_table
            and self.seq_lens is seq_lens
            and self.query_start_loc is query_start_loc
            and self.seq_lens_cpu is seq_lens_cpu
            and self.versions == tensor_versions(block_table, seq_lens, query_start_loc)
        )


def tensor_versions(*tensors: torch.Tensor | None) -> tuple[int, ...]:
    """The version counters of `tensors`: -1 for None, -2 for an inference tensor (made under
    `torch.inference_mode()`, where torch keeps no counter: identity alone decides for it)."""
    return tuple(-1 if t is None else -2 if t.is_inference() else t._version for t in tensors)
