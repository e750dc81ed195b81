"""The index lists of docs/semantics.md §3 resolved: which entries a row attends, and a compact, sorted form
for kernel libraries that want ascending ids with `-1` padding at the tail."""

from __future__ import annotations

import torch

from msa.semantics import row_positions

__all__ = ["row_positions", "resolve_entries", "compact_topk"]

_LAST = torch.iinfo(torch.int32).max


def resolve_entries(
    topk_indices: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    decode_query_len: int,
    page_size: int,
    num_pages: int,
    query_start_loc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Resolve index lists into what each row attends.

    Args:
        topk_indices: int `[Hkv, R, K]`, any strides.
        block_table: int `[B, max_blocks]`.
        seq_lens: int `[B]`.

    Returns:
        `(used, block, page, visible)`:
        - `used` bool `[Hkv, R, K]`: the entry is attended (`0 <= j < ceil(n/P)`, `j` inside the
          block table, its page inside `[0, num_pages)`);
        - `block` int64 `[Hkv, R, K]`: the block id (0 where unused);
        - `page` int64 `[Hkv, R, K]`: the physical page (0 where unused);
        - `visible` int64 `[R]`: `n = max(position + 1, 0)` (see `row_positions`).
    """
    max_blocks = block_table.shape[1]
    request, position = row_positions(
        topk_indices.shape[1], seq_lens, decode_query_len=decode_query_len, query_start_loc=query_start_loc
    )
    visible = (position + 1).clamp(min=0)
    limit = ((visible + page_size - 1) // page_size).clamp(max=max_blocks)
    idx = topk_indices.long()
    used = (idx >= 0) & (idx < limit.view(1, -1, 1))
    block = torch.where(used, idx, 0)
    if block_table.shape[0] == 0:  # no requests: every row is padding, nothing is used
        page = torch.zeros_like(block)
    else:
        page = block_table.long()[request.view(1, -1, 1), block]
    used &= (page >= 0) & (page < num_pages)
    return used, block, torch.where(used, page, 0), visible


def compact_topk(
    topk_indices: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    decode_query_len: int,
    page_size: int,
    num_pages: int,
    out: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the used entries of each list in ascending order, `-1`-padded at the tail, into `out`.

    Every entry docs/semantics.md §3 skips becomes `-1`, so a kernel that trusts "ascending ids, padding at
    the end, every id readable" computes exactly the result docs/semantics.md §3 defines.

    Args:
        out: int32 `[Hkv, R, K]` (head-major) or a transposed view of a token-major buffer.
    """
    used, block, _, _ = resolve_entries(
        topk_indices,
        block_table,
        seq_lens,
        decode_query_len=decode_query_len,
        page_size=page_size,
        num_pages=num_pages,
        query_start_loc=query_start_loc,
    )
    keyed = torch.where(used, block, _LAST)
    ordered = keyed.sort(dim=-1).values
    out.copy_(torch.where(ordered == _LAST, -1, ordered))
    return out
