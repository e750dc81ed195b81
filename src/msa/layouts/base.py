"""The interface every KV-cache layout offers: allocate, write through a slot mapping,
dequantize, and gather pages for the reference backend."""

from __future__ import annotations

import abc
from typing import Literal, overload

import attrs
import torch

from msa.errors import MSAInputError, MSAUnsupportedError, check_flag, is_int
from msa.launcher import unit_stride
from msa.platform import detect, e4m3_in_hardware, resolve_device, triton_available
from msa.scales import Scale, check_scale, check_scale_value

__all__ = ["CacheShape", "KVCache", "KVLayout", "KVOperands", "SlotWrite", "UNREAD_FP8", "cache_device", "cache_nbytes",
           "e4m3_by_bits",
           "refuse_unread_fp8"]

_KV_INPUT_DTYPES = (torch.bfloat16, torch.float16)

#: A cache: one tensor in its layout (the packed `[pages, Hkv, P, 2D]` split cache, NVFP4 head
#: slots), or, for the split layouts, a `(k_cache, v_cache)` pair of `[pages, Hkv, P, D]` views
#: with a unit last stride (FlashInfer's separate tensors, SGLang's token pools viewed as pages).
KVCache = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def cache_device(cache: KVCache) -> torch.device:
    """The device of a cache (of its K tensor, for a pair)."""
    return cache[0].device if isinstance(cache, tuple) else cache.device


#: fp8 formats an engine may keep a cache in that msa does not read (it reads E4M3FN): refused as
#: unsupported (`MSAUnsupportedError`: an engine keeps its own kernel for them), not as bad input.
UNREAD_FP8: tuple[torch.dtype, ...] = tuple(
    getattr(torch, name) for name in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, name)
)


def refuse_unread_fp8(argument: str, value: object) -> None:
    """`MSAUnsupportedError` for a tensor in one of the `UNREAD_FP8` formats."""
    if isinstance(value, torch.Tensor) and value.dtype in UNREAD_FP8:
        raise MSAUnsupportedError(f"{argument}: msa reads fp8 caches in float8_e4m3fn, not {value.dtype}")


def cache_nbytes(cache: KVCache) -> int:
    """Bytes a cache holds (both tensors of a pair)."""
    tensors = cache if isinstance(cache, tuple) else (cache,)
    return sum(t.numel() * t.element_size() for t in tensors)


@attrs.frozen
class CacheShape:
    """The logical geometry of a cache tensor: `[num_pages, num_kv_heads, page_size, head_dim]`."""

    num_pages: int
    num_kv_heads: int
    page_size: int
    head_dim: int


@attrs.frozen
class KVOperands:
    """How a kernel addresses a cache's keys and values, without creating views: element
    `(page, head, token, i)` of K is at `k + page*k_strides[0] + head*k_strides[1] +
    token*k_strides[2] + i`, and of V at `v + v_offset + ...` with `v_strides` (for NVFP4 a
    "token" row is not addressed through the strides: a head slot is one run of bytes).

    Attributes:
        k, v: the base tensors (the cache itself, or the two tensors of a pair).
        v_offset: elements from `v`'s base to the first value (D in a packed split cache, one
            head slot in NVFP4, 0 for a pair).
        k_strides, v_strides: (page, head, token) strides in elements.
    """

    k: torch.Tensor
    v: torch.Tensor
    v_offset: int
    k_strides: tuple[int, int, int]
    v_strides: tuple[int, int, int]

    @property
    def addresses(self) -> tuple[int, int]:
        """The device addresses of the first key and of the first value."""
        return self.k.data_ptr(), self.v.data_ptr() + self.v_offset * self.v.element_size()


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
        separable: the cache may also be a `(k_cache, v_cache)` pair of `[pages, Hkv, P, D]`
            tensors (the split layouts).
    """

    name: str
    storage_dtype: torch.dtype
    accepted_dtypes: tuple[torch.dtype, ...]
    quantized: bool = False
    block_scaled: bool = False
    separable: bool = False

    def __repr__(self) -> str:
        return f"<KVLayout {self.name}>"

    def resolve(self, dtype: torch.dtype) -> KVLayout:
        """The concrete layout for a cache (or model) of `dtype`: itself, except for the "auto"
        layout, which follows the model dtype (bf16 or fp16)."""
        return self

    @abc.abstractmethod
    def kv_views(self, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of the keys and the values, each `[pages, Hkv, P, W]` with the unit
        last stride of the cache: `W = D` for the split layouts (the two tensors themselves for
        a pair), the `D/2 + D/16` bytes of a head slot for NVFP4. Readers and writers go
        through these views, so a packed cache and a pair are read by the same code."""

    @abc.abstractmethod
    def kv_operands(self, cache: KVCache) -> KVOperands:
        """The same keys and values as `kv_views`, as kernels address them (no view created:
        the per-call cost of a launch)."""

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
        """Check that `cache` is a cache of this layout — one tensor, or a `(k_cache, v_cache)`
        pair for the split layouts — and return its geometry.

        Raises:
            MSAInputError: wrong type, dtype, rank, shape or strides.
        """
        if isinstance(cache, tuple):
            return self._inspect_pair(cache, argument)
        if not isinstance(cache, torch.Tensor):
            raise MSAInputError(argument, "a torch.Tensor (or a (k_cache, v_cache) pair)", type(cache).__name__)
        self._check_tensor(argument, cache, self._shape_doc())
        return self._shape_from_cache(cache, argument)

    def _check_tensor(self, argument: str, tensor: torch.Tensor, shape_doc: str) -> None:
        refuse_unread_fp8(argument, tensor)
        if tensor.dtype not in self.accepted_dtypes:
            names = ", ".join(str(d) for d in self.accepted_dtypes)
            raise MSAInputError(
                argument,
                f"dtype {names} for the {self.name!r} layout",
                tensor.dtype,
                "Pass kv_cache_dtype matching the cache, or None to infer it.",
            )
        if tensor.dim() != 4:
            raise MSAInputError(argument, "a 4-D tensor " + shape_doc, f"shape {tuple(tensor.shape)}")
        if tensor.stride(-1) != 1:
            raise MSAInputError(argument, "unit stride in the last dimension", tensor.stride())

    def _inspect_pair(self, cache: tuple[object, ...], argument: str) -> CacheShape:
        if not self.separable:
            raise MSAInputError(
                argument, f"one tensor {self._shape_doc()} for the {self.name!r} layout", "a tuple"
            )
        if len(cache) != 2:
            raise MSAInputError(argument, "a (k_cache, v_cache) pair", f"a tuple of {len(cache)}")
        k, v = cache
        for name, t in ((f"{argument}[0] (k_cache)", k), (f"{argument}[1] (v_cache)", v)):
            if not isinstance(t, torch.Tensor):
                raise MSAInputError(name, "a torch.Tensor", type(t).__name__)
            self._check_tensor(name, t, "[pages, Hkv, P, D]")
        assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
        if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
            raise MSAInputError(
                f"{argument}[1] (v_cache)",
                f"the shape, dtype and device of k_cache ({tuple(k.shape)}, {k.dtype}, {k.device})",
                f"({tuple(v.shape)}, {v.dtype}, {v.device})",
            )
        pages, heads, page_size, head_dim = k.shape
        return CacheShape(pages, heads, page_size, head_dim)

    @abc.abstractmethod
    def _shape_doc(self) -> str:
        """The shape of a cache, in words, for error messages."""

    @overload
    def allocate(
        self, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int, *,
        device: torch.device | str = ..., separate: Literal[False] = ...,
    ) -> torch.Tensor: ...

    @overload
    def allocate(
        self, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int, *,
        device: torch.device | str = ..., separate: Literal[True],
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def allocate(
        self,
        num_pages: int,
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        *,
        device: torch.device | str = "cpu",
        separate: bool = False,
    ) -> KVCache:
        """A zero-filled cache of `num_pages` pages (zeros dequantize to 0 in every layout): one
        tensor, or with `separate=True` a `(k_cache, v_cache)` pair (split layouts)."""
        for argument, value in (
            ("num_pages", num_pages),
            ("num_kv_heads", num_kv_heads),
            ("page_size", page_size),
            ("head_dim", head_dim),
        ):
            if not is_int(value) or value <= 0:
                raise MSAInputError(argument, "a positive int", repr(value))
        self._check_geometry(page_size, head_dim)
        check_flag("separate", separate)
        device = resolve_device(device)  # a clear error for a CUDA device on a machine without one
        if separate:
            if not self.separable:
                raise MSAInputError("separate", f"False for the {self.name!r} layout (one tensor of head slots)", True)
            half = (num_pages, num_kv_heads, page_size, head_dim)
            return (
                torch.zeros(half, dtype=self.storage_dtype, device=device),
                torch.zeros(half, dtype=self.storage_dtype, device=device),
            )
        shape = self.cache_shape(num_pages, num_kv_heads, page_size, head_dim)
        return torch.zeros(shape, dtype=self.storage_dtype, device=device)

    def _check_geometry(self, page_size: int, head_dim: int) -> None:  # noqa: B027 (optional hook)
        """Layout-specific limits on page size and head dim (none by default)."""

    # -- writing ----------------------------------------------------------------------------
    def write(
        self,
        cache: KVCache,
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
            cache: a cache of this layout (a `(k_cache, v_cache)` pair for the split layouts).
            key: `[num_tokens, Hkv, D]` bf16/fp16.
            value: `[num_tokens, Hkv, D]` bf16/fp16.
            slot_mapping: `[num_tokens]` int64 (or int32), any stride, `page * P + offset`. A negative slot
                (the `-1` padding of serving engines) skips its token; so does a slot past the
                end of the cache (or raises, with `validate=True`).
            k_scale, v_scale: the dequantization scales (stored = x / scale). `None` means 1.0
                for the split layouts; for NVFP4 it means "compute the global scale from the
                tokens written now" (then pass the returned scales to later writes).
            validate: raise on out-of-range slots instead of skipping them, and on a scale
                tensor that does not hold a finite value > 0 (reads the device).
            kernel: use the Triton writer (True), the torch writer (False), or decide (None:
                Triton on CUDA when triton imports; on a GPU without E4M3 in hardware, below
                compute capability 8.9, it encodes E4M3 by bits). Both store the same bytes;
                the Triton one never synchronises with the host; the torch one does (it finds
                the kept slots on the host), so it cannot be captured in a CUDA graph.

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
        check_flag("validate", validate)
        if kernel is not None and not isinstance(kernel, bool):
            raise MSAInputError("kernel", "True, False or None", repr(kernel))
        shape = self.inspect(cache)
        device = cache_device(cache)
        slots = _check_write_inputs(device, shape, key, value, slot_mapping, validate)
        assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
        keep = ((slots >= 0) & (slots < shape.num_pages * shape.page_size)).view(-1, 1, 1)
        k = self._resolve_scale("k_scale", k_scale, device, key, keep)
        v = self._resolve_scale("v_scale", v_scale, device, value, keep)
        if validate:
            for argument, given in (("k_scale", k_scale), ("v_scale", v_scale)):
                if given is not None:
                    check_scale_value(argument, given)
        if kernel is None:
            kernel = device.type == "cuda" and triton_available()
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
        cache: KVCache,
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
        cache: KVCache,
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
        cache: KVCache,
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
        self, cache: KVCache, *, k_scale: Scale = 1.0, v_scale: Scale = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache as float32 `(K, V)`, each `[pages, Hkv, P, D]`, scales applied."""
        shape = self.inspect(cache)
        device = cache_device(cache)
        pages = torch.arange(shape.num_pages, device=device).view(-1, 1)
        heads = torch.arange(shape.num_kv_heads, device=device).view(1, -1)
        return self.gather(cache, pages, heads, k_scale=k_scale, v_scale=v_scale)




def _check_write_inputs(
    device: torch.device,
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
        if tensor.device != device:
            raise MSAInputError(argument, f"a tensor on {device}", tensor.device)
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
    if slot_mapping.device != device:
        raise MSAInputError("slot_mapping", f"a tensor on {device}", slot_mapping.device)
    capacity = shape.num_pages * shape.page_size
    slots = unit_stride(slot_mapping.long())  # (the Triton writer reads slot i at ptr + i)
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


def e4m3_by_bits(device: torch.device) -> bool:
    """Whether the Triton writers encode E4M3 by bits on `device`: a GPU without E4M3 in hardware
    (compute capability below 8.9, where Triton has no fp8e4nv type)."""
    return not e4m3_in_hardware(detect(device).capability)
