"""Host side of the Triton decode: scales, strides, workspaces and the launches."""

from __future__ import annotations

import os

import torch
import triton.language as tl

from msa.backends.triton.config import LaunchConfig
from msa.backends.triton.kernels import (
    LOG2E,
    merge_kernel,
    nvfp4_decode_kernel,
    pad_rows_kernel,
    split_decode_kernel,
    split_dedup_kernel,
)
from msa.planning import RowMetadata
from msa.problem import DecodeProblem
from msa.validation import DecodeInputs

__all__ = ["launch_decode", "interpreting", "Workspace"]

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_COMPUTE = {"fp16": tl.float16, "bf16": tl.bfloat16}


def interpreting() -> bool:
    """True when Triton kernels run on the CPU through the interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


class Workspace:
    """Split-K partials: fp32 accumulators `[B*L*Hq*S, D]` and (max, sum) pairs `[B*L*Hq*S, 2]`."""

    def __init__(self, problem: DecodeProblem, config: LaunchConfig, device: torch.device) -> None:
        rows = problem.num_rows * problem.geometry.num_q_heads * config.num_splits
        size = rows if config.num_splits > 1 else 0
        self.partial_out = torch.empty((size, problem.geometry.head_dim), dtype=torch.float32, device=device)
        self.partial_ml = torch.empty((size, 2), dtype=torch.float32, device=device)


def _compute_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype, config: LaunchConfig) -> tuple[object, str]:
    """(dtype of the dots, their input precision). Interpreter: fp32. A bf16/fp16 cache: its own
    dtype when q matches (or is fp8), else fp32 with IEEE products. fp8/NVFP4: `config.compute`."""
    if interpreting():
        return tl.float32, "ieee"
    if cache_dtype in _TL_DTYPES:
        if q_dtype in (cache_dtype, torch.float8_e4m3fn):
            return _TL_DTYPES[cache_dtype], "tf32"
        return tl.float32, "ieee"
    return _COMPUTE[config.compute], "tf32"


def _scale_args(value: float | torch.Tensor) -> tuple[float, torch.Tensor | None]:
    """(python factor, device tensor or None): tensors are read by the kernel, floats folded in."""
    if isinstance(value, torch.Tensor):
        return 1.0, value
    return float(value), None


def launch_decode(
    problem: DecodeProblem,
    inputs: DecodeInputs,
    rows: RowMetadata,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    config: LaunchConfig,
    workspace: Workspace,
) -> None:
    """Run the decode kernel (and the merge when split) into `out` / `lse`. Allocates nothing
    and never synchronises: every buffer is the caller's or the plan's."""
    g = problem.geometry
    if problem.num_rows == 0:
        return
    q, cache = inputs.q, inputs.kv_cache
    sm, sm_t = _scale_args(inputs.sm_scale)
    qs, qs_t = _scale_args(inputs.q_scale)
    ks, ks_t = _scale_args(inputs.k_scale)
    vs, vs_t = _scale_args(inputs.v_scale)
    if sm_t is not None:  # a tensor softmax scale rides with q_scale (both multiply the scores)
        qs_t = sm_t if qs_t is None else sm_t * qs_t
    qk_scale = sm * qs * ks * LOG2E
    compute, precision = _compute_dtype(q.dtype, cache.dtype, config)
    topk, table = inputs.topk_indices, inputs.block_table
    lse_arg = lse if lse is not None else out
    common = (
        out, lse_arg, workspace.partial_out, workspace.partial_ml,
        qs_t if qs_t is not None else out, ks_t if ks_t is not None else out,
        vs_t if vs_t is not None else out, qk_scale, vs,
        cache.shape[0], table.shape[1],
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2),
        topk.stride(0), topk.stride(1), topk.stride(2), table.stride(0),
        out.stride(0), out.stride(1), lse_arg.stride(0), lse_arg.stride(1) if lse_arg.dim() > 1 else 1,
    )
    flags = dict(
        NUM_KV_HEADS=g.num_kv_heads, GROUP=g.group_size, HEAD_DIM=g.head_dim, PAGE=g.page_size, TOPK=g.topk,
        BLOCK_N=config.block_n, NUM_SPLITS=config.num_splits, TILES_PER_SPLIT=config.tiles_per_split,
        Q_SCALE_PTR=qs_t is not None, K_SCALE_PTR=ks_t is not None, V_SCALE_PTR=vs_t is not None,
        WRITE_LSE=lse is not None, COMPUTE=compute, PRECISION=precision, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if config.dedup:
        grid = (problem.batch_size * g.num_kv_heads * config.token_chunks, config.num_splits)
        split_dedup_kernel[grid](
            q, cache, topk, table, rows.req_start, rows.q_pos, *common[:11], problem.num_rows, *common[11:],
            TOKENS=config.tokens, TOKEN_CHUNKS=config.token_chunks, BLOCK_M=config.block_m,
            ENTRIES_PAD=config.entries_pad, **flags,
        )
    else:
        kernel = nvfp4_decode_kernel if problem.layout.block_scaled else split_decode_kernel
        grid = (problem.num_rows * g.num_kv_heads * config.group_chunks, config.num_splits)
        kernel[grid](
            q, cache, topk, table, rows.row_request, rows.q_pos, *common,
            BLOCK_G=config.block_g, GROUP_CHUNKS=config.group_chunks,
            TOPK_PAD=max(2, 1 << max(g.topk - 1, 0).bit_length()), **flags,
        )
    if config.num_splits > 1:
        merge_kernel[(problem.num_rows * g.num_q_heads,)](
            workspace.partial_out, workspace.partial_ml, out, lse_arg,
            vs_t if vs_t is not None else out, vs, rows.q_pos,
            out.stride(0), out.stride(1), lse_arg.stride(0), lse_arg.stride(1) if lse_arg.dim() > 1 else 1,
            NUM_Q_HEADS=g.num_q_heads, HEAD_DIM=g.head_dim, NUM_SPLITS=config.num_splits,
            BLOCK_S=1 << max(config.num_splits - 1, 0).bit_length(),
            V_SCALE_PTR=vs_t is not None, WRITE_LSE=lse is not None,
            num_warps=4,
        )
    if config.dedup and rows.ragged and config.num_splits == 1:
        # rows owned by no request: no dedup program covers them (the merge zeroes them when split)
        pad_rows_kernel[(problem.num_rows,)](
            rows.q_pos, out, lse_arg, out.stride(0), out.stride(1), lse_arg.stride(0),
            lse_arg.stride(1) if lse_arg.dim() > 1 else 1,
            NUM_Q_HEADS=g.num_q_heads, BLOCK_H=1 << max(g.num_q_heads - 1, 0).bit_length(),
            HEAD_DIM=g.head_dim, WRITE_LSE=lse is not None,
        )
