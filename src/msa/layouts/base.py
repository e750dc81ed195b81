"""The interface every KV-cache layout offers: allocate, write through a slot mapping,
dequantize, and gather pages for the reference backend."""

from __future__ import annotations

import abc

import attrs
import torch

from msa.errors import MSAInputError
from msa.platform import triton_available
from msa.scales import Scale, check_scale

__all__ = ["CacheShape", "KVLayout", "SlotWrite"]

_KV_INPUT_DTYPES = (torch.bfloat16, torch.float16)


@attrs.frozen
class CacheShape:
    """The logical geometry of a cache tensor: `[num_pages, num_kv_heads, page_size, head_dim]`."""

    num_pages: int
    num_kv_heads: int
    page_size: int
    head_dim: int


@attrs.frozen
class SlotWrite:
    """The tokens of one `write` call that land in the cache (slots in range), in order.

    Attributes:
        pages: int64 `[n]` physical page of each written token.
        offsets: int64 `[n]` slot within the page.
        key: `[n, Hkv, D]` the keys to store.
        value: `[n, Hkv, D]` the values to store.
    """

    pages: torch.Tensor
    offsets: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


class KVLayout(abc.ABC):
    """A KV-cache layout (docs/semantics.md §4). Instances are stateless and shared.

    Attributes:
        name: the canonical name ("bfloat16", "float16", "fp8_e4m3", "nvfp4"; "auto" until
            `resolve`d).
        storage_dtype: the dtype `allocate` uses.
        accepted_dtypes: cache dtypes this layout reads and writes.
        quantized: stored values are scaled (`k_scale` / `v_scale` dequantize them).
        block_scaled: values are 4-bit E2M1 codes with an E4M3 scale per 16 elements (NVFP4):
            a reader decodes them itself; otherwise K and V are plain elements of the storage
            dtype, read and converted.
    """

    name: str
    storage_dtype: torch.dtype
    accepted_dtypes: tuple[torch.dtype, ...]
    quantized: bool = False
    block_scaled: bool = False

    def __repr__(self) -> str:
        return f"<KVLayout {self.name}>"

    def resolve(self, dtype: torch.dtype) -> KVLayout:
        """The concrete layout for a cache (or model) of `dtype`: itself, except for the "auto"
        layout, which follows the model dtype (bf16 or fp16)."""
        return self

    @abc.abstractmethod
    def kv_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of the keys and the values, each `[pages, Hkv, P, W]` with the unit
        last stride of the cache: `W = D` for the split layouts, the `D/2 + D/16` bytes of a
        head slot for NVFP4."""

    # -- geometry ---------------------------------------------------------------------------
    @abc.abstractmethod
    def cache_shape(
        self, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int
    ) -> tuple[int, ...]:
        """The shape of a cache tensor holding `num_pages` pages."""

    @abc.abstractmethod
    def _shape_from_cache(self, cache: torch.Tensor, argument: str) -> CacheShape:
        """Recover the logical geometry from a cache tensor whose dtype and rank are checked."""

    @abc.abstractmethod
    def bytes_per_token(self, head_dim: int) -> int:
        """Bytes one token of one KV head occupies (K and V together, scales included)."""

    def inspect(self, cache: object, argument: str = "kv_cache") -> CacheShape:
        """Check that `cache` is a tensor of this layout and return its geometry.

        Raises:
            MSAInputError: wrong type, dtype, rank, shape or strides.
        """
        if not isinstance(cache, torch.Tensor):
            raise MSAInputError(argument, "a torch.Tensor", type(cache).__name__)
        if cache.dtype not in self.accepted_dtypes:
            names = ", ".join(str(d) for d in self.accepted_dtypes)
            raise MSAInputError(
                argument,
                f"dtype {names} for the {self.name!r} layout",
                cache.dtype,
                "Pass kv_cache_dtype matching the cache, or None to infer it.",
            )
        if cache.dim() != 4:
            raise MSAInputError(
                argument, "a 4-D tensor " + self._shape_doc(), f"shape {tuple(cache.shape)}"
            )
        if cache.stride(-1) != 1:
            raise MSAInputError(argument, "unit stride in the last dimension", cache.stride())
        return self._shape_from_cache(cache, argument)

    @abc.abstractmethod
    def _shape_doc(self) -> str:
        """The shape of a cache, in words, for error messages."""

    def allocate(
        self,
        num_pages: int,
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        *,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """A zero-filled cache of `num_pages` pages (zeros dequantize to 0 in every layout)."""
        for argument, value in (
            ("num_pages", num_pages),
            ("num_kv_heads", num_kv_heads),
            ("page_size", page_size),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise MSAInputError(argument, "a positive int", repr(value))
        self._check_geometry(page_size, head_dim)
        shape = self.cache_shape(num_pages, num_kv_heads, page_size, head_dim)
        return torch.zeros(shape, dtype=self.storage_dtype, device=device)

    def _check_geometry(self, page_size: int, head_dim: int) -> None:  # noqa: B027 (optional hook)
        """Layout-specific limits on page size and head dim (none by default)."""

    # -- writing ----------------------------------------------------------------------------
    def write(
        self,
        cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: Scale | None = None,
        v_scale: Scale | None = None,
        validate: bool = False,
        kernel: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new tokens into the cache in place.

        Args:
            cache: a cache of this layout.
            key: `[num_tokens, Hkv, D]` bf16/fp16.
            value: `[num_tokens, Hkv, D]` bf16/fp16.
            slot_mapping: `[num_tokens]` int64 (or int32), `page * P + offset`. A negative slot
                (the `-1` padding of serving engines) skips its token; so does a slot past the
                end of the cache (or raises, with `validate=True`).
            k_scale, v_scale: the dequantization scales (stored = x / scale). `None` means 1.0
                for the split layouts; for NVFP4 it means "compute the global scale from the
                tokens written now" (then pass the returned scales to later writes).
            validate: raise on out-of-range slots instead of skipping them (reads the device).
            kernel: use the Triton writer (True), the torch writer (False), or decide (None:
                Triton on CUDA when triton imports). Both store the same bytes; the Triton one
                never synchronises with the host.

        Returns:
            `(k_scale, v_scale)`: the scales used, as one-element fp32 tensors on the cache's
            device — what `dequantize` and `msa.sparse_decode` need.

        Non-finite inputs (checking them would cost a host synchronisation per write): the split
        layouts store what they are given (FP8 saturates +-Inf at +-448, NaN stays NaN, and only
        the rows that attend that token see it). NVFP4 computes its default global scale from
        the finite values, saturates +-Inf at the block's largest code (6 x block scale, the
        block scale at 448) and stores NaN as 0 (E2M1 has no NaN), so one bad value cannot
        poison the rest of the write.
        """
        shape = self.inspect(cache)
        slots = _check_write_inputs(cache, shape, key, value, slot_mapping, validate)
        assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
        keep = ((slots >= 0) & (slots < shape.num_pages * shape.page_size)).view(-1, 1, 1)
        k = self._resolve_scale("k_scale", k_scale, cache.device, key, keep)
        v = self._resolve_scale("v_scale", v_scale, cache.device, value, keep)
        if kernel is None:
            kernel = cache.is_cuda and triton_available()
        if kernel:
            self._store_kernel(cache, shape, key, value, slots, k, v)
        else:
            self._store(cache, shape, _select_slots(shape, key, value, slots), k, v)
        return k, v

    def _resolve_scale(
        self,
        argument: str,
        scale: Scale | None,
        device: torch.device,
        data: torch.Tensor,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """The scale to write with, as a one-element fp32 tensor (default 1.0). `keep`
        `[n, 1, 1]` marks the tokens that land in the cache."""
        if scale is None:
            return torch.ones(1, dtype=torch.float32, device=device)
        checked = check_scale(argument, scale, device)
        if isinstance(checked, torch.Tensor):
            return checked.reshape(1)
        return torch.full((1,), checked, dtype=torch.float32, device=device)

    @abc.abstractmethod
    def _store_kernel(
        self,
        cache: torch.Tensor,
        shape: CacheShape,
        key: torch.Tensor,
        value: torch.Tensor,
        slots: torch.Tensor,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
    ) -> None:
        """Encode and store with the Triton writer (skips out-of-range slots on the device)."""

    @abc.abstractmethod
    def _store(
        self,
        cache: torch.Tensor,
        shape: CacheShape,
        selected: SlotWrite,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
    ) -> None:
        """Encode `selected` and store it."""

    # -- reading ----------------------------------------------------------------------------
    @abc.abstractmethod
    def gather(
        self,
        cache: torch.Tensor,
        pages: torch.Tensor,
        heads: torch.Tensor,
        *,
        k_scale: Scale = 1.0,
        v_scale: Scale = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantize selected (page, KV head) pairs.

        Args:
            pages: int64, any shape `S`, values in `[0, num_pages)`.
            heads: int64, broadcastable with `pages`, values in `[0, Hkv)`.

        Returns:
            `(K, V)`, float32, each `[*S, P, D]`, scales applied.
        """

    def dequantize(
        self, cache: torch.Tensor, *, k_scale: Scale = 1.0, v_scale: Scale = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache as float32 `(K, V)`, each `[pages, Hkv, P, D]`, scales applied."""
        shape = self.inspect(cache)
        pages = torch.arange(shape.num_pages, device=cache.device).view(-1, 1)
        heads = torch.arange(shape.num_kv_heads, device=cache.device).view(1, -1)
        return self.gather(cache, pages, heads, k_scale=k_scale, v_scale=v_scale)




def _check_write_inputs(
    cache: torch.Tensor,
    shape: CacheShape,
    key: object,
    value: object,
    slot_mapping: object,
    validate: bool,
) -> torch.Tensor:
    """Check the writer's inputs; returns the slots as int64."""
    expected = f"[num_tokens, {shape.num_kv_heads}, {shape.head_dim}] bf16/fp16"
    for argument, tensor in (("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            raise MSAInputError(argument, "a torch.Tensor", type(tensor).__name__)
        if tensor.dtype not in _KV_INPUT_DTYPES:
            raise MSAInputError(argument, expected, f"dtype {tensor.dtype}")
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != (shape.num_kv_heads, shape.head_dim):
            raise MSAInputError(argument, expected, f"shape {tuple(tensor.shape)}")
        if tensor.device != cache.device:
            raise MSAInputError(argument, f"a tensor on {cache.device}", tensor.device)
        if tensor.stride(-1) != 1:
            raise MSAInputError(argument, "unit stride in the last dimension", tensor.stride())
    assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
    if value.shape != key.shape or value.dtype != key.dtype:
        raise MSAInputError(
            "value",
            f"the shape and dtype of key ({tuple(key.shape)}, {key.dtype})",
            f"({tuple(value.shape)}, {value.dtype})",
        )
    if not isinstance(slot_mapping, torch.Tensor):
        raise MSAInputError("slot_mapping", "a torch.Tensor", type(slot_mapping).__name__)
    if slot_mapping.dtype not in (torch.int64, torch.int32) or slot_mapping.dim() != 1:
        raise MSAInputError(
            "slot_mapping",
            "a 1-D int64 (or int32) tensor [num_tokens]",
            f"{slot_mapping.dtype} of shape {tuple(slot_mapping.shape)}",
        )
    if slot_mapping.shape[0] != key.shape[0]:
        raise MSAInputError(
            "slot_mapping", f"{key.shape[0]} entries (one per key token)", slot_mapping.shape[0]
        )
    if slot_mapping.device != cache.device:
        raise MSAInputError("slot_mapping", f"a tensor on {cache.device}", slot_mapping.device)
    capacity = shape.num_pages * shape.page_size
    slots = slot_mapping.long()
    if validate:
        bad = (slots >= capacity) | (slots < -1)
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            raise MSAInputError(
                "slot_mapping",
                f"-1 or a slot in [0, {capacity}) (num_pages * page_size)",
                f"{int(slots[first])} for token {first}",
            )
    return slots


def _select_slots(
    shape: CacheShape, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> SlotWrite:
    """The tokens whose slot lies inside the cache (the torch writer; synchronises)."""
    capacity = shape.num_pages * shape.page_size
    keep = ((slots >= 0) & (slots < capacity)).nonzero().view(-1)
    kept = slots[keep]
    return SlotWrite(
        pages=kept // shape.page_size,
        offsets=kept % shape.page_size,
        key=key[keep],
        value=value[keep],
    )
