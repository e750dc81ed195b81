"""Host side of the Triton decode: the kernels' arguments (built in one place), the workspace and
the launches.

Eager callers (a serving engine runs attention between graph pieces) pay Triton's Python launch
path on every call, so a plan keeps a memo per call signature (`DecodeInputs.signature`, set by
`msa.sparse_decode`): the arguments that depend on shapes, strides and dtypes alone are built
once, and on a GPU the compiled kernels are launched directly, without Triton's binder, as long
as the pointer alignments they were specialised for still hold (`MSA_TRITON_DIRECT_LAUNCH=0`
turns direct launches off).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import attrs
import torch
import triton.language as tl

from msa.backends.triton.config import COMPUTE, LaunchConfig
from msa.backends.triton.kernels import (
    LOG2E,
    merge_kernel,
    nvfp4_decode_kernel,
    pad_rows_kernel,
    split_decode_kernel,
    split_dedup_kernel,
)
from msa.launcher import DirectKernel, bind_arguments, interpreting, kernel_parameters
from msa.planning import RowMetadata
from msa.problem import DecodeProblem
from msa.scales import Scale
from msa.validation import DecodeInputs

__all__ = ["step_launches", "interpreting", "Workspace", "ScaleArgs", "decode_args", "LaunchMemo",
           "kernel_parameters", "bind_arguments"]  # the launcher's three: re-exported for the tests and benchmarks

#: The tensor arguments of the decode kernels (replaced per call; everything else is static for
#: a call signature).
_TENSOR_ARGS = ("q_ptr", "k_ptr", "v_ptr", "topk_ptr", "table_ptr", "out_ptr", "lse_ptr",
                "sm_scale_ptr", "q_scale_ptr", "k_scale_ptr", "v_scale_ptr")

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_COMPUTE = dict(zip(COMPUTE, (tl.float16, tl.bfloat16), strict=True))


class Workspace:
    """Split-K partials: fp32 accumulators `[B*L*Hq*S, D]` and (max, sum) pairs `[B*L*Hq*S, 2]`;
    with `in_kernel_merge`, one int32 counter per program (back at zero after each launch: the
    merging split takes its count off)."""

    def __init__(self, problem: DecodeProblem, config: LaunchConfig, device: torch.device) -> None:
        rows = problem.num_rows * problem.geometry.num_q_heads * config.num_splits
        size = rows if config.num_splits > 1 else 0
        self.partial_out = torch.empty((size, problem.geometry.head_dim), dtype=torch.float32, device=device)
        self.partial_ml = torch.empty((size, 2), dtype=torch.float32, device=device)
        counters = _programs(problem, config) if config.in_kernel_merge else 1
        self.counters = torch.zeros(counters, dtype=torch.int32, device=device)


def _programs(problem: DecodeProblem, config: LaunchConfig) -> int:
    """Programs along the decode grid's first axis (the splits are its second)."""
    g = problem.geometry
    if config.dedup:
        return problem.batch_size * g.num_kv_heads * config.token_chunks
    return problem.num_rows * g.num_kv_heads * config.group_chunks


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
    dtype, whatever q's (a bf16 query over an fp16 cache is fitted into fp16's range, `_query_form`;
    an f16 one over a bf16 cache is two bf16 terms, `_query_form`: exact either way, at the tensor
    cores' 16-bit rate; fp32 IEEE dots were 30x slower). fp8/NVFP4: `config.compute`."""
    if interpreting():
        return tl.float32, "ieee"
    if cache_dtype in _TL_DTYPES:
        return _TL_DTYPES[cache_dtype], "tf32"
    return _COMPUTE[config.compute], "tf32"


def _query_form(q_dtype: torch.dtype, compute: object) -> dict[str, bool]:
    """How the kernels take the query for their dots (`kernels._query_terms`): `Q_FIT`, a bf16
    query scaled by a power of two before fp16 dots (fp16's range is narrower than bf16's,
    `kernels._fit_q`); `Q_SPLIT`, an f16 query as two bf16 terms for bf16 dots (bf16 has 8
    significant bits to f16's 11, `kernels._q_low`)."""
    return dict(Q_FIT=q_dtype == torch.bfloat16 and compute == tl.float16,
                Q_SPLIT=q_dtype == torch.float16 and compute == tl.bfloat16)


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: LaunchConfig) -> dict[str, torch.Tensor]:
    """The query, key and value arguments as the kernels read them: fp8 tensors as they are, or
    as their bytes (`LaunchConfig.soft_e4m3`)."""
    def operand(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if config.soft_e4m3 and t.dtype == torch.float8_e4m3fn else t

    return dict(q_ptr=operand(q), k_ptr=operand(k), v_ptr=operand(v))


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
    kv = problem.layout.kv_operands(inputs.kv_cache)
    (stride_kp, stride_kh, stride_kt), (stride_vp, stride_vh, stride_vt) = kv.k_strides, kv.v_strides
    lse_arg = lse if lse is not None else out  # never written when WRITE_LSE is off
    compute, precision = _compute_dtype(q.dtype, kv.k.dtype, config)
    return dict(
        **_qkv(q, kv.k, kv.v, config), topk_ptr=topk, table_ptr=table,
        row_request_ptr=rows.row_request, req_start_ptr=rows.req_start, q_pos_ptr=rows.q_pos,
        out_ptr=out, lse_ptr=lse_arg, part_o_ptr=workspace.partial_out, part_ml_ptr=workspace.partial_ml,
        **ScaleArgs.of(inputs).kernel_args(dummy=out),
        num_pages=kv.k.shape[0], max_blocks=table.shape[1], num_rows=problem.num_rows, v_offset=kv.v_offset,
        stride_qr=q.stride(0), stride_qh=q.stride(1),
        stride_kp=stride_kp, stride_kh=stride_kh, stride_kt=stride_kt,
        stride_vp=stride_vp, stride_vh=stride_vh, stride_vt=stride_vt,
        stride_th=topk.stride(0), stride_tr=topk.stride(1), stride_tk=topk.stride(2), stride_bt=table.stride(0),
        stride_or=out.stride(0), stride_oh=out.stride(1),
        stride_lr=lse_arg.stride(0), stride_lh=lse_arg.stride(1) if lse_arg.dim() > 1 else 1,
        NUM_KV_HEADS=g.num_kv_heads, GROUP=g.group_size, HEAD_DIM=g.head_dim, PAGE=g.page_size, TOPK=g.topk,
        BLOCK_N=config.block_n, NUM_SPLITS=config.num_splits, TILES_PER_SPLIT=config.tiles_per_split,
        WRITE_LSE=lse is not None, COMPUTE=compute, PRECISION=precision, NUM_STAGES=config.num_stages,
        **_query_form(q.dtype, compute), SOFT_E4M3=config.soft_e4m3,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _kernel_constants(problem: DecodeProblem, config: LaunchConfig) -> dict[str, Any]:
    """The compile-time constants of the kernel `config` picks, beyond the shared ones."""
    block_scaled = problem.layout.block_scaled
    # the packed PTX decode of NVFP4 needs a GPU whose dots run in fp16
    nvfp4 = dict(DECODE_ASM=config.decode_asm and not interpreting() and config.compute == "fp16",
                 CODES_ROWS=config.codes_rows)
    if config.dedup:
        return dict(TOKENS=config.tokens, TOKEN_CHUNKS=config.token_chunks, BLOCK_M=config.block_m,
                    ENTRIES_PAD=config.entries_pad, BLOCK_SCALED=block_scaled, **(nvfp4 if block_scaled else {}))
    topk = problem.geometry.topk
    constants = dict(BLOCK_G=config.block_g, GROUP_CHUNKS=config.group_chunks,
                     TOPK_PAD=max(2, 1 << max(topk - 1, 0).bit_length()))
    if block_scaled:
        constants.update(nvfp4, SWAP_AB=config.swap_ab)
    return constants


#: A kernel of a step and the function that turns the decode arguments into its own.
_Launch = tuple[DirectKernel, Callable[[dict[str, Any]], dict[str, Any]]]


class LaunchMemo:
    """A plan's launches per call signature: the static kernel arguments and the kernels."""

    def __init__(self, limit: int = 32) -> None:
        self.limit = limit
        self._entries: dict[Hashable, tuple[dict[str, Any], list[_Launch]]] = {}

    def get(self, signature: Hashable | None) -> tuple[dict[str, Any], list[_Launch]] | None:
        return None if signature is None else self._entries.get(signature)

    def put(self, signature: Hashable | None, entry: tuple[dict[str, Any], list[_Launch]]) -> None:
        if signature is None:
            return
        if len(self._entries) >= self.limit:
            self._entries.clear()
        self._entries[signature] = entry


def _launches(
    problem: DecodeProblem, rows: RowMetadata, config: LaunchConfig, workspace: Workspace, with_lse: bool,
) -> list[_Launch]:
    """The kernels of a step, each with the function that turns the decode arguments into its own."""
    g = problem.geometry
    launches: list[_Launch] = []
    grid = (_programs(problem, config), config.num_splits)
    if config.dedup:
        launches.append((DirectKernel(split_dedup_kernel, grid), lambda a: a))
    else:
        kernel = nvfp4_decode_kernel if problem.layout.block_scaled else split_decode_kernel
        merge_args = dict(counter_ptr=workspace.counters, IN_KERNEL_MERGE=config.in_kernel_merge,
                          MERGE_FENCE=config.merge_fence and not interpreting())
        launches.append((DirectKernel(kernel, grid), lambda a: dict(a, **merge_args)))
    if config.num_splits > 1 and not config.in_kernel_merge:
        merge_constants = dict(
            part_o_ptr=workspace.partial_out, part_ml_ptr=workspace.partial_ml, q_pos_ptr=rows.q_pos,
            NUM_Q_HEADS=g.num_q_heads, HEAD_DIM=g.head_dim, NUM_SPLITS=config.num_splits,
            BLOCK_S=1 << max(config.num_splits - 1, 0).bit_length(), WRITE_LSE=with_lse, num_warps=4,
        )
        launches.append((DirectKernel(merge_kernel, (problem.num_rows * g.num_q_heads,)), lambda a: dict(
            merge_constants, out_ptr=a["out_ptr"], lse_ptr=a["lse_ptr"], v_scale_ptr=a["v_scale_ptr"],
            v_scale=a["v_scale"], stride_or=a["stride_or"], stride_oh=a["stride_oh"], stride_lr=a["stride_lr"],
            stride_lh=a["stride_lh"], V_SCALE_PTR=a["V_SCALE_PTR"])))
    elif config.dedup and rows.ragged:
        # rows owned by no request: no dedup program covers them (the merge zeroes them when split)
        pad_constants = dict(q_pos_ptr=rows.q_pos, NUM_Q_HEADS=g.num_q_heads, HEAD_DIM=g.head_dim,
                             BLOCK_H=1 << max(g.num_q_heads - 1, 0).bit_length(), WRITE_LSE=with_lse)
        launches.append((DirectKernel(pad_rows_kernel, (problem.num_rows,)), lambda a: dict(
            pad_constants, out_ptr=a["out_ptr"], lse_ptr=a["lse_ptr"], stride_or=a["stride_or"],
            stride_oh=a["stride_oh"], stride_lr=a["stride_lr"], stride_lh=a["stride_lh"])))
    return launches


def step_launches(
    problem: DecodeProblem,
    inputs: DecodeInputs,
    rows: RowMetadata,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    config: LaunchConfig,
    workspace: Workspace,
    memo: LaunchMemo | None = None,
) -> list[tuple[DirectKernel, dict[str, Any]]]:
    """Each kernel of the step with its named arguments: built in full the first time a call
    signature is seen (and remembered in `memo`), from the remembered static ones and this call's
    tensors after that."""
    entry = memo.get(inputs.signature) if memo is not None else None
    if entry is None:
        args = decode_args(problem, inputs, rows, out, lse, config, workspace)
        args.update(_kernel_constants(problem, config))
        entry = ({k: v for k, v in args.items() if k not in _TENSOR_ARGS},
                 _launches(problem, rows, config, workspace, lse is not None))
        if memo is not None:
            memo.put(inputs.signature, entry)
    else:  # same shapes, strides, dtypes and scale forms as a call before: only the tensors are new
        static, _ = entry
        kv = problem.layout.kv_operands(inputs.kv_cache)
        args = dict(static, **_qkv(inputs.q, kv.k, kv.v, config), topk_ptr=inputs.topk_indices,
                    table_ptr=inputs.block_table, out_ptr=out, lse_ptr=lse if lse is not None else out)
        args.update((f"{name}_ptr", value) for name in ("sm_scale", "q_scale", "k_scale", "v_scale")
                    if isinstance(value := getattr(inputs, name), torch.Tensor))
        args.setdefault("sm_scale_ptr", out)
        for name in ("q_scale_ptr", "k_scale_ptr", "v_scale_ptr"):
            args.setdefault(name, out)
    return [(kernel, kernel_args(args)) for kernel, kernel_args in entry[1]]
