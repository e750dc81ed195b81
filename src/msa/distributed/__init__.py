"""Decode context parallelism (DCP): one request's KV spread over several GPUs, merged exactly
through torch.distributed (gloo on CPU, NCCL on GPU).

    import msa.distributed as dcp

    local_table = dcp.rank_local_block_table(block_table, rank, world_size)   # -1: other ranks' blocks
    out = dcp.sparse_decode(q, local_cache, topk_indices, local_table, seq_lens,
                            decode_query_len=1, group=group)                  # the whole group's result

- Placement (`sharding`): logical block `j` of request `b` lives on rank
  `(j // interleave + rotation[b]) % W`; a rank's share is its own cache plus a rank-local block
  table with `-1` for the blocks it does not hold. Top-k lists, lengths and `q` stay global.
- Merge (`merge`): `merge_partials` (every rank gets all heads) and `merge_partials_scattered`
  (each rank keeps `Hq / W` heads), exact through the natural-log LSE; `combine_partials` is the
  local rule.
- One call (`decode.sparse_decode`) and the CUDA-graph form (`DistributedDecodePlanner`).

Guide: docs/distributed.md.
"""

from __future__ import annotations

from msa.distributed.combine import combine_partials
from msa.distributed.decode import sparse_decode
from msa.distributed.exchange import FULL_METHODS, SCATTERED_METHODS, Exchange
from msa.distributed.merge import merge_partials, merge_partials_scattered
from msa.distributed.planner import DistributedDecodePlan, DistributedDecodePlanner
from msa.distributed.sharding import (
    block_owner,
    owned_block_count,
    rank_local_block_table,
    rank_slot_mapping,
    rank_table_from_virtual,
    shard_cache,
)

__all__ = [
    "sparse_decode",
    "DistributedDecodePlanner",
    "DistributedDecodePlan",
    "merge_partials",
    "merge_partials_scattered",
    "combine_partials",
    "Exchange",
    "FULL_METHODS",
    "SCATTERED_METHODS",
    "block_owner",
    "owned_block_count",
    "rank_local_block_table",
    "rank_table_from_virtual",
    "rank_slot_mapping",
    "shard_cache",
]
