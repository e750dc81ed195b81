"""Random decode steps for the tests, with every kind of malformed index docs/semantics.md §3 says to skip."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from naive import dequantize, naive_decode

import msa
from msa.layouts import get_layout, layout_for_cache

OUT_DTYPE_RTOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10, torch.float32: 2.0**-20, torch.float64: 1e-12}


class HasNaive(Protocol):
    def naive(self) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass
class Case:
    layout: str = "bfloat16"
    batch: int = 2
    query_len: int = 1
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    topk: int = 4
    max_blocks: int = 6
    q_dtype: torch.dtype = torch.bfloat16
    tensor_scales: bool = False
    token_major: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return (
            f"{self.layout} B{self.batch} L{self.query_len} {self.num_q_heads}/{self.num_kv_heads} "
            f"D{self.head_dim} P{self.page_size} K{self.topk}"
        )


@dataclass
class Built:
    case: Case
    kwargs: dict[str, Any]
    keys: np.ndarray
    values: np.ndarray
    score_scale: float

    def naive(self) -> tuple[np.ndarray, np.ndarray]:
        kw = self.kwargs
        topk = kw["topk_indices"]
        return naive_decode(
            kw["q"], self.keys, self.values, topk.contiguous(), kw["block_table"],
            kw["seq_lens"], self.case.query_len, self.score_scale,
        )


def _scale(value: float, as_tensor: bool) -> float | torch.Tensor:
    return torch.tensor([value], dtype=torch.float32) if as_tensor else value


def build(case: Case, gen: torch.Generator) -> Built:
    """A random step: cache written through the layout's writer, malformed indices included."""
    layout = get_layout(case.layout)
    p, mb, b, length = case.page_size, case.max_blocks, case.batch, case.query_len
    hkv, k = case.num_kv_heads, case.topk
    num_pages = b * mb + 2
    cache = layout.allocate(num_pages, hkv, p, case.head_dim)
    kv_dtype = torch.float16 if case.layout in ("float16", "fp16") else torch.bfloat16
    shape = (num_pages * p, hkv, case.head_dim)
    key = torch.randn(shape, generator=gen).to(kv_dtype)
    value = torch.randn(shape, generator=gen).to(kv_dtype)
    write_scale = 0.05 if case.layout.startswith("fp8") else None
    k_s, v_s = layout.write(
        cache, key, value, torch.arange(num_pages * p), k_scale=write_scale, v_scale=write_scale
    )
    k_scale, v_scale = float(k_s), float(v_s)

    # lengths: mostly long, some empty, some shorter than L, last pages partly visible
    lens = torch.randint(p * mb // 2, p * mb + 1, (b,), generator=gen)
    if b >= 2:
        lens[0] = p * (mb + 1) + 3  # longer than the block table holds: ids >= max_blocks skipped
    if b >= 3:
        lens[1] = 0
        lens[2] = int(torch.randint(0, length + 1, (1,), generator=gen))
    seq_lens = lens.int()

    perm = torch.randperm(num_pages, generator=gen)[: b * mb].view(b, mb)
    table = perm.clone()
    noise = torch.rand((b, mb), generator=gen)
    table[noise < 0.08] = -1  # negative pages
    table[(noise >= 0.08) & (noise < 0.12)] = num_pages + 3  # pages past the cache
    block_table = table.int()

    rows = b * length
    ids = torch.stack(
        [torch.randperm(mb + 2, generator=gen)[:k] for _ in range(rows * hkv)]
    ).view(rows, hkv, k)  # ids past max_blocks included
    pad = torch.rand((rows, hkv, k), generator=gen)
    ids[pad < 0.15] = -1
    ids[(pad >= 0.15) & (pad < 0.18)] = -7
    ids[..., 0][pad[..., 0] > 0.9] = -1  # -1 at the front
    ids[..., -1][pad[..., -1] > 0.85] = -1  # and the tail
    token_major = ids.int().contiguous()
    topk_indices = token_major.transpose(0, 1) if case.token_major else token_major.transpose(0, 1).contiguous()

    q = torch.randn((rows, case.num_q_heads, case.head_dim), generator=gen)
    q_scale = 1.0
    if case.q_dtype == torch.float8_e4m3fn:
        q_scale = 0.1
        q = (q / q_scale).to(torch.float8_e4m3fn)
    else:
        q = q.to(case.q_dtype)
    sm_scale = case.head_dim**-0.5
    kwargs: dict[str, Any] = dict(
        q=q,
        kv_cache=cache,
        topk_indices=topk_indices,
        block_table=block_table,
        seq_lens=seq_lens,
        decode_query_len=length,
        kv_cache_dtype=case.layout,
        q_scale=_scale(q_scale, case.tensor_scales),
        k_scale=_scale(k_scale, case.tensor_scales),
        v_scale=_scale(v_scale, case.tensor_scales),
    )
    keys, values = dequantize(case.layout, cache, k_scale, v_scale)
    return Built(case, kwargs, keys, values, sm_scale * q_scale)


def gpu_atol(kwargs: dict[str, Any]) -> float:
    """The absolute tolerance of a GPU kernel's output against the reference for the step of
    `kwargs` (`msa.sparse_decode`'s arguments).

    On a GPU the kernels round the softmax weights to the 16-bit dtype of the P @ V product
    before it (bf16 for bf16 caches: 8 significant bits, a relative error of at most 2^-9; fp16
    otherwise, 2^-11). The weights of a row sum to one, so an output element moves by up to
    2^-9 * max|V| over what the row attends: with values up to 5 (N(0, 1) data) that is 0.01,
    and a fixed 3e-3 failed one run in a few (`test_drop_in_on_gpu`, V = 2 N(0, 1): 0.0156).
    Allowed: twice the bound over the whole cache's values (non-finite, poisoned ones left out),
    at least 3e-3; the output's own rounding is the caller's `rtol`."""
    cache = kwargs["kv_cache"]
    layout = layout_for_cache(cache, kwargs.get("kv_cache_dtype"))
    _, values = layout.dequantize(cache, k_scale=kwargs.get("k_scale", 1.0), v_scale=kwargs.get("v_scale", 1.0))
    largest = float(values.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).max()) if values.numel() else 0.0
    return max(3e-3, 2.0**-8 * largest)


def assert_close_to_naive(
    built: HasNaive, out: torch.Tensor, lse: torch.Tensor, where: str = "", atol: float = 0.0,
    rtol: float | None = None,
) -> None:
    """Compare with the float64 loop: out within the output dtype's rounding (plus `atol`, for
    kernels whose dots round their inputs), LSE within 2e-5 (plus `atol`); rows that attend
    nothing exactly 0 with an LSE of -inf; nothing non-finite."""
    ref_out, ref_lse = built.naive()
    label = f"{where} {getattr(built, 'case', '')}".strip()
    got = out.double().numpy()
    rtol = OUT_DTYPE_RTOL[out.dtype] if rtol is None else rtol
    bound = rtol * np.abs(ref_out) + 2e-5 + atol
    err = np.abs(got - ref_out)
    assert np.isfinite(got).all(), f"{label}: non-finite output at {np.argwhere(~np.isfinite(got))[:4].tolist()}"
    if err.size:
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        assert (err <= bound).all(), f"{label}: out differs at {worst}: {got[worst]} vs {ref_out[worst]}"
    got_lse = lse.double().numpy()
    empty = np.isneginf(ref_lse)
    assert not np.isnan(got_lse).any(), f"{label}: NaN LSE"
    assert (np.isneginf(got_lse) == empty).all(), f"{label}: -inf LSE rows differ"
    assert (got[empty.nonzero()] == 0).all(), f"{label}: empty rows must be exactly 0"
    lse_err = np.abs(got_lse[~empty] - ref_lse[~empty])
    assert (lse_err <= 2e-5 + atol + 1e-6 * np.abs(ref_lse[~empty])).all(), (
        f"{label}: LSE differs by {lse_err.max()}"
    )


def run(built: Built, **extra: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Run msa.sparse_decode with poisoned out/lse buffers."""
    kw = dict(built.kwargs)
    q = kw["q"]
    out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    out = torch.full(q.shape, float("nan"), dtype=out_dtype)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32)
    kw.update(extra)
    kw.setdefault("backend", "reference")
    result = msa.sparse_decode(**kw, out=out, lse=lse)
    assert isinstance(result, tuple) and result[0] is out and result[1] is lse
    return out, lse
