"""The one-shot entry point: validate -> plan (cached per shape) -> run."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any, Literal, TypedDict, Unpack, overload

import attrs
import torch

from msa.backends.base import AnyBackend
from msa.errors import MSAInputError, check_flag
from msa.layouts import KVCache
from msa.planner import DecodePlanner
from msa.platform import current_stream_key, detect, stream_capturing
from msa.policy import default_policy
from msa.problem import DecodeProblem
from msa.registry import get_registry
from msa.scales import Scale
from msa.validation import (
    CheckedCall,
    DecodeInputs,
    call_signature,
    check_decode_data,
    check_decode_inputs,
    validation_requested,
)

__all__ = ["sparse_decode", "select_backend", "available_backends", "DecodeOptions"]


def available_backends() -> list[AnyBackend]:
    """Every registered backend that loads, highest priority first (a backend whose factory
    fails is skipped; `msa backends` shows it with its error)."""
    return get_registry().backends()


def select_backend(problem: DecodeProblem, backend: str = "auto") -> AnyBackend:
    """The backend that will run `problem` on its device (see `msa.policy`).

    Raises:
        MSAInputError: an unknown backend name.
        MSAUnsupportedError: the named backend (or, for "auto", every backend) cannot serve
            `problem`; the message lists each refusal's reasons.
        MSAPluginError: the named backend's plugin failed (with its source and error), or, for
            "auto", a plugin named in `MSA_PLUGINS` failed.
    """
    chosen, _ = default_policy().select(problem, detect(problem.device_type), backend)
    return chosen


class DecodeOptions(TypedDict, total=False):
    """The keyword arguments of a decode step besides its tensors and its LSE output, shared by
    `sparse_decode` and `msa.distributed.sparse_decode` (see `sparse_decode` for each)."""

    decode_query_len: int
    kv_cache_dtype: str | None
    sm_scale: Scale | None
    q_scale: Scale
    k_scale: Scale
    v_scale: Scale
    out: torch.Tensor | None
    backend: str
    validate: bool
    query_start_loc: torch.Tensor | None


@overload
def sparse_decode(
    q: torch.Tensor, kv_cache: KVCache, topk_indices: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    *, lse: None = ..., return_lse: Literal[False] = ..., dcp_size: int = ..., **options: Unpack[DecodeOptions],
) -> torch.Tensor: ...


@overload
def sparse_decode(
    q: torch.Tensor, kv_cache: KVCache, topk_indices: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    *, lse: torch.Tensor, return_lse: bool = ..., dcp_size: int = ..., **options: Unpack[DecodeOptions],
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def sparse_decode(
    q: torch.Tensor, kv_cache: KVCache, topk_indices: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    *, lse: torch.Tensor | None = ..., return_lse: Literal[True], dcp_size: int = ..., **options: Unpack[DecodeOptions],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def sparse_decode(
    q: torch.Tensor,
    kv_cache: KVCache,
    topk_indices: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    decode_query_len: int = 1,
    kv_cache_dtype: str | None = None,
    sm_scale: Scale | None = None,
    q_scale: Scale = 1.0,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    validate: bool = False,
    query_start_loc: torch.Tensor | None = None,
    dcp_size: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention decode over a paged KV cache with per-query-token page selection.

    Row `r = b*L + i` (request `b`, query token `i`) at position `seq_lens[b] - L + i` attends,
    for each KV head `h`, the visible tokens of the blocks listed in `topk_indices[h, r]`
    (docs/semantics.md §3); `-1` and out-of-range entries are skipped.

    Args:
        q: `[B*L, Hq, D]` bf16/fp16 (fp8 e4m3 with `q_scale`), rows request-major, unit last
            stride.
        kv_cache: the paged cache in its layout (see `msa.layouts`): `[pages, Hkv, P, 2D]`
            bf16/fp16/fp8, or a `(k_cache, v_cache)` pair of `[pages, Hkv, P, D]` views with a
            unit last stride (separate caches, SGLang's pools viewed as pages), or
            `[pages, 2Hkv, P, D/2 + D/16]` uint8 for NVFP4.
        topk_indices: int32 `[Hkv, B*L, K]`, block ids per (KV head, row); any strides (the
            transpose of a token-major `[B*L, Hkv, K]` buffer is accepted without a copy).
        block_table: int32 `[B, max_blocks]`: block `j` of request `b` lives at page
            `block_table[b, j]`.
        seq_lens: int32 `[B]`: KV length of each request including its `L` new tokens.
        decode_query_len: `L`, query tokens per request (default 1: plain decode).
        kv_cache_dtype: "auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "nvfp4", or None to
            infer it from the cache dtype.
        sm_scale: softmax scale, default `D ** -0.5`.
        q_scale, k_scale, v_scale: dequantization scales; floats or one-element fp32 tensors
            on `q`'s device (NVFP4 global scales).
        out: optional `[B*L, Hq, D]` output (dtype of `q`, bf16 for fp8 `q`); views with unit
            last stride are fine.
        lse: optional fp32 `[B*L, Hq]` output for the natural-log log-sum-exp.
        return_lse: also return the log-sum-exp (`-inf` for rows that attend nothing).
        backend: "auto" (the first backend that qualifies) or a backend name.
        validate: also run the checks that read device data (index ranges, duplicates, pages).
            `MSA_VALIDATE=1` turns them on globally.
        query_start_loc: int32 `[B+1]` for ragged steps: request `b` owns rows
            `[qsl[b], qsl[b+1])` of `q` (its own query length); `decode_query_len` is then the
            largest length. Rows past `qsl[B]` are padding (zeros, LSE -inf).
        dcp_size: the ranks each request's pages are spread over when this call decodes one
            rank's share under decode context parallelism (`msa.distributed` passes its group's
            size); it steers the kernel choice (a share of each selection favours other kernels).

    Returns:
        `out`, or `(out, lse)` when `return_lse` (or `lse=`) is given.

    Thread safety: calls from any number of threads, and on any number of CUDA streams, are
    independent: each (thread, stream) pair plans with its own buffers.

    Called eagerly, layer after layer (serving engines run attention between graph pieces), the
    call stays cheap: the checks of a call are remembered per signature (shapes, strides,
    dtypes, devices, scale forms — everything they depend on), and a step is planned once. The
    per-row metadata is refreshed when `block_table`, `seq_lens` or `query_start_loc` are other
    tensor objects than the previous call's, or were changed in place through torch (their
    version counters); every later layer of a step reuses it. A caller that rewrites those same
    tensor objects by other means (its own kernels) between steps must pass fresh objects (new
    views), or use a `DecodePlanner`, whose `plan()` always refreshes. Tensors made under
    `torch.inference_mode()` have no version counters: for them the same objects mean the same
    step (serving engines pass each step's tables as new views), so one rewritten in place
    under inference mode must also be passed as a fresh view.
    """
    local = _thread_local()
    signature = _call_signature(
        q, kv_cache, topk_indices, block_table, seq_lens, decode_query_len, kv_cache_dtype, sm_scale, q_scale,
        k_scale, v_scale, out, lse, return_lse, backend, validate, query_start_loc, dcp_size,
    )
    known = local.calls.get(signature) if signature is not None else None
    if known is None:
        problem, inputs, planner = _checked_call(
            q, kv_cache, topk_indices, block_table, seq_lens, decode_query_len, kv_cache_dtype, sm_scale, q_scale,
            k_scale, v_scale, out, lse, return_lse, backend, validate, query_start_loc, dcp_size, signature,
        )
    else:  # checked before, with the same signature: only what depends on pointers is new
        checked, planner = known
        problem = checked.problem
        inputs = checked.inputs(
            q, kv_cache, topk_indices, block_table, seq_lens, query_start_loc, (sm_scale, q_scale, k_scale, v_scale),
            out, lse, signature,
        )
    device = q.device
    g = problem.geometry
    out_t = inputs.out
    if out_t is None:
        out_t = torch.empty((problem.num_rows, g.num_q_heads, g.head_dim), dtype=problem.out_dtype, device=device)
    lse_t = inputs.lse
    if lse_t is None and problem.return_lse:
        lse_t = torch.empty((problem.num_rows, g.num_q_heads), dtype=torch.float32, device=device)
    planner.run_one_shot(problem, inputs, out_t, lse_t)  # never contended: this thread's and stream's
    if lse_t is not None:
        return out_t, lse_t
    return out_t


#: Planners of the one-shot path, per thread (thread-local) and per CUDA stream: a plan's
#: buffers are refreshed by one call and read by its kernels, so two calls may share them only
#: when their work is ordered — same thread, same stream. Beside them, the signatures of the
#: calls already checked.
_LOCAL = threading.local()
_MAX_PLANNERS = 16
_MAX_CALLS = 256

#: What a checked call remembers: what its checks found, and its planner.
_Known = tuple[CheckedCall, DecodePlanner]


def _thread_local() -> Any:
    local = _LOCAL
    if not hasattr(local, "calls"):
        local.calls = {}
        local.planners = OrderedDict()
    return local


def _call_signature(
    q: object, kv_cache: object, topk_indices: object, block_table: object, seq_lens: object,
    decode_query_len: object, kv_cache_dtype: object, sm_scale: object, q_scale: object, k_scale: object,
    v_scale: object, out: object, lse: object, return_lse: object, backend: object, validate: object,
    query_start_loc: object, dcp_size: object,
) -> tuple[Any, ...] | None:
    """The call's `call_signature`, with what else picks its planner (backend, environment,
    stream, registry); None when it must be checked in full."""
    if validate is not False or not isinstance(q, torch.Tensor):
        return None
    return call_signature(
        (q, kv_cache, topk_indices, block_table, seq_lens, out, lse, query_start_loc),
        (sm_scale, q_scale, k_scale, v_scale, return_lse, decode_query_len, kv_cache_dtype, backend, dcp_size,
         os.environ.get("MSA_BACKEND", ""), current_stream_key(q.get_device()), get_registry(),
         stream_capturing(q.device)),
    )


def _checked_call(
    q: torch.Tensor, kv_cache: KVCache, topk_indices: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    decode_query_len: int, kv_cache_dtype: str | None, sm_scale: Scale | None, q_scale: Scale, k_scale: Scale,
    v_scale: Scale, out: torch.Tensor | None, lse: torch.Tensor | None, return_lse: bool, backend: str,
    validate: bool, query_start_loc: torch.Tensor | None, dcp_size: int, signature: tuple[Any, ...] | None,
) -> tuple[DecodeProblem, DecodeInputs, DecodePlanner]:
    """Every check of a call (and the deep ones when asked for); remembers it under `signature`."""
    check_flag("validate", validate)
    if not isinstance(backend, str):
        raise MSAInputError("backend", "'auto' or a backend name (a str)", repr(backend))
    problem, inputs = check_decode_inputs(
        q, kv_cache, topk_indices, block_table, seq_lens, decode_query_len=decode_query_len,
        kv_cache_dtype=kv_cache_dtype, sm_scale=sm_scale, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
        out=out, lse=lse, return_lse=return_lse, query_start_loc=query_start_loc, dcp_size=dcp_size,
    )
    if validation_requested(validate):
        check_decode_data(problem, inputs)
    planner = _one_shot_planner(problem, inputs.layout.name, backend, inputs.q.device)
    if signature is not None:
        calls = _thread_local().calls
        if len(calls) >= _MAX_CALLS:
            calls.clear()
        calls[signature] = (CheckedCall.of(problem, inputs), planner)
        inputs = attrs.evolve(inputs, signature=signature)
    return problem, inputs, planner


def _one_shot_planner(problem: DecodeProblem, layout: str, backend: str, device: torch.device) -> DecodePlanner:
    """This thread's planner for this configuration and stream (bounded, least recently used
    dropped)."""
    planners: OrderedDict[tuple[Any, ...], DecodePlanner] = _thread_local().planners
    registry = get_registry()
    capturing = stream_capturing(device)  # only capturable backends are chosen then
    key = (
        problem.geometry, layout, backend, os.environ.get("MSA_BACKEND", ""), device,
        current_stream_key(q_index(device)), problem.q_dtype, problem.return_lse, registry, problem.kv_form,
        capturing, problem.vector_aligned, problem.dcp_size,
    )
    planner = planners.get(key)
    if planner is None:
        planner = DecodePlanner(
            problem.geometry, kv_cache_dtype=layout, backend=backend, device=device,
            q_dtype=problem.q_dtype, with_lse=problem.return_lse, kv_form=problem.kv_form, graph_capture=capturing,
            vector_aligned=problem.vector_aligned, dcp_size=problem.dcp_size,
        )
        planners[key] = planner
        while len(planners) > _MAX_PLANNERS:
            planners.popitem(last=False)
    planners.move_to_end(key)
    return planner


def q_index(device: torch.device) -> int:
    """The CUDA index of `device` (-1 off CUDA)."""
    return device.index if device.type == "cuda" and device.index is not None else -1
