"""Where each page of a request lives under decode context parallelism (DCP).

A request's KV is split over the `W` ranks of a group by whole pages. Logical block `j` of
request `b` (tokens `j*P .. j*P + P - 1`) lives on rank

    block_owner(j) = (j // I + rotation[b]) % W

with `I` the page interleave (`I` consecutive blocks on one rank, then the next rank) and
`rotation[b]` an optional per-request offset (default 0). Rank `r` holds its blocks in its own
KV cache and describes them with a **rank-local block table**: the same `[B, max_blocks]` shape
as a single-GPU table, with the page of each block it holds and `-1` for every block another
rank holds. Top-k lists, `seq_lens`, `query_start_loc` and `q` stay global and identical on
every rank; msa skips index entries whose table entry is `-1` (docs/semantics.md §3), so each
rank attends exactly the selected blocks it holds, and `msa.distributed.merge_partials` combines
the ranks' partial results exactly.

A rotation of `stable_request_id % W` spreads the blocks every token selects (block 0 and the
token's last block, docs/distributed.md) over the ranks; without it rank 0 holds every request's
block 0.

Everything here except `shard_cache` is device ops only (no host synchronisation), so it can run
every step, before graph replay.
"""

from __future__ import annotations

from typing import overload

import torch

from msa.errors import MSAInputError, is_int
from msa.layouts import KVCache, KVLayout, get_layout
from msa.semantics import INT32_MAX

__all__ = [
    "block_owner",
    "owned_block_count",
    "rank_local_block_table",
    "rank_table_from_virtual",
    "rank_slot_mapping",
    "shard_cache",
]

Rotation = int | torch.Tensor | None


def _positive_int(argument: str, value: object) -> int:
    if not is_int(value) or value < 1:
        raise MSAInputError(argument, "an int >= 1", repr(value))
    return value


def _check_rank(rank: object, world_size: object, interleave: object) -> tuple[int, int, int]:
    w = _positive_int("world_size", world_size)
    i = _positive_int("interleave", interleave)
    if not is_int(rank) or not 0 <= rank < w:
        raise MSAInputError("rank", f"an int in [0, {w}) (world_size={w})", repr(rank))
    return rank, w, i


def _table(argument: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise MSAInputError(argument, "a torch.Tensor", type(value).__name__)
    if value.dtype != torch.int32 or value.dim() != 2:
        raise MSAInputError(argument, "an int32 tensor [B, blocks]", f"{value.dtype} of shape {tuple(value.shape)}")
    return value


def _rotation_column(rotation: Rotation, batch: int, device: torch.device, world_size: int) -> torch.Tensor | int:
    """`rotation` modulo `world_size` (only its residue picks a rank: reduced first, so no sum
    with it overflows), as an int or as an int64 `[B, 1]` tensor on `device`."""
    if rotation is None:
        return 0
    if isinstance(rotation, bool):
        raise MSAInputError("rotation", "None, an int, or an integer tensor [B]", repr(rotation))
    if isinstance(rotation, int):
        return rotation % world_size
    if not isinstance(rotation, torch.Tensor):
        raise MSAInputError("rotation", "None, an int, or an integer tensor [B]", type(rotation).__name__)
    if rotation.is_floating_point() or rotation.is_complex() or tuple(rotation.shape) != (batch,):
        raise MSAInputError(
            "rotation", f"an integer tensor of shape ({batch},) (one offset per request)",
            f"{rotation.dtype} of shape {tuple(rotation.shape)}",
        )
    if rotation.device != device:
        raise MSAInputError("rotation", f"a tensor on {device} (the device of the table)", rotation.device)
    return (rotation.long() % world_size).view(-1, 1)


@overload
def block_owner(block: int, world_size: int, interleave: int = 1, rotation: int = 0) -> int: ...
@overload
def block_owner(
    block: torch.Tensor, world_size: int, interleave: int = 1, rotation: int | torch.Tensor = 0
) -> torch.Tensor: ...
def block_owner(
    block: int | torch.Tensor, world_size: int, interleave: int = 1, rotation: int | torch.Tensor = 0
) -> int | torch.Tensor:
    """The rank that holds logical block `block`: `(block // interleave + rotation) % world_size`.

    Args:
        block: a block index (int) or a tensor of them (any shape; negative ids give meaningless
            owners: they are skipped anyway).
        world_size: ranks in the group (`W`).
        interleave: consecutive blocks per rank (`I`).
        rotation: the request's offset (an int, or a tensor broadcastable against `block`).
    """
    w = _positive_int("world_size", world_size)
    i = _positive_int("interleave", interleave)
    return (block // i + rotation % w) % w


@overload
def owned_block_count(num_blocks: int, rank: int, world_size: int, interleave: int = 1, rotation: int = 0) -> int: ...
@overload
def owned_block_count(
    num_blocks: torch.Tensor, rank: int, world_size: int, interleave: int = 1, rotation: int | torch.Tensor = 0
) -> torch.Tensor: ...
def owned_block_count(
    num_blocks: int | torch.Tensor, rank: int, world_size: int, interleave: int = 1, rotation: int | torch.Tensor = 0
) -> int | torch.Tensor:
    """How many of the blocks `0 .. num_blocks - 1` rank `rank` holds (pages to allocate on it
    for a request of `num_blocks` blocks). Works on ints and tensors.

    With the rotation folded into the rank (`s = (rank - rotation) % W`, the slot of the rank in
    each cycle of `W * I` blocks): `(n // (W*I)) * I + clamp(n % (W*I) - s*I, 0, I)`.
    """
    r, w, i = _check_rank(rank, world_size, interleave)
    slot = (r - rotation % w) % w
    cycle = w * i
    rest = num_blocks % cycle - slot * i
    if isinstance(rest, torch.Tensor):
        return (num_blocks // cycle) * i + rest.clamp(0, i)
    return (num_blocks // cycle) * i + min(max(rest, 0), i)


def _owned_mask(shape: tuple[int, int], device: torch.device, rank: int, world_size: int, interleave: int,
                rotation: Rotation) -> torch.Tensor:
    batch, blocks = shape
    col = torch.arange(blocks, device=device).view(1, -1)
    rot = _rotation_column(rotation, batch, device, world_size)
    return ((col // interleave + rot) % world_size == rank).expand(batch, blocks)


def _check_out(out: torch.Tensor | None, shape: tuple[int, int], device: torch.device) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int32 or tuple(out.shape) != shape:
        given = f"{out.dtype} of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise MSAInputError("out", f"an int32 tensor of shape {shape}", given)
    if out.device != device or out.stride(-1) != 1:
        raise MSAInputError(
            "out", f"a tensor on {device} with unit last stride", f"{out.device}, strides {out.stride()}"
        )


def rank_local_block_table(
    block_table: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int = 1,
    *,
    rotation: Rotation = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's view of a block table: the entries of the blocks it holds, `-1` elsewhere.

    Use it when every rank addresses its pages with the same ids (each rank's page
    `block_table[b, j]` holds block `j` when the rank owns it): the result is what
    `msa.distributed.sparse_decode` takes as this rank's `block_table`. Device ops only.

    Args:
        block_table: int32 `[B, max_blocks]`.
        rank, world_size, interleave: this rank, the group size `W`, blocks per rank `I`.
        rotation: per-request offsets (int64/int32 `[B]`) or one int; None for 0.
        out: optional int32 `[B, max_blocks]` to write into (a graph-stable buffer), unit last stride.

    Returns:
        int32 `[B, max_blocks]` (`out` when given).
    """
    table = _table("block_table", block_table)
    rank, world_size, interleave = _check_rank(rank, world_size, interleave)
    shape = (table.shape[0], table.shape[1])
    _check_out(out, shape, table.device)
    mask = _owned_mask(shape, table.device, rank, world_size, interleave, rotation)
    minus_one = torch.full((), -1, dtype=torch.int32, device=table.device)
    if out is None:
        return torch.where(mask, table, minus_one)
    torch.where(mask, table, minus_one, out=out)
    return out


def rank_table_from_virtual(
    virtual_table: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int = 1,
    *,
    max_blocks: int | None = None,
    rotation: Rotation = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's block table from one table shared by every rank, in virtual blocks.

    A virtual block covers `W * I` consecutive logical blocks (`W * I * P` tokens), like the
    scheduler blocks of vLLM's DCP; each rank holds `I` of them (one group of `I`, whichever the
    rotation gives it), in pages `v * I .. v * I + I - 1` of its own cache for virtual block id `v`. So a scheduler that
    allocates virtual blocks of `W * I * P` tokens, and ranks that each allocate caches of
    `num_virtual_blocks * I` pages, need no per-rank allocator:

        local[b, j] = virtual_table[b, j // (W*I)] * I + j % I   if rank owns block j
                      -1                                         otherwise (or when the
                                                                 virtual entry is negative)

    Args:
        virtual_table: int32 `[B, num_virtual]`.
        rank, world_size, interleave: this rank, `W`, `I`.
        max_blocks: columns of the result (default `num_virtual * W * I`).
        rotation: per-request offsets (integer `[B]`) or one int; None for 0.
        out: optional int32 `[B, max_blocks]` to write into.

    Returns:
        int32 `[B, max_blocks]` (`out` when given). Device ops only.
    """
    table = _table("virtual_table", virtual_table)
    rank, world_size, interleave = _check_rank(rank, world_size, interleave)
    cycle = world_size * interleave
    if max_blocks is None:
        max_blocks = table.shape[1] * cycle
    max_blocks = _positive_int("max_blocks", max_blocks)
    shape = (table.shape[0], max_blocks)
    _check_out(out, shape, table.device)
    col = torch.arange(max_blocks, device=table.device)
    virtual = col // cycle
    inside = virtual < table.shape[1]
    entries = table[:, virtual.clamp(max=max(table.shape[1] - 1, 0))] if table.shape[1] else table.new_full(shape, -1)
    pages = entries.long() * interleave + (col % interleave)
    owned = _owned_mask(shape, table.device, rank, world_size, interleave, rotation)
    keep = inside & owned & (entries >= 0) & (pages <= INT32_MAX)  # (a page past int32 would wrap onto a real one)
    result = torch.where(keep, pages, -1).to(torch.int32)
    if out is None:
        return result
    out.copy_(result)
    return out


def rank_slot_mapping(
    block_table: torch.Tensor,
    request_indices: torch.Tensor,
    positions: torch.Tensor,
    *,
    page_size: int,
    rank: int,
    world_size: int,
    interleave: int = 1,
    rotation: Rotation = None,
) -> torch.Tensor:
    """Where a cache writer stores each new token on this rank: `slot = page * P + pos % P`,
    or `-1` (skipped by every layout's `write`) for tokens of blocks another rank holds.

    Every rank computes K/V for all new tokens (they come out of the same layers) and writes
    only its own: pass the result as `slot_mapping` to `layout.write`.

    Args:
        block_table: int32 `[B, max_blocks]`, this rank's table (a global table works too: the
            ownership test is applied either way).
        request_indices: integer `[N]`, the request (row of the table) of each new token.
        positions: integer `[N]`, the token's position in its request (0-based).
        page_size: `P`.
        rank, world_size, interleave, rotation: the placement (see the module docstring).

    Returns:
        int64 `[N]` slots, `-1` for tokens this rank does not store, negative positions,
        positions past the table, and blocks whose table entry is negative.
    """
    table = _table("block_table", block_table)
    rank, world_size, interleave = _check_rank(rank, world_size, interleave)
    p = _positive_int("page_size", page_size)
    for argument, value in (("request_indices", request_indices), ("positions", positions)):
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.is_floating_point():
            raise MSAInputError(argument, "an integer tensor [N]", value if not isinstance(value, torch.Tensor) else
                                f"{value.dtype} of shape {tuple(value.shape)}")
    if request_indices.shape != positions.shape:
        raise MSAInputError("positions", f"shape {tuple(request_indices.shape)} (that of request_indices)",
                            tuple(positions.shape))
    req = request_indices.long().to(table.device)
    pos = positions.long().to(table.device)
    batch, blocks = table.shape
    block = pos.div(p, rounding_mode="floor")
    valid = (pos >= 0) & (block < blocks) & (req >= 0) & (req < batch)
    safe_req, safe_block = torch.where(valid, req, 0), torch.where(valid, block, 0)
    page = table[safe_req, safe_block].long() if table.numel() else torch.full_like(pos, -1)
    rot = _rotation_column(rotation, batch, table.device, world_size)
    rot_tok = rot.view(-1)[safe_req] if isinstance(rot, torch.Tensor) else rot
    owned = (safe_block // interleave + rot_tok) % world_size == rank
    keep = valid & owned & (page >= 0)
    return torch.where(keep, page * p + pos % p, -1)


def shard_cache(
    layout: KVLayout | str,
    cache: KVCache,
    block_table: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int = 1,
    *,
    rotation: Rotation = None,
) -> tuple[KVCache, torch.Tensor]:
    """A compact copy of one rank's share of a single-GPU cache, for tests and examples.

    The rank keeps the pages of the blocks it holds (valid pages only, each once, in ascending
    order of their global id, so a page two requests share is copied once); its table points at
    them and holds `-1` for every other block (including blocks whose global entry is negative or
    past the cache, which no rank reads). Reads the table on the host (not for serving loops).

    Args:
        layout: the cache's layout (or its `kv_cache_dtype` name).
        cache: the single-GPU cache: one tensor, or a `(k_cache, v_cache)` pair.
        block_table: int32 `[B, max_blocks]`, the single-GPU table.
        rank, world_size, interleave, rotation: the placement.

    Returns:
        `(local_cache, local_table)`: a cache of this layout and form (a pair for a pair) with the
        rank's pages (at least one page: a zero page when the rank holds none) and an int32
        `[B, max_blocks]` table.
    """
    lay = get_layout(layout) if isinstance(layout, str) else layout
    if not isinstance(lay, KVLayout):
        raise MSAInputError("layout", "an msa KVLayout or a kv_cache_dtype name", type(layout).__name__)
    shape = lay.inspect(cache)
    table = _table("block_table", block_table)
    local = rank_local_block_table(table, rank, world_size, interleave, rotation=rotation)
    in_cache = (local >= 0) & (local < shape.num_pages)
    pages = torch.unique(local[in_cache].long())  # sorted
    remap = torch.full((shape.num_pages,), -1, dtype=torch.long, device=table.device)
    remap[pages] = torch.arange(pages.numel(), device=table.device)
    local_table = torch.where(in_cache, remap[torch.where(in_cache, local, 0).long()], -1).to(torch.int32)
    device = cache[0].device if isinstance(cache, tuple) else cache.device
    local_cache: KVCache
    if pages.numel() == 0 and isinstance(cache, tuple):
        local_cache = lay.allocate(1, shape.num_kv_heads, shape.page_size, shape.head_dim, device=device,
                                   separate=True)
    elif pages.numel() == 0:
        local_cache = lay.allocate(1, shape.num_kv_heads, shape.page_size, shape.head_dim, device=device)
    elif isinstance(cache, tuple):
        local_cache = (cache[0].index_select(0, pages.to(device)), cache[1].index_select(0, pages.to(device)))
    else:
        local_cache = cache.index_select(0, pages.to(device))
    return local_cache, local_table.contiguous()
