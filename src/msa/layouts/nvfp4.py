"""The NVFP4 head-slot layout (docs/semantics.md §4), byte for byte.

Cache: uint8 `[pages, 2*Hkv, P, D/2 + D/16]`. Slot `2h` holds head `h`'s K, slot `2h + 1` its V.
A slot is one contiguous run of `P * (D/2 + D/16)` bytes:

- `P * D/2` bytes of E2M1 codes, token-major; byte `d` of a token holds element `2d` in its low
  nibble and element `2d + 1` in its high nibble;
- `P * D/16` bytes of E4M3 block scales (one per 16 consecutive elements): K scales linear
  (`t * D/16 + g`), V scales interleaved by token quads (`(t//4) * 4*D/16 + g*4 + t%4`).

value = e2m1(code) * e4m3(block_scale) * global_scale.
"""

from __future__ import annotations

import torch

from msa.errors import MSAInputError
from msa.layouts.base import CacheShape, KVCache, KVLayout, KVOperands, SlotWrite, e4m3_by_bits
from msa.scales import FP32_SCALE_RANGE, Scale, apply_scale, check_scale

__all__ = [
    "NVFP4",
    "NVFP4HeadSlotLayout",
    "E2M1_VALUES",
    "E2M1_MAX",
    "E4M3_MAX",
    "BLOCK",
    "e2m1_encode",
    "e2m1_decode",
    "quantize_blocks",
    "scale_byte_index",
]

#: Elements per block scale.
BLOCK = 16
#: Largest E2M1 magnitude and largest E4M3 value: the writer's default global scale is amax / (6 * 448).
E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: Values of E2M1 codes 0..15 (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Round-to-nearest-even onto the E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}: a magnitude `a`
# gets code c where c counts the thresholds it passes; a tie goes to the even code, so the
# threshold is inclusive (<=) below an even code's upper tie and exclusive (<) below an odd one.
_TIES_TO_LOWER = (0.25, 1.25, 2.5, 5.0)  # ties between (0,.5) (1,1.5) (2,3) (4,6): keep lower (even)
_TIES_TO_UPPER = (0.75, 1.75, 3.5)  # ties between (.5,1) (1.5,2) (3,4): go up (to the even code)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round float32 `x` to E2M1 codes (uint8 0..15), nearest-even, saturating at +-6.

    The sign bit is set for every negative input (so -0.1 becomes code 8, minus zero).
    """
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t in _TIES_TO_LOWER:
        code += (a > t).to(torch.uint8)
    for t in _TIES_TO_UPPER:
        code += (a >= t).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits) -> float32 values.

    The magnitude bits shifted into an E4M3 byte (`m << 2`, the sign to bit 7) encode exactly
    the E2M1 value times 2^-6, so the float8 conversion decodes them (no lookup table, no
    host-to-device copy)."""
    c = codes.to(torch.uint8)
    e4m3 = ((c & 0x7) << 2) | ((c & 0x8) << 4)
    return e4m3.view(torch.float8_e4m3fn).float() * 64.0


def _ieee_quotient(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """`x / divisor` rounded once, on every device. A python-float divisor would be a
    multiplication by its reciprocal on CUDA (torch's division by a host scalar), one ulp away
    from the IEEE quotient the Triton writer takes (`div_rn`): divided by a device tensor, both
    writers round the same quotient."""
    return x / torch.full_like(x, divisor)


def quantize_blocks(
    x: torch.Tensor, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `[..., D]` values to NVFP4.

    Args:
        x: `[..., D]`, any float dtype, `D % 16 == 0`.
        global_scale: one-element fp32 tensor.

    Returns:
        `(packed, scales)`: uint8 `[..., D/2]` (element 2d low nibble, 2d+1 high nibble) and
        uint8 `[..., D/16]` E4M3 block-scale bytes.

    Non-finite values: +-Inf saturate (the block scale to 448, the code to +-6); NaN is stored
    as 0 and does not enter its block's scale (E2M1 has no NaN).
    """
    g = global_scale.reshape(()).float()
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)  # [..., D/16, 16]
    amax = blocks.abs().nan_to_num(nan=0.0).amax(dim=-1)  # NaN stores 0 and sets no scale
    scale = (_ieee_quotient(amax, E2M1_MAX) / g).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = scale.float().unsqueeze(-1) * g  # [..., D/16, 1]
    # a block whose scale rounded to 0 stores zeros, each negative one as -0 (E2M1 code 8): a ratio
    # of -1/8 rounds to it (NaN is no negative: code 0)
    ratio = torch.where(step > 0, blocks / step, torch.where(blocks < 0, -0.125, 0.0))
    codes = e2m1_encode(ratio).flatten(-2)  # [..., D]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scale.view(torch.uint8)


def scale_byte_index(token: torch.Tensor, group: torch.Tensor, groups: int, interleaved: bool) -> torch.Tensor:
    """Byte offset of the block scale of (`token`, `group`) inside a slot's scale area."""
    if interleaved:
        return (token // 4) * (4 * groups) + group * 4 + token % 4
    return token * groups + group


class NVFP4HeadSlotLayout(KVLayout):
    """NVFP4 with K and V of each KV head in adjacent head slots."""

    name = "nvfp4"
    storage_dtype = torch.uint8
    accepted_dtypes = (torch.uint8,)
    quantized = True
    block_scaled = True

    def kv_views(self, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        slots = _one_tensor(cache)
        return slots[:, 0::2], slots[:, 1::2]

    def kv_operands(self, cache: KVCache) -> KVOperands:
        slots = _one_tensor(cache)
        strides = (slots.stride(0), 2 * slots.stride(1), slots.stride(2))  # head h: slots 2h (K), 2h+1 (V)
        return KVOperands(slots, slots, slots.stride(1), strides, strides)

    def cache_shape(
        self, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_pages, 2 * num_kv_heads, page_size, head_dim // 2 + head_dim // BLOCK)

    def _shape_doc(self) -> str:
        return "[pages, 2*Hkv, P, D/2 + D/16] uint8"

    def _check_geometry(self, page_size: int, head_dim: int) -> None:
        if head_dim % (2 * BLOCK):
            raise MSAInputError("head_dim", "a multiple of 32 for nvfp4", head_dim)
        if page_size % 4:
            raise MSAInputError(
                "page_size", "a multiple of 4 for nvfp4 (V scales interleave token quads)", page_size
            )

    def _shape_from_cache(self, cache: torch.Tensor, argument: str) -> CacheShape:
        pages, slots, page_size, width = cache.shape
        head_dim = width * BLOCK // 9  # width = D/2 + D/16 = 9 D / 16
        if slots % 2 or head_dim * 9 != width * BLOCK or head_dim % (2 * BLOCK) or page_size % 4:
            raise MSAInputError(
                argument,
                "nvfp4 shape [pages, 2*Hkv, P, D/2 + D/16] with D % 32 == 0 and P % 4 == 0",
                f"shape {tuple(cache.shape)}",
            )
        if cache.stride(-2) != width:
            raise MSAInputError(
                argument, "each head slot contiguous (stride of dim 2 == D/2 + D/16)", cache.stride()
            )
        return CacheShape(pages, slots // 2, page_size, head_dim)

    def bytes_per_token(self, head_dim: int) -> int:
        return 2 * (head_dim // 2 + head_dim // BLOCK)

    def _resolve_scale(
        self,
        argument: str,
        scale: Scale | None,
        device: torch.device,
        data: torch.Tensor,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        if scale is not None:
            return super()._resolve_scale(argument, scale, device, data, keep)
        if data.numel() == 0:
            return torch.ones(1, dtype=torch.float32, device=device)
        # the finite values written now set the global scale (one Inf must not make it Inf and
        # every code NaN); no host synchronisation
        amax = torch.where(keep & data.isfinite(), data.abs(), 0).amax().float()
        chosen = torch.where(amax > 0, _ieee_quotient(amax, E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
        # at least the smallest scale every entry point accepts (`FP32_SCALE_RANGE`): values below
        # 2^-125 * 2688 get smaller block scales (or round to 0) instead of a scale msa refuses
        return chosen.clamp(min=FP32_SCALE_RANGE[0]).reshape(1)

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
        from msa.layouts.kernels import nvfp4_write_kernel

        cache = _one_tensor(cache)
        if key.shape[0] == 0:
            return
        nvfp4_write_kernel[(key.shape[0], shape.num_kv_heads, 2)](
            key, value, slots, cache, k_scale, v_scale, shape.num_pages * shape.page_size,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            cache.stride(0), cache.stride(1),
            HEAD_DIM=shape.head_dim, PAGE=shape.page_size, SOFT=e4m3_by_bits(cache.device),
        )

    def _store(
        self,
        cache: KVCache,
        shape: CacheShape,
        selected: SlotWrite,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
    ) -> None:
        cache = _one_tensor(cache)
        p, d, hkv = shape.page_size, shape.head_dim, shape.num_kv_heads
        groups = d // BLOCK
        flat = cache.view(shape.num_pages, 2 * hkv, p * (d // 2 + groups))
        n = selected.pages.shape[0]
        page = selected.pages.view(n, 1, 1)
        offset = selected.offsets.view(n, 1, 1)
        head = torch.arange(hkv, device=cache.device).view(1, hkv, 1)
        code_bytes = offset * (d // 2) + torch.arange(d // 2, device=cache.device).view(1, 1, -1)
        group = torch.arange(groups, device=cache.device).view(1, 1, -1)
        for side, data, scale, interleaved in (
            (0, selected.key, k_scale, False),
            (1, selected.value, v_scale, True),
        ):
            packed, block_scales = quantize_blocks(data, scale)  # [n, Hkv, D/2], [n, Hkv, D/16]
            slot = 2 * head + side
            flat[page, slot, code_bytes] = packed
            flat[page, slot, p * (d // 2) + scale_byte_index(offset, group, groups, interleaved)] = (
                block_scales
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
        cache = _one_tensor(cache)
        num_pages, slots, p, width = cache.shape
        d = width * BLOCK // 9
        groups = d // BLOCK
        flat = cache.view(num_pages, slots, p * width)
        out = []
        for side, scale, name in ((0, k_scale, "k_scale"), (1, v_scale, "v_scale")):
            raw = flat[pages, 2 * heads + side]  # [*S, P*width]
            lead = raw.shape[:-1]
            codes = raw[..., : p * d // 2].reshape(*lead, p, d // 2)
            scale_bytes = raw[..., p * d // 2 :]
            if side == 0:
                block = scale_bytes.reshape(*lead, p, groups)
            else:
                block = scale_bytes.reshape(*lead, p // 4, groups, 4).transpose(-1, -2)
                block = block.flatten(-3, -2)
            values = torch.stack((e2m1_decode(codes), e2m1_decode(codes >> 4)), dim=-1)
            values = values.flatten(-2)  # [*S, P, D]
            block_f = block.contiguous().view(torch.float8_e4m3fn).float()
            values = values * block_f.repeat_interleave(BLOCK, dim=-1)
            checked = check_scale(name, scale, cache.device)
            out.append(apply_scale(values, checked))
        return out[0], out[1]


def _one_tensor(cache: KVCache) -> torch.Tensor:
    """The cache tensor (NVFP4 keeps K and V of a head in adjacent slots of one tensor)."""
    if isinstance(cache, tuple):
        raise MSAInputError("kv_cache", "one uint8 tensor of head slots for the 'nvfp4' layout", "a tuple")
    return cache


NVFP4 = NVFP4HeadSlotLayout()
