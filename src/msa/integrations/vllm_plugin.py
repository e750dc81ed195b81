"""A vLLM general plugin that routes vLLM's MiniMax-M3 sparse decode to msa.

Declared as the `msa` entry point of the `vllm.general_plugins` group, so vLLM's plugin loader
(`vllm.plugins.load_general_plugins`, run in every vLLM process) calls `register()` once msa is
installed in vLLM's environment. `VLLM_PLUGINS` (vLLM's allow-list) must name `msa` when it is
set; `MSA_VLLM_PLUGIN=0` turns the routing off.

What it routes: vLLM 0.33.0's M3 attention backends look `minimax_m3_sparse_attn_decode` up as a
global of their own modules at every call —

- `vllm.models.minimax_m3.common.sparse_attention` (`MiniMaxM3SparseTritonImpl.forward`: Hopper
  and every other CUDA device but Blackwell), and
- `vllm.models.minimax_m3.nvidia.sparse_attention_msa` (`MiniMaxM3SparseMSAImpl.forward`'s
  Triton decode: Blackwell, when vLLM's CUTLASS decode is not planned),

so that name is replaced in those two modules (vLLM's function stays where it is defined,
`vllm.models.minimax_m3.common.ops.sparse_attn`). The replacement calls
`msa.integrations.vllm.minimax_m3_sparse_attn_decode` (`backend="auto"`, or `MSA_BACKEND`: the
Triton kernels on Hopper, whatever `auto` picks on Blackwell); a step msa does not serve
(`MSAUnsupportedError`: an fp8 e5m2 cache, per-slot scales) goes to vLLM's own function, with one
warning per reason. The modules are patched when vLLM imports them (vLLM loads plugins before the
model), or at once if they are imported already; nothing of vLLM is imported here.

Refused, with one warning and nothing changed: a vLLM whose M3 modules are not where they were in
0.33.0 or whose function has other parameters, ROCm builds of torch, and any failure while
patching. The plugin never raises into vLLM.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["register", "unregister", "ENV", "CALL_SITES", "FUNCTION", "VERIFIED_VLLM"]

#: `MSA_VLLM_PLUGIN=0` (or false/off/no) leaves vLLM's function in place.
ENV = "MSA_VLLM_PLUGIN"
#: The vLLM release the module layout and parameters were verified against.
VERIFIED_VLLM = "0.33.0"
FUNCTION = "minimax_m3_sparse_attn_decode"
#: The modules whose global `FUNCTION` vLLM's MiniMax-M3 attention backends call.
CALL_SITES = (
    "vllm.models.minimax_m3.common.sparse_attention",
    "vllm.models.minimax_m3.nvidia.sparse_attention_msa",
)
#: vLLM's parameters, in order (0.33.0's eleven; vLLM's main branch adds the last two).
_PARAMETERS = ("q", "kv_cache", "topk_idx", "block_table", "seq_lens", "num_kv_heads", "sm_scale", "output",
               "decode_query_len", "k_scale", "v_scale", "query_start_loc", "token_to_req_indices")

# vLLM's own logger tree: the lines appear in vLLM's log, with its format and level
logger = logging.getLogger("vllm.plugins.msa")
_lock = threading.RLock()
_originals: dict[str, tuple[ModuleType, Callable[..., Any]]] = {}
_warned: set[str] = set()
_finder: _PatchOnImport | None = None


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def _enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _vllm_layout_problem() -> str | None:
    """Why vLLM's M3 modules are not where 0.33.0 has them (None if they are), without
    importing them (importing `vllm.models.minimax_m3` loads the whole model)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return "vLLM is not installed"
    roots = [Path(p) for p in spec.submodule_search_locations]
    for name in CALL_SITES:
        rel = Path(*name.split(".")[1:]).with_suffix(".py")
        if not any((root / rel).is_file() for root in roots):
            return f"{name} not found (vLLM's MiniMax-M3 modules moved?)"
    return None


def _signature_problem(function: object) -> str | None:
    """Why vLLM's function cannot be replaced by msa's drop-in (None if it can)."""
    if not callable(function):
        return f"{FUNCTION} is missing"
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return f"{FUNCTION} has no readable signature"
    if len(names) < 11 or names != list(_PARAMETERS[: len(names)]):
        return f"{FUNCTION} takes ({', '.join(names)}), not vLLM {VERIFIED_VLLM}'s ({', '.join(_PARAMETERS[:11])})"
    return None


def _router(original: Callable[..., Any]) -> Callable[..., Any]:
    """msa's drop-in, falling back to vLLM's `original` for steps msa does not serve."""
    from msa.errors import MSAUnsupportedError
    from msa.integrations.vllm import minimax_m3_sparse_attn_decode

    @functools.wraps(minimax_m3_sparse_attn_decode)
    def routed(*args: Any, **kwargs: Any) -> None:
        try:
            minimax_m3_sparse_attn_decode(*args, **kwargs)
        except MSAUnsupportedError as error:  # raised before any kernel runs
            reason = str(error).split("\n")[0]
            _warn_once(f"fallback: {reason}", "msa does not serve this MiniMax-M3 decode step (%s); "
                       "vLLM's own kernel runs it", reason)
            original(*args, **kwargs)

    routed.__msa_routed__ = True  # type: ignore[attr-defined]
    routed.__vllm_original__ = original  # type: ignore[attr-defined]
    return routed


def _patch(module: ModuleType) -> None:
    """Replace `FUNCTION` in one call-site module (once; never raises)."""
    try:
        with _lock:
            current = getattr(module, FUNCTION, None)
            if getattr(current, "__msa_routed__", False):
                return
            problem = _signature_problem(current)
            if problem is not None:
                _warn_once("signature", "msa does not route vLLM's MiniMax-M3 sparse decode: %s", problem)
                return
            assert current is not None
            setattr(module, FUNCTION, _router(current))
            _originals[module.__name__] = (module, current)
            logger.info("msa: %s.%s now runs on msa (backend %s)", module.__name__, FUNCTION,
                        os.environ.get("MSA_BACKEND") or "auto")
    except Exception as error:  # never break vLLM's import of its model
        _warn_once("patch", "msa does not route vLLM's MiniMax-M3 sparse decode: patching %s failed: %r",
                   module.__name__, error)


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then `_patch` once the module has run."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the real loader
        return getattr(self._inner, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the call-site modules through the other finders and wraps their loaders."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in CALL_SITES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if isinstance(spec.loader, importlib.abc.Loader) and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchingLoader(spec.loader)
            return spec
        return None


def register() -> None:
    """The `vllm.general_plugins` entry point: route vLLM's M3 sparse decode to msa.

    Idempotent (vLLM loads plugins in every process, some more than once), off with
    `MSA_VLLM_PLUGIN=0`; never raises: what it refuses is logged once as a warning.
    """
    global _finder
    try:
        with _lock:
            if not _enabled():
                logger.info("msa: %s=%s, vLLM's MiniMax-M3 sparse decode is left alone", ENV, os.environ.get(ENV))
                return
            if _finder is not None or _originals:
                return
            problem = _vllm_layout_problem()
            if problem is None and _is_rocm():
                problem = "msa's kernels are not verified on ROCm"
            if problem is not None:
                _warn_once("layout", "msa does not route vLLM's MiniMax-M3 sparse decode: %s", problem)
                return
            _finder = _PatchOnImport()
            sys.meta_path.insert(0, _finder)
            for name in CALL_SITES:
                module = sys.modules.get(name)
                if module is not None:
                    _patch(module)
    except Exception as error:  # never break vLLM's start-up
        _warn_once("register", "msa does not route vLLM's MiniMax-M3 sparse decode: %r", error)


def unregister() -> None:
    """Put vLLM's functions back and stop patching modules on import (tests, notebooks)."""
    global _finder
    with _lock:
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None
        for module, original in _originals.values():
            if getattr(getattr(module, FUNCTION, None), "__msa_routed__", False):
                setattr(module, FUNCTION, original)
        _originals.clear()
        _warned.clear()


def _is_rocm() -> bool:
    torch = sys.modules.get("torch") or importlib.import_module("torch")
    return getattr(torch.version, "hip", None) is not None
