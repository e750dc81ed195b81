"""The split layouts (docs/semantics.md §4): `[pages, Hkv, P, 2*D]`, K in the first `D` channels, V in the
last `D`. BF16/FP16 store values as they are; FP8 stores `x / scale` in float8_e4m3fn."""

from __future__ import annotations

import torch

from msa.errors import MSAInputError
from msa.layouts.base import CacheShape, KVCache, KVLayout, KVOperands, SlotWrite, cache_device, e4m3_by_bits
from msa.scales import Scale, apply_scale, check_scale

__all__ = ["SplitLayout", "AUTO", "BFLOAT16", "FLOAT16", "FP8_E4M3", "FP8_E4M3_MAX"]

#: The largest finite float8_e4m3fn value; the FP8 writer saturates to it.
FP8_E4M3_MAX = 448.0


class SplitLayout(KVLayout):
    """K and V of a token side by side in one row of `2*D` elements."""

    def __init__(
        self,
        name: str,
        storage_dtype: torch.dtype,
        accepted: tuple[torch.dtype, ...],
        *,
        quantized: bool = False,
        concrete: dict[torch.dtype, KVLayout] | None = None,
    ) -> None:
        self.name = name
        self.storage_dtype = storage_dtype
        self.accepted_dtypes = accepted
        self.quantized = quantized
        self.separable = True
        self._concrete = concrete or {}

    def resolve(self, dtype: torch.dtype) -> KVLayout:
        return self._concrete.get(dtype, self)

    def kv_views(self, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(cache, tuple):
            return cache
        d = cache.shape[-1] // 2
        return cache[..., :d], cache[..., d:]

    def kv_operands(self, cache: KVCache) -> KVOperands:
        if isinstance(cache, tuple):
            k, v = cache
            return KVOperands(k, v, 0, (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2)))
        strides = (cache.stride(0), cache.stride(1), cache.stride(2))
        return KVOperands(cache, cache, cache.shape[-1] // 2, strides, strides)

    def cache_shape(
        self, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_pages, num_kv_heads, page_size, 2 * head_dim)

    def _shape_doc(self) -> str:
        return "[pages, Hkv, P, 2*D]"

    def _shape_from_cache(self, cache: torch.Tensor, argument: str) -> CacheShape:
        pages, heads, page_size, width = cache.shape
        if width % 2:
            raise MSAInputError(
                argument, "an even last dimension (2*D: K then V)", f"shape {tuple(cache.shape)}"
            )
        return CacheShape(pages, heads, page_size, width // 2)

    def bytes_per_token(self, head_dim: int) -> int:
        return 2 * head_dim * self.storage_dtype.itemsize

    def _encode(self, x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scaled = x.float() / scale
        if dtype == torch.float8_e4m3fn:
            scaled = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        return scaled.to(dtype)

    def _store(
        self,
        cache: KVCache,
        shape: CacheShape,
        selected: SlotWrite,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
    ) -> None:
        keys, values = self.kv_views(cache)
        # [page, :, offset] of every written token: [n, Hkv, D]
        keys[selected.pages, :, selected.offsets] = self._encode(selected.key, k_scale, keys.dtype)
        values[selected.pages, :, selected.offsets] = self._encode(selected.value, v_scale, values.dtype)

    def _store_kernel(
        self,
        cache: KVCache,
        shape: CacheShape,
        key: torch.Tensor,
        value: torch.Tensor,
        slots: torch.Tensor,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
    ) -> None:
        from msa.layouts.kernels import split_write_kernel

        if key.shape[0] == 0:
            return
        keys, values = self.kv_views(cache)
        fp8 = keys.dtype == torch.float8_e4m3fn
        soft = fp8 and e4m3_by_bits(keys.device)
        if soft:  # (no E4M3 in hardware: the bytes, encoded by bits)
            keys, values = keys.view(torch.uint8), values.view(torch.uint8)
        split_write_kernel[(key.shape[0], shape.num_kv_heads)](
            key, value, slots, keys, values, k_scale, v_scale, shape.num_pages * shape.page_size,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
            HEAD_DIM=shape.head_dim, PAGE=shape.page_size, FP8=fp8, SOFT=soft,
        )

    def gather(
        self,
        cache: KVCache,
        pages: torch.Tensor,
        heads: torch.Tensor,
        *,
        k_scale: Scale = 1.0,
        v_scale: Scale = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.kv_views(cache)
        k = check_scale("k_scale", k_scale, cache_device(cache))
        v = check_scale("v_scale", v_scale, cache_device(cache))
        return (
            apply_scale(keys[pages, heads].float(), k),  # [*S, P, D]
            apply_scale(values[pages, heads].float(), v),
        )


BFLOAT16 = SplitLayout("bfloat16", torch.bfloat16, (torch.bfloat16,))
FLOAT16 = SplitLayout("float16", torch.float16, (torch.float16,))
FP8_E4M3 = SplitLayout("fp8_e4m3", torch.float8_e4m3fn, (torch.float8_e4m3fn,), quantized=True)
#: The split layout whose storage follows the model dtype (bf16 or fp16); allocates bf16.
AUTO = SplitLayout(
    "auto", torch.bfloat16, (torch.bfloat16, torch.float16),
    concrete={torch.bfloat16: BFLOAT16, torch.float16: FLOAT16},
)
