"""Per-row metadata written in place from `seq_lens` (graph-safe: fixed buffers, device ops only).

For row `r = b*L + i`: `row_request[r] = b`, `kv_lens[r] = seq_lens[b]` and
`q_pos[r] = seq_lens[b] - L + i` (the row's causal position, the "qo_offset" of kernel
libraries). A Triton kernel rewrites them on CUDA; torch ops elsewhere.
"""

from __future__ import annotations

import torch

__all__ = ["RowMetadata"]


class RowMetadata:
    """int32 buffers for `B*L` rows whose addresses never change; `refresh` rewrites them.

    Attributes:
        row_request: `[B*L]`, `r // L` (constant).
        row_shift: `[B*L]`, `L - r % L` (constant).
        kv_lens: `[B*L]` (or a caller-owned buffer), `seq_lens[r // L]`.
        q_pos: `[B*L]` (or a caller-owned buffer), `seq_lens[r // L] - L + r % L`.
    """

    def __init__(
        self,
        batch_size: int,
        query_len: int,
        device: torch.device | str,
        *,
        kv_lens: torch.Tensor | None = None,
        q_pos: torch.Tensor | None = None,
    ) -> None:
        rows = torch.arange(batch_size * query_len, device=device, dtype=torch.int32)
        self.batch_size = batch_size
        self.query_len = query_len
        self.num_rows = batch_size * query_len
        self.row_request = rows // query_len
        self.row_shift = query_len - rows % query_len
        self.kv_lens = kv_lens if kv_lens is not None else torch.zeros_like(rows)
        self.q_pos = q_pos if q_pos is not None else torch.zeros_like(rows)
        for name, buf in (("kv_lens", self.kv_lens), ("q_pos", self.q_pos)):
            if buf.dtype != torch.int32 or tuple(buf.shape) != (self.num_rows,):
                raise ValueError(
                    f"{name}: expected int32 [{self.num_rows}], got {buf.dtype} {tuple(buf.shape)}"
                )

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"row_request": self.row_request, "row_shift": self.row_shift, "kv_lens": self.kv_lens, "q_pos": self.q_pos}

    def refresh(self, seq_lens: torch.Tensor, *, kernel: bool | None = None) -> None:
        """Rewrite `kv_lens` and `q_pos` from `seq_lens` `[B]` int32, in place, on the device.

        Args:
            kernel: the Triton kernel (True), torch ops (False), or decide (None: Triton on CUDA).
        """
        if self.num_rows == 0:
            return
        if kernel is None:
            kernel = seq_lens.is_cuda and _triton_available()
        if kernel:
            from msa.planning.kernels import BLOCK, refresh_rows_kernel

            refresh_rows_kernel[(-(-self.num_rows // BLOCK),)](
                seq_lens, self.row_request, self.row_shift, self.kv_lens, self.q_pos, self.num_rows, BLOCK=BLOCK
            )
            return
        torch.index_select(seq_lens, 0, self.row_request, out=self.kv_lens)
        torch.sub(self.kv_lens, self.row_shift, out=self.q_pos)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
