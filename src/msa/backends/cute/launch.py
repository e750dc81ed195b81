"""Host side of the CuTe DSL backend: the compile cache, the split count, the workspace and the
launches (the decode kernel, then Triton's split merge when the step is split).

Kernels are compiled on first use for the GPU they run on (`cute.compile`, one per `KernelSpec`
and compute capability), under a lock, and kept for the life of the process. Every argument the
kernel takes is a device address, a stride or a size: one compiled kernel serves every batch
size. They are launched through `fastcall.PackedCall`, which packs the arguments itself instead
of paying the DSL's per-call adaptation.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs
import torch

from msa.backends.cute.config import (
    HOST_ARG_KINDS,
    KINDS,
    Q_KINDS,
    WGMMA_KINDS,
    CuteConfig,
    wgmma_cluster,
    wgmma_heads,
    wgmma_programs,
)
from msa.backends.cute.fastcall import PackedCall, packing_matches
from msa.backends.triton.kernels import LOG2E, merge_kernel
from msa.errors import MSAInputError
from msa.planning import RowMetadata
from msa.problem import DecodeProblem
from msa.validation import DecodeInputs, vector_misalignment

__all__ = ["CuteWorkspace", "compiled_kernel", "launch_cute", "prepare", "spec_for", "traced_kernel"]

_OUT_KINDS = {torch.bfloat16: "bf16", torch.float16: "f16"}

_lock = threading.Lock()
_compiled: dict[tuple[Any, tuple[int, int]], PackedCall] = {}


class CuteWorkspace:
    """What a plan owns: split partials `[B*L*Hq*S, D]` / `[B*L*Hq*S, 2]` (fp32; none where a
    cluster merges the splits in shared memory), followed (for a kernel whose last split merges
    them) by one zeroed int32 counter per program, and a 1.0 the kernel reads for every scale the
    caller gives as a float."""

    def __init__(self, problem: DecodeProblem, config: CuteConfig, device: torch.device) -> None:
        in_global = config.num_splits > 1 and not wgmma_cluster(config)  # (a cluster merges in shared memory)
        rows = problem.num_rows * problem.geometry.num_q_heads * config.num_splits if in_global else 0
        self.partial_out = torch.empty((max(rows, 1), problem.geometry.head_dim), dtype=torch.float32, device=device)
        counters = wgmma_programs(problem) if config.fused and in_global else 0
        self._ml = torch.zeros(max(rows, 1) * 2 + counters, dtype=torch.float32, device=device)
        self.partial_ml = self._ml[:max(rows, 1) * 2].view(max(rows, 1), 2)
        self.one = torch.ones(1, dtype=torch.float32, device=device)


def spec_for(problem: DecodeProblem, config: CuteConfig, out_dtype: torch.dtype, with_lse: bool) -> Any:
    """The `KernelSpec` (or, for the wgmma kernel, `Sm90Spec`) of a step (imports the DSL)."""
    g = problem.geometry
    if config.kernel == "wgmma":
        from msa.backends.cute.sm90 import Sm90Spec

        fused = config.fused and config.num_splits > 1
        return Sm90Spec(g.page_size, Q_KINDS[problem.q_dtype], _OUT_KINDS[out_dtype], config.num_splits == 1,
                        with_lse and (config.num_splits == 1 or fused), wgmma_heads(g.group_size) * config.tokens,
                        config.stages, fused, config.lag, config.min_ctas, config.wgs, config.vreg,
                        WGMMA_KINDS[problem.kv_layout], config.kreg, config.tconv, config.tokens,
                        wgmma_cluster(config), config.evict, config.refill)
    from msa.backends.cute.kernel import KernelSpec

    return KernelSpec(KINDS[problem.kv_layout], g.page_size, Q_KINDS[problem.q_dtype], _OUT_KINDS[out_dtype],
                      config.num_splits == 1,
                      with_lse and config.num_splits == 1, g.head_dim, config.stages, config.qk_chains, config.min_ctas)


def prepare(problem: DecodeProblem, config: CuteConfig, device: torch.device) -> dict[bool, Any]:
    """The launches a plan's `run` makes, by whether the kernel writes the LSE (the output dtype is
    the problem's: validation fixes it): compiled here, with the DSL's executor on `device` made
    here too, so that no compilation, module load or cache lookup under the lock happens in `run`
    (nor inside a graph capture)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    with torch.cuda.device(index):  # the DSL compiles for, and binds to, the current device
        capability = torch.cuda.get_device_capability(index)
        return {with_lse: compiled_kernel(spec_for(problem, config, problem.out_dtype, with_lse), capability)
                .launcher(index) for with_lse in (False, True)}


def traced_kernel(problem: DecodeProblem, config: CuteConfig) -> tuple[Any, int]:
    """The wgmma kernel of a step compiled with `Sm90Spec.trace` (profiling,
    benchmarks/trace_cute.py), for the current GPU, and the CTAs it launches: pass it to
    `launch_cute` as `{True: kernel}` with an int64 `[ctas, sm90.TRACE_WORDS]` tensor as `lse`,
    where each CTA writes its milestones' clocks instead of an LSE."""
    if config.kernel != "wgmma" or (config.num_splits > 1 and not config.fused):
        raise MSAInputError("config", "the wgmma kernel merging its own splits (the traced kernel)", repr(config))
    spec = attrs.evolve(spec_for(problem, config, problem.out_dtype, False), trace=True)
    index = torch.cuda.current_device()
    kernel = compiled_kernel(spec, torch.cuda.get_device_capability(index)).launcher(index)
    return kernel, wgmma_programs(problem, config.tokens) * config.num_splits


def compiled_kernel(spec: Any, capability: tuple[int, int]) -> PackedCall:
    """The compiled kernel of `spec` for GPUs of `capability` (compiled once per process, for the
    current GPU, which must be of that capability), with whether msa may pack its arguments
    (`fastcall.packing_matches`, checked once per compiled kernel)."""
    with _lock:
        call = _compiled.get((spec, capability))
        if call is None:
            import cutlass.cute as cute

            from msa.backends.cute.kernel import build, compile_args
            from msa.backends.cute.sm90 import Sm90Spec, build_sm90

            fn = cute.compile(build_sm90(spec) if isinstance(spec, Sm90Spec) else build(spec), *compile_args())
            call = _compiled[(spec, capability)] = PackedCall(fn, HOST_ARG_KINDS, packing_matches(fn, HOST_ARG_KINDS))
    return call


def _scales(inputs: DecodeInputs, one: torch.Tensor) -> tuple[float, float, list[torch.Tensor]]:
    """(qk factor of the float scales, v factor, the four tensors the kernel reads: the caller's
    tensor scales, `one` for each float)."""
    factors, tensors = [], []
    for name in ("sm_scale", "q_scale", "k_scale", "v_scale"):
        value = getattr(inputs, name)
        if isinstance(value, torch.Tensor):
            factors.append(1.0)
            tensors.append(value)
        else:
            factors.append(float(value))
            tensors.append(one)
    return factors[0] * factors[1] * factors[2] * LOG2E, factors[3], tensors


def launch_cute(
    problem: DecodeProblem,
    inputs: DecodeInputs,
    rows: RowMetadata,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    config: CuteConfig,
    workspace: CuteWorkspace,
    kernels: dict[bool, Any],
) -> None:
    """Run the kernel (and the merge when split) into `out` / `lse`. Allocates nothing and never
    synchronises."""
    if problem.num_rows == 0:
        return
    g = problem.geometry
    q, topk, table = inputs.q, inputs.topk_indices, inputs.block_table
    kv = problem.layout.kv_operands(inputs.kv_cache)
    k_base, v_base = kv.addresses
    misaligned = vector_misalignment(q, out, kv, problem.layout.block_scaled)
    if misaligned is not None:  # the plan's problem assumed aligned runs; this one is not
        name, expected, given = misaligned
        raise MSAInputError(name, f"{expected} for the cute backend (the triton backend takes any)", given)
    qk, vs, scales = _scales(inputs, workspace.one)
    fn = kernels[lse is not None]
    lse_arg = lse if lse is not None else out
    (stride_kp, stride_kh, stride_kt), (stride_vp, stride_vh, stride_vt) = kv.k_strides, kv.v_strides
    fn(q.data_ptr(), k_base, v_base, topk.data_ptr(), table.data_ptr(), rows.row_request.data_ptr(),
       rows.q_pos.data_ptr(), out.data_ptr(), lse_arg.data_ptr(), workspace.partial_out.data_ptr(),
       workspace.partial_ml.data_ptr(), *(t.data_ptr() for t in scales), qk, vs, kv.k.shape[0], table.shape[1],
       config.num_splits, q.stride(0), q.stride(1), stride_kp, stride_kh, stride_kt, stride_vp, stride_vh,
       stride_vt, topk.stride(0), topk.stride(1), topk.stride(2), table.stride(0), out.stride(0), out.stride(1),
       lse_arg.stride(0), lse_arg.stride(1) if lse_arg.dim() > 1 else 1, g.num_kv_heads, g.group_size, g.topk,
       problem.num_rows, 0 if problem.ragged else problem.query_len, _stream(out.device))
    if config.num_splits > 1 and not config.fused:  # (only the wgmma kernel merges its own splits)
        _merge(problem, config, workspace, out, lse, lse_arg, scales[3], vs, rows)


def _merge(problem: DecodeProblem, config: CuteConfig, workspace: CuteWorkspace, out: torch.Tensor,
           lse: torch.Tensor | None, lse_arg: torch.Tensor, scales_v: torch.Tensor, vs: float,
           rows: RowMetadata) -> None:
    """The Triton merge of the splits' partials, on the stream the kernel ran on: `out`'s device's
    (Triton launches on the current device's stream, which may be another device's)."""
    g = problem.geometry
    with torch.cuda.device(out.device):
        merge_kernel[(problem.num_rows * g.num_q_heads,)](
            workspace.partial_out, workspace.partial_ml, out, lse_arg, scales_v, vs, rows.q_pos,
            out.stride(0), out.stride(1), lse_arg.stride(0), lse_arg.stride(1) if lse_arg.dim() > 1 else 1,
            NUM_Q_HEADS=g.num_q_heads, HEAD_DIM=g.head_dim, NUM_SPLITS=config.num_splits,
            BLOCK_S=1 << max(config.num_splits - 1, 0).bit_length(), V_SCALE_PTR=True, WRITE_LSE=lse is not None,
            num_warps=4,
        )


def _stream(device: torch.device) -> int:
    """The handle of `device`'s current torch stream (what the kernel's last argument takes), the
    plan's device whichever device is current."""
    return int(torch.cuda.current_stream(device).cuda_stream)
