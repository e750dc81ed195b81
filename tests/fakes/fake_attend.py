"""What the output-only fake libraries compute: attention over explicitly listed pages, float64.

The fakes check nothing about how they are called: tests/conformance runs the real libraries'
Python code (their argument checks, plan options, layout checks) against msa's adapters."""

from __future__ import annotations

from collections.abc import Callable

import torch

#: `dequant(pages, h)` -> float K, V `[n, P, D]` of KV head `h` in those pages.
Dequant = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def attend(
    q: torch.Tensor,
    scale: float,
    dequant: Dequant,
    rows: list[list[tuple[list[int], list[int], int]]],
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows[r][h] = (block ids, their pages, visible tokens n)`: row `r`'s query heads of KV head
    `h` attend tokens `j*P + o < n` of the listed blocks. Returns float64 `(out, lse)`; rows that
    attend nothing give 0 and -inf."""
    r_count, hq, d = q.shape
    group = hq // num_kv_heads
    out = torch.zeros((r_count, hq, d), dtype=torch.float64)
    lse = torch.full((r_count, hq), float("-inf"), dtype=torch.float64)
    for r in range(r_count):
        for h in range(num_kv_heads):
            blocks, pages, n = rows[r][h]
            if not blocks:
                continue
            k, v = dequant(torch.tensor(pages), h)
            p = k.shape[1]
            token = torch.tensor(blocks).view(-1, 1) * p + torch.arange(p)
            keep = (token < n).view(-1)
            if not keep.any():
                continue
            kk = k.reshape(-1, d)[keep].double()
            vv = v.reshape(-1, d)[keep].double()
            qq = q[r, h * group : (h + 1) * group].double()
            s = qq @ kk.T * scale
            lse[r, h * group : (h + 1) * group] = torch.logsumexp(s, dim=-1)
            out[r, h * group : (h + 1) * group] = torch.softmax(s, dim=-1) @ vv
    return out, lse
