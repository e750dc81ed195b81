"""The index lists of docs/semantics.md §3 resolved: which entries a row attends, and a compact, sorted form
for kernel libraries that want ascending ids with `-1` padding at the tail."""

from __future__ import annotations

import torch

from msa.semantics import row_positions
from msa.validation import DecodeInputs

__all__ = ["resolve_entries", "compact_topk"]

_LAST = torch.iinfo(torch.int32).max


def resolve_entries(inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Resolve a checked step's index lists into what each row attends (docs/semantics.md §3).

    Returns:
        `(used, block, page, visible)`:
        - `used` bool `[Hkv, R, K]`: the entry is attended (`0 <= j < ceil(n/P)`, `j` inside the
          block table, its page inside `[0, num_pages)`);
        - `block` int64 `[Hkv, R, K]`: the block id (0 where unused);
        - `page` int64 `[Hkv, R, K]`: the physical page (0 where unused);
        - `visible` int64 `[R]`: `n = max(position + 1, 0)` (see `row_positions`).
    """
    problem, block_table = inputs.problem, inputs.block_table
    page_size, max_blocks = problem.geometry.page_size, block_table.shape[1]
    request, position = row_positions(
        problem.num_rows, inputs.seq_lens, decode_query_len=problem.query_len, query_start_loc=inputs.query_start_loc
    )
    visible = (position + 1).clamp(min=0)
    limit = ((visible + page_size - 1) // page_size).clamp(max=max_blocks)
    idx = inputs.topk_indices.long()
    used = (idx >= 0) & (idx < limit.view(1, -1, 1))
    block = torch.where(used, idx, 0)
    # no requests: every row is padding, nothing is used (and there is no table row to index)
    page = torch.zeros_like(block) if block_table.shape[0] == 0 else block_table.long()[request.view(1, -1, 1), block]
    used &= (page >= 0) & (page < problem.num_pages)
    return used, block, torch.where(used, page, 0), visible


def compact_topk(inputs: DecodeInputs, out: torch.Tensor) -> torch.Tensor:
    """Write the used entries of each list in ascending order, `-1`-padded at the tail, into `out`.

    Every entry docs/semantics.md §3 skips becomes `-1`, so a kernel that trusts "ascending ids,
    padding at the end, every id readable" computes exactly the result docs/semantics.md §3
    defines.

    Args:
        out: int32 `[Hkv, R, K]` (head-major) or a transposed view of a token-major buffer.
    """
    used, block, _, _ = resolve_entries(inputs)
    keyed = torch.where(used, block, _LAST)
    ordered = keyed.sort(dim=-1).values
    out.copy_(torch.where(ordered == _LAST, -1, ordered))
    return out
