"""Checks of a sharded step.

Deep checks (`validate=True` or `MSA_VALIDATE=1`) read device data and synchronise with the host,
and the coverage check is a collective, so they never run inside graph capture.

msa's own deep checks (`msa.validation.check_decode_data`) report a selected visible block whose
page is negative, which is right for one GPU but is exactly how a rank-local table marks the
blocks other ranks hold. Here `-1` entries count as "held elsewhere"; every other check runs
unchanged on this rank's inputs (`shard_usage`, local), and one more, across the group
(`check_coverage`), makes sure the shares fit together: every *used* block — selected by a row
that sees it — is held by exactly one rank (none: part of the attention would be silently
missing; two: it would be counted twice). Row `r` of request `b` sees
`n = max(seq_lens[b] - L + i + 1, 0)` tokens (its position + 1; ragged steps likewise), so it uses
block `j` of its list iff `0 <= j < ceil(n / P)`; a rank holds it iff its table has a page
(`>= 0`) there. Entries nothing uses (a padded request's row, blocks past every row's reach) are
never counted, whatever they hold.

`check_outputs_apart`: the outputs share no memory with each other or with any input (host only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from msa.api import select_backend
from msa.backends.base import AnyBackend
from msa.distributed.group import GroupInfo
from msa.errors import MSAInputError
from msa.problem import DecodeProblem
from msa.semantics import row_positions
from msa.validation import DecodeInputs, check_decode_data, check_decode_inputs, check_disjoint

__all__ = ["shard_usage", "check_coverage", "check_outputs_apart", "run_checked"]


def shard_usage(
    problem: DecodeProblem,
    inputs: DecodeInputs,
    *,
    decode_query_len: int,
    kv_cache_dtype: str | None,
) -> torch.Tensor:
    """The deep checks of this rank's share (local: no collective), and what it uses.

    Returns:
        int32 `[2, B, max_blocks]`: `[0]` 1 where this rank holds a used block (a page `>= 0`),
        `[1]` 1 where a block is used (selected by a row that sees it; the same on every rank).

    Raises:
        MSAInputError: the first problem found in this rank's inputs.
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
    request, position = row_positions(problem.num_rows, inputs.seq_lens, decode_query_len=decode_query_len,
                                      query_start_loc=inputs.query_start_loc)
    page = problem.geometry.page_size
    visible_blocks = ((position + 1).clamp(min=0) + page - 1) // page  # [R]: ceil(n / P)
    idx = inputs.topk_indices.long()  # in [-1, max_blocks): check_decode_data said so
    chosen = (idx >= 0) & (idx < visible_blocks.view(1, -1, 1))
    used = torch.zeros((batch, max_blocks), dtype=torch.bool, device=table.device)
    if batch and idx.numel():
        req = request.view(1, -1, 1).expand_as(idx)
        used[req[chosen], idx[chosen]] = True
    return torch.stack((used & (table >= 0), used)).to(torch.int32)


def check_coverage(info: GroupInfo, usage: torch.Tensor) -> None:
    """Every used block held by exactly one rank of the group. A collective (an all-reduce of
    `usage`, whose shape the group has agreed on); its errors are raised on every rank alike.

    Raises:
        MSAInputError: a used block held by two ranks or by none, or global inputs (lists,
            lengths) that differ between ranks.
    """
    total = usage.clone()
    dist.all_reduce(total, group=info.group)
    held, used = total[0], total[1]
    w = info.world_size
    differ = ((used > 0) & (used < w)).nonzero()
    if differ.shape[0]:
        b, j = (int(x) for x in differ[0])
        raise MSAInputError(
            "topk_indices / seq_lens / query_start_loc",
            "the same lists and lengths on every rank of the group (they are global)",
            f"block {j} of request {b} used on {int(used[b, j])} of the {w} ranks",
        )
    twice = (held > 1).nonzero()
    if twice.shape[0]:
        b, j = (int(x) for x in twice[0])
        raise MSAInputError(
            "block_table", "each used block held by at most one rank of the group",
            f"block {j} of request {b} held by {int(held[b, j])} ranks (it would be counted {int(held[b, j])} times)",
        )
    missing = ((used > 0) & (held == 0)).nonzero()
    if missing.shape[0]:
        b, j = (int(x) for x in missing[0])
        raise MSAInputError(
            "block_table", "every used block (selected by a row that sees it) held by one rank of the group",
            f"block {j} of request {b} is used but no rank holds a page for it",
        )


def check_outputs_apart(out: torch.Tensor, lse: torch.Tensor | None, inputs: Sequence[tuple[str, object]]) -> None:
    """`out` and `lse` share no memory with each other or with any tensor of `inputs` (name,
    tensor / tuple of tensors / anything else, skipped): the merge writes them last, after
    reading everything else. Host only and cheap (it runs on every eager call): tensors of two
    different storages are taken to be apart (two allocations never overlap); within one
    storage, `msa.validation.check_disjoint` compares the exact byte ranges.

    Raises:
        MSAInputError: naming the output and what it overlaps.
    """
    outputs = [("out", out)] if lse is None else [("out", out), ("lse", lse)]
    bases = [(name, o, o.untyped_storage().data_ptr()) for name, o in outputs]
    if lse is not None and bases[0][2] == bases[1][2]:
        check_disjoint("lse", lse, "out", out)
    for name, value in inputs:
        tensors = value if isinstance(value, tuple) else (value,)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                continue
            base = t.untyped_storage().data_ptr()
            for out_name, o, o_base in bases:
                if base == o_base and t.device == o.device:
                    check_disjoint(out_name, o, f"{name}[{i}]" if isinstance(value, tuple) else name, t)


def run_checked(
    problem: DecodeProblem, inputs: DecodeInputs, backend: str | AnyBackend, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Run a checked local step on `backend` (a backend object, or a name / "auto" to select one)
    without msa's single-GPU deep checks (which `shard_usage` replaced)."""
    chosen = select_backend(problem, backend) if isinstance(backend, str) else backend
    chosen.run_step(problem, inputs, out, lse)
