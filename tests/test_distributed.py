"""msa.distributed on the CPU: sharding helpers, the exact combine, and multi-process gloo runs
(2 and 3 ranks spawned here) equal to the single-process msa.sparse_decode over the unsharded
cache. The spawned ranks run every scenario of tests/distributed_cases.py in one group each, to
pay process start-up once."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_cases import agreement_worker, spawn

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


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_combine_partials_reads_nan_or_inf_lse_as_empty(bad: float) -> None:
    """docs/distributed.md: an LSE of NaN or +inf is read as -inf (its rank contributes nothing)."""
    outs = torch.ones((2, 1, 1, 2))
    outs[1] = 7.0
    lses = torch.tensor([[[0.5]], [[bad]]])
    out, lse = dcp.combine_partials(outs, lses)
    assert torch.equal(out, torch.ones((1, 1, 2))) and lse.item() == 0.5


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "") in ("", "0"), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_combine_kernel_reads_nan_or_inf_lse_as_empty(bad: float) -> None:
    """The same in the Triton combine kernel: a row with one bad rank takes the other's; a row
    whose every rank is bad is empty (out 0, LSE -inf)."""
    from msa.distributed.combine import combine_into

    outs = torch.ones((2, 1, 2, 16), dtype=torch.bfloat16)
    outs[1] = 7.0
    lses = torch.tensor([[[0.5, bad]], [[bad, bad]]])
    out = torch.full((1, 2, 16), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((1, 2), float("nan"))
    combine_into(outs, lses, out, lse, kernel=True)
    assert torch.equal(out[0, 0].float(), torch.ones(16)) and lse[0, 0].item() == 0.5
    assert not out[0, 1].any() and lse[0, 1].item() == float("-inf")


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


def test_a_virtual_block_whose_pages_pass_int32_is_skipped_not_wrapped() -> None:
    """Virtual block v's pages are v * I + j; past int32 they would wrap onto real pages (attended)."""
    for w, i, v in ((1, 4, 2**30), (2, 3, 1431655766), (1, 2, 2**31 - 1)):
        virtual = torch.tensor([[0, v]], dtype=torch.int32)
        for r in range(w):
            table = dcp.rank_table_from_virtual(virtual, r, w, i)
            assert table[0, w * i:].eq(-1).all(), (w, i, v, table.tolist())
            assert table[0, :w * i].tolist() == [j % i if (j // i) % w == r else -1 for j in range(w * i)]


def test_huge_rotations_act_by_their_residue() -> None:
    """Only rotation % W picks a rank: any int (2**64 included) or int64 tensor works, and the
    count of owned blocks agrees with the tables (no int64 sum overflows)."""
    table = torch.arange(7, dtype=torch.int32).view(1, 7)
    for w, i in ((3, 1), (2, 2)):
        for rot in (2**64, 2**63 - 1, -(2**63), -5):
            residue = rot % w
            for r in range(w):
                want = dcp.rank_local_block_table(table, r, w, i, rotation=residue)
                assert torch.equal(dcp.rank_local_block_table(table, r, w, i, rotation=rot), want)
                if -(2**63) <= rot < 2**63:
                    tensor_rot = torch.tensor([rot], dtype=torch.int64)
                    assert torch.equal(dcp.rank_local_block_table(table, r, w, i, rotation=tensor_rot), want)
                    held = int(want.ne(-1).sum())
                    assert int(dcp.owned_block_count(torch.tensor([7]), r, w, i, tensor_rot)) == held
                assert dcp.owned_block_count(7, r, w, i, rot) == int(want.ne(-1).sum())
                assert dcp.block_owner(3, w, i, rot) == dcp.block_owner(3, w, i, residue)


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
    planner, as they do for `msa.DecodePlanner`, and the group's size is its dcp_size (a
    one-process gloo group)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        planner = dcp.DistributedDecodePlanner(msa.MINIMAX_M3, device="cpu", kv_form="separate",
                                               graph_capture=True, vector_aligned=False)
        local = planner.local
        assert (local.kv_form, local.graph_capture, local.vector_aligned) == ("separate", True, False)
        default = dcp.DistributedDecodePlanner(msa.MINIMAX_M3, device="cpu").local
        assert (default.kv_form, default.graph_capture, default.vector_aligned) == ("packed", False, True)
        assert default.dcp_size == 1
        # the group's size reaches the rank's kernel choice (a share of each selection: no dedup)
        import msa.distributed.planner as dplanner
        from msa.distributed.group import GroupInfo

        original = dplanner.group_info
        dplanner.group_info = lambda group: GroupInfo(group, 2, 0)  # type: ignore[assignment]
        try:
            two = dcp.DistributedDecodePlanner(msa.MINIMAX_M3, device="cpu").local
        finally:
            dplanner.group_info = original
        assert two.dcp_size == 2 and two._problem((64, 4, 16, None)).dcp_size == 2
    finally:
        dist.destroy_process_group()


def _agreement(case: str, seed: int, tmp_path: Path) -> None:
    """Run one group of `AGREEMENT_CASES` on 2 gloo ranks whose collectives time out in seconds."""
    results = spawn(2, tmp_path, seed, "cpu", ("reference",), timeout=150.0, target=agreement_worker,
                    extra=([case],))
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures)
    checks = [r["checks"] for r in results]
    assert min(checks) == max(checks) > 0, f"checks per rank: {checks}"


def test_an_error_on_one_rank_is_raised_on_every_rank(seed: int, tmp_path: Path) -> None:
    """A bad page on one rank (validate=True, one-shot and planner), an int64 block table on one
    rank, tables of different widths (validate=True), different rows / methods / validate between
    ranks: every rank raises MSAInputError naming the argument (and the rank where it was found),
    none waits in a collective; the group is still usable afterwards."""
    _agreement("local errors", seed, tmp_path)


def test_a_rank_may_ask_for_the_lse_alone(seed: int, tmp_path: Path) -> None:
    """Rank 1 asks for the LSE, rank 0 does not: rank 1's is the whole step's on every merge method,
    one-shot and planner."""
    _agreement("lse on some ranks", seed, tmp_path)


def test_steps_of_no_rows_merge_on_every_method(seed: int, tmp_path: Path) -> None:
    """B = 0 and a ragged step of 0 rows through every merge method and the planner (with and
    without validate), and merge_partials of T = 0 in bf16 / fp16 / fp32."""
    _agreement("zero rows", seed, tmp_path)


def test_validate_counts_only_used_blocks(seed: int, tmp_path: Path) -> None:
    """A padded request whose table row holds page 0 on every rank, and blocks past a row's
    length held everywhere, pass validate=True; a used block on two ranks or on none does not."""
    _agreement("coverage", seed, tmp_path)


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _small_step(seed: int, batch: int = 2) -> dict[str, Any]:
    g = msa.Geometry(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, topk=4)
    return make_decode_step(g, batch_size=batch, context_len=16 * 4, kv_cache_dtype="bfloat16", seed=seed).kwargs()


@pytest.mark.usefixtures("one_rank_group")
def test_outputs_must_not_overlap_each_other_or_inputs(seed: int) -> None:
    kw = _small_step(seed)
    rows, heads, dim = kw["q"].shape
    out = torch.empty((rows, heads, dim), dtype=torch.bfloat16)
    lse_in_out = out.view(-1)[: rows * heads * 2].view(torch.float32).view(rows, heads)
    for validate in (False, True):
        with pytest.raises(msa.MSAInputError, match="lse") as info:
            dcp.sparse_decode(**kw, out=out, lse=lse_in_out, backend="reference", validate=validate)
        assert info.value.argument == "lse"
    with pytest.raises(msa.MSAInputError) as info:
        dcp.sparse_decode(**kw, out=kw["q"], backend="reference")
    assert info.value.argument == "out"
    lse_in_q = kw["q"].view(-1)[: rows * heads * 2].view(torch.float32).view(rows, heads)
    with pytest.raises(msa.MSAInputError) as info:
        dcp.sparse_decode(**kw, lse=lse_in_q, backend="reference")
    assert info.value.argument == "lse"
    g = msa.Geometry(heads, kw["topk_indices"].shape[0], dim, 16, kw["topk_indices"].shape[2])
    planner = dcp.DistributedDecodePlanner(g, kv_cache_dtype="bfloat16", backend="reference", device="cpu")
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1)
    for validate in (False, True):
        with pytest.raises(msa.MSAInputError) as info:
            planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, lse=lse_in_out, validate=validate,
                        k_scale=kw["k_scale"], v_scale=kw["v_scale"])
        assert info.value.argument == "lse"
    ref = msa.sparse_decode(**kw, backend="reference")
    lse = torch.empty((rows, heads))
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, lse=lse, k_scale=kw["k_scale"],
                v_scale=kw["v_scale"])
    torch.testing.assert_close(out, ref)


@pytest.mark.usefixtures("one_rank_group")
def test_the_planner_checks_and_runs_in_one_atomic_step(seed: int) -> None:
    """A plan() from another thread while run() is between its plan check and its launch (or
    a run() while plan() refreshes) raises MSAInputError instead of letting run() launch
    metadata that thread refreshed."""
    kw, other = _small_step(seed), _small_step(seed + 1)
    rows, heads, dim = kw["q"].shape
    g = msa.Geometry(heads, kw["topk_indices"].shape[0], dim, 16, kw["topk_indices"].shape[2])
    planner = dcp.DistributedDecodePlanner(g, kv_cache_dtype="bfloat16", backend="reference", device="cpu")
    ref = msa.sparse_decode(**kw, backend="reference")
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1)
    scales = {"k_scale": kw["k_scale"], "v_scale": kw["v_scale"]}
    seen: list[BaseException | None] = []

    def in_thread(fn: Any) -> None:
        def target() -> None:
            try:
                fn()
                seen.append(None)
            except BaseException as exc:  # noqa: BLE001
                seen.append(exc)

        worker = threading.Thread(target=target)
        worker.start()
        worker.join(timeout=30)

    local_run = planner.local.run

    def run_after_a_plan_from_another_thread(*args: Any, **kwargs: Any) -> None:
        in_thread(lambda: planner.plan(other["block_table"], other["seq_lens"], decode_query_len=1))
        local_run(*args, **kwargs)

    planner.local.run = run_after_a_plan_from_another_thread  # type: ignore[method-assign]
    out = torch.full((rows, heads, dim), float("nan"), dtype=torch.bfloat16)
    try:
        planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, **scales)
    except msa.MSAInputError:
        pass  # refusing the run is fine; a wrong answer is not
    else:
        torch.testing.assert_close(out, ref)
    finally:
        del planner.local.run
    assert len(seen) == 1 and isinstance(seen[0], msa.MSAInputError), seen
    assert seen[0].argument == "DistributedDecodePlanner"
    # and the other way round: a run() while plan() is refreshing
    seen.clear()
    local_plan = planner.local.plan

    def plan_with_a_run_from_another_thread(*args: Any, **kwargs: Any) -> Any:
        in_thread(lambda: planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, **scales))
        return local_plan(*args, **kwargs)

    planner.local.plan = plan_with_a_run_from_another_thread  # type: ignore[method-assign]
    try:
        assert planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1) is plan
    finally:
        del planner.local.plan
    assert len(seen) == 1 and isinstance(seen[0], msa.MSAInputError), seen
    assert seen[0].argument == "DistributedDecodePlanner"
    out.fill_(float("nan"))
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, **scales)  # the planner is free again
    torch.testing.assert_close(out, ref)


def test_an_uninitialised_group_is_refused_by_name() -> None:
    """docs/distributed.md: without torch.distributed initialised (and no group given), every
    form raises MSAInputError naming `group`."""
    assert not dist.is_initialized()
    g = msa.Geometry(4, 2, 64, 16, 4)
    with pytest.raises(msa.MSAInputError) as caught:
        dcp.merge_partials(torch.zeros(2, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 4))
    assert caught.value.argument == "group"
    with pytest.raises(msa.MSAInputError) as caught:
        dcp.sparse_decode(**make_decode_step(g, batch_size=2, context_len=64, seed=0).kwargs())
    assert caught.value.argument == "group"
    with pytest.raises(msa.MSAInputError) as caught:
        dcp.DistributedDecodePlanner(g, device="cpu")
    assert caught.value.argument == "group"


def test_rank_slot_mapping_skips_what_the_rank_does_not_store() -> None:
    """rank_slot_mapping's docstring: -1 for tokens the rank does not store, negative positions,
    positions past the table, blocks whose table entry is negative (and requests outside it)."""
    table = torch.tensor([[3, -1, 5], [7, 8, 9]], dtype=torch.int32)
    request = torch.tensor([0, 0, 0, 0, 1, 1, 1, 5, -1])
    position = torch.tensor([-1, 16, 3, 48, 40, 33, 0, 0, 0])
    got = dcp.rank_slot_mapping(table, request, position, page_size=16, rank=0, world_size=1)
    assert got.dtype == torch.int64
    assert got.tolist() == [-1, -1, 3 * 16 + 3, -1, 9 * 16 + 8, 9 * 16 + 1, 7 * 16, -1, -1]
    rotated = dcp.rank_slot_mapping(table, torch.tensor([0, 0, 1, 1]), torch.tensor([0, 16, 0, 16]), page_size=16,
                                    rank=0, world_size=2, rotation=torch.tensor([1, 0]))
    assert rotated.tolist() == [-1, -1, 7 * 16, -1]  # request 0: block 0 on rank 1, block 1's entry -1


def test_shard_cache_gives_an_idle_rank_one_zero_page_keeps_pairs_and_copies_a_shared_page_once() -> None:
    """shard_cache's docstring: a rank that holds no page gets one zero page; a pair stays a pair;
    a page two requests share is copied once."""
    g = msa.Geometry(4, 2, 64, 16, 4)
    step = make_decode_step(g, batch_size=1, context_len=16, seed=0)  # one block: rank 1 of 2 holds none
    cache, table = dcp.shard_cache(step.layout, step.kv_cache, step.block_table, 1, 2)
    assert cache.shape[0] == 1 and not cache.any() and (table == -1).all()
    pair = step.layout.allocate(step.kv_cache.shape[0], 2, 16, 64, separate=True)
    for dst, src in zip(pair, step.layout.kv_views(step.kv_cache), strict=True):
        dst.copy_(src)
    shard, shard_table = dcp.shard_cache(step.layout, pair, step.block_table, 0, 2)
    assert isinstance(shard, tuple) and len(shard) == 2
    whole = msa.sparse_decode(**step.kwargs(), backend="reference")
    assert torch.equal(whole, msa.sparse_decode(**dict(step.kwargs(), kv_cache=shard, block_table=shard_table),
                                                backend="reference"))
    two = make_decode_step(g, batch_size=2, context_len=32, seed=0)
    shared = two.block_table.clone()
    shared[1] = shared[0]
    copied, local = dcp.shard_cache(two.layout, two.kv_cache, shared, 0, 1)
    assert copied.shape[0] == 2 and torch.equal(local[0], local[1])


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("validate", [False, True])
def test_a_distributed_plan_refuses_a_cache_of_another_layout(validate: bool) -> None:
    """A distributed planner of kv_cache_dtype 'auto' plans a bf16 query for a bfloat16 cache; an
    f16 cache run on that plan is refused by name with and without validate (the validated path
    ran it, so a validated warm-up passed where the plain step then failed)."""
    g = msa.Geometry(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, topk=4)
    kw = make_decode_step(g, batch_size=2, context_len=16 * 6, kv_cache_dtype="float16", seed=0).kwargs()
    q = kw["q"].to(torch.bfloat16)
    planner = dcp.DistributedDecodePlanner(g, backend="reference", device="cpu")
    plan = planner.plan(kw["block_table"], kw["seq_lens"], decode_query_len=1)
    assert plan.local.problem.kv_layout == "bfloat16"
    with pytest.raises(msa.MSAInputError, match=r"kv_cache: expected a bfloat16 cache, as planned, got a float16 cache"):
        planner.run(plan, q, kw["kv_cache"], kw["topk_indices"], out=torch.empty(q.shape, dtype=torch.bfloat16),
                    validate=validate)
