"""msa: sparse attention decode over a paged KV cache with per-query-token page selection.

    import msa
    out = msa.sparse_decode(q, kv_cache, topk_indices, block_table, seq_lens, decode_query_len=1)

See `msa.sparse_decode` for shapes and `msa.layouts` for the cache layouts.

The names below are imported on first use (PEP 562), so `import msa` — and the `msa` command's
`--help` — does not pay for torch, triton and the backends; `msa.sparse_decode`,
`from msa import DecodePlanner` and the like work as plain attributes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` imports them
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

#: Where each lazily imported name lives: a name of that module, or (None) the submodule itself.
_LAZY: dict[str, tuple[str, str | None]] = {
    "sparse_decode": ("msa.api", "sparse_decode"),
    "select_backend": ("msa.api", "select_backend"),
    "available_backends": ("msa.api", "available_backends"),
    "DecodePlanner": ("msa.planner", "DecodePlanner"),
    "DecodePlan": ("msa.planner", "DecodePlan"),
    "PlanKey": ("msa.planner", "PlanKey"),
    "Geometry": ("msa.problem", "Geometry"),
    "DecodeProblem": ("msa.problem", "DecodeProblem"),
    "MINIMAX_M3": ("msa.problem", "MINIMAX_M3"),
    "MINIMAX_M3_TP": ("msa.problem", "MINIMAX_M3_TP"),
    "KVLayout": ("msa.layouts", "KVLayout"),
    "get_layout": ("msa.layouts", "get_layout"),
    "layouts": ("msa.layouts", None),
    "errors": ("msa.errors", None),
    "MSAError": ("msa.errors", "MSAError"),
    "MSAInputError": ("msa.errors", "MSAInputError"),
    "MSAUnsupportedError": ("msa.errors", "MSAUnsupportedError"),
    "MSAPluginError": ("msa.errors", "MSAPluginError"),
}


def __getattr__(name: str) -> object:
    """Import one of `__all__`'s names on first use and keep it in the module."""
    try:
        module_name, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'msa' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
