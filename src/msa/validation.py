"""Input checks for a decode step (docs/semantics.md §6).

`check_decode_inputs` runs every check that needs no device data and returns the step as a
`DecodeProblem` plus the checked `DecodeInputs`. `check_decode_data` runs the deep checks
(`validate=True` or `MSA_VALIDATE=1`), which read indices, tables and lengths from the device and
report the first offending row.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any

import attrs
import torch

from msa.errors import MSAInputError, check_flag, is_int
from msa.layouts import KVCache, KVLayout, cache_device, layout_for_cache
from msa.layouts.base import KVOperands
from msa.problem import DecodeProblem, Geometry, cache_form
from msa.scales import Scale, check_scale, check_scale_value, check_score_factor
from msa.semantics import row_positions

__all__ = [
    "DecodeInputs",
    "Q_DTYPES",
    "check_decode_inputs",
    "check_decode_data",
    "output_dtype",
    "validation_requested",
    "check_tensor",
    "check_dims",
    "check_int32",
    "check_disjoint",
    "byte_span",
    "call_signature",
    "CheckedCall",
]

#: dtypes accepted for `q`.
Q_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)


@attrs.frozen(eq=False)
class DecodeInputs:
    """The checked tensors and scales of one decode step (shapes as in docs/semantics.md §2).

    Attributes:
        problem: the step's shape (what `check_decode_inputs` also returns).
        q: `[B*L, Hq, D]`.
        kv_cache: the cache, in `layout`: one tensor, or a `(k_cache, v_cache)` pair.
        topk_indices: int32 `[Hkv, B*L, K]`, any strides.
        block_table: int32 `[B, max_blocks]`, unit last stride.
        seq_lens: int32 `[B]`, KV lengths including the `L` new tokens.
        layout: the cache's concrete layout.
        sm_scale, q_scale, k_scale, v_scale: floats or one-element fp32 device tensors.
        out: `[B*L, Hq, D]` output (None until the API allocates it).
        lse: `[B*L, Hq]` fp32 log-sum-exp output, or None.
        query_start_loc: int32 `[B+1]` for ragged steps (request `b` owns rows
            `[qsl[b], qsl[b+1])`), else None.
        signature: what the call's checks depended on (shapes, strides, dtypes, devices, scale
            forms), when the caller computed it (`msa.sparse_decode` does): backends may memoise
            per signature what depends on nothing else. None: no memo.
    """

    problem: DecodeProblem
    q: torch.Tensor
    kv_cache: KVCache
    topk_indices: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    layout: KVLayout
    sm_scale: Scale
    q_scale: Scale
    k_scale: Scale
    v_scale: Scale
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    query_start_loc: torch.Tensor | None = None
    signature: Hashable | None = None


def output_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """`q`'s dtype, or bf16 when `q` is fp8."""
    return torch.bfloat16 if q_dtype == torch.float8_e4m3fn else q_dtype


def validation_requested(validate: bool) -> bool:
    """True when the caller passed `validate=True` or the environment sets `MSA_VALIDATE=1`."""
    return validate or os.environ.get("MSA_VALIDATE", "") not in ("", "0")


def check_tensor(
    argument: str, value: object, device: torch.device | None = None, whose: str = "the device of q"
) -> torch.Tensor:
    """`value` as a tensor (on `device`, when given), or an `MSAInputError` naming `argument`."""
    if not isinstance(value, torch.Tensor):
        raise MSAInputError(argument, "a torch.Tensor", type(value).__name__)
    if device is not None and value.device != device:
        raise MSAInputError(argument, f"a tensor on {device} ({whose})", value.device)
    return value


def check_dims(argument: str, value: object, dim: int, expected: str) -> torch.Tensor:
    """`value` as a tensor of `dim` dimensions, or an `MSAInputError` naming `argument` with
    `expected` and what was given (its shape, or its type)."""
    if not isinstance(value, torch.Tensor) or value.dim() != dim:
        given = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise MSAInputError(argument, expected, given)
    return value


def _span(t: torch.Tensor) -> int:
    """Elements from the first to one past the last element `t` addresses."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True) if size > 0)


def _check_no_self_overlap(argument: str, t: torch.Tensor) -> None:
    """No two elements of `t` share memory (a view with stride 0, or rows that overlap, would
    make the kernel's writes race)."""
    covered = 0
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1):
        if stride <= covered:
            raise MSAInputError(
                argument,
                "a tensor whose elements do not overlap in memory",
                f"strides {t.stride()} for shape {tuple(t.shape)}",
            )
        covered += stride * (size - 1)


def byte_span(t: torch.Tensor) -> int:
    """Bytes from the first to one past the last byte `t` addresses (0 when empty)."""
    return 0 if t.numel() == 0 else _span(t) * t.element_size()


def check_disjoint(
    argument: str, t: torch.Tensor, other_name: str, other: torch.Tensor, spans: tuple[int, int] | None = None
) -> None:
    """`t` and `other` share no memory (an output must not overwrite an input or another output).
    `spans`: their `byte_span`s, when the caller knows them (they depend on shapes alone)."""
    t_bytes, other_bytes = spans if spans is not None else (byte_span(t), byte_span(other))
    if t_bytes == 0 or other_bytes == 0:
        return
    a0, b0 = t.data_ptr(), other.data_ptr()
    a1, b1 = a0 + t_bytes, b0 + other_bytes
    if a0 < b1 and b0 < a1:
        raise MSAInputError(argument, f"memory that does not overlap {other_name}", "an overlapping tensor")


def _tensor_signature(t: object) -> object:
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(map(_tensor_signature, t))
    assert isinstance(t, torch.Tensor)
    # the device itself (`get_device()` is -1 for cpu and meta alike); the address: `vector_aligned`
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def vector_misalignment(q: torch.Tensor, out: torch.Tensor | None, kv: KVOperands,
                        block_scaled: bool) -> tuple[str, str, str] | None:
    """What keeps a kernel with vector loads from these tensors, as (argument, expectation, what
    was given), or None: the rows of `q` and `out` must start on 4-byte boundaries, and the cache's
    key and value bases, pages and heads (and tokens, except in NVFP4 head slots, whose rows the
    layout addresses itself) on 16-byte ones. `DecodeProblem.vector_aligned` records the answer
    for the selection policy."""
    for name, t in (("q", q), ("out", out)):
        if t is not None and (t.data_ptr() % 4 or any(st * t.element_size() % 4 for st in t.stride()[:-1])):
            return name, "rows aligned to 4 bytes", f"address {t.data_ptr():#x}, strides {tuple(t.stride())}"
    kept = 2 if block_scaled else 3
    bases = kv.addresses
    strides = (*(st * kv.k.element_size() for st in kv.k_strides[:kept]),
               *(st * kv.v.element_size() for st in kv.v_strides[:kept]))
    if any(b % 16 for b in bases) or any(st % 16 for st in strides):
        return ("kv_cache", "keys and values, pages, heads and tokens aligned to 16 bytes",
                f"bases {bases[0]:#x} / {bases[1]:#x}, byte strides {strides}")
    return None


def _vector_aligned(q: torch.Tensor, out: torch.Tensor | None, layout: KVLayout, cache: KVCache) -> bool:
    try:
        kv = layout.kv_operands(cache)
    except MSAInputError:  # a form no kernel addresses this way (the reference reads it)
        return False
    return vector_misalignment(q, out, kv, layout.block_scaled) is None


def call_signature(tensors: tuple[object, ...], values: tuple[object, ...]) -> tuple[Any, ...] | None:
    """Everything the cheap checks of a call depend on apart from pointers — shapes, strides,
    dtypes and devices of `tensors` (each a tensor, a `(k, v)` pair or None), the type and value
    of each of `values` (True is not 1.0; a tensor counts by its shape, dtype and device) — so a
    later call with an equal signature passes the same checks. None when the call must be checked
    in full: deep checks asked for (`MSA_VALIDATE`), or arguments that are not what they should be.
    """
    if os.environ.get("MSA_VALIDATE", "") not in ("", "0"):
        return None
    try:
        signature = (
            tuple(map(_tensor_signature, tensors)),
            tuple(_tensor_signature(v) if isinstance(v, torch.Tensor) else (type(v), v) for v in values),
        )
        hash(signature)
    except (AssertionError, AttributeError, TypeError, RuntimeError):
        return None
    return signature


@attrs.frozen(eq=False)
class CheckedCall:
    """What a fully checked call leaves for later calls of the same `call_signature`: its problem,
    layout, scales as checked, and the byte spans of out, q and lse (the overlap checks depend
    on pointers and are made again)."""

    problem: DecodeProblem
    layout: KVLayout
    scales: tuple[Scale, Scale, Scale, Scale]
    spans: tuple[int, int, int]

    @classmethod
    def of(cls, problem: DecodeProblem, inputs: DecodeInputs) -> CheckedCall:
        spans = tuple(0 if t is None else byte_span(t) for t in (inputs.out, inputs.q, inputs.lse))
        scales = (inputs.sm_scale, inputs.q_scale, inputs.k_scale, inputs.v_scale)
        return cls(problem, inputs.layout, scales, (spans[0], spans[1], spans[2]))

    def inputs(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        topk_indices: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None,
        scales: tuple[object, object, object, object],
        out: torch.Tensor | None,
        lse: torch.Tensor | None,
        signature: Hashable,
    ) -> DecodeInputs:
        """The inputs of a call with this signature: the overlap checks, then the new tensors
        (tensor scales as given, float scales as checked)."""
        _check_outputs_disjoint(q, out, lse, self.spans)
        sm, qs, ks, vs = (
            given if isinstance(given, torch.Tensor) else checked
            for given, checked in zip(scales, self.scales, strict=True)
        )
        return DecodeInputs(
            problem=self.problem, q=q, kv_cache=kv_cache, topk_indices=topk_indices, block_table=block_table,
            seq_lens=seq_lens, layout=self.layout, sm_scale=sm, q_scale=qs, k_scale=ks, v_scale=vs, out=out,
            lse=lse, query_start_loc=query_start_loc, signature=signature,
        )


def _check_outputs_disjoint(
    q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None, spans: tuple[int, int, int] | None = None
) -> None:
    """`out` and `lse` overlap neither `q` nor each other. `spans`: the byte spans of (out, q, lse)
    when known (they depend on shapes and strides alone)."""
    out_bytes, q_bytes, lse_bytes = spans if spans is not None else (
        0 if out is None else byte_span(out), byte_span(q), 0 if lse is None else byte_span(lse))
    if out is not None:
        check_disjoint("out", out, "q", q, (out_bytes, q_bytes))
    if lse is not None:
        check_disjoint("lse", lse, "q", q, (lse_bytes, q_bytes))
        if out is not None:
            check_disjoint("lse", lse, "out", out, (lse_bytes, out_bytes))


def check_int32(argument: str, value: torch.Tensor, shape_doc: str, dim: int) -> None:
    """An int32 tensor of `dim` dimensions, or an `MSAInputError` naming `argument`."""
    if value.dtype != torch.int32 or value.dim() != dim:
        raise MSAInputError(
            argument, f"an int32 tensor {shape_doc}", f"{value.dtype} of shape {tuple(value.shape)}"
        )


def _check_q(q: torch.Tensor) -> None:
    if q.dim() != 3:
        raise MSAInputError("q", "a 3-D tensor [B*L, Hq, D]", f"shape {tuple(q.shape)}")
    if q.dtype not in Q_DTYPES:
        raise MSAInputError("q", "dtype bfloat16, float16 or float8_e4m3fn", q.dtype)
    if q.stride(-1) != 1:
        raise MSAInputError("q", "unit stride in the last dimension", f"strides {q.stride()}")
    if q.shape[1] < 1 or q.shape[2] < 1:
        raise MSAInputError("q", "at least one head and a head dim >= 1 ([B*L, Hq >= 1, D >= 1])",
                            f"shape {tuple(q.shape)}")


def _check_output(
    argument: str, value: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    if value is None:
        return None
    t = check_tensor(argument, value, device)
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise MSAInputError(
            argument,
            f"a {dtype} tensor of shape {shape}",
            f"{t.dtype} of shape {tuple(t.shape)}",
        )
    if t.stride(-1) != 1:
        raise MSAInputError(argument, "unit stride in the last dimension", f"strides {t.stride()}")
    _check_no_self_overlap(argument, t)
    return t


def check_decode_inputs(
    q: object,
    kv_cache: object,
    topk_indices: object,
    block_table: object,
    seq_lens: object,
    *,
    decode_query_len: object = 1,
    kv_cache_dtype: str | None = None,
    sm_scale: object = None,
    q_scale: object = 1.0,
    k_scale: object = 1.0,
    v_scale: object = 1.0,
    out: object = None,
    lse: object = None,
    return_lse: bool = False,
    query_start_loc: object = None,
    dcp_size: object = 1,
) -> tuple[DecodeProblem, DecodeInputs]:
    """Every check of docs/semantics.md §6 that needs no device data.

    Returns:
        The step's `DecodeProblem` and its `DecodeInputs` (out/lse as given, possibly None).

    Raises:
        MSAInputError: naming the first argument that breaks the contract.
    """
    q_t = check_tensor("q", q)
    _check_q(q_t)
    device = q_t.device
    layout = layout_for_cache(kv_cache, kv_cache_dtype)
    shape = layout.inspect(kv_cache)
    cache: KVCache = kv_cache  # type: ignore[assignment]  # inspect checked it
    if cache_device(cache) != device:
        raise MSAInputError("kv_cache", f"a tensor on {device} (the device of q)", cache_device(cache))
    if shape.num_pages < 1 or shape.num_kv_heads < 1:
        first = cache[0] if isinstance(cache, tuple) else cache
        raise MSAInputError("kv_cache", "at least one page and one KV head", f"shape {tuple(first.shape)}")
    check_flag("return_lse", return_lse)
    rows, num_q_heads, head_dim = q_t.shape
    if head_dim != shape.head_dim:  # either may be the wrong one: name both, with the cache's last dimension
        first = cache[0] if isinstance(cache, tuple) else cache
        raise MSAInputError(
            "q / kv_cache", "the same head dim",
            f"head dim {head_dim} in q and {shape.head_dim} in kv_cache (a last dimension of {first.shape[-1]} "
            f"in the {layout.name} layout)",
        )
    if num_q_heads % shape.num_kv_heads:
        raise MSAInputError(
            "q",
            f"a number of heads divisible by the cache's {shape.num_kv_heads} KV heads",
            f"{num_q_heads} heads",
        )
    if not is_int(decode_query_len):
        raise MSAInputError("decode_query_len", "an int >= 1", repr(decode_query_len))
    if decode_query_len < 1:
        raise MSAInputError("decode_query_len", "an int >= 1", decode_query_len)

    lens = check_tensor("seq_lens", seq_lens, device)
    check_int32("seq_lens", lens, "[B]", 1)
    batch = lens.shape[0]
    starts = None
    if query_start_loc is not None:
        starts = check_tensor("query_start_loc", query_start_loc, device)
        check_int32("query_start_loc", starts, "[B+1]", 1)
        if starts.shape[0] != batch + 1:
            raise MSAInputError("query_start_loc", f"{batch + 1} entries (B+1, B from seq_lens)", starts.shape[0])
    elif rows != batch * decode_query_len:
        raise MSAInputError(
            "q",
            f"B*L = {batch}*{decode_query_len} = {batch * decode_query_len} rows "
            "(B from seq_lens, L = decode_query_len)",
            f"{rows} rows",
        )
    table = check_tensor("block_table", block_table, device)
    check_int32("block_table", table, "[B, max_blocks]", 2)
    if table.shape[0] != batch or table.shape[1] < 1:
        raise MSAInputError(
            "block_table", f"shape [{batch}, max_blocks >= 1] (B from seq_lens)", tuple(table.shape)
        )
    if table.stride(-1) != 1:
        raise MSAInputError("block_table", "unit stride in the last dimension", table.stride())
    indices = check_tensor("topk_indices", topk_indices, device)
    check_int32("topk_indices", indices, "[Hkv, B*L, K]", 3)
    if indices.shape[0] != shape.num_kv_heads or indices.shape[1] != rows or indices.shape[2] < 1:
        raise MSAInputError(
            "topk_indices",
            f"shape [{shape.num_kv_heads}, {rows}, K >= 1] (head-major: [Hkv, B*L, K]; "
            "pass a token-major buffer as .transpose(0, 1))",
            tuple(indices.shape),
        )

    if sm_scale is None:
        sm_scale = head_dim**-0.5
    scales = {
        name: check_scale(name, value, device)
        for name, value in (
            ("sm_scale", sm_scale),
            ("q_scale", q_scale),
            ("k_scale", k_scale),
            ("v_scale", v_scale),
        )
    }
    factor = (scales["sm_scale"], scales["q_scale"], scales["k_scale"])
    if not any(isinstance(x, torch.Tensor) for x in factor):  # (a tensor's value: the deep checks)
        check_score_factor(*factor)
    out_dtype = output_dtype(q_t.dtype)
    out_t = _check_output("out", out, (rows, num_q_heads, head_dim), out_dtype, device)
    lse_t = _check_output("lse", lse, (rows, num_q_heads), torch.float32, device)
    _check_outputs_disjoint(q_t, out_t, lse_t)

    geometry = Geometry(
        num_q_heads=num_q_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=head_dim,
        page_size=shape.page_size,
        topk=indices.shape[2],
    )
    problem = DecodeProblem(
        geometry=geometry,
        batch_size=batch,
        query_len=decode_query_len,
        kv_layout=layout.name,
        q_dtype=q_t.dtype,
        out_dtype=out_dtype,
        device_type=device.type,
        num_pages=shape.num_pages,
        max_blocks=table.shape[1],
        return_lse=return_lse or lse_t is not None,
        block_table_stride=table.stride(0),
        ragged=starts is not None,
        total_rows=rows if starts is not None else None,
        kv_form=cache_form(cache),
        vector_aligned=_vector_aligned(q_t, out_t, layout, cache),
        dcp_size=_dcp_size(dcp_size),
    )
    inputs = DecodeInputs(
        problem=problem,
        q=q_t,
        kv_cache=cache,
        topk_indices=indices,
        block_table=table,
        seq_lens=lens,
        layout=layout,
        out=out_t,
        lse=lse_t,
        query_start_loc=starts,
        **scales,
    )
    return problem, inputs


def _dcp_size(value: object) -> int:
    if not is_int(value) or value < 1:
        raise MSAInputError("dcp_size", "the ranks each request's pages are spread over (an int >= 1)", repr(value))
    return value


def _first_row(mask: torch.Tensor) -> tuple[int, ...] | None:
    """The first `(head, row, entry)` where `mask [Hkv, R, K]` is set, ordered by row."""
    hits = mask.transpose(0, 1).nonzero()  # [(row, head, entry)], row-major
    if hits.shape[0] == 0:
        return None
    row, head, entry = (int(x) for x in hits[0])
    return head, row, entry


def check_decode_data(problem: DecodeProblem, inputs: DecodeInputs) -> None:
    """The deep checks (docs/semantics.md §6), reading device data. Reports the first offending row.

    Checks, in order: tensor scales finite and > 0; `query_start_loc` well formed; `seq_lens`
    non-negative and within the block table; every `topk_indices`
    entry is -1 or in `[0, max_blocks)`; no id repeated within one list; every selected visible
    block maps to a page in `[0, num_pages)`.

    Raises:
        MSAInputError: naming the argument, the rule and the first offending row.
    """
    p, length = problem.geometry.page_size, problem.query_len
    for name in ("sm_scale", "q_scale", "k_scale", "v_scale"):
        check_scale_value(name, getattr(inputs, name))
    check_score_factor(inputs.sm_scale, inputs.q_scale, inputs.k_scale)
    lens = inputs.seq_lens.long()
    if inputs.query_start_loc is not None:
        starts = inputs.query_start_loc.tolist()
        if starts[0] != 0:
            raise MSAInputError("query_start_loc", "query_start_loc[0] = 0", starts[0])
        for b in range(len(starts) - 1):
            count = starts[b + 1] - starts[b]
            if not 0 <= count <= length:
                raise MSAInputError(
                    "query_start_loc",
                    f"non-decreasing offsets, at most decode_query_len = {length} rows per request",
                    f"{count} rows for request {b} ({starts[b]} .. {starts[b + 1]})",
                )
        if starts[-1] > problem.num_rows:
            raise MSAInputError("query_start_loc", f"a last offset <= the {problem.num_rows} rows of q", starts[-1])
    for b, n in enumerate(lens.tolist()):
        if n < 0:
            raise MSAInputError("seq_lens", "lengths >= 0", f"seq_lens[{b}] = {n}")
        if -(-n // p) > problem.max_blocks:
            raise MSAInputError(
                "seq_lens",
                f"at most max_blocks * page_size = {problem.max_blocks * p} tokens "
                "(the block table's capacity)",
                f"seq_lens[{b}] = {n}",
            )

    request, position = row_positions(
        problem.num_rows, inputs.seq_lens, decode_query_len=length, query_start_loc=inputs.query_start_loc
    )

    def where(head: int, row: int, entry: int) -> str:
        b = int(request[row])
        first = b * length if inputs.query_start_loc is None else int(inputs.query_start_loc[b])
        return f"head {head}, row {row} (request {b}, token {row - first}), entry {entry}"

    idx = inputs.topk_indices.long()
    bad = _first_row((idx < -1) | (idx >= problem.max_blocks))
    if bad is not None:
        raise MSAInputError(
            "topk_indices",
            f"-1 or a block id in [0, {problem.max_blocks}) (the block table's columns)",
            f"{int(idx[bad])} at {where(*bad)}",
        )
    ordered, order = idx.sort(dim=-1)
    dup = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    bad = _first_row(dup)
    if bad is not None:
        h, r, t = bad
        entry = int(order[h, r, t + 1])
        raise MSAInputError(
            "topk_indices",
            "distinct block ids within one list",
            f"{int(ordered[h, r, t])} repeated at {where(h, r, entry)}",
        )
    visible = (position + 1).clamp(min=0)
    visible_blocks = (visible + p - 1) // p  # [R]
    selected = (idx >= 0) & (idx < visible_blocks.view(1, -1, 1))
    table = inputs.block_table.long()
    # (no request, B = 0: every row is padding, none selects a visible block)
    pages = torch.zeros_like(idx) if table.shape[0] == 0 else table[request.view(1, -1, 1), idx.clamp(min=0)]
    bad = _first_row(selected & ((pages < 0) | (pages >= problem.num_pages)))
    if bad is not None:
        h, r, t = bad
        raise MSAInputError(
            "block_table",
            f"a page in [0, {problem.num_pages}) for every selected visible block",
            f"block_table[{int(request[r])}, {int(idx[bad])}] = {int(pages[bad])}, selected at "
            + where(h, r, t),
        )
