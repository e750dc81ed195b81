"""KV-cache layouts (docs/semantics.md §4): one interface to allocate, write, dequantize and gather pages.

`get_layout(kv_cache_dtype)` maps the names serving engines use to a layout:

| name | layout | cache |
|---|---|---|
| "auto" | BF16/FP16 split (follows the cache dtype; allocates bf16) | `[pages, Hkv, P, 2D]` |
| "bfloat16", "float16" | BF16/FP16 split | `[pages, Hkv, P, 2D]` |
| "fp8", "fp8_e4m3" | FP8 split (`x / scale` in e4m3) | `[pages, Hkv, P, 2D]` float8_e4m3fn |
| "nvfp4" | NVFP4 head slots | `[pages, 2Hkv, P, D/2 + D/16]` uint8 |
"""

from __future__ import annotations

import torch

from msa.errors import MSAInputError
from msa.layouts.base import (
    UNREAD_FP8,
    CacheShape,
    KVCache,
    KVLayout,
    KVOperands,
    cache_device,
    cache_nbytes,
    refuse_unread_fp8,
)
from msa.layouts.nvfp4 import NVFP4, NVFP4HeadSlotLayout
from msa.layouts.split import AUTO, BFLOAT16, FLOAT16, FP8_E4M3, SplitLayout

__all__ = [
    "CacheShape",
    "KVCache",
    "KVLayout",
    "KVOperands",
    "cache_device",
    "cache_nbytes",
    "SplitLayout",
    "NVFP4HeadSlotLayout",
    "AUTO",
    "BFLOAT16",
    "FLOAT16",
    "FP8_E4M3",
    "NVFP4",
    "LAYOUT_NAMES",
    "UNREAD_FP8",
    "refuse_unread_fp8",
    "get_layout",
    "layout_for_cache",
]

_BY_NAME: dict[str, KVLayout] = {
    "auto": AUTO,
    "bfloat16": BFLOAT16,
    "bf16": BFLOAT16,
    "float16": FLOAT16,
    "fp16": FLOAT16,
    "fp8": FP8_E4M3,
    "fp8_e4m3": FP8_E4M3,
    "nvfp4": NVFP4,
}

#: Every accepted `kv_cache_dtype` string.
LAYOUT_NAMES: tuple[str, ...] = tuple(_BY_NAME)

_BY_CACHE_DTYPE: dict[torch.dtype, KVLayout] = {
    torch.bfloat16: BFLOAT16,
    torch.float16: FLOAT16,
    torch.float8_e4m3fn: FP8_E4M3,
    torch.uint8: NVFP4,
}


def get_layout(kv_cache_dtype: str) -> KVLayout:
    """The layout for a `kv_cache_dtype` name ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3",
    "nvfp4").

    Raises:
        MSAInputError: an unknown name.
    """
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in _BY_NAME:
        raise MSAInputError(
            "kv_cache_dtype", "one of " + ", ".join(repr(n) for n in _BY_NAME), repr(kv_cache_dtype)
        )
    return _BY_NAME[kv_cache_dtype]


def layout_for_cache(cache: object, kv_cache_dtype: str | None = None) -> KVLayout:
    """The concrete layout of `cache` (one tensor, or a `(k_cache, v_cache)` pair): named by
    `kv_cache_dtype`, or inferred from its dtype when that is None ("auto" resolves to the bf16
    or fp16 split layout). The layout's `inspect` checks the rest.

    Raises:
        MSAInputError: an unknown name, or a cache dtype the layout does not store.
        MSAUnsupportedError: an fp8 cache in a format msa does not read (`UNREAD_FP8`).
    """
    first = cache[0] if isinstance(cache, tuple) and cache else cache
    if not isinstance(first, torch.Tensor):
        raise MSAInputError("kv_cache", "a torch.Tensor or a (k_cache, v_cache) pair", type(cache).__name__)
    for part in cache if isinstance(cache, tuple) else (cache,):
        refuse_unread_fp8("kv_cache", part)
    if kv_cache_dtype is None:
        if first.dtype not in _BY_CACHE_DTYPE:
            raise MSAInputError(
                "kv_cache",
                "dtype bfloat16, float16, float8_e4m3fn or uint8 (nvfp4) to infer the layout",
                first.dtype,
            )
        return _BY_CACHE_DTYPE[first.dtype]
    layout = get_layout(kv_cache_dtype).resolve(first.dtype)
    layout.inspect(cache)  # raises on a dtype that disagrees with the name
    return layout
