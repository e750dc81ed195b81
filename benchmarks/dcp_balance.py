"""Load balance of decode context parallelism (CPU): how evenly the pages an indexer selects
fall on the ranks, for each placement.

A decode step is memory-bound: each rank's time is set by the bytes it reads, and the merge
waits for the slowest rank, so a step costs what its busiest rank reads. This measures, with
top-k lists shaped like an indexer's (`msa.workload.indexer_topk`: 16 of N blocks per token and
KV head, block 0 and the token's last block always chosen), MiniMax-M3 TP1 (4 KV heads, pages of
128 tokens):

Request lengths are uniform over the last 128 pages below the context (16K tokens), so the
token's last block — always selected — falls on every rank alike, as in a batch of mixed lengths.

- per-step imbalance: max over ranks of the tokens the rank reads in the step / the mean;
- per-row imbalance: the same for one (query token, KV head) list;
- with dedup (L > 1): the same counting each (request, head, page) once, as the dedup kernel reads.

Placements: whole pages (`block j -> rank (j // I + rot) % W`) for page interleaves I, without and
with a per-request rotation (`rot = request % W`), and tokens spread within each page (`token
t -> rank (t // I) % W`, as vLLM's cp_kv_cache_interleave_size allows), simulated.

    python3 benchmarks/dcp_balance.py --out benchmarks/results/dcp_balance
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from msa.workload import indexer_topk

PAGE, HKV, TOPK = 128, 4, 16
POOL = 1024  # requests drawn per (context, L); steps are consecutive groups of B of them
SPREAD = 128  # request lengths are uniform in [context - SPREAD pages, context]: the last block's
#               owner is then uniform for every W * I <= SPREAD (real batches mix lengths)


def counts_of(x: torch.Tensor | int, rank: int, world: int, inter: int) -> torch.Tensor:
    """How many of the units `0 .. x - 1` fall on `rank` when runs of `inter` units go to the
    ranks in turn."""
    cycle = world * inter
    xt = torch.as_tensor(x)
    return (xt // cycle) * inter + (xt % cycle - rank * inter).clamp(0, inter)


def draw(context: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """A pool of requests: visible lengths [N*L] and top-k block ids [N*L, Hkv, K]."""
    gen = torch.Generator()
    gen.manual_seed(seed)
    blocks = -(-context // PAGE)
    seq_lens = (context - torch.randint(0, SPREAD * PAGE, (POOL,), generator=gen)).int()
    ids = []
    chunk = max(1, (1 << 24) // (length * HKV * blocks))
    for start in range(0, POOL, chunk):
        part = seq_lens[start : start + chunk]
        topk = indexer_topk(part, decode_query_len=length, num_kv_heads=HKV, topk=TOPK, page_size=PAGE,
                            max_blocks=blocks, generator=gen)
        ids.append(topk.transpose(0, 1).long())
    rows = torch.arange(POOL * length)
    visible = (seq_lens.long()[rows // length] - length + rows % length + 1).clamp(min=0)
    return {"ids": torch.cat(ids), "visible": visible, "seq_lens": seq_lens.long()}


def rank_tokens(pool: dict[str, torch.Tensor], length: int, world: int, placement: tuple[str, int, bool],
                dedup: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens each rank reads, per request `[N, W]` and per (row, head) list `[N*L*Hkv, W]`."""
    kind, inter, rotate = placement
    ids = pool["ids"]  # [R, Hkv, K]
    rows = ids.shape[0]
    request = torch.arange(rows) // length
    if dedup:  # one read per (request, head, block), as far as the request's last token sees
        blocks = int(ids.max()) + 1
        seen = torch.zeros((POOL, HKV, blocks), dtype=torch.bool)
        r_idx = request.view(-1, 1, 1).expand_as(ids)
        h_idx = torch.arange(HKV).view(1, -1, 1).expand_as(ids)
        ok = ids >= 0
        seen[r_idx[ok], h_idx[ok], ids[ok]] = True
        req, head, ids_flat = seen.nonzero(as_tuple=True)
        visible = pool["seq_lens"][req]
        entry_request = req
        lists = req * HKV + head
        n_lists = POOL * HKV
    else:
        ok = ids >= 0
        ids_flat = ids[ok]
        visible = pool["visible"].view(-1, 1, 1).expand_as(ids)[ok]
        entry_request = request.view(-1, 1, 1).expand_as(ids)[ok]
        lists = (torch.arange(rows).view(-1, 1, 1) * HKV + torch.arange(HKV).view(1, -1, 1)).expand_as(ids)[ok]
        n_lists = rows * HKV
    lo = ids_flat * PAGE
    hi = torch.minimum(visible, lo + PAGE)
    per_entry = torch.zeros((ids_flat.shape[0], world), dtype=torch.long)
    if kind == "page":
        rot = entry_request % world if rotate else torch.zeros_like(entry_request)
        owner = (ids_flat // inter + rot) % world
        per_entry[torch.arange(ids_flat.shape[0]), owner] = (hi - lo).clamp(min=0)
    else:
        for r in range(world):
            per_entry[:, r] = (counts_of(hi, r, world, inter) - counts_of(lo, r, world, inter)).clamp(min=0)
    per_request = torch.zeros((POOL, world), dtype=torch.long).index_add_(0, entry_request, per_entry)
    per_list = torch.zeros((n_lists, world), dtype=torch.long).index_add_(0, lists, per_entry)
    return per_request, per_list


def imbalance(loads: torch.Tensor) -> torch.Tensor:
    """max / mean over the last dimension (rows with no load dropped)."""
    loads = loads.double()
    total = loads.sum(-1)
    keep = total > 0
    return loads[keep].max(-1).values / (total[keep] / loads.shape[-1])


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def placements(interleaves: list[int], token_interleaves: list[int]) -> list[tuple[str, int, bool]]:
    found = [("page", i, False) for i in interleaves] + [("page", i, True) for i in interleaves]
    return found + [("token", i, False) for i in token_interleaves]


def label(p: tuple[str, int, bool]) -> str:
    kind, inter, rotate = p
    return f"{kind} I={inter}{' rot' if rotate else ''}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="write dcp_balance.json here")
    ap.add_argument("--contexts", default="65536,1048576")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--query-lens", default="1,4")
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--interleaves", default="1,2,4,16")
    ap.add_argument("--token-interleaves", default="1,16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    contexts, batches, lengths = ints(args.contexts), ints(args.batches), ints(args.query_lens)
    worlds, places = ints(args.worlds), placements(ints(args.interleaves), ints(args.token_interleaves))
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    for context in contexts:
        for length in lengths:
            pool = draw(context, length, args.seed + context + length)
            for world in worlds:
                for place in places:
                    per_request, per_list = rank_tokens(pool, length, world, place)
                    row = imbalance(per_list)
                    rec: dict[str, Any] = {
                        "context": context, "L": length, "W": world, "placement": label(place),
                        "row_imbalance_mean": float(row.mean()), "row_imbalance_p99": float(row.quantile(0.99)),
                        "row_imbalance_max": float(row.max()), "step": {},
                    }
                    dedup_request = rank_tokens(pool, length, world, place, dedup=True)[0] if length > 1 else None
                    for batch in batches:
                        steps = per_request[: POOL // batch * batch].view(-1, batch, world).sum(1)
                        ratio = imbalance(steps)
                        entry = {"mean": float(ratio.mean()), "p95": float(ratio.quantile(0.95)), "steps": len(ratio)}
                        if dedup_request is not None:
                            dd = imbalance(dedup_request[: POOL // batch * batch].view(-1, batch, world).sum(1))
                            entry["dedup_mean"] = float(dd.mean())
                        rec["step"][str(batch)] = entry
                    records.append(rec)
    elapsed = time.perf_counter() - started
    print_tables(records, batches, worlds, places)
    print(f"\n({POOL} requests per context and L, lengths uniform in [context - {SPREAD * PAGE // 1024}K, context]; "
          f"steps = consecutive groups of B; {elapsed:.0f} s)")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"page": PAGE, "kv_heads": HKV, "topk": TOPK, "pool": POOL, "spread_pages": SPREAD, "seed": args.seed}
        (args.out / "dcp_balance.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
        print(f"wrote {args.out / 'dcp_balance.json'}")


def print_tables(records: list[dict[str, Any]], batches: list[int], worlds: list[int],
                 places: list[tuple[str, int, bool]]) -> None:
    by = {(r["context"], r["L"], r["W"], r["placement"]): r for r in records}
    for context in sorted({r["context"] for r in records}):
        for length in sorted({r["L"] for r in records}):
            print(f"\nper-step imbalance (busiest rank / mean, mean over steps), context {context // 1024}K, L={length}"
                  + (" [dedup reads in brackets]" if length > 1 else ""))
            head = f"{'placement':<14}" + "".join(f"{f'W={w} B={b}':>{16 if length > 1 else 11}}"
                                                 for w in worlds for b in batches)
            print(head)
            for place in places:
                cells = []
                for w in worlds:
                    for b in batches:
                        e = by[(context, length, w, label(place))]["step"][str(b)]
                        cell = f"{e['mean']:.3f}" + (f" [{e['dedup_mean']:.3f}]" if "dedup_mean" in e else "")
                        cells.append(f"{cell:>{16 if length > 1 else 11}}")
                print(f"{label(place):<14}" + "".join(cells))
    print("\nper-row imbalance (one token's list for one KV head; mean / p99), L=1")
    print(f"{'placement':<14}" + "".join(f"{f'W={w} {c // 1024}K':>16}" for w in worlds
                                         for c in sorted({r['context'] for r in records})))
    for place in places:
        cells = []
        for w in worlds:
            for c in sorted({r["context"] for r in records}):
                r = by[(c, min(r["L"] for r in records), w, label(place))]
                cells.append(f"{r['row_imbalance_mean']:.2f} / {r['row_imbalance_p99']:.2f}".rjust(16))
        print(f"{label(place):<14}" + "".join(cells))


if __name__ == "__main__":
    main()
