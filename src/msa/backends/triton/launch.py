"""Host side of the Triton decode: the kernels' arguments (built in one place), the workspace and
the launches."""

from __future__ import annotations

import os
from typing import Any

import attrs
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
from msa.scales import Scale
from msa.validation import DecodeInputs

__all__ = ["launch_decode", "interpreting", "Workspace", "ScaleArgs", "decode_args"]

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


@attrs.frozen
class ScaleArgs:
    """The step's scales as the kernels take them: python floats folded into two factors on the
    host, tensors (graph-safe) read on the device.

    Attributes:
        qk_scale: `sm_scale * q_scale * k_scale * log2(e)` over the float scales.
        v_scale: the float `v_scale` (1.0 when it is a tensor).
        tensors: name -> the one-element tensor, for each scale given as a tensor.
    """

    qk_scale: float
    v_scale: float
    tensors: dict[str, torch.Tensor]

    @classmethod
    def of(cls, inputs: DecodeInputs) -> ScaleArgs:
        factors: dict[str, float] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name in ("sm_scale", "q_scale", "k_scale", "v_scale"):
            value: Scale = getattr(inputs, name)
            if isinstance(value, torch.Tensor):
                tensors[name], factors[name] = value, 1.0
            else:
                factors[name] = float(value)
        qk = factors["sm_scale"] * factors["q_scale"] * factors["k_scale"] * LOG2E
        return cls(qk, factors["v_scale"], tensors)

    def kernel_args(self, dummy: torch.Tensor) -> dict[str, Any]:
        """`<name>_ptr` (the tensor, or `dummy` never read) and `<NAME>_PTR` flags."""
        args: dict[str, Any] = {"qk_scale": self.qk_scale, "v_scale": self.v_scale}
        for name in ("sm_scale", "q_scale", "k_scale", "v_scale"):
            args[f"{name}_ptr"] = self.tensors.get(name, dummy)
            args[f"{name.upper()}_PTR"] = name in self.tensors
        return args


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


def decode_args(
    problem: DecodeProblem,
    inputs: DecodeInputs,
    rows: RowMetadata,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    config: LaunchConfig,
    workspace: Workspace,
) -> dict[str, Any]:
    """The named arguments every decode kernel takes (tensors, strides, scales and the shared
    compile-time constants). The kernels' own constants come from `_kernel_constants`."""
    g = problem.geometry
    q, topk, table = inputs.q, inputs.topk_indices, inputs.block_table
    keys, values = problem.layout.kv_views(inputs.kv_cache)
    lse_arg = lse if lse is not None else out  # never written when WRITE_LSE is off
    compute, precision = _compute_dtype(q.dtype, keys.dtype, config)
    return dict(
        q_ptr=q, k_ptr=keys, v_ptr=values, topk_ptr=topk, table_ptr=table,
        row_request_ptr=rows.row_request, req_start_ptr=rows.req_start, q_pos_ptr=rows.q_pos,
        out_ptr=out, lse_ptr=lse_arg, part_o_ptr=workspace.partial_out, part_ml_ptr=workspace.partial_ml,
        **ScaleArgs.of(inputs).kernel_args(dummy=out),
        num_pages=keys.shape[0], max_blocks=table.shape[1], num_rows=problem.num_rows,
        stride_qr=q.stride(0), stride_qh=q.stride(1),
        stride_kp=keys.stride(0), stride_kh=keys.stride(1), stride_kt=keys.stride(2),
        stride_vp=values.stride(0), stride_vh=values.stride(1), stride_vt=values.stride(2),
        stride_th=topk.stride(0), stride_tr=topk.stride(1), stride_tk=topk.stride(2), stride_bt=table.stride(0),
        stride_or=out.stride(0), stride_oh=out.stride(1),
        stride_lr=lse_arg.stride(0), stride_lh=lse_arg.stride(1) if lse_arg.dim() > 1 else 1,
        NUM_KV_HEADS=g.num_kv_heads, GROUP=g.group_size, HEAD_DIM=g.head_dim, PAGE=g.page_size, TOPK=g.topk,
        BLOCK_N=config.block_n, NUM_SPLITS=config.num_splits, TILES_PER_SPLIT=config.tiles_per_split,
        WRITE_LSE=lse is not None, COMPUTE=compute, PRECISION=precision, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _kernel_constants(problem: DecodeProblem, config: LaunchConfig) -> dict[str, Any]:
    """The compile-time constants of the kernel `config` picks, beyond the shared ones."""
    if config.dedup:
        return dict(TOKENS=config.tokens, TOKEN_CHUNKS=config.token_chunks, BLOCK_M=config.block_m,
                    ENTRIES_PAD=config.entries_pad)
    topk = problem.geometry.topk
    return dict(BLOCK_G=config.block_g, GROUP_CHUNKS=config.group_chunks,
                TOPK_PAD=max(2, 1 << max(topk - 1, 0).bit_length()))


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
    args = decode_args(problem, inputs, rows, out, lse, config, workspace)
    args.update(_kernel_constants(problem, config))
    if config.dedup:
        grid = (problem.batch_size * g.num_kv_heads * config.token_chunks, config.num_splits)
        split_dedup_kernel[grid](**args)
    else:
        kernel = nvfp4_decode_kernel if problem.layout.block_scaled else split_decode_kernel
        kernel[(problem.num_rows * g.num_kv_heads * config.group_chunks, config.num_splits)](**args)
    if config.num_splits > 1:
        merge_kernel[(problem.num_rows * g.num_q_heads,)](
            workspace.partial_out, workspace.partial_ml, out, args["lse_ptr"], args["v_scale_ptr"], args["v_scale"],
            rows.q_pos, out.stride(0), out.stride(1), args["stride_lr"], args["stride_lh"],
            NUM_Q_HEADS=g.num_q_heads, HEAD_DIM=g.head_dim, NUM_SPLITS=config.num_splits,
            BLOCK_S=1 << max(config.num_splits - 1, 0).bit_length(),
            V_SCALE_PTR=args["V_SCALE_PTR"], WRITE_LSE=lse is not None, num_warps=4,
        )
    elif config.dedup and rows.ragged:
        # rows owned by no request: no dedup program covers them (the merge zeroes them when split)
        pad_rows_kernel[(problem.num_rows,)](
            rows.q_pos, out, args["lse_ptr"], out.stride(0), out.stride(1), args["stride_lr"], args["stride_lh"],
            NUM_Q_HEADS=g.num_q_heads, BLOCK_H=1 << max(g.num_q_heads - 1, 0).bit_length(),
            HEAD_DIM=g.head_dim, WRITE_LSE=lse is not None,
        )
