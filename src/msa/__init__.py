"""msa: sparse attention decode over a paged KV cache with per-query-token page selection.

    import msa
    out = msa.sparse_decode(q, kv_cache, topk_indices, block_table, seq_lens, decode_query_len=1)

See `msa.sparse_decode` for shapes and `msa.layouts` for the cache layouts.
"""

from __future__ import annotations

from msa import errors, layouts
from msa.api import available_backends, select_backend, sparse_decode
from msa.errors import MSAError, MSAInputError, MSAPluginError, MSAUnsupportedError
from msa.layouts import KVLayout, get_layout
from msa.planner import DecodePlan, DecodePlanner, PlanKey
from msa.problem import MINIMAX_M3, MINIMAX_M3_TP, DecodeProblem, Geometry

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "sparse_decode",
    "DecodePlanner",
    "DecodePlan",
    "PlanKey",
    "select_backend",
    "available_backends",
    "Geometry",
    "DecodeProblem",
    "MINIMAX_M3",
    "MINIMAX_M3_TP",
    "KVLayout",
    "get_layout",
    "layouts",
    "errors",
    "MSAError",
    "MSAInputError",
    "MSAUnsupportedError",
    "MSAPluginError",
]
