"""Loads the serving engines' own MiniMax-M3 sparse decode kernels at run time, from the files
`prepare.sh` extracted into `.baselines/` (git-ignored: the engines' code is never part of msa).

    from engine_baselines import load
    if load.available():
        load.vllm_decode(q, kv_cache, topk_idx, block_table, seq_lens, num_kv_heads, sm_scale, output, L,
                         k_scale=None, v_scale=None)       # vLLM 0.33.0 minimax_m3_sparse_attn_decode
        out = load.sglang_decode(q, None, k_pool, v_pool, req_to_token, seq_lens, slot_ids, block_size,
                                 topk_idx, page_size=P, k_scale=..., v_scale=...)
                                                           # SGLang 0.5.23 flash_decode_with_gqa_share_sparse

`vllm_decode` and `sglang_decode` are the engines' functions themselves (imported on first use).
The extracted files import a few things from their packages; the rest of vLLM and SGLang is
never imported. Our own stub modules stand in for those imports, registered in `sys.modules`
only while the engine files are being imported (an installed vLLM or SGLang is left alone):

- `vllm.platforms.current_platform`: `is_arch_support_pdl()` (vLLM's rule: CUDA compute
  capability >= 9; False without CUDA or under `TRITON_INTERPRET=1`, where the kernels'
  `gdc_wait`/`launch_pdl` path cannot run);
- `vllm.triton_utils`: `triton` and `tl`;
- `sglang.srt.runtime_context.get_platform()`: `is_cuda`, `is_hip`, `is_sm90` (SGLang's rule:
  capability 9.x with CUDA >= 12.3; selects the Hopper-pinned decode kernel), `is_sm100`.

`platform(is_sm90=True)` or `platform(is_arch_support_pdl=False)` pretends other facts, e.g. to
run SGLang's Hopper-pinned path under the interpreter.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["BASELINES", "available", "missing", "platform", "vllm_module", "sglang_module"]

#: Where prepare.sh extracts the engines' files (MSA_BASELINES_DIR overrides).
BASELINES = Path(os.environ.get("MSA_BASELINES_DIR") or Path(__file__).resolve().parents[2] / ".baselines")

VLLM_MODULE = "vllm.models.minimax_m3.common.ops.sparse_attn"
SGLANG_MODULE = "sglang.kernels.ops.attention.minimax_sparse.decode.topk_sparse"
_SGLANG_HELPERS = (
    "sglang.kernels.ops.attention.minimax_sparse.common.tile_ptr",
    "sglang.kernels.ops.attention.minimax_sparse.common.utils",
)
_FILES = (VLLM_MODULE, SGLANG_MODULE, *_SGLANG_HELPERS)

#: Pretended platform facts (see `platform`).
_OVERRIDES: dict[str, bool] = {}
_LOADED: dict[str, types.ModuleType] = {}


def _path(module: str) -> Path:
    return BASELINES / (module.replace(".", "/") + ".py")


def missing() -> list[str]:
    """The extracted files that are not there (all of them before prepare.sh has run)."""
    return [str(_path(m)) for m in _FILES if not _path(m).is_file()]


def available() -> bool:
    """Whether prepare.sh has extracted every engine file this loader needs."""
    return not missing()


@contextmanager
def platform(**facts: bool) -> Iterator[None]:
    """Pretend platform facts for the engines' stubs within the block (`is_sm90`,
    `is_arch_support_pdl`)."""
    unknown = set(facts) - {"is_sm90", "is_arch_support_pdl"}
    if unknown:
        raise ValueError(f"unknown platform facts: {sorted(unknown)}")
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(facts)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def _capability() -> tuple[int, int] | None:
    """The CUDA device's compute capability; None without one or under the interpreter."""
    if _interpreted() or torch.version.hip is not None or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major, minor


class _VllmPlatform:
    """Stands in for `vllm.platforms.current_platform` (only what sparse_attn.py reads)."""

    @staticmethod
    def is_arch_support_pdl() -> bool:
        if "is_arch_support_pdl" in _OVERRIDES:
            return _OVERRIDES["is_arch_support_pdl"]
        capability = _capability()
        return capability is not None and capability[0] >= 9


class _SglangPlatform:
    """Stands in for `sglang.srt.runtime_context.get_platform()` (topk_sparse.py reads `is_sm90`)."""

    @property
    def is_cuda(self) -> bool:
        return _capability() is not None

    @property
    def is_hip(self) -> bool:
        return torch.version.hip is not None

    @property
    def is_sm90(self) -> bool:
        if "is_sm90" in _OVERRIDES:
            return _OVERRIDES["is_sm90"]
        capability, cuda = _capability(), torch.version.cuda
        return capability is not None and capability[0] == 9 and cuda is not None and _version(cuda) >= (12, 3)

    @property
    def is_sm100(self) -> bool:
        capability = _capability()
        return capability is not None and capability[0] == 10


_SGLANG_PLATFORM = _SglangPlatform()


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2])


def _module(name: str, path: list[Path] | None = None, **attributes: Any) -> types.ModuleType:
    """A stub module; a package whose submodules are searched in `path` when given."""
    module = types.ModuleType(name, "msa engine-baseline stub")
    if path is not None:
        module.__path__ = [str(p) for p in path]
    module.__dict__.update(attributes)
    return module


def _stubs() -> dict[str, types.ModuleType]:
    return {
        # top-level packages rooted in .baselines: the extracted folders below them import as
        # namespace packages, so no __init__.py of vLLM or SGLang is ever run
        "vllm": _module("vllm", [BASELINES / "vllm"]),
        "vllm.platforms": _module("vllm.platforms", current_platform=_VllmPlatform()),
        "vllm.triton_utils": _module("vllm.triton_utils", triton=triton, tl=tl),
        "sglang": _module("sglang", [BASELINES / "sglang"]),
        "sglang.srt": _module("sglang.srt", []),
        "sglang.srt.runtime_context": _module(
            "sglang.srt.runtime_context", get_platform=lambda: _SGLANG_PLATFORM
        ),
    }


def _ours(name: str) -> bool:
    return name.split(".", 1)[0] in ("vllm", "sglang")


@contextmanager
def _engine_namespace() -> Iterator[None]:
    """`vllm` and `sglang` resolve to our stubs and the extracted files within the block; the
    `sys.modules` entries of those names are restored afterwards."""
    saved = {name: module for name, module in sys.modules.items() if _ours(name)}
    for name in saved:
        del sys.modules[name]
    sys.modules.update(_stubs())
    try:
        yield
    finally:
        for name in [name for name in sys.modules if _ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)


def _load(name: str) -> types.ModuleType:
    if name not in _LOADED:
        if not available():
            raise FileNotFoundError(
                "the engines' kernels are not extracted (run `bash benchmarks/engine_baselines/prepare.sh`); "
                "missing: " + ", ".join(missing())
            )
        with _engine_namespace():
            _LOADED[name] = importlib.import_module(name)
    return _LOADED[name]


def vllm_module() -> types.ModuleType:
    """vLLM's `vllm/models/minimax_m3/common/ops/sparse_attn.py`, imported from `.baselines/`."""
    return _load(VLLM_MODULE)


def sglang_module() -> types.ModuleType:
    """SGLang's `.../minimax_sparse/decode/topk_sparse.py`, imported from `.baselines/`."""
    return _load(SGLANG_MODULE)


def __getattr__(name: str) -> Callable[..., Any]:
    """`vllm_decode` and `sglang_decode`: the engines' own functions, imported on first use."""
    if name == "vllm_decode":
        fn: Callable[..., Any] = vllm_module().minimax_m3_sparse_attn_decode
        return fn
    if name == "sglang_decode":
        fn = sglang_module().flash_decode_with_gqa_share_sparse
        return fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
