"""The row geometry of a step (docs/semantics.md §3): which request a query row belongs to, and
at which position.

Every backend, the deep checks and the planner's row metadata read `query_start_loc` through
`request_starts`, so a malformed one means the same thing everywhere and can never point a kernel
outside the rows it was given.
"""

from __future__ import annotations

import torch

__all__ = ["row_positions", "request_starts", "INT32_MAX"]

#: The largest value of the int32 tables, index lists and lengths a step is given (a page id
#: past it, from an int64 source, must be kept past every cache, never wrapped onto a real page).
INT32_MAX = torch.iinfo(torch.int32).max


def request_starts(query_start_loc: torch.Tensor, num_rows: int, decode_query_len: int) -> torch.Tensor:
    """`query_start_loc` `[B+1]` made well-formed, int64 `[B+1]`.

    A valid `query_start_loc` (non-decreasing from 0, at most `decode_query_len` rows per
    request, ending at or before `num_rows`) is returned unchanged. Anything else is read as:
    offsets clamped into `[0, num_rows]`, then made non-decreasing (a running maximum), then each
    request's row count capped at `decode_query_len`, counting from the first offset. So every
    request owns at most `L` consecutive rows inside `q`, no row belongs to two requests, and the
    rows outside every request are padding.
    """
    bounded = query_start_loc.long().clamp(0, num_rows)
    rising = torch.cummax(bounded, dim=0).values
    counts = (rising[1:] - rising[:-1]).clamp(max=min(decode_query_len, num_rows))  # (an L past int64's range)
    return torch.cat((rising[:1], rising[:1] + torch.cumsum(counts, dim=0)))


def row_positions(
    num_rows: int,
    seq_lens: torch.Tensor,
    *,
    decode_query_len: int,
    query_start_loc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, position) of every query row, int64 `[R]` each.

    Uniform: row `r = b*L + i` is request `b` at `seq_lens[b] - L + i`. Ragged
    (`query_start_loc` `[B+1]`, read through `request_starts`): request `b` owns rows
    `[qsl[b], qsl[b+1])` and its `i`-th row is at `seq_lens[b] - (qsl[b+1] - qsl[b]) + i`; rows
    owned by no request are padding, at position -1 (request 0), so they attend nothing.
    """
    device = seq_lens.device
    rows = torch.arange(num_rows, device=device)
    lens = seq_lens.long()
    if query_start_loc is None:
        request = rows // decode_query_len
        return request, lens[request] - decode_query_len + rows % decode_query_len
    batch = lens.shape[0]
    if batch == 0:  # every row is padding
        return torch.zeros_like(rows), torch.full_like(rows, -1)
    starts = request_starts(query_start_loc, num_rows, decode_query_len)
    request = torch.searchsorted(starts[1:], rows, right=True)  # first b with qsl[b+1] > r
    b = torch.where(request < batch, request, 0)
    inside = (request < batch) & (rows >= starts[b])
    count = starts[b + 1] - starts[b]
    position = torch.where(inside, lens[b] - count + (rows - starts[b]), -1)
    return torch.where(inside, b, 0), position
