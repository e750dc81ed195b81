"""msa.distributed on the CPU: sharding helpers, the exact combine, and multi-process gloo runs
(2 and 3 ranks spawned here) equal to the single-process msa.sparse_decode over the unsharded
cache. The spawned ranks run every scenario of tests/distributed_cases.py in one group each, to
pay process start-up once."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from distributed_cases import spawn

import msa
import msa.distributed as dcp
from msa.workload import make_decode_step

# -- combine_partials: the rule, without processes ------------------------------------------------


def _float64_combine(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    o, lv = outs.double(), lses.double()
    w_count, t_count, h_count = lv.shape
    out = torch.zeros(o.shape[1:], dtype=torch.float64)
    lse = torch.full((t_count, h_count), -math.inf, dtype=torch.float64)
    for t in range(t_count):
        for h in range(h_count):
            finite = [w for w in range(w_count) if math.isfinite(lv[w, t, h])]
            if not finite:
                continue
            total = sum(math.exp(lv[w, t, h]) for w in finite)
            lse[t, h] = math.log(total)
            for w in finite:
                out[t, h] += math.exp(lv[w, t, h]) / total * o[w, t, h]
    return out, lse


def test_combine_partials_is_exact(gen: torch.Generator) -> None:
    outs = torch.randn((3, 5, 4, 8), generator=gen)
    lses = torch.randn((3, 5, 4), generator=gen) * 4
    lses[0, 1] = -math.inf  # rank 0 has nothing of row 1
    lses[:, 2, 1] = -math.inf  # row 2, head 1: nothing anywhere
    outs[0, 1] = float("nan")  # an empty share's output is never read
    out, lse = dcp.combine_partials(outs, lses)
    ref_out, ref_lse = _float64_combine(torch.nan_to_num(outs), lses)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    assert (out[2, 1] == 0).all() and lse[2, 1] == -math.inf


def test_combine_partials_empty_everywhere_and_large_lses() -> None:
    outs = torch.full((2, 1, 2, 4), float("nan"))
    lses = torch.full((2, 1, 2), -math.inf)
    lses[:, 0, 1] = torch.tensor([1e4, 1e4 - 1.0])  # large LSEs: no overflow around the max
    outs[:, 0, 1] = torch.tensor([[1.0], [3.0]])
    out, lse = dcp.combine_partials(outs, lses)
    assert (out[0, 0] == 0).all() and lse[0, 0] == -math.inf
    w0 = 1 / (1 + math.exp(-1.0))
    torch.testing.assert_close(out[0, 1], torch.full((4,), w0 * 1 + (1 - w0) * 3))
    torch.testing.assert_close(lse[0, 1], torch.tensor(1e4 + math.log1p(math.exp(-1.0))))


def test_combine_partials_one_rank_contributes_nothing(gen: torch.Generator) -> None:
    outs = torch.randn((2, 3, 2, 4), generator=gen)
    lses = torch.randn((2, 3, 2), generator=gen)
    lses[1] = -math.inf
    outs[1] = float("inf")
    out, lse = dcp.combine_partials(outs, lses)
    torch.testing.assert_close(out, outs[0])
    torch.testing.assert_close(lse, lses[0])


def test_combine_partials_reads_nan_lse_as_empty() -> None:
    outs = torch.ones((2, 1, 1, 2))
    lses = torch.tensor([[[0.5]], [[float("nan")]]])
    out, lse = dcp.combine_partials(outs, lses)
    assert torch.equal(out, torch.ones((1, 1, 2))) and lse.item() == 0.5


def test_combine_partials_rejects_mismatched_shapes() -> None:
    with pytest.raises(msa.MSAInputError, match="lses"):
        dcp.combine_partials(torch.zeros((2, 3, 4, 8)), torch.zeros((2, 3, 5)))


triton_cpu = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "") in ("", "0") and not torch.cuda.is_available(),
    reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1",
)


@triton_cpu
def test_triton_combine_and_correct_match_torch(gen: torch.Generator) -> None:
    from msa.distributed.combine import combine_into, correct_into, correction_weights

    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, t, h, d = 3, 4, 20, 64  # 20 heads: a partial head block
    outs = torch.randn((w, t, h, d), generator=gen).to(torch.bfloat16).to(device)
    lses = (torch.randn((w, t, h), generator=gen) * 3).to(device)
    lses[1, 0] = -math.inf
    lses[:, 2, 3] = -math.inf
    outs[1, 0] = float("nan")
    ref_out, ref_lse = dcp.combine_partials(outs, lses)
    got = torch.full((t, h + 4, d), float("nan"), dtype=torch.bfloat16, device=device)[:, 2 : 2 + h]  # strided
    got_lse = torch.full((t, h), float("nan"), device=device)
    combine_into(outs, lses, got, got_lse, kernel=True)
    torch.testing.assert_close(got.float(), ref_out.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(got_lse, ref_lse, rtol=1e-6, atol=1e-6)
    # correction for a reduce-scatter: head chunks laid out rank by rank
    weights, glse = correction_weights(lses)
    for rank in range(w):
        part = outs[rank]
        chunk = h // 4
        dst = torch.empty((4, t, chunk, d), dtype=torch.float32, device=device)
        lse_mine = torch.empty((t, chunk), device=device)
        correct_into(part, lses, rank, dst.permute(1, 0, 2, 3), lse_mine, head_lo=chunk, kernel=True)
        want = torch.where(weights[rank, ..., None] > 0, weights[rank, ..., None] * part.float(), 0.0)
        torch.testing.assert_close(dst.permute(1, 0, 2, 3).reshape(t, h, d), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse_mine, glse[:, chunk : 2 * chunk])
        assert not torch.isnan(dst).any()


# -- placement -----------------------------------------------------------------------------------


def test_block_owner_and_counts() -> None:
    assert [dcp.block_owner(j, 2) for j in range(5)] == [0, 1, 0, 1, 0]
    assert [dcp.block_owner(j, 3, 2) for j in range(7)] == [0, 0, 1, 1, 2, 2, 0]
    assert [dcp.block_owner(j, 2, 1, rotation=1) for j in range(3)] == [1, 0, 1]
    for w, i, rot in ((2, 1, 0), (3, 2, 1), (4, 3, 2)):
        for n in range(0, 40):
            for r in range(w):
                want = sum(1 for j in range(n) if dcp.block_owner(j, w, i, rot) == r)
                assert dcp.owned_block_count(n, r, w, i, rot) == want
                assert int(dcp.owned_block_count(torch.tensor(n), r, w, i, rot)) == want


def test_rank_local_tables_partition_the_global_table(gen: torch.Generator) -> None:
    table = torch.randint(-1, 50, (4, 9), generator=gen, dtype=torch.int32)
    rotation = torch.tensor([0, 1, 2, 1])
    locals_ = [dcp.rank_local_block_table(table, r, 3, 2, rotation=rotation) for r in range(3)]
    held = torch.stack([t != -1 for t in locals_]).sum(0)
    assert (held <= 1).all() and torch.equal(held == 1, table != -1)
    merged = torch.stack(locals_).max(0).values
    assert torch.equal(merged, table)
    out = torch.empty_like(table)
    assert dcp.rank_local_block_table(table, 1, 3, 2, rotation=rotation, out=out) is out
    assert torch.equal(out, locals_[1])
    with pytest.raises(msa.MSAInputError, match="rank"):
        dcp.rank_local_block_table(table, 3, 3)
    with pytest.raises(msa.MSAInputError, match="rotation"):
        dcp.rank_local_block_table(table, 0, 3, rotation=torch.zeros(3, dtype=torch.int64))


def test_rank_table_from_virtual() -> None:
    virtual = torch.tensor([[5, -1, 2]], dtype=torch.int32)  # 3 virtual blocks of W*I = 4 blocks
    w, i = 2, 2
    tables = [dcp.rank_table_from_virtual(virtual, r, w, i, max_blocks=11) for r in range(w)]
    assert tables[0].tolist() == [[10, 11, -1, -1, -1, -1, -1, -1, 4, 5, -1]]
    assert tables[1].tolist() == [[-1, -1, 10, 11, -1, -1, -1, -1, -1, -1, 4]]
    rotated = [dcp.rank_table_from_virtual(virtual, r, w, i, max_blocks=11, rotation=torch.tensor([1]))
               for r in range(w)]
    assert rotated[0].tolist() == tables[1].tolist() and rotated[1].tolist() == tables[0].tolist()


def test_slot_mapping_writes_exactly_the_rank_share(gen: torch.Generator) -> None:
    """Writing every token through each rank's slot mapping builds the shards shard_cache cuts."""
    g = msa.Geometry(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, topk=4)
    step = make_decode_step(g, batch_size=3, context_len=16 * 6, kv_cache_dtype="bfloat16", seed=int(gen.seed() % 2**31))
    layout, world, inter = step.layout, 2, 1
    full = layout.dequantize(step.kv_cache, k_scale=step.k_scale, v_scale=step.v_scale)
    b_count, mb = step.block_table.shape
    req = torch.arange(b_count).repeat_interleave(mb * 16)
    pos = torch.arange(mb * 16).repeat(b_count)
    for rank in range(world):
        local_table = dcp.rank_local_block_table(step.block_table, rank, world, inter)
        slots = dcp.rank_slot_mapping(local_table, req, pos, page_size=16, rank=rank, world_size=world)
        again = dcp.rank_slot_mapping(step.block_table, req, pos, page_size=16, rank=rank, world_size=world)
        assert torch.equal(slots, again)  # the global table gives the same slots
        owned = (pos // 16) % world == rank
        assert ((slots >= 0) == owned).all()
        cache = layout.allocate(step.kv_cache.shape[0], 2, 16, 64)
        page, off = step.block_table.long()[req, pos // 16], pos % 16
        key = full[0][page, :, off].to(torch.bfloat16)
        value = full[1][page, :, off].to(torch.bfloat16)
        layout.write(cache, key, value, slots)
        mine = torch.unique(local_table[local_table >= 0].long())
        assert torch.equal(cache[mine], step.kv_cache[mine])
        others = torch.ones(cache.shape[0], dtype=torch.bool)
        others[mine] = False
        assert (cache[others] == 0).all()
    with pytest.raises(msa.MSAInputError, match="positions"):
        dcp.rank_slot_mapping(step.block_table, req, pos[:-1], page_size=16, rank=0, world_size=2)


def test_shard_cache_compacts_and_a_single_rank_equals_the_whole(seed: int) -> None:
    g = msa.Geometry(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, topk=4)
    step = make_decode_step(g, batch_size=2, decode_query_len=2, context_len=16 * 5, kv_cache_dtype="nvfp4", seed=seed)
    kw = step.kwargs()
    ref_out, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
    one_cache, one_table = dcp.shard_cache(step.layout, step.kv_cache, step.block_table, 0, 1)
    out, lse = msa.sparse_decode(**dict(kw, kv_cache=one_cache, block_table=one_table), backend="reference",
                                 return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    sizes = []
    for rank in range(3):
        cache, table = dcp.shard_cache("nvfp4", step.kv_cache, step.block_table, rank, 3)
        sizes.append(cache.shape[0])
        assert (table[:, [j for j in range(table.shape[1]) if j % 3 != rank]] == -1).all()
        assert int(table.max()) == cache.shape[0] - 1
    assert sum(sizes) == step.block_table.numel()


# -- multi-process runs (gloo) ------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_ranks_equal_single_process(world_size: int, seed: int, tmp_path: Path) -> None:
    results = spawn(world_size, tmp_path, seed, "cpu", ("reference",), timeout=180.0)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} failure(s) over {world_size} ranks:\n" + "\n".join(failures)
    checks = [r["checks"] for r in results]
    assert min(checks) == max(checks) > 50, f"checks per rank: {checks}"


def test_the_planners_options_reach_the_ranks_planner(tmp_path: Path) -> None:
    """kv_form, graph_capture and vector_aligned steer the backend choice of each rank's own
    planner, as they do for `msa.DecodePlanner` (a one-process gloo group)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        planner = dcp.DistributedDecodePlanner(msa.MINIMAX_M3, device="cpu", kv_form="separate",
                                               graph_capture=True, vector_aligned=False)
        local = planner.local
        assert (local.kv_form, local.graph_capture, local.vector_aligned) == ("separate", True, False)
        default = dcp.DistributedDecodePlanner(msa.MINIMAX_M3, device="cpu").local
        assert (default.kv_form, default.graph_capture, default.vector_aligned) == ("packed", False, True)
    finally:
        dist.destroy_process_group()
