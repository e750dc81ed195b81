"""The step generator used by the demo and the benchmarks."""

from __future__ import annotations

import attrs
import torch

import msa
from msa.workload import indexer_topk, make_decode_step


def test_indexer_topk_shape_and_rules(gen: torch.Generator) -> None:
    seq_lens = torch.tensor([0, 5, 130, 1000, 4000], dtype=torch.int32)
    ids = indexer_topk(
        seq_lens, decode_query_len=3, num_kv_heads=2, topk=8, page_size=128, max_blocks=32, generator=gen
    )
    assert ids.shape == (2, 15, 8) and ids.dtype == torch.int32
    assert ids.stride() == (8, 16, 1), "a head-major view of a token-major buffer"
    for r in range(15):
        b, i = divmod(r, 3)
        n = max(int(seq_lens[b]) - 3 + i + 1, 0)
        blocks = -(-n // 128)
        for h in range(2):
            row = [int(x) for x in ids[h, r]]
            chosen = [x for x in row if x >= 0]
            assert len(chosen) == len(set(chosen)) == min(8, blocks)
            assert all(0 <= x < blocks for x in chosen)
            if blocks:
                assert 0 in chosen and blocks - 1 in chosen
            assert row[len(chosen):] == [-1] * (8 - len(chosen)), "padding at the tail"


def test_make_decode_step_is_valid_and_runs() -> None:
    geometry = msa.MINIMAX_M3.tensor_parallel(8)
    step = make_decode_step(geometry, batch_size=3, decode_query_len=2, context_len=500, kv_cache_dtype="nvfp4", seed=7)
    assert step.batch_size == 3
    assert (step.seq_lens > 500 - 128).all() and (step.seq_lens <= 500).all()
    out = msa.sparse_decode(**step.kwargs(), validate=True)
    assert isinstance(out, torch.Tensor) and torch.isfinite(out).all() and out.abs().sum() > 0
    again = make_decode_step(geometry, batch_size=3, decode_query_len=2, context_len=500, kv_cache_dtype="nvfp4", seed=7)
    assert torch.equal(again.kv_cache, step.kv_cache) and torch.equal(again.q, step.q)


def test_a_context_shorter_than_the_query_tokens_gives_a_valid_step() -> None:
    """Every request holds at least its L new tokens, so the table holds them too (it was sized
    from the context alone: 32 tokens against a 16-token table, refused by validate=True)."""
    step = make_decode_step(msa.Geometry(4, 1, 64, 16, 4), batch_size=2, decode_query_len=32, context_len=8, seed=0)
    assert (step.seq_lens == 32).all() and step.block_table.shape[1] * 16 >= 32
    msa.sparse_decode(**step.kwargs(), validate=True)


def test_a_steps_oracle_is_what_the_reference_computes() -> None:
    """`DecodeStep.oracle` passes the step's cache, lists and scales: the reference's output and LSE
    of the same step agree with it to the reference's own rounding (float32 over a quantised cache)."""
    geometry = msa.MINIMAX_M3.tensor_parallel(8)
    for dtype in ("fp8_e4m3", "nvfp4"):
        made = make_decode_step(geometry, batch_size=2, decode_query_len=2, context_len=700, kv_cache_dtype=dtype,
                                seed=11)
        step = attrs.evolve(made, v_scale=made.v_scale * 3)  # (the generator writes k_scale == v_scale)
        out, lse = step.oracle()
        assert out.dtype == lse.dtype == torch.float64 and out.shape == step.q.shape
        ref_out, ref_lse = msa.sparse_decode(**step.kwargs(), backend="reference", return_lse=True)
        assert (ref_out.double() - out).abs().max().item() <= 2e-2 * out.abs().max().item(), dtype
        assert (ref_lse.double() - lse).abs().max().item() <= 1e-3, dtype
