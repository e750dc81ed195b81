"""SPEC §3's row geometry: which request a query row belongs to, and at which position."""

from __future__ import annotations

import torch

__all__ = ["row_positions"]


def row_positions(
    num_rows: int,
    seq_lens: torch.Tensor,
    *,
    decode_query_len: int,
    query_start_loc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, position) of every query row, int64 `[R]` each.

    Uniform: row `r = b*L + i` is request `b` at `seq_lens[b] - L + i`. Ragged
    (`query_start_loc` `[B+1]`): request `b` owns rows `[qsl[b], qsl[b+1])` and its `i`-th row is
    at `seq_lens[b] - (qsl[b+1] - qsl[b]) + i`; rows past `qsl[B]` are padding, at position -1
    (request 0), so they attend nothing.
    """
    device = seq_lens.device
    rows = torch.arange(num_rows, device=device)
    lens = seq_lens.long()
    if query_start_loc is None:
        request = rows // decode_query_len
        return request, lens[request] - decode_query_len + rows % decode_query_len
    starts = query_start_loc.long()
    batch = lens.shape[0]
    request = torch.searchsorted(starts[1:], rows, right=True)  # first b with qsl[b+1] > r
    inside = request < batch
    b = torch.where(inside, request, 0)
    count = starts[b + 1] - starts[b]
    position = torch.where(inside, lens[b] - count + (rows - starts[b]), -1)
    return b, position
