"""An independent float64 oracle for the tests: its own dequantizers (numpy, from the docs/semantics.md §4
byte rules) and a loop per row, per KV head, per token (docs/semantics.md §3 read literally)."""

from __future__ import annotations

import math

import numpy as np
import torch

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_to_float(byte: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes -> float64, from the bit layout (1 sign, 4 exponent, 3 mantissa)."""
    b = byte.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).astype(np.float64)
    normal = (1.0 + man / 8.0) * np.exp2(exp.astype(np.float64) - 7.0)
    sub = man / 8.0 * 2.0**-6
    value = sign * np.where(exp == 0, sub, normal)
    return np.where((b & 0x7F) == 0x7F, np.nan, value)


def e2m1_to_float(code: np.ndarray) -> np.ndarray:
    mag = np.array(E2M1)[code & 0x7]
    return np.where(code & 0x8, -mag, mag)


def dequantize(layout: str, cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The whole cache as float64 numpy `(K, V)` `[pages, Hkv, P, D]`."""
    if layout != "nvfp4":
        c = cache.float().numpy().astype(np.float64)
        d = c.shape[-1] // 2
        return c[..., :d] * k_scale, c[..., d:] * v_scale
    raw = cache.numpy()
    pages, slots, p, width = raw.shape
    d = width * 16 // 9
    hkv = slots // 2
    flat = raw.reshape(pages, slots, p * width)
    out = []
    for side, scale in ((0, k_scale), (1, v_scale)):
        x = np.zeros((pages, hkv, p, d))
        for t in range(p):
            for e in range(d):
                byte = flat[:, side::2, t * (d // 2) + e // 2]
                code = (byte >> 4) if e % 2 else (byte & 0xF)
                g = e // 16
                pos = t * (d // 16) + g if side == 0 else (t // 4) * (4 * d // 16) + g * 4 + t % 4
                s = e4m3_to_float(flat[:, side::2, p * d // 2 + pos])
                x[:, :, t, e] = e2m1_to_float(code) * s * scale
        out.append(x)
    return out[0], out[1]


def naive_decode(
    q: torch.Tensor,
    keys: np.ndarray,
    values: np.ndarray,
    topk: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    decode_query_len: int,
    score_scale: float,
    query_start_loc: torch.Tensor | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """docs/semantics.md §3, one (row, KV head, token) at a time. `keys`/`values` are dequantized, scaled.

    Rows are request-major (`r = b*L + i`), or, with a (valid) `query_start_loc`, request `b`
    owns rows `[qsl[b], qsl[b+1])`; rows owned by no request attend nothing."""
    rows, hq, d = q.shape
    pages, hkv, p, _ = keys.shape
    group = hq // hkv
    qn = q.float().numpy().astype(np.float64)
    ids = topk.numpy()
    table = block_table.numpy()
    lens = seq_lens.numpy().astype(np.int64)
    max_blocks = table.shape[1]
    out = np.zeros((rows, hq, d))
    lse = np.full((rows, hq), -np.inf)
    owner: dict[int, tuple[int, int]] = {}  # row -> (request, position)
    if query_start_loc is None:
        for r in range(rows):
            b, i = divmod(r, decode_query_len)
            owner[r] = (b, int(lens[b]) - decode_query_len + i)
    else:
        starts = query_start_loc.tolist()
        for b in range(len(starts) - 1):
            count = starts[b + 1] - starts[b]
            for i in range(count):
                owner[starts[b] + i] = (b, int(lens[b]) - count + i)
    for r in range(rows):
        if r not in owner:
            continue
        b, position = owner[r]
        n = max(position + 1, 0)
        visible_blocks = math.ceil(n / p)
        for h in range(hkv):
            scores: list[np.ndarray] = []
            vs: list[np.ndarray] = []
            for j in ids[h, r]:
                j = int(j)
                if not (0 <= j < visible_blocks and j < max_blocks):
                    continue
                page = int(table[b, j])
                if not (0 <= page < pages):
                    continue
                for o in range(p):
                    if j * p + o >= n:
                        break
                    qh = qn[r, h * group : (h + 1) * group]  # [G, D]
                    scores.append(score_scale * (qh @ keys[page, h, o]))
                    vs.append(values[page, h, o])
            if not scores:
                continue
            s = np.stack(scores, axis=1)  # [G, T]
            m = s.max(axis=1, keepdims=True)
            w = np.exp(s - m)
            total = w.sum(axis=1, keepdims=True)
            out[r, h * group : (h + 1) * group] = (w / total) @ np.stack(vs)
            lse[r, h * group : (h + 1) * group] = (m + np.log(total))[:, 0]
    return out, lse
