"""Value objects that describe a decode step: `Geometry` and `DecodeProblem`.

These are frozen, slotted attrs classes, so they can key caches (plans, selections).
"""

from __future__ import annotations

import attrs
import torch

from msa.errors import MSAInputError, MSAKeyError, is_int
from msa.layouts import KVCache, KVLayout, get_layout

__all__ = ["Geometry", "DecodeProblem", "CACHE_FORMS", "MINIMAX_M3", "MINIMAX_M3_TP", "cache_form"]

#: How a cache is held in memory (`DecodeProblem.kv_form`): "packed" — one contiguous tensor (the
#: split layouts' `[pages, Hkv, P, 2D]`, NVFP4 head slots); "separate" — a `(k_cache, v_cache)`
#: pair of two contiguous `[pages, Hkv, P, D]` tensors; "strided" — a tensor or a pair that is
#: not contiguous (views into larger buffers, such as SGLang's token pools viewed as pages).
#: Some kernel libraries read only some forms.
CACHE_FORMS = ("packed", "separate", "strided")


def cache_form(cache: KVCache) -> str:
    """The form (`CACHE_FORMS`) of a checked cache."""
    tensors = cache if isinstance(cache, tuple) else (cache,)
    if not all(t.is_contiguous() for t in tensors):
        return "strided"
    return "separate" if isinstance(cache, tuple) else "packed"


def _positive(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not is_int(value) or value <= 0:
        raise MSAInputError(attribute.name, "a positive int", repr(value))


@attrs.frozen
class Geometry:
    """The attention geometry of one rank.

    Attributes:
        num_q_heads: query heads on this rank (`Hq`).
        num_kv_heads: KV heads on this rank (`Hkv`); `Hq % Hkv == 0`.
        head_dim: head dimension (`D`).
        page_size: tokens per KV page (`P`), also the sparse block size.
        topk: selected pages per (query token, KV head) (`K`).
    """

    num_q_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    page_size: int = attrs.field(validator=_positive)
    topk: int = attrs.field(validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise MSAInputError(
                "num_q_heads",
                f"a multiple of num_kv_heads={self.num_kv_heads}",
                self.num_q_heads,
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (`G = Hq // Hkv`)."""
        return self.num_q_heads // self.num_kv_heads

    def tensor_parallel(self, tp_size: int) -> Geometry:
        """The per-rank geometry under tensor parallelism of `tp_size` ranks.

        Query heads are split evenly; KV heads are split while there are enough of them and
        replicated (one per rank) beyond that, as serving engines do.
        """
        if tp_size <= 0 or self.num_q_heads % tp_size:
            raise MSAInputError(
                "tp_size", f"a positive divisor of num_q_heads={self.num_q_heads}", tp_size
            )
        if self.num_kv_heads % tp_size and tp_size % self.num_kv_heads:
            raise MSAInputError(
                "tp_size",
                f"a divisor or multiple of num_kv_heads={self.num_kv_heads}",
                tp_size,
            )
        return attrs.evolve(
            self,
            num_q_heads=self.num_q_heads // tp_size,
            num_kv_heads=max(self.num_kv_heads // tp_size, 1),
        )

    def describe(self) -> str:
        """A short human-readable form, e.g. `64/4 heads, D=128, P=128, K=16`."""
        return (
            f"{self.num_q_heads}/{self.num_kv_heads} heads, D={self.head_dim}, "
            f"P={self.page_size}, K={self.topk}"
        )


#: MiniMax-M3's full (TP1) attention geometry: 64 query heads, 4 KV heads, D 128, 16 pages of 128.
MINIMAX_M3 = Geometry(num_q_heads=64, num_kv_heads=4, head_dim=128, page_size=128, topk=16)

class _PerRankGeometries(dict[int, Geometry]):
    """Geometries by tensor-parallel size; an unknown size is an `MSAKeyError` naming the sizes."""

    def __missing__(self, key: object) -> Geometry:
        raise MSAKeyError(
            "MINIMAX_M3_TP", f"a tensor-parallel size in {sorted(self)}", repr(key),
            "msa.MINIMAX_M3.tensor_parallel(n) gives another size's geometry, where it divides the heads.",
        )


#: MiniMax-M3's per-rank geometry for each tensor-parallel size: 64/4, 32/2, 16/1, 8/1 heads.
MINIMAX_M3_TP: dict[int, Geometry] = _PerRankGeometries((tp, MINIMAX_M3.tensor_parallel(tp)) for tp in (1, 2, 4, 8))


@attrs.frozen
class DecodeProblem:
    """Everything a backend or the selection policy may know about a step without reading
    device data.

    Attributes:
        geometry: the rank's heads, head dim, page size and top-k.
        batch_size: decode requests in the step (`B`).
        query_len: query tokens per request (`L`).
        kv_layout: canonical layout name ("bfloat16", "float16", "fp8_e4m3", "nvfp4"); the
            layout itself is `layout`.
        q_dtype: dtype of `q`.
        out_dtype: dtype of `out` (`q`'s dtype; bf16 when `q` is fp8).
        device_type: "cuda", "cpu", ...
        num_pages: physical pages in the cache (0 in a plan's problem: plans do not depend on it).
        max_blocks: columns of `block_table` (0 in a plan's problem, likewise).
        return_lse: whether the caller asked for the log-sum-exp.
        block_table_stride: elements between rows of `block_table` (None: `max_blocks`).
        ragged: query lengths come from `query_start_loc`; `query_len` is then their maximum.
        total_rows: query rows of a ragged step (None: `batch_size * query_len`).
        kv_form: how the cache is held in memory, one of `CACHE_FORMS` (a planner that has not
            seen the cache assumes msa's default, one packed tensor).
        graph_capture: the caller will capture `run` in a CUDA graph (backends whose `run`
            allocates or reads the host refuse such steps).
        vector_aligned: q's and out's rows start on 4-byte boundaries and the cache's pages and
            heads on 16-byte ones (`validation.vector_misalignment`), as kernels with vector loads
            need; a planner assumes so, as it assumes `kv_form` (`msa.sparse_decode` checks).
        dcp_size: the ranks each request's pages are spread over (decode context parallelism;
            1: all on this device). A rank then holds about 1/dcp_size of every selection, which
            changes which kernel pays (the dedup kernel does not, measured at 2).
    """

    geometry: Geometry
    batch_size: int
    query_len: int
    kv_layout: str
    q_dtype: torch.dtype
    out_dtype: torch.dtype
    device_type: str
    num_pages: int
    max_blocks: int
    return_lse: bool = False
    block_table_stride: int | None = None
    ragged: bool = False
    total_rows: int | None = None
    kv_form: str = attrs.field(default="packed", validator=attrs.validators.in_(CACHE_FORMS))
    graph_capture: bool = False
    vector_aligned: bool = True
    dcp_size: int = attrs.field(default=1, validator=_positive)

    @property
    def layout(self) -> KVLayout:
        """The cache layout (what kernels ask about the cache's format)."""
        return get_layout(self.kv_layout)

    @property
    def table_stride(self) -> int:
        """Elements between rows of `block_table`."""
        return self.max_blocks if self.block_table_stride is None else self.block_table_stride

    @property
    def num_rows(self) -> int:
        """Query rows: `B * L`, or the rows of a ragged step."""
        return self.batch_size * self.query_len if self.total_rows is None else self.total_rows
