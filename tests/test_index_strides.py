"""1-D index arguments of any stride (a column of a wider metadata buffer, a slice with a step)
reach msa's Triton kernels as the elements they hold: the kernels read element i at `ptr + i`,
so a strided view must be made dense first (`msa.launcher.unit_stride`). Each case compares a
strided argument with a dense copy of it through the same kernel (under the interpreter on the
CPU, compiled on CUDA: the GPU gate runs the `gpu` cases), so the comparison is exact whatever
the interpreter's rounding."""

from __future__ import annotations

import pytest
import torch

import msa
from msa.integrations.sglang import flash_decode_with_gqa_share_sparse
from msa.launcher import unit_stride
from msa.planning import RowMetadata

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _column(values: list[int], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """`values` as column 0 of a `[n, 2]` buffer whose column 1 is junk: stride 2."""
    wide = torch.tensor([[v, 999] for v in values], dtype=dtype, device=device)
    return wide[:, 0]


def _kernels_here(device: str) -> None:
    import os

    if device == "cpu" and os.environ.get("TRITON_INTERPRET", "") in ("", "0"):
        pytest.skip("the Triton kernels run on the CPU only under TRITON_INTERPRET=1")


def test_unit_stride_copies_only_views_that_need_it() -> None:
    dense = torch.arange(4)
    one = torch.arange(6)[::3][:1]  # a one-element view of stride 3: its element is where it is
    assert unit_stride(dense) is dense and unit_stride(one) is one
    strided = _column([3, 1, 2], torch.int32)
    made = unit_stride(strided)
    assert made.stride() == (1,) and made.tolist() == [3, 1, 2]
    expanded = torch.tensor([7]).expand(3)
    assert unit_stride(expanded).stride() == (1,) and unit_stride(expanded).tolist() == [7, 7, 7]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("query_len", [1, 2])
def test_row_refresh_kernel_reads_strided_seq_lens(query_len: int, device: str) -> None:
    _kernels_here(device)
    lens = _column([40, 7, 129], torch.int32, device)
    got, want = RowMetadata(3, query_len, device), RowMetadata(3, query_len, device)
    got.refresh(lens, kernel=True)
    want.refresh(lens.contiguous(), kernel=True)
    assert torch.equal(got.q_pos, want.q_pos) and torch.equal(got.kv_lens, want.kv_lens)
    assert got.kv_lens.tolist()[::query_len] == [40, 7, 129]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["bfloat16", "fp8_e4m3", "nvfp4"])
def test_triton_writer_reads_strided_slot_mapping(layout: str, device: str) -> None:
    _kernels_here(device)
    lay = msa.get_layout(layout)
    g = torch.Generator().manual_seed(3)
    key = torch.randn(4, 2, 64, generator=g).bfloat16().to(device)
    value = torch.randn(4, 2, 64, generator=g).bfloat16().to(device)
    slots = _column([5, 9, 2, 30], torch.int64, device)  # (int64: .long() keeps the view)
    caches = []
    for slot_mapping in (slots, slots.contiguous()):
        cache = lay.allocate(2, 2, 16, 64, device=device)
        lay.write(cache, key, value, slot_mapping, kernel=True)
        caches.append(cache)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert caches[0].view(torch.uint8).any()


@pytest.mark.parametrize("device", DEVICES)
def test_sglang_drop_in_reads_strided_seq_lens_and_slot_ids(device: str) -> None:
    _kernels_here(device)
    g = torch.Generator().manual_seed(0)
    page, d = 16, 64
    k_pool = torch.randn(8 * page, 1, d, generator=g).bfloat16().to(device)
    v_pool = torch.randn(8 * page, 1, d, generator=g).bfloat16().to(device)
    req_to_token = torch.arange(3 * 64, dtype=torch.int32, device=device).view(3, 64)
    q = torch.randn(2, 4, d, generator=g).bfloat16().to(device)
    topk = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3]]], dtype=torch.int32, device=device)
    lens, slot_ids = _column([40, 7], torch.int32, device), _column([2, 0], torch.int64, device)
    outs = [flash_decode_with_gqa_share_sparse(q, None, k_pool, v_pool, req_to_token, n, s, page, topk, page_size=page)
            for n, s in ((lens, slot_ids), (lens.contiguous(), slot_ids.contiguous()))]
    assert torch.equal(outs[0], outs[1])
