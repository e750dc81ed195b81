"""Per-row metadata written in place from `seq_lens` (graph-safe: fixed buffers, device ops only).

For row `r = b*L + i`: `kv_lens[r] = seq_lens[b]` and `q_pos[r] = seq_lens[b] - L + i` (the
row's causal position, the "qo_offset" of kernel libraries).
"""

from __future__ import annotations

import torch

__all__ = ["RowMetadata"]


class RowMetadata:
    """Buffers for `B*L` rows whose addresses never change; `refresh` rewrites their contents.

    Attributes:
        row_request: int64 `[B*L]`, `r // L` (constant).
        row_shift: int32 `[B*L]`, `L - r % L` (constant).
        kv_lens: int32 `[B*L]` (or a caller-owned buffer), `seq_lens[r // L]`.
        q_pos: int32 `[B*L]` (or a caller-owned buffer), `seq_lens[r // L] - L + r % L`.
    """

    def __init__(
        self,
        batch_size: int,
        query_len: int,
        device: torch.device,
        *,
        kv_lens: torch.Tensor | None = None,
        q_pos: torch.Tensor | None = None,
    ) -> None:
        rows = torch.arange(batch_size * query_len, device=device)
        self.query_len = query_len
        self.row_request = rows // query_len
        self.row_shift = (query_len - rows % query_len).to(torch.int32)
        self.kv_lens = kv_lens if kv_lens is not None else torch.zeros_like(self.row_shift)
        self.q_pos = q_pos if q_pos is not None else torch.zeros_like(self.row_shift)
        for name, buf in (("kv_lens", self.kv_lens), ("q_pos", self.q_pos)):
            if buf.dtype != torch.int32 or tuple(buf.shape[:1]) != (rows.shape[0],):
                raise ValueError(f"{name}: expected int32 [{rows.shape[0]}], got {buf.dtype} {tuple(buf.shape)}")

    def refresh(self, seq_lens: torch.Tensor) -> None:
        """Rewrite `kv_lens` and `q_pos` from `seq_lens` `[B]` int32, in place, on the device."""
        rows = self.row_request.shape[0]
        torch.index_select(seq_lens, 0, self.row_request, out=self.kv_lens[:rows])
        torch.sub(self.kv_lens[:rows], self.row_shift, out=self.q_pos[:rows])
