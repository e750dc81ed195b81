"""Per-row metadata written in place from `seq_lens` (graph-safe: fixed buffers, device ops only).

For row `r = b*L + i`: `row_request[r] = b`, `kv_lens[r] = seq_lens[b]` and
`q_pos[r] = max(seq_lens[b] - L + i, -1)` (the row's causal position, the "qo_offset" of kernel
libraries; -1 for every row that sees nothing). A Triton kernel rewrites them on CUDA; torch ops elsewhere. Ragged steps
(`query_start_loc`) are refreshed with torch ops: `req_start` holds `query_start_loc` as
`msa.semantics.request_starts` reads it (well-formed whatever the caller passed), and rows
owned by no request get position -1.
"""

from __future__ import annotations

from typing import Any

import torch

from msa.platform import triton_available
from msa.problem import DecodeProblem
from msa.semantics import request_starts, row_positions

__all__ = ["RowMetadata"]


class RowMetadata:
    """int32 buffers for `B*L` rows whose addresses never change; `refresh` rewrites them.

    Attributes:
        row_request: `[R]`, the row's request (`r // L` when uniform: constant).
        row_shift: `[R]`, `L - r % L` (uniform steps).
        req_start: `[B+1]`, the first row of each request (`b * L`, or `query_start_loc`).
        kv_lens: `[R]` (or a caller-owned buffer), the request's length.
        q_pos: `[R]` (or a caller-owned buffer), the row's causal position.
    """

    def __init__(
        self,
        batch_size: int,
        query_len: int,
        device: torch.device | str,
        *,
        num_rows: int | None = None,
        ragged: bool = False,
        kv_lens: torch.Tensor | None = None,
        q_pos: torch.Tensor | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.query_len = query_len
        self.ragged = ragged
        self.num_rows = batch_size * query_len if num_rows is None else num_rows
        rows = torch.arange(self.num_rows, device=device, dtype=torch.int32)
        self.row_request = rows // query_len
        self.row_shift = query_len - rows % query_len
        self.req_start = torch.arange(batch_size + 1, device=device, dtype=torch.int32) * query_len
        self.kv_lens = kv_lens if kv_lens is not None else torch.zeros_like(rows)
        self.q_pos = q_pos if q_pos is not None else torch.zeros_like(rows)
        self._kernel: Any = None  # the refresh kernel's launcher, made on the first refresh on CUDA
        for name, buf in (("kv_lens", self.kv_lens), ("q_pos", self.q_pos)):
            if buf.dtype != torch.int32 or tuple(buf.shape) != (self.num_rows,):
                raise ValueError(
                    f"{name}: expected int32 [{self.num_rows}], got {buf.dtype} {tuple(buf.shape)}"
                )

    @classmethod
    def for_problem(
        cls,
        problem: DecodeProblem,
        device: torch.device | str,
        *,
        kv_lens: torch.Tensor | None = None,
        q_pos: torch.Tensor | None = None,
    ) -> RowMetadata:
        """Buffers for the rows of a step of shape `problem` (optionally into a kernel library's
        own `kv_lens` / `q_pos` buffers)."""
        return cls(
            problem.batch_size, problem.query_len, device, num_rows=problem.num_rows, ragged=problem.ragged,
            kv_lens=kv_lens, q_pos=q_pos,
        )

    def buffers(self) -> dict[str, torch.Tensor]:
        return {
            "row_request": self.row_request,
            "row_shift": self.row_shift,
            "req_start": self.req_start,
            "kv_lens": self.kv_lens,
            "q_pos": self.q_pos,
        }

    def refresh(
        self,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None = None,
        *,
        kernel: bool | None = None,
    ) -> None:
        """Rewrite the metadata from `seq_lens` `[B]` (and, when ragged, `query_start_loc`
        `[B+1]`) int32, in place, on the device.

        Args:
            kernel: the Triton kernel (True), torch ops (False), or decide (None: Triton on CUDA).
        """
        if self.num_rows == 0:
            return
        if self.ragged:
            if query_start_loc is None:
                raise ValueError("query_start_loc: a ragged plan needs it at every refresh")
            request, position = row_positions(
                self.num_rows, seq_lens, decode_query_len=self.query_len, query_start_loc=query_start_loc
            )
            self.row_request.copy_(request)
            self.q_pos.copy_(position.clamp(min=-1))
            lens = torch.cat((seq_lens.long(), seq_lens.new_zeros(1, dtype=torch.long)))  # B may be 0
            self.kv_lens.copy_(torch.where(position >= 0, lens[request], 0))
            self.req_start.copy_(request_starts(query_start_loc, self.num_rows, self.query_len))
            return
        if kernel is None:
            kernel = seq_lens.is_cuda and triton_available()
        if kernel:
            from msa.launcher import DirectKernel, direct_launch_enabled, unit_stride
            from msa.planning.kernels import BLOCK, refresh_rows_kernel

            if self._kernel is None:  # the rows, hence the grid and the integer arguments, never change
                self._kernel = DirectKernel(refresh_rows_kernel, (-(-self.num_rows // BLOCK),))
            self._kernel(dict(seq_lens_ptr=unit_stride(seq_lens), row_request_ptr=self.row_request,
                              row_shift_ptr=self.row_shift, kv_lens_ptr=self.kv_lens, q_pos_ptr=self.q_pos,
                              num_rows=self.num_rows, BLOCK=BLOCK),
                         direct_launch_enabled())
            return
        torch.index_select(seq_lens, 0, self.row_request, out=self.kv_lens)
        # in int64: a length near -2**31 must not wrap around to a huge position
        self.q_pos.copy_((self.kv_lens.long() - self.row_shift).clamp(min=-1))
