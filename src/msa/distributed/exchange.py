"""Preallocated communication buffers and the collectives of one merge configuration.

An `Exchange` serves one step shape (rows, heads, head dim, output dtype) on one group with one
method. It owns the buffers the local decode writes its partial into (`local_out`,
`local_lse`) and every buffer its collectives read and write, so `merge` allocates nothing and
never synchronises with the host: with NCCL it can be captured in a CUDA graph.

Methods (`W` ranks, `H` heads, `Hh = H / W`; "elements" in the output dtype, fp32 = 2 of them):

| method | result | collectives | elements each rank receives |
|---|---|---|---|
| `all_gather` | all heads, or own | one all-gather of out + LSE packed | `(W-1) T H (D+2)` |
| `all_to_all` | own heads | one all-to-all of head chunks (vLLM "a2a") | `(W-1)/W T H (D+2)` |
| `all_to_all` | all heads | the above, then an all-gather of the result | twice that |
| `reduce_scatter` | own heads | LSE all-gather, correction, reduce-scatter | `(W-1) T H 2 + (W-1)/W T H D` (*) |
| `all_reduce` | all heads | LSE all-gather, correction, all-reduce | `(W-1) T H 2` + all-reduce of `T H D` (*) |

(*) the summed partials travel in `reduce_dtype` (fp32 by default: twice the elements).

The LSE travels inside the output's buffer (its fp32 bits as two 16-bit elements), so
`all_gather` and `all_to_all` need one collective each.
"""

from __future__ import annotations

import torch

from msa.distributed.combine import combine_into, correct_into
from msa.distributed.group import GroupInfo, all_gather_into, all_reduce_, all_to_all_into, reduce_scatter_into
from msa.errors import MSAInputError

__all__ = ["Exchange", "FULL_METHODS", "SCATTERED_METHODS", "METHODS", "check_method"]

#: Methods that give every rank all heads.
FULL_METHODS: tuple[str, ...] = ("all_gather", "all_to_all", "all_reduce")
#: Methods that give each rank its `H / W` heads (tensor-parallel engines).
SCATTERED_METHODS: tuple[str, ...] = ("reduce_scatter", "all_to_all", "all_gather")
#: Every method, once.
METHODS: tuple[str, ...] = tuple(dict.fromkeys(FULL_METHODS + SCATTERED_METHODS))

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_method(method: object, scatter_heads: bool) -> str:
    """`method` if it serves this form of result, else an `MSAInputError`."""
    allowed = SCATTERED_METHODS if scatter_heads else FULL_METHODS
    if not isinstance(method, str) or method not in allowed:
        form = "a head-scattered merge" if scatter_heads else "a merge that returns all heads"
        raise MSAInputError("method", f"one of {', '.join(map(repr, allowed))} for {form}", repr(method))
    return method


def _packed_size(rows: int, heads: int, dim: int, lse_units: int) -> tuple[int, int]:
    """(elements of the output part, rounded up so the LSEs start on an fp32 boundary; total)."""
    n_out = -(-rows * heads * dim // lse_units) * lse_units
    return n_out, n_out + rows * heads * lse_units


def _packed(buffer: torch.Tensor, rows: int, heads: int, dim: int, lse_units: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a `[..., n]` buffer holding `[rows, heads, dim]` outputs then `[rows, heads]` fp32
    LSEs (as raw bits): `([..., rows, heads, dim], [..., rows, heads])`."""
    n_out, total = _packed_size(rows, heads, dim, lse_units)
    lead = buffer.shape[:-1]
    out = buffer[..., : rows * heads * dim].view(*lead, rows, heads, dim)
    if rows * heads == 0:  # no LSEs (an empty step): an empty buffer's strides may not allow the fp32 view
        return out, torch.empty((*lead, rows, heads), dtype=torch.float32, device=buffer.device)
    lse = buffer[..., n_out:total].view(torch.float32).view(*lead, rows, heads)
    return out, lse


class Exchange:
    """Buffers and collectives that merge one step shape's partial results over a group.

    Args:
        info: the group (size `W`, this rank).
        rows: query rows `T` of the step (the same on every rank).
        heads: query heads `H` of the partial results (the same on every rank).
        head_dim: `D`.
        dtype: the output dtype (bf16, fp16 or fp32).
        device: where the buffers live (CUDA for NCCL, CPU for gloo).
        method: see the module docstring.
        scatter_heads: each rank keeps heads `rank*Hh .. rank*Hh + Hh - 1` only.
        reduce_dtype: dtype of the corrected partials summed by `reduce_scatter` / `all_reduce`
            (default fp32: exact to the partials' rounding; the output dtype halves the bytes but
            rounds every corrected partial and every partial sum, which loses up to an ulp of
            the largest partial where partials cancel).
        heads_from: the argument an error about `heads` names (the caller's source of it).

    Attributes:
        local_out: `[T, H, D]` where this rank's partial output must be written before `merge`.
        local_lse: fp32 `[T, H]` where its natural-log LSE must be written.
        out_heads: heads of the merged result (`H`, or `H / W` when scattering).
    """

    def __init__(
        self,
        info: GroupInfo,
        *,
        rows: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        method: str,
        scatter_heads: bool = False,
        reduce_dtype: torch.dtype | None = None,
        heads_from: str = "out",
    ) -> None:
        self.method = check_method(method, scatter_heads)
        if dtype not in _OUT_DTYPES:
            raise MSAInputError("out", "a bfloat16, float16 or float32 tensor", dtype)
        if reduce_dtype is not None and reduce_dtype not in _OUT_DTYPES:
            raise MSAInputError("reduce_dtype", "None, torch.bfloat16, torch.float16 or torch.float32", reduce_dtype)
        w = info.world_size
        split = scatter_heads or method == "all_to_all"
        if split and heads % w:
            raise MSAInputError(
                heads_from, f"a head count divisible by the group size {w} (method {method!r}, "
                f"scatter_heads={scatter_heads} give each rank heads / {w})", f"{heads} heads",
            )
        self.info = info
        self.rows, self.heads, self.head_dim = rows, heads, head_dim
        self.dtype, self.device = dtype, device
        self.scatter_heads = scatter_heads
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else torch.float32
        self.chunk = heads // w if split else heads
        self.out_heads = self.chunk if scatter_heads else heads
        lse_units = 4 // torch.empty((), dtype=dtype).element_size()  # fp32 LSE in output elements
        t, h, d, c = rows, heads, head_dim, self.chunk

        def empty(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=kind, device=device)

        u = lse_units
        if method == "all_gather":
            self._send = empty(_packed_size(t, h, d, u)[1])
            self.local_out, self.local_lse = _packed(self._send, t, h, d, u)
            self._recv = empty(w, self._send.numel())
            self._recv_out, self._recv_lse = _packed(self._recv, t, h, d, u)
        elif method == "all_to_all":
            self.local_out, self.local_lse = empty(t, h, d), empty(t, h, kind=torch.float32)
            chunk = _packed_size(t, c, d, u)[1]
            self._send = empty(w, chunk)
            self._send_out, self._send_lse = _packed(self._send, t, c, d, u)
            self._recv = empty(w, chunk)
            self._recv_out, self._recv_lse = _packed(self._recv, t, c, d, u)
            if not scatter_heads:
                self._gsend = empty(chunk)
                self._gsend_out, self._gsend_lse = _packed(self._gsend, t, c, d, u)
                self._grecv = empty(w, chunk)
                self._grecv_out, self._grecv_lse = _packed(self._grecv, t, c, d, u)
        else:  # reduce_scatter, all_reduce: gather LSEs, correct locally, sum over ranks
            self.local_out, self.local_lse = empty(t, h, d), empty(t, h, kind=torch.float32)
            self._lses = empty(w, t, h, kind=torch.float32)
            if method == "reduce_scatter":
                self._rs_send = empty(w, t, c, d, kind=self.reduce_dtype)
                self._rs_recv = empty(t, c, d, kind=self.reduce_dtype)
            else:
                self._acc = empty(t, h, d, kind=self.reduce_dtype)

    def __repr__(self) -> str:
        form = "scattered" if self.scatter_heads else "full"
        return (f"Exchange({self.method}, {form}, T={self.rows}, H={self.heads}, D={self.head_dim}, "
                f"{self.dtype}, {self.info})")

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer a captured graph reads or writes (their addresses never change)."""
        return {k.lstrip("_"): v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    def check_outputs(self, out: object, lse: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`out` `[T, out_heads, D]` of the exchange's dtype and device, unit last stride, and
        `lse` fp32 `[T, out_heads]` or None; `MSAInputError` otherwise."""
        shape = (self.rows, self.out_heads, self.head_dim)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != self.dtype:
            given = f"{out.dtype} of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise MSAInputError("out", f"a {self.dtype} tensor of shape {shape}", given)
        if out.device != self.device or out.stride(-1) != 1:
            raise MSAInputError("out", f"a tensor on {self.device} with unit last stride",
                                f"{out.device}, strides {out.stride()}")
        if lse is None:
            return out, None
        if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != shape[:2] or lse.dtype != torch.float32:
            given = f"{lse.dtype} of shape {tuple(lse.shape)}" if isinstance(lse, torch.Tensor) else type(lse).__name__
            raise MSAInputError("lse", f"a float32 tensor of shape {shape[:2]} (out's rows and heads)", given)
        if lse.device != self.device:
            raise MSAInputError("lse", f"a tensor on {self.device}", lse.device)
        return out, lse

    def merge(self, out: torch.Tensor, lse: torch.Tensor | None = None) -> None:
        """Merge the partials every rank wrote into its `local_out` / `local_lse` into `out`
        (and `lse`). A collective: every rank of the group calls it, in the same order as its
        other collectives. Allocates nothing and never synchronises with the host."""
        out, lse = self.check_outputs(out, lse)
        if self.rows == 0 or self.heads == 0:
            return  # the same on every rank: the shapes agree
        group, rank, c = self.info.group, self.info.rank, self.chunk
        if self.method == "all_gather":
            all_gather_into(self._recv, self._send, group)
            lo = rank * c if self.scatter_heads else 0
            hi = lo + self.out_heads
            combine_into(self._recv_out[:, :, lo:hi], self._recv_lse[:, :, lo:hi], out, lse)
        elif self.method == "all_to_all":
            w, t, d = self.info.world_size, self.rows, self.head_dim
            self._send_out.copy_(self.local_out.view(t, w, c, d).transpose(0, 1))
            self._send_lse.copy_(self.local_lse.view(t, w, c).transpose(0, 1))
            all_to_all_into(self._recv, self._send, group)
            if self.scatter_heads:
                combine_into(self._recv_out, self._recv_lse, out, lse)
                return
            # the chunk's LSE is sent whether or not this rank wants the LSE: a rank that does reads
            # every rank's (whether a rank asks for it is not agreed on)
            combine_into(self._recv_out, self._recv_lse, self._gsend_out, self._gsend_lse)
            all_gather_into(self._grecv, self._gsend, group)
            out.view(t, w, c, d).copy_(self._grecv_out.transpose(0, 1))
            if lse is not None:
                lse.view(t, w, c).copy_(self._grecv_lse.transpose(0, 1))
        elif self.method == "reduce_scatter":
            all_gather_into(self._lses, self.local_lse, group)
            dst = self._rs_send.permute(1, 0, 2, 3)  # [T, W, Hh, D]: head chunks rank by rank
            correct_into(self.local_out, self._lses, rank, dst, lse, head_lo=rank * c)
            if out.dtype == self.reduce_dtype and out.is_contiguous():
                reduce_scatter_into(out, self._rs_send, group)
            else:
                reduce_scatter_into(self._rs_recv, self._rs_send, group)
                out.copy_(self._rs_recv)
        else:  # all_reduce
            all_gather_into(self._lses, self.local_lse, group)
            direct = out.dtype == self.reduce_dtype and out.is_contiguous()
            acc = out if direct else self._acc
            correct_into(self.local_out, self._lses, rank, acc.unsqueeze(1), lse)
            all_reduce_(acc, group)
            if not direct:
                out.copy_(acc)
