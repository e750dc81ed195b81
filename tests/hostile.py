"""Malformed-but-legal decode steps, with every byte the contract says is never read poisoned.

`make_hostile(params, seed)` builds a step whose lengths, block tables and index lists hold
everything docs/semantics.md says a backend must skip (-1 anywhere, ids past the visible blocks or
past the table, negative and out-of-range pages, empty and huge lengths, ragged row counts), then
works out — independently of msa, one row, head and entry at a time — which cache tokens and
block-table entries a backend may read, and overwrites everything else: cache tokens with NaN
(NaN scale bytes for NVFP4), unread block-table entries with wild values, the query heads of rows
that attend nothing with NaN. A backend that reads anything it should not turns the answer into
NaN or garbage, which `assert_close_to_naive` catches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from naive import dequantize, naive_decode

from msa.layouts import get_layout

LAYOUTS = ("bfloat16", "float16", "fp8_e4m3", "nvfp4")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@dataclass
class Hostile:
    """A poisoned step: `kwargs` for `msa.sparse_decode`, and what the float64 loop needs."""

    params: dict[str, Any]
    seed: int
    kwargs: dict[str, Any]
    keys: np.ndarray
    values: np.ndarray
    score_scale: float
    read_tokens: int

    def naive(self) -> tuple[np.ndarray, np.ndarray]:
        kw = self.kwargs
        return naive_decode(
            kw["q"], self.keys, self.values, kw["topk_indices"].contiguous(), kw["block_table"],
            kw["seq_lens"], kw["decode_query_len"], self.score_scale, kw.get("query_start_loc"),
        )

    def __str__(self) -> str:
        return f"seed={self.seed} " + " ".join(f"{k}={v}" for k, v in self.params.items())


def _choice(gen: torch.Generator, values: list[int]) -> int:
    return values[int(torch.randint(len(values), (1,), generator=gen))]


def _lengths(gen: torch.Generator, batch: int, length: int, capacity: int) -> list[int]:
    kinds = [0, 1, 2, 2, 2, 3, 4, 5]
    out = []
    for _ in range(batch):
        kind = _choice(gen, kinds)
        if kind == 0:
            out.append(0)  # a padded request
        elif kind == 1:
            out.append(int(torch.randint(1, length + 1, (1,), generator=gen)))  # shorter than L
        elif kind == 2:
            out.append(int(torch.randint(1, capacity + 1, (1,), generator=gen)))  # ordinary
        elif kind == 3:
            out.append(capacity + int(torch.randint(1, 300, (1,), generator=gen)))  # past the table
        elif kind == 4:
            out.append(INT32_MAX - int(torch.randint(0, 3, (1,), generator=gen)))  # near 2**31
        else:
            out.append(-int(torch.randint(1, 5, (1,), generator=gen)))  # negative
    return out


def _query_start_loc(gen: torch.Generator, batch: int, length: int) -> tuple[list[int], int]:
    starts = [0]
    for _ in range(batch):
        starts.append(starts[-1] + int(torch.randint(0, length + 1, (1,), generator=gen)))
    return starts, starts[-1] + int(torch.randint(0, 3, (1,), generator=gen))


def _index_lists(gen: torch.Generator, rows: int, hkv: int, k: int, max_blocks: int) -> torch.Tensor:
    wild = [-1, -1, -7, INT32_MIN, INT32_MAX, max_blocks, max_blocks + 2]
    ids = torch.empty((rows, hkv, k), dtype=torch.int32)
    for r in range(rows):
        for h in range(hkv):
            distinct = torch.randperm(max_blocks + 3, generator=gen).tolist()
            entries = []
            for t in range(k):
                if t >= len(distinct) or torch.rand((), generator=gen) < 0.3:
                    entries.append(_choice(gen, wild))
                else:
                    entries.append(distinct[t])
            ids[r, h] = torch.tensor(entries, dtype=torch.int32)
    return ids


def make_hostile(params: dict[str, Any], seed: int, device: str = "cpu", poison: bool = True) -> Hostile:
    """Build and poison a step. `params`: layout, batch, query_len, num_kv_heads, group,
    head_dim, page_size, topk, max_blocks, ragged, token_major, tensor_scales, table_pad, q_fp8."""
    gen = torch.Generator().manual_seed(seed)
    layout = get_layout(params["layout"])
    b, length, hkv = params["batch"], params["query_len"], params["num_kv_heads"]
    hq, d, p, k, mb = hkv * params["group"], params["head_dim"], params["page_size"], params["topk"], params["max_blocks"]
    num_pages = b * mb + 2
    cache = layout.allocate(num_pages, hkv, p, d)
    kv_dtype = torch.float16 if layout.name == "float16" else torch.bfloat16
    shape = (num_pages * p, hkv, d)
    key = torch.randn(shape, generator=gen).to(kv_dtype)
    value = torch.randn(shape, generator=gen).to(kv_dtype)
    write_scale = 0.05 if layout.name == "fp8_e4m3" else None
    k_s, v_s = layout.write(cache, key, value, torch.arange(num_pages * p), k_scale=write_scale, v_scale=write_scale)
    k_scale, v_scale = float(k_s), float(v_s)

    seq_lens = _lengths(gen, b, length, mb * p)
    if params["ragged"]:
        starts, rows = _query_start_loc(gen, b, length)
    else:
        starts, rows = None, b * length
    stride = mb + params["table_pad"]
    table_buf = torch.randint(0, num_pages, (max(b, 1), stride), generator=gen, dtype=torch.int32)[:b]
    noise = torch.rand((b, stride), generator=gen)
    table_buf[noise < 0.1] = -1
    table_buf[(noise >= 0.1) & (noise < 0.15)] = num_pages + 3
    table_buf[(noise >= 0.15) & (noise < 0.18)] = INT32_MIN
    table = table_buf[:, :mb]
    ids = _index_lists(gen, rows, hkv, k, mb)

    # what a backend may read, worked out row by row
    owner: dict[int, tuple[int, int]] = {}
    if starts is None:
        for r in range(rows):
            owner[r] = (r // length, seq_lens[r // length] - length + r % length)
    else:
        for req in range(b):
            count = starts[req + 1] - starts[req]
            for i in range(count):
                owner[starts[req] + i] = (req, seq_lens[req] - count + i)
    read_tokens = torch.zeros((num_pages, hkv, p), dtype=torch.bool)
    read_table = torch.zeros((b, stride), dtype=torch.bool)
    empty_heads = torch.ones((rows, hkv), dtype=torch.bool)
    for r, (req, position) in owner.items():
        n = max(position + 1, 0)
        for h in range(hkv):
            for j in ids[r, h].tolist():
                if not (0 <= j < mb and j * p < n):
                    continue
                read_table[req, j] = True
                page = int(table[req, j])
                if not 0 <= page < num_pages:
                    continue
                visible = min(p, n - j * p)
                read_tokens[page, h, :visible] = True
                empty_heads[r, h] = False

    wild = torch.tensor([-1, INT32_MIN, INT32_MAX, num_pages, num_pages + 1000], dtype=torch.int32)
    garbage = wild[torch.randint(len(wild), (b, stride), generator=gen)]
    if poison:
        _poison_cache(layout.name, cache, ~read_tokens, gen)
        table_buf.copy_(torch.where(read_table, table_buf, garbage))

    q = torch.randn((rows, hq, d), generator=gen)
    q_scale = 1.0
    if params["q_fp8"]:
        q_scale = 0.1
        q = (q / q_scale).to(torch.float8_e4m3fn)
    else:
        q = q.to(torch.float16 if layout.name == "float16" else torch.bfloat16)
    q_heads = empty_heads.repeat_interleave(params["group"], dim=1) & poison  # [rows, Hq]
    if q.dtype == torch.float8_e4m3fn:
        q.view(torch.uint8)[q_heads] = 0x7F
    else:
        q[q_heads] = float("nan")

    token_major = ids.contiguous()
    topk = token_major.transpose(0, 1) if params["token_major"] else token_major.transpose(0, 1).contiguous()
    as_tensor = params["tensor_scales"]

    def scale(x: float) -> float | torch.Tensor:
        return torch.tensor([x], dtype=torch.float32) if as_tensor else x

    kwargs: dict[str, Any] = dict(
        q=q, kv_cache=cache, topk_indices=topk, block_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), decode_query_len=length,
        kv_cache_dtype=layout.name, q_scale=scale(q_scale), k_scale=scale(k_scale), v_scale=scale(v_scale),
    )
    if starts is not None:
        kwargs["query_start_loc"] = torch.tensor(starts, dtype=torch.int32)
    keys, values = dequantize(layout.name, cache, k_scale, v_scale)
    if device != "cpu":
        kwargs = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in kwargs.items()}
    return Hostile(dict(params), seed, kwargs, keys, values, d**-0.5 * q_scale, int(read_tokens.sum()))


def _poison_cache(layout: str, cache: torch.Tensor, unread: torch.Tensor, gen: torch.Generator) -> None:
    """NaN into every token slot of `unread` `[pages, Hkv, P]`, K and V (codes and scales)."""
    if layout in ("bfloat16", "float16"):
        cache[unread] = float("nan")
        return
    if layout == "fp8_e4m3":
        cache.view(torch.uint8)[unread] = 0x7F  # e4m3 NaN
        return
    pages, slots, p, width = cache.shape
    d = width * 16 // 9
    groups = d // 16
    flat = cache.view(pages, slots, p * width)
    page, head, token = unread.nonzero(as_tuple=True)
    for side in (0, 1):
        slot = 2 * head + side
        codes = token.view(-1, 1) * (d // 2) + torch.arange(d // 2).view(1, -1)
        flat[page.view(-1, 1), slot.view(-1, 1), codes] = torch.randint(
            0, 256, (page.shape[0], d // 2), generator=gen, dtype=torch.uint8
        )
        g = torch.arange(groups).view(1, -1)
        t = token.view(-1, 1)
        pos = t * groups + g if side == 0 else (t // 4) * (4 * groups) + g * 4 + t % 4
        flat[page.view(-1, 1), slot.view(-1, 1), p * d // 2 + pos] = 0x7F  # e4m3 NaN scale bytes
