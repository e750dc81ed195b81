"""The exact merge of partial attention results, locally: torch (the oracle, and the CPU path)
and the Triton kernels (CUDA) behind one pair of functions.

For `W` partial results of one row and head — `out_w` over a disjoint share of the attended
tokens, with the natural-log LSE `lse_w` of that share — the result over all the tokens is

    lse = ln sum_w exp(lse_w),      out = sum_w exp(lse_w - lse) * out_w

computed around the largest `lse_w` in fp32. A share that attends nothing (`lse_w = -inf`)
gets weight 0 and its `out_w` is never multiplied in (a NaN there cannot leak); a row that
attends nothing on every rank gives `out = 0`, `lse = -inf`. An LSE of NaN or +inf is read as
-inf (no valid partial has one).
"""

from __future__ import annotations

import torch

from msa.errors import MSAInputError
from msa.platform import triton_available

__all__ = ["combine_partials", "correction_weights", "combine_into", "correct_into"]

_BLOCK_H = 16


def _clean(lses: torch.Tensor) -> torch.Tensor:
    lses = lses.float()
    return torch.where(torch.isnan(lses) | (lses == float("inf")), float("-inf"), lses)


def correction_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights `exp(lse_w - lse)` `[W, ...]` (0 for empty shares and empty rows) and the
    global `lse` `[...]`, in fp32, from the partial LSEs `[W, ...]`."""
    lses = _clean(lses)
    top = lses.amax(dim=0)
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    exps = torch.exp(lses - shift)
    total = exps.sum(dim=0)
    lse = torch.log(total) + shift  # log(0) = -inf for rows empty everywhere
    weights = torch.where(total > 0, exps / torch.where(total > 0, total, 1.0), 0.0)
    return weights, lse


def combine_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine `W` partial results exactly (pure torch, fp32).

    Args:
        outs: `[W, T, Hq, D]` partial outputs (any float dtype).
        lses: `[W, T, Hq]` their natural-log LSEs (-inf for a share that attends nothing).

    Returns:
        `(out, lse)`: fp32 `[T, Hq, D]` and `[T, Hq]`. Rows that attend nothing on every rank
        give 0 and -inf; NaN never comes out of empty shares.
    """
    if not isinstance(outs, torch.Tensor) or outs.dim() != 4:
        raise MSAInputError("outs", "a tensor [W, T, Hq, D]", getattr(outs, "shape", type(outs).__name__))
    if not isinstance(lses, torch.Tensor) or tuple(lses.shape) != tuple(outs.shape[:3]):
        raise MSAInputError("lses", f"a tensor of shape {tuple(outs.shape[:3])} ([W, T, Hq] of outs)",
                            getattr(lses, "shape", type(lses).__name__))
    weights, lse = correction_weights(lses)
    w = weights.unsqueeze(-1)
    out = torch.where(w > 0, w * outs.float(), 0.0).sum(dim=0)
    return out, lse


def _use_kernel(t: torch.Tensor, kernel: bool | None) -> bool:
    """Triton on CUDA by default; torch for head dims that are not powers of two."""
    dim = t.shape[-1]
    if dim & (dim - 1):
        return False
    return (t.is_cuda and triton_available()) if kernel is None else kernel


def combine_into(
    outs: torch.Tensor,
    lses: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    kernel: bool | None = None,
) -> None:
    """`combine_partials(outs, lses)` written into `out` `[T, H, D]` (any float dtype, unit
    last stride) and `lse` fp32 `[T, H]` (or None). Views with any strides (unit last stride for
    `outs` and `out`) are fine; nothing is allocated on the kernel path.

    Args:
        kernel: the Triton kernel (True), torch (False), or decide (None: Triton on CUDA).
    """
    rows, heads, dim = out.shape
    if rows == 0 or heads == 0:
        return
    if not _use_kernel(out, kernel):
        merged, merged_lse = combine_partials(outs, lses)
        out.copy_(merged)
        if lse is not None:
            lse.copy_(merged_lse)
        return
    from msa.distributed.kernels import combine_kernel

    lse_t = lse if lse is not None else lses
    combine_kernel[(rows, -(-heads // _BLOCK_H))](
        outs, lses, out, lse_t, heads,
        outs.stride(0), outs.stride(1), outs.stride(2), lses.stride(0), lses.stride(1), lses.stride(2),
        out.stride(0), out.stride(1), lse_t.stride(0), lse_t.stride(1),
        W=outs.shape[0], D=dim, BLOCK_H=_BLOCK_H, HAS_LSE=lse is not None,
    )


def correct_into(
    part: torch.Tensor,
    lses: torch.Tensor,
    rank: int,
    dst: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    head_lo: int = 0,
    kernel: bool | None = None,
) -> None:
    """This rank's partial scaled by its weight, ready for a sum over ranks.

    Args:
        part: `[T, H, D]` this rank's partial output (unit last stride).
        lses: `[W, T, H]` every rank's partial LSE (gathered).
        rank: this rank's index into `lses`.
        dst: `[T, C, H // C, D]` where the scaled partial goes: head `h` at `dst[:, h // c,
            h % c]` with `c = H // C` (`C = 1` for a plain `[T, 1, H, D]` view; `C = W` to lay
            head chunks out rank by rank for a reduce-scatter). Any strides, unit last stride.
        lse: fp32 `[T, Hl]` for the global LSE of heads `head_lo .. head_lo + Hl - 1`, or None.
        head_lo: the first head `lse` holds.
        kernel: Triton (True), torch (False), or decide (None: Triton on CUDA).
    """
    rows, heads, dim = part.shape
    if rows == 0 or heads == 0:
        return
    chunks = dst.shape[1]
    if not _use_kernel(part, kernel):
        weights, merged_lse = correction_weights(lses)
        w = weights[rank].unsqueeze(-1)
        scaled = torch.where(w > 0, w * part.float(), 0.0)
        dst.copy_(scaled.view(rows, chunks, heads // chunks, dim))
        if lse is not None:
            lse.copy_(merged_lse[:, head_lo : head_lo + lse.shape[1]])
        return
    from msa.distributed.kernels import correct_kernel

    lse_t = lse if lse is not None else lses[0]
    correct_kernel[(rows, -(-heads // _BLOCK_H))](
        part, lses, dst, lse_t, heads, rank, head_lo, head_lo + (lse.shape[1] if lse is not None else 0),
        heads // chunks,
        part.stride(0), part.stride(1), lses.stride(0), lses.stride(1), lses.stride(2),
        dst.stride(0), dst.stride(1), dst.stride(2), lse_t.stride(0), lse_t.stride(1),
        W=lses.shape[0], D=dim, BLOCK_H=_BLOCK_H, HAS_LSE=lse is not None,
    )
