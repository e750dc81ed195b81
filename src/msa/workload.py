"""Realistic decode steps: a cache written through the layout's writer, scattered pages, and
top-k lists shaped like an indexer's. Shared by `msa demo`, the tests and the benchmarks."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from msa.errors import MSAInputError
from msa.layouts import KVCache, KVLayout, get_layout
from msa.oracle import dense_masked_attention
from msa.problem import Geometry

__all__ = ["DecodeStep", "make_decode_step", "indexer_topk", "as_kv_form", "KV_FORMS", "DEFAULT_SCALES"]

#: The cache forms serving engines keep, for the split layouts: msa's packed `[pages, Hkv, P, 2D]`
#: ("packed"), separate contiguous `[pages, Hkv, P, D]` K and V (FlashInfer's, "separate"), and
#: separate token-major pools `[slots, Hkv, D]` viewed as pages (SGLang's, "sglang").
KV_FORMS = ("packed", "separate", "sglang")

#: Dequantization scales the generator writes with, per layout (N(0, 1) data): FP8 stores
#: 16x the value; the NVFP4 global scale admits |x| <= 8 without saturating the block scales.
DEFAULT_SCALES: dict[str, float] = {"fp8_e4m3": 2.0**-4, "nvfp4": 8.0 / (6.0 * 448.0)}

_WRITE_CHUNK = 1 << 16  # tokens per writer call


@attrs.frozen(eq=False)
class DecodeStep:
    """One decode step's inputs, ready for `msa.sparse_decode(**step.kwargs())`.

    Attributes:
        geometry: heads, head dim, page size, top-k.
        layout: the cache layout.
        decode_query_len: `L`.
        q: `[B*L, Hq, D]`.
        kv_cache: the cache (one tensor, or a `(k_cache, v_cache)` pair: see `as_kv_form`).
        topk_indices: int32 `[Hkv, B*L, K]` (a head-major view of a token-major buffer).
        block_table: int32 `[B, max_blocks]`.
        seq_lens: int32 `[B]`.
        k_scale, v_scale: one-element fp32 tensors.
    """

    geometry: Geometry
    layout: KVLayout
    decode_query_len: int
    q: torch.Tensor
    kv_cache: KVCache
    topk_indices: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `msa.sparse_decode`."""
        return {
            "q": self.q,
            "kv_cache": self.kv_cache,
            "topk_indices": self.topk_indices,
            "block_table": self.block_table,
            "seq_lens": self.seq_lens,
            "decode_query_len": self.decode_query_len,
            "kv_cache_dtype": self.layout.name,
            "k_scale": self.k_scale,
            "v_scale": self.v_scale,
        }

    def oracle(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's float64 oracle (`msa.oracle.dense_masked_attention`, its scales included).

        Returns:
            `(out, lse)`: float64 `[B*L, Hq, D]` and `[B*L, Hq]`.
        """
        return dense_masked_attention(self.q, self.kv_cache, self.topk_indices, self.block_table, self.seq_lens,
                                      layout=self.layout, decode_query_len=self.decode_query_len,
                                      k_scale=self.k_scale, v_scale=self.v_scale)


def indexer_topk(
    seq_lens: torch.Tensor,
    *,
    decode_query_len: int,
    num_kv_heads: int,
    topk: int,
    page_size: int,
    max_blocks: int,
    generator: torch.Generator | None = None,
    overlap: float | None = None,
) -> torch.Tensor:
    """Top-k lists as an indexer produces them: block 0 and the token's own last block always
    chosen, the rest distinct random visible blocks, in score order, `-1`-padded when fewer than
    `topk` blocks are visible.

    `overlap` (speculative decoding): each token after the first of a request keeps each block
    the previous token chose with this probability (0: independent draws; 1: the same choices,
    up to causality). None draws every token independently.

    Returns:
        int32 `[Hkv, B*L, K]`: a head-major view (strides of the transpose) of a token-major
        `[B*L, Hkv, K]` buffer, as serving engines hold it.
    """
    device = seq_lens.device
    length = decode_query_len
    rows = torch.arange(seq_lens.shape[0] * length, device=device)
    visible = (seq_lens.long()[rows // length] - length + rows % length + 1).clamp(min=0)
    blocks = ((visible + page_size - 1) // page_size).clamp(max=max_blocks).view(-1, 1, 1)
    col = torch.arange(max_blocks, device=device).view(1, 1, -1)
    score = torch.rand(
        (rows.shape[0], num_kv_heads, max_blocks), generator=generator, device=device
    )
    score = torch.where(col < blocks, score, -1.0)
    forced = ((col == 0) | (col == blocks - 1)) & (col < blocks)
    score = torch.where(forced, 2.0, score)
    k = min(topk, max_blocks)
    if overlap is not None and length > 1:
        score = score.view(-1, length, num_kv_heads, max_blocks)
        visible_col = (col < blocks).view(-1, length, 1, max_blocks)
        for i in range(1, length):
            prev = score[:, i - 1]
            chosen = torch.zeros_like(prev, dtype=torch.bool).scatter_(-1, prev.topk(k, dim=-1).indices, True)
            chosen &= prev >= 0
            keep = chosen & visible_col[:, i] & (
                torch.rand(prev.shape, generator=generator, device=device) < overlap
            )
            score[:, i] = torch.where(keep & (score[:, i] < 1.5), 1.5, score[:, i])
        score = score.view(-1, num_kv_heads, max_blocks)
    values, ids = score.topk(k, dim=-1)
    ids = torch.where(values >= 0, ids, -1).int()
    if topk > max_blocks:
        ids = torch.nn.functional.pad(ids, (0, topk - max_blocks), value=-1)
    return ids.contiguous().transpose(0, 1)


def as_kv_form(layout: KVLayout, cache: KVCache, form: str) -> KVCache:
    """The same keys and values in another of the `KV_FORMS` (a copy; "packed" returns `cache`).

    "sglang" holds each side as a token pool `[pages * P, Hkv, D]`, as SGLang allocates it, and
    returns the views msa reads: `pool.view(pages, P, Hkv, D).transpose(1, 2)` (page, head and
    token strides `P*Hkv*D`, `D`, `Hkv*D`).
    """
    if form not in KV_FORMS:
        raise MSAInputError("form", "one of " + ", ".join(KV_FORMS), repr(form))
    if form == "packed":
        return cache
    if not layout.separable:
        raise MSAInputError("form", f"'packed' for the {layout.name!r} layout (one tensor of head slots)", repr(form))
    keys, values = layout.kv_views(cache)
    if form == "separate":
        return keys.contiguous(), values.contiguous()
    pages, heads, p, d = keys.shape
    pools = [t.transpose(1, 2).reshape(pages * p, heads, d) for t in (keys, values)]
    return pools[0].view(pages, p, heads, d).transpose(1, 2), pools[1].view(pages, p, heads, d).transpose(1, 2)


def make_decode_step(
    geometry: Geometry,
    *,
    batch_size: int,
    decode_query_len: int = 1,
    context_len: int = 8192,
    kv_cache_dtype: str = "bfloat16",
    q_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int | None = None,
    overlap: float | None = None,
    kv_form: str = "packed",
) -> DecodeStep:
    """Build a decode step of `batch_size` requests whose contexts are up to `context_len` tokens
    (the cache in one of the `KV_FORMS`).

    Each request's length is `context_len` minus a random part of a page (so last pages are
    partly visible); its pages are scattered over the cache at random; every token's K and V
    (N(0, 1)) go through the layout's writer with `DEFAULT_SCALES`.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(int(torch.randint(2**62, ()).item()) if seed is None else seed)
    g, layout = geometry, get_layout(kv_cache_dtype)
    p, length = g.page_size, decode_query_len
    max_blocks = max(1, -(-max(context_len, length) // p))  # (every length is at least L)
    num_pages = batch_size * max_blocks + 1
    jitter = torch.randint(0, p, (batch_size,), generator=generator, device=device)
    seq_lens = (context_len - jitter).clamp(min=length).int()
    block_table = (
        torch.randperm(num_pages, generator=generator, device=device)[: batch_size * max_blocks]
        .view(batch_size, max_blocks)
        .int()
    )
    cache = layout.allocate(num_pages, g.num_kv_heads, p, g.head_dim, device=device)
    scale = torch.full((1,), DEFAULT_SCALES.get(layout.name, 1.0), device=device)
    token = torch.arange(max_blocks * p, device=device).view(1, -1)
    slots = block_table.long().repeat_interleave(p, dim=1) * p + token % p
    slots = slots[token.expand(batch_size, -1) < seq_lens.view(-1, 1)]
    kv_dtype = torch.float16 if layout.storage_dtype == torch.float16 else torch.bfloat16
    for start in range(0, slots.shape[0], _WRITE_CHUNK):
        chunk = slots[start : start + _WRITE_CHUNK]
        shape = (chunk.shape[0], g.num_kv_heads, g.head_dim)
        key = torch.randn(shape, generator=generator, device=device).to(kv_dtype)
        value = torch.randn(shape, generator=generator, device=device).to(kv_dtype)
        layout.write(cache, key, value, chunk, k_scale=scale, v_scale=scale)
    q = torch.randn(
        (batch_size * length, g.num_q_heads, g.head_dim), generator=generator, device=device
    ).to(q_dtype)
    topk = indexer_topk(
        seq_lens,
        decode_query_len=length,
        num_kv_heads=g.num_kv_heads,
        topk=g.topk,
        page_size=p,
        max_blocks=max_blocks,
        generator=generator,
        overlap=overlap,
    )
    return DecodeStep(
        geometry=g,
        layout=layout,
        decode_query_len=length,
        q=q,
        kv_cache=as_kv_form(layout, cache, kv_form),
        topk_indices=topk,
        block_table=block_table,
        seq_lens=seq_lens,
        k_scale=scale,
        v_scale=scale.clone(),
    )
