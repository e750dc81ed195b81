"""Deep checks of a sharded step (`validate=True` or `MSA_VALIDATE=1`): they read device data,
synchronise with the host and make a collective, so they never run inside graph capture.

msa's own deep checks (`msa.validation.check_decode_data`) report a selected visible block whose
page is negative, which is right for one GPU but is exactly how a rank-local table marks the
blocks other ranks hold. Here `-1` entries count as "held elsewhere"; every other check runs
unchanged on this rank's inputs, and one more, across the group, makes sure the shares fit
together: every selected visible block is held by exactly one rank (none: part of the attention
would be silently missing; two: it would be counted twice).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from msa.api import select_backend
from msa.backends.base import AnyBackend
from msa.distributed.group import GroupInfo
from msa.errors import MSAInputError
from msa.problem import DecodeProblem
from msa.semantics import row_positions
from msa.validation import DecodeInputs, check_decode_data, check_decode_inputs

__all__ = ["check_shard", "run_checked"]


def check_shard(
    info: GroupInfo,
    problem: DecodeProblem,
    inputs: DecodeInputs,
    *,
    decode_query_len: int,
    kv_cache_dtype: str | None,
) -> None:
    """The deep checks of this rank's share, and the group's coverage of every selected block.

    A collective (every rank calls it, in the same order as its other collectives).

    Raises:
        MSAInputError: the first problem found (the coverage error is raised on every rank).
    """
    table = inputs.block_table
    held_table = torch.where(table == -1, torch.zeros_like(table), table)  # -1: held by another rank
    p_check, i_check = check_decode_inputs(
        inputs.q, inputs.kv_cache, inputs.topk_indices, held_table, inputs.seq_lens,
        decode_query_len=decode_query_len, kv_cache_dtype=kv_cache_dtype, sm_scale=inputs.sm_scale,
        q_scale=inputs.q_scale, k_scale=inputs.k_scale, v_scale=inputs.v_scale,
        query_start_loc=inputs.query_start_loc,
    )
    check_decode_data(p_check, i_check)
    batch, max_blocks = table.shape
    held = ((table >= 0) & (table < problem.num_pages)).to(torch.int32)
    dist.all_reduce(held, group=info.group)
    request, position = row_positions(problem.num_rows, inputs.seq_lens, decode_query_len=decode_query_len,
                                      query_start_loc=inputs.query_start_loc)
    page = problem.geometry.page_size
    visible_blocks = ((position + 1).clamp(min=0) + page - 1) // page  # [R]
    idx = inputs.topk_indices.long()
    chosen = (idx >= 0) & (idx < visible_blocks.view(1, -1, 1)) & (idx < max_blocks)
    selected = torch.zeros((batch, max_blocks), dtype=torch.bool, device=table.device)
    if batch:
        req = request.view(1, -1, 1).expand_as(idx)
        selected[req[chosen], idx[chosen]] = True
    twice = (held > 1).nonzero()
    if twice.shape[0]:
        b, j = (int(x) for x in twice[0])
        raise MSAInputError(
            "block_table", "each block held by at most one rank of the group",
            f"block {j} of request {b} held by {int(held[b, j])} ranks (it would be counted {int(held[b, j])} times)",
        )
    missing = (selected & (held == 0)).nonzero()
    if missing.shape[0]:
        b, j = (int(x) for x in missing[0])
        raise MSAInputError(
            "block_table", "every selected visible block held by one rank of the group",
            f"block {j} of request {b} is selected but no rank holds a page for it",
        )


def run_checked(
    problem: DecodeProblem, inputs: DecodeInputs, backend: str | AnyBackend, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Run a checked local step on `backend` (a backend object, or a name / "auto" to select one)
    without msa's single-GPU deep checks (which `check_shard` replaced)."""
    chosen = select_backend(problem, backend) if isinstance(backend, str) else backend
    chosen.run_step(problem, inputs, out, lse)
