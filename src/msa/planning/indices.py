"""The index lists of docs/semantics.md §3 resolved: which entries a row attends (the reference
reads them; `backends.external.TopkCompactor` writes the same rule allocation-free for kernel
libraries, and is tested against this)."""

from __future__ import annotations

import torch

from msa.semantics import row_positions
from msa.validation import DecodeInputs

__all__ = ["resolve_entries"]


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
