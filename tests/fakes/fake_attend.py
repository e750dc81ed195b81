"""What the fake libraries compute: attention over explicitly listed pages, float64."""

from __future__ import annotations

from collections.abc import Callable

import torch

Dequant = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError("fake library: " + message)


def check_lists(ids: torch.Tensor, where: str) -> None:
    """Every list ascending over its non-negative ids, -1 padding only at the tail."""
    for row in ids.reshape(-1, ids.shape[-1]).tolist():
        used = [j for j in row if j >= 0]
        check(row[: len(used)] == used, f"{where}: -1 inside the list {row}")
        check(row[len(used):] == [-1] * (len(row) - len(used)), f"{where}: bad padding {row}")
        check(used == sorted(set(used)), f"{where}: not ascending and distinct {row}")


def attend(
    q: torch.Tensor,
    scale: float,
    dequant: Dequant,
    rows: list[list[tuple[list[int], list[int], int]]],
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows[r][h] = (block ids, pages, visible tokens n)`; `dequant(pages, h)` -> K, V [n, P, D]."""
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
