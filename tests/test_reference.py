"""The reference backend against the independent float64 loop (tests/naive.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from cases import Case, assert_close_to_naive, build, run

import msa

LAYOUTS = ("bfloat16", "float16", "fp8_e4m3", "nvfp4")
QUERY_LENS = (1, 2, 4, 32)
# (group size, head dim, page size) rotated so every layout meets every value
GEOMETRIES = [(1, 64, 16), (8, 128, 16), (16, 64, 128), (8, 64, 128), (16, 128, 16), (1, 128, 128)]


def _matrix() -> list[Case]:
    cases = []
    for n, (layout, length) in enumerate(itertools.product(LAYOUTS, QUERY_LENS)):
        group, d, p = GEOMETRIES[n % len(GEOMETRIES)]
        hkv = 2 if group < 16 else 1
        big = length * p > 256
        cases.append(
            Case(
                layout=layout,
                batch=1 if length == 32 else 3,
                query_len=length,
                num_q_heads=group * hkv,
                num_kv_heads=hkv,
                head_dim=d,
                page_size=p,
                topk=2 if big else 4,
                max_blocks=3 if big else 6,
                q_dtype=torch.float16 if layout == "float16" else torch.bfloat16,
                tensor_scales=n % 2 == 1,
                token_major=n % 3 == 0,
            )
        )
    return cases


@pytest.mark.parametrize("case", _matrix(), ids=str)
def test_reference_matches_naive_loop(case: Case, gen: torch.Generator) -> None:
    built = build(case, gen)
    out, lse = run(built)
    assert_close_to_naive(built, out, lse)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_queries_with_q_scale(layout: str, gen: torch.Generator) -> None:
    built = build(Case(layout=layout, q_dtype=torch.float8_e4m3fn, batch=3, query_len=2), gen)
    out, lse = run(built)
    assert out.dtype == torch.bfloat16
    assert_close_to_naive(built, out, lse)


def _with_ids(built_kwargs: dict, ids: torch.Tensor) -> dict:
    kw = dict(built_kwargs)
    kw["topk_indices"] = ids
    return kw


def test_padding_position_does_not_matter(gen: torch.Generator) -> None:
    """-1 at the front, middle or tail of a list gives the same result as the list without it."""
    built = build(Case(batch=3, query_len=2, topk=6, max_blocks=8), gen)
    seq_lens = torch.full((3,), 8 * 16, dtype=torch.int32)
    built.kwargs["seq_lens"] = seq_lens
    table = torch.randperm(3 * 8 + 2, generator=gen)[:24].view(3, 8).int()
    built.kwargs["block_table"] = table
    hkv, rows = 2, 6
    base = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(hkv * rows)])
    base = base.view(hkv, rows, 3).int()
    neg = torch.full((hkv, rows, 1), -1, dtype=torch.int32)
    variants = {
        "front": torch.cat([neg, neg, neg, base], dim=-1),
        "middle": torch.cat([base[..., :1], neg, neg, base[..., 1:], neg], dim=-1),
        "tail": torch.cat([base, neg, neg, neg], dim=-1),
    }
    results = {}
    for name, ids in variants.items():
        built.kwargs["topk_indices"] = ids
        out, lse = run(built)
        assert_close_to_naive(built, out, lse, where=name)
        results[name] = (out, lse)
    for name in ("middle", "tail"):
        assert torch.equal(results[name][0], results["front"][0])
        assert torch.allclose(results[name][1], results["front"][1], rtol=0, atol=1e-6)


def test_skipped_entries_equal_explicit_padding(gen: torch.Generator) -> None:
    """Ids past the visible blocks or past the table, ids with negative or out-of-cache pages and
    ids below -1 are skipped: replacing them by -1 changes nothing."""
    built = build(Case(batch=4, query_len=4, topk=5, max_blocks=7), gen)
    kw = built.kwargs
    out, lse = run(built)
    assert_close_to_naive(built, out, lse)
    ids = kw["topk_indices"].long()
    rows = torch.arange(ids.shape[1])
    n = (kw["seq_lens"].long()[rows // 4] - 4 + rows % 4 + 1).clamp(min=0)
    limit = ((n + 15) // 16).clamp(max=7).view(1, -1, 1)
    used = (ids >= 0) & (ids < limit)
    page = kw["block_table"].long()[(rows // 4).view(1, -1, 1), torch.where(used, ids, 0)]
    used &= (page >= 0) & (page < kw["kv_cache"].shape[0])
    assert (~used & (ids >= 0)).any(), "the case must contain skippable non-negative ids"
    built.kwargs["topk_indices"] = torch.where(used, ids, -1).int()
    out2, lse2 = run(built)
    assert torch.equal(out, out2)
    assert torch.equal(lse, lse2)


def test_empty_rows_are_zero_with_neg_inf_lse(gen: torch.Generator) -> None:
    built = build(Case(batch=4, query_len=3), gen)
    kw = built.kwargs
    kw["seq_lens"] = torch.tensor([0, 2, 40, 0], dtype=torch.int32)  # request 1: row 0 sees nothing
    ids = kw["topk_indices"].clone()
    ids[:, 6:9] = -1  # request 2: all -1
    kw["topk_indices"] = ids
    out, lse = run(built)
    assert_close_to_naive(built, out, lse)
    empty = [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]
    assert (out[empty] == 0).all()
    assert torch.isneginf(lse[empty]).all()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


def test_partly_visible_last_page(gen: torch.Generator) -> None:
    """Only the first n - j*P tokens of the last visible block count, for each query token."""
    built = build(Case(batch=1, query_len=4, topk=3, max_blocks=4), gen)
    kw = built.kwargs
    kw["seq_lens"] = torch.tensor([37], dtype=torch.int32)  # positions 33..36 -> block 2 partial
    kw["block_table"] = torch.tensor([[5, 1, 7, 3]], dtype=torch.int32)
    kw["topk_indices"] = torch.tensor([[0, 2, 1]], dtype=torch.int32).expand(2, 4, 3)
    out, lse = run(built)
    assert_close_to_naive(built, out, lse)
    diffs = (lse[1:] - lse[:-1]).abs()
    assert (diffs > 0).all(), "each later query token sees one more token"


def test_token_major_transpose_equals_head_major_copy(gen: torch.Generator) -> None:
    built = build(Case(batch=3, query_len=2, token_major=True), gen)
    ids = built.kwargs["topk_indices"]
    assert not ids.is_contiguous()
    out, lse = run(built)
    built.kwargs["topk_indices"] = ids.contiguous()
    out2, lse2 = run(built)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_out_and_lse_into_strided_views(gen: torch.Generator) -> None:
    built = build(Case(batch=2, query_len=2, num_q_heads=8, head_dim=64), gen)
    kw = dict(built.kwargs)
    rows = 4
    out_buf = torch.full((rows, 8, 96), float("nan"), dtype=torch.bfloat16)
    lse_buf = torch.full((rows, 11), float("nan"))
    out_view, lse_view = out_buf[:, :, 16:80], lse_buf[:, 2:10]
    assert not out_view.is_contiguous() and not lse_view.is_contiguous()
    result = msa.sparse_decode(**kw, out=out_view, lse=lse_view, backend="reference")
    assert isinstance(result, tuple)
    assert result[0].data_ptr() == out_view.data_ptr()
    assert_close_to_naive(built, out_view, lse_view)
    assert torch.isnan(out_buf[:, :, :16]).all() and torch.isnan(out_buf[:, :, 80:]).all()
    assert torch.isnan(lse_buf[:, :2]).all() and torch.isnan(lse_buf[:, 10:]).all()


def test_return_forms(gen: torch.Generator) -> None:
    built = build(Case(), gen)
    out = msa.sparse_decode(**built.kwargs)
    assert isinstance(out, torch.Tensor) and out.shape == built.kwargs["q"].shape
    pair = msa.sparse_decode(**built.kwargs, return_lse=True)
    assert isinstance(pair, tuple) and pair[1].dtype == torch.float32
    assert torch.equal(pair[0], out)
    ref_out, ref_lse = built.naive()
    np.testing.assert_allclose(pair[1].double().numpy(), ref_lse, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_on_cuda_matches_naive_loop(layout: str, gen: torch.Generator) -> None:
    built = build(Case(layout=layout, batch=4, query_len=4, num_q_heads=16, num_kv_heads=2), gen)
    kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in built.kwargs.items()}
    out, lse = msa.sparse_decode(**kw, return_lse=True, backend="reference")
    assert out.is_cuda
    assert_close_to_naive(built, out.cpu(), lse.cpu())
