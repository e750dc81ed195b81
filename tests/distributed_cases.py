"""Scenarios for the decode-context-parallel tests, run inside every spawned rank.

Each rank rebuilds the same global step from the seed (a single-GPU cache, table and top-k
lists, with the malformed touches docs/semantics.md §3 says to skip), computes the single-process
`msa.sparse_decode` over it with the reference backend, takes its own share with
`msa.distributed.shard_cache`, and checks every distributed form against the single-process
result: `msa.distributed.sparse_decode` with every merge method (all heads and head-scattered),
and the planner form. Failures are collected, never raised, so the ranks keep making the same
collectives in the same order and the parent reports every failure of every rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cases import Case, build

import msa
import msa.distributed as dcp
from msa.workload import make_decode_step

#: Output tolerance: `OUT_RTOL * |ref| + OUT_ATOL + PARTIAL_RTOL * scale`, where `scale` is the
#: combination of the partials' magnitudes (sum_r w_r |out_r|): each rank's partial is rounded to
#: bf16 before the merge, so where partials cancel the error is an ulp of the partials, not of
#: the result. LSE: relative 1e-5.
OUT_RTOL, OUT_ATOL, PARTIAL_RTOL, LSE_RTOL = 2.0**-7, 2e-3, 2.0**-8, 1e-5
#: The Triton interpreter truncates fp32 -> bf16 where a GPU rounds to nearest even
#: (docs/architecture.md, "Known traps of the Triton interpreter": bf16 outputs compared under the
#: interpreter allow one bf16 ulp), so a bf16 output of the interpreted merge kernels gets one bf16
#: ulp of itself (at most 2^-7 |out|) on top of the bound above (docs/distributed.md §3).
INTERPRETER_BF16_ULP = 2.0**-7


@dataclass
class Scenario:
    name: str
    geometry: msa.Geometry
    layout: str = "bfloat16"
    batch: int = 3
    query_len: int = 1
    context: int = 160
    interleave: int = 1
    rotate: bool = False
    ragged: bool = False
    q_fp8: bool = False
    pair: bool = False  # a (k_cache, v_cache) pair instead of one packed tensor
    malformed: Case | None = None  # a tests/cases.py step instead of make_decode_step


SMALL = msa.Geometry(num_q_heads=12, num_kv_heads=2, head_dim=64, page_size=16, topk=4)
TP4_SMALL = msa.MINIMAX_M3_TP[4]  # 16/1 heads, D=128, P=128, K=16, with a small context

SCENARIOS = [
    Scenario("bf16 L1 touched", SMALL, "bfloat16", batch=3, context=16 * 10),
    Scenario("fp8 ragged L3 interleave2", SMALL, "fp8", batch=3, query_len=3, context=16 * 12, interleave=2, ragged=True),
    Scenario("nvfp4 L2 rotated", SMALL, "nvfp4", batch=2, query_len=2, context=16 * 9, rotate=True),
    Scenario("M3 TP4 fp8", TP4_SMALL, "fp8", batch=2, query_len=1, context=128 * 20 - 37),
    Scenario("bf16 fp8-q", SMALL, "bfloat16", batch=2, query_len=2, context=16 * 7, q_fp8=True),
    Scenario("fp8 (k, v) pair", SMALL, "fp8", batch=2, query_len=1, context=16 * 8, pair=True),
    Scenario("malformed bf16", SMALL, malformed=Case(layout="bfloat16", batch=3, query_len=2, num_q_heads=6,
                                                     num_kv_heads=2, tensor_scales=True, token_major=True)),
    Scenario("malformed nvfp4", SMALL, malformed=Case(layout="nvfp4", batch=3, query_len=1, num_q_heads=12,
                                                      num_kv_heads=2, head_dim=64)),
]


def _one_rank_row(token_major: torch.Tensor, visible: int, sc: Scenario, world_size: int, rotation: int) -> None:
    """Row 0 selects only blocks rank 0 holds: every other rank's share of it is empty."""
    p, k = sc.geometry.page_size, token_major.shape[-1]
    blocks = -(-visible // p)
    mine = [j for j in range(blocks) if dcp.block_owner(j, world_size, sc.interleave, rotation) == 0]
    row = torch.full((k,), -1, dtype=torch.int32)
    row[: min(k, len(mine))] = torch.tensor(mine[:k], dtype=torch.int32)
    token_major[0, :] = row


def build_global(sc: Scenario, seed: int, world_size: int, device: str) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The single-GPU step (kwargs of msa.sparse_decode) and the per-request rotation."""
    if sc.malformed is not None:
        gen = torch.Generator()
        gen.manual_seed(seed)
        kw = dict(build(sc.malformed, gen).kwargs)
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        return kw, None
    g = sc.geometry
    step = make_decode_step(
        g, batch_size=sc.batch, decode_query_len=sc.query_len, context_len=sc.context, kv_cache_dtype=sc.layout,
        q_dtype=torch.float8_e4m3fn if sc.q_fp8 else torch.bfloat16, seed=seed,
    )
    kw = step.kwargs()
    gen = torch.Generator()
    gen.manual_seed(seed + 1)
    token_major = step.topk_indices.transpose(0, 1).contiguous()  # [R, Hkv, K]
    drop = torch.rand(token_major.shape, generator=gen) < 0.15
    token_major[drop] = -1  # -1 anywhere in the lists
    rotation = torch.randint(0, world_size, (sc.batch,), generator=gen) if sc.rotate else None
    seq_lens = step.seq_lens.clone()
    _one_rank_row(token_major, int(seq_lens[0]) - sc.query_len + 1, sc, world_size,
                  int(rotation[0]) if rotation is not None else 0)
    if sc.batch >= 2:
        seq_lens[-1] = 0  # a padded request
    kw["seq_lens"] = seq_lens
    kw["topk_indices"] = token_major.transpose(0, 1)  # head-major view, as engines hold it
    if sc.q_fp8:
        kw["q_scale"] = 0.25
    if sc.pair:
        cache, d = kw["kv_cache"], g.head_dim
        kw["kv_cache"] = (cache[..., :d], cache[..., d:])  # [pages, Hkv, P, D] views, unit last stride
    if sc.ragged:
        counts = [sc.query_len, 1, max(sc.query_len - 1, 1)][: sc.batch]
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        kw["query_start_loc"] = torch.tensor(starts, dtype=torch.int32)  # rows past the last: padding
    kw = {k: _to(v, device) for k, v in kw.items()}
    return kw, (rotation.to(device) if rotation is not None else None)


def _to(value: Any, device: str) -> Any:
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value.to(device) if isinstance(value, torch.Tensor) else value


class Checker:
    """Collects comparison failures (never raises between collectives)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []
        self.checks = 0
        self.interpreted = False  # outputs from Triton kernels under TRITON_INTERPRET (truncating casts)

    def close(self, what: str, out: torch.Tensor, lse: torch.Tensor | None, ref_out: torch.Tensor,
              ref_lse: torch.Tensor, scale: torch.Tensor | None = None, partial_rtol: float = PARTIAL_RTOL) -> None:
        self.checks += 1
        got, ref = out.double().cpu(), ref_out.double().cpu()
        if got.shape != ref.shape:
            self.failures.append(f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}")
            return
        problems = []
        if not torch.isfinite(got).all():
            problems.append("non-finite output")
        bound = OUT_RTOL * ref.abs() + OUT_ATOL
        interpreted_bf16 = self.interpreted and out.dtype == torch.bfloat16
        if scale is not None:  # a truncating cast of the partials errs up to twice a rounding one
            bound = bound + partial_rtol * (2 if interpreted_bf16 else 1) * scale.double().cpu()
        if interpreted_bf16:
            bound = bound + INTERPRETER_BF16_ULP * got.abs()
        err = (got - ref).abs() - bound
        if err.numel() and err.max() > 0:
            at = tuple(int(i) for i in torch.nonzero(err == err.max())[0])
            problems.append(f"out differs at {at}: {got[at].item():.6g} vs {ref[at].item():.6g}")
        empty = torch.isneginf(ref_lse.double().cpu())
        if (got[empty] != 0).any():
            problems.append("rows empty on every rank are not exactly 0")
        if lse is not None:
            g_lse = lse.double().cpu()
            if torch.isnan(g_lse).any():
                problems.append("NaN LSE")
            if not torch.equal(torch.isneginf(g_lse), empty):
                problems.append("-inf LSE rows differ")
            else:
                r = ref_lse.double().cpu()[~empty]
                diff = (g_lse[~empty] - r).abs()
                if diff.numel() and (diff > LSE_RTOL * r.abs() + 1e-5).any():
                    problems.append(f"LSE differs by {diff.max().item():.3g}")
        if problems:
            self.failures.append(f"rank {self.rank}, {what}: " + "; ".join(problems))

    def raises(self, what: str, fn: Callable[[], object], argument: str | None) -> None:
        """`fn()` raises MSAInputError naming `argument` (any argument for None)."""
        self.checks += 1
        try:
            fn()
        except msa.MSAInputError as exc:
            if argument is not None and exc.argument != argument:
                self.failures.append(f"rank {self.rank}, {what}: MSAInputError names {exc.argument!r}, not {argument!r}")
            return
        except Exception as exc:  # noqa: BLE001
            self.failures.append(f"rank {self.rank}, {what}: raised {type(exc).__name__}: {exc}")
            return
        self.failures.append(f"rank {self.rank}, {what}: did not raise MSAInputError")


def run_scenario(sc: Scenario, seed: int, check: Checker, device: str, backends: tuple[str, ...],
                 planner_methods: bool = True) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    kw, rotation = build_global(sc, seed, world, device)
    ref_out, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
    layout = kw["kv_cache_dtype"]
    local_cache, local_table = dcp.shard_cache(layout, kw["kv_cache"], kw["block_table"], rank, world,
                                               sc.interleave, rotation=rotation)
    local = dict(kw, kv_cache=local_cache, block_table=local_table)
    heads = ref_out.shape[1]
    divisible = heads % world == 0
    chunk = heads // world
    mine = slice(rank * chunk, (rank + 1) * chunk)
    # the partials themselves: their pure combination must equal the single-process result,
    # and their magnitudes bound the rounding every merge inherits from them
    part, part_lse = msa.sparse_decode(**local, backend="reference", return_lse=True)
    outs = [torch.empty_like(part) for _ in range(world)]
    lses = [torch.empty_like(part_lse) for _ in range(world)]
    dist.all_gather(outs, part)
    dist.all_gather(lses, part_lse)
    combined, combined_lse = dcp.combine_partials(torch.stack(outs), torch.stack(lses))
    scale, _ = dcp.combine_partials(torch.stack(outs).abs(), torch.stack(lses))
    check.close(f"{sc.name} combine_partials of the gathered partials", combined, combined_lse, ref_out, ref_lse, scale)
    # the deep checks, with -1 read as "held by another rank", and the group's coverage
    if sc.malformed is None:
        out, lse = dcp.sparse_decode(**local, validate=True, return_lse=True, backend="reference")
        check.close(f"{sc.name} validate=True", out, lse, ref_out, ref_lse, scale)
        check.raises(f"{sc.name} validate=True with every block on every rank",
                     lambda: dcp.sparse_decode(**kw, validate=True, backend="reference"), "block_table")
    else:
        check.raises(f"{sc.name} validate=True on malformed input",
                     lambda: dcp.sparse_decode(**local, validate=True, backend="reference"), None)
    for backend in backends:
        tag = f"{sc.name} [{backend}]"
        for method in dcp.FULL_METHODS:
            if method == "all_to_all" and not divisible:
                check.raises(f"{tag} {method} with {heads} heads over {world}",
                             lambda m=method, b=backend: dcp.sparse_decode(**local, method=m, backend=b), "q / method")
                continue
            out, lse = dcp.sparse_decode(**local, method=method, return_lse=True, backend=backend)
            check.close(f"{tag} sparse_decode {method}", out, lse, ref_out, ref_lse, scale)
        for method in dcp.SCATTERED_METHODS:
            if not divisible:
                check.raises(f"{tag} scattered {method} with {heads} heads over {world}",
                             lambda m=method, b=backend: dcp.sparse_decode(**local, method=m, scatter_heads=True,
                                                                           backend=b),
                             "q / method")
                continue
            out, lse = dcp.sparse_decode(**local, method=method, scatter_heads=True, return_lse=True, backend=backend)
            check.close(f"{tag} scattered {method}", out, lse, ref_out[:, mine], ref_lse[:, mine], scale[:, mine])
        if divisible:  # a bf16 reduce-scatter, as vLLM does: one more rounding per rank
            out, lse = dcp.sparse_decode(**local, scatter_heads=True, reduce_dtype=torch.bfloat16, return_lse=True,
                                         backend=backend)
            check.close(f"{tag} scattered reduce_scatter in bf16", out, lse, ref_out[:, mine], ref_lse[:, mine],
                        scale[:, mine], partial_rtol=2.0**-9 * (2 + world))
        if planner_methods:
            run_planner(sc, local, ref_out, ref_lse, scale, check, backend, divisible, mine)


def run_planner(sc: Scenario, local: dict[str, Any], ref_out: torch.Tensor, ref_lse: torch.Tensor, scale: torch.Tensor,
                check: Checker, backend: str, divisible: bool, mine: slice) -> None:
    q = local["q"]
    geometry = msa.Geometry(q.shape[1], local["topk_indices"].shape[0], q.shape[2],
                            _page_size(local), local["topk_indices"].shape[2])
    forms = [("all_gather", False), ("all_to_all" if divisible else "all_reduce", False)]
    if divisible:
        forms.append(("reduce_scatter", True))
    qsl = local.get("query_start_loc")
    for method, scatter in forms:
        planner = dcp.DistributedDecodePlanner(
            geometry, method=method, scatter_heads=scatter, kv_cache_dtype=local["kv_cache_dtype"], backend=backend,
            device=q.device, q_dtype=q.dtype,
        )
        plan = planner.plan(local["block_table"], local["seq_lens"], decode_query_len=local["decode_query_len"],
                            query_start_loc=qsl, num_rows=q.shape[0] if qsl is not None else None)
        again = planner.plan(local["block_table"], local["seq_lens"], decode_query_len=local["decode_query_len"],
                             query_start_loc=qsl, num_rows=q.shape[0] if qsl is not None else None)
        check.checks += 1
        if again is not plan:
            check.failures.append(f"rank {dist.get_rank()}, {sc.name}: plan() for one shape returned two objects")
        heads = planner.out_heads
        out = torch.full((q.shape[0], heads, q.shape[2]), float("nan"), dtype=plan.exchange.dtype, device=q.device)
        lse = torch.full((q.shape[0], heads), float("nan"), device=q.device)
        planner.run(plan, q, local["kv_cache"], local["topk_indices"], out=out, lse=lse,
                    q_scale=local.get("q_scale", 1.0), k_scale=local["k_scale"], v_scale=local["v_scale"],
                    validate=sc.malformed is None and method == "all_gather")
        want = (ref_out[:, mine], ref_lse[:, mine], scale[:, mine]) if scatter else (ref_out, ref_lse, scale)
        check.close(f"{sc.name} [{backend}] planner {method}{' scattered' if scatter else ''}", out, lse, *want)


def _page_size(kw: dict[str, Any]) -> int:
    return int(msa.get_layout(kw["kv_cache_dtype"]).inspect(kw["kv_cache"]).page_size)


@contextlib.contextmanager
def rank_report(rank: int, result_dir: str) -> Iterator[dict[str, Any]]:
    """The result of one rank's worker: the body fills it; on leaving, the rank leaves the process
    group, and whatever the body raised is recorded as a failure; `rank{r}.json` is written
    either way (the parent reads it)."""
    result: dict[str, Any] = {"rank": rank, "failures": [], "checks": 0}
    try:
        yield result
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported by the parent
        result["failures"].append(f"rank {rank}: {traceback.format_exc()}")
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(result))


def worker(rank: int, world_size: int, init_file: str, seed: int, result_dir: str, device_kind: str,
           backends: tuple[str, ...], scenario_names: list[str] | None = None) -> None:
    """One rank: run every scenario, write `rank{r}.json` with the failures and the check count."""
    with rank_report(rank, result_dir) as result:
        if device_kind == "cuda":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
            dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=120), device_id=torch.device("cuda", rank))
        else:
            torch.set_num_threads(1)
            device = "cpu"
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=60))
        check = Checker(rank)
        for i, sc in enumerate(SCENARIOS):
            if scenario_names is not None and sc.name not in scenario_names:
                continue
            try:
                run_scenario(sc, seed + 1000 * i, check, device, backends)
            except Exception:  # noqa: BLE001 - reported by the parent
                check.failures.append(f"rank {rank}, {sc.name}: {traceback.format_exc()}")
        error_checks(check, device)
        if device == "cpu" and os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
            forced_kernel_pass(check, seed, device)
        result["failures"], result["checks"] = check.failures, check.checks


def forced_kernel_pass(check: Checker, seed: int, device: str) -> None:
    """Two scenarios again with the merge's Triton kernels (interpreted), as CUDA runs them (but
    for the interpreter's truncating bf16 casts: `INTERPRETER_BF16_ULP`)."""
    import dataclasses

    import msa.distributed.combine as combine

    saved = combine._use_kernel
    combine._use_kernel = lambda t, kernel: t.shape[-1] & (t.shape[-1] - 1) == 0
    check.interpreted = True
    try:
        for i, base in enumerate(SCENARIOS):
            if base.name in ("bf16 L1 touched", "malformed nvfp4"):
                sc = dataclasses.replace(base, name=base.name + " (Triton merge kernels)")
                run_scenario(sc, seed + 1000 * i, check, device, ("reference",))
    except Exception:  # noqa: BLE001
        check.failures.append(f"rank {check.rank}, Triton merge kernels: {traceback.format_exc()}")
    finally:
        combine._use_kernel = saved
        check.interpreted = False


def error_checks(check: Checker, device: str) -> None:
    """Argument errors, raised on every rank before any collective."""
    world = dist.get_world_size()
    out = torch.zeros((4, 8 * world + 1, 64), dtype=torch.bfloat16, device=device)
    lse = torch.zeros((4, 8 * world + 1), device=device)
    check.raises("merge_partials_scattered with heads % W != 0",
                 lambda: dcp.merge_partials_scattered(out, lse), "out")
    check.raises("merge_partials with lse of the wrong shape", lambda: dcp.merge_partials(out, lse[:, :3]), "lse")
    check.raises("merge_partials with an unknown method", lambda: dcp.merge_partials(out, lse, method="ring"), "method")
    odd = msa.Geometry(num_q_heads=8 * world + 2, num_kv_heads=2, head_dim=64, page_size=16, topk=4)
    if odd.num_q_heads % world:
        check.raises("DistributedDecodePlanner scattering heads % W != 0",
                     lambda: dcp.DistributedDecodePlanner(odd, scatter_heads=True, device=device), "geometry")
    check.raises("DistributedDecodePlanner with an unknown method",
                 lambda: dcp.DistributedDecodePlanner(odd, method="reduce_scatter", device=device), "method")
    good_out, good_lse = out[:, :8], lse[:, :8]
    merged, merged_lse = dcp.merge_partials(good_out, good_lse, validate=True)
    check.checks += 1
    if not (merged == 0).all():
        check.failures.append(f"rank {dist.get_rank()}: merging zeros with LSE 0 is not zero")
    # any head dim (odd: the packed LSEs start after padding), partials from anywhere, fp16
    gen = torch.Generator()
    gen.manual_seed(17 + dist.get_rank())
    part = torch.randn((5, 2 * world, 3), generator=gen).half().to(device)
    part_lse = (torch.randn((5, 2 * world), generator=gen) * 2).to(device)
    part_lse[dist.get_rank()] = float("-inf")  # this rank's share of one row is empty
    part_lse[world] = float("-inf")  # a row empty everywhere
    outs = [torch.empty_like(part) for _ in range(world)]
    lses = [torch.empty_like(part_lse) for _ in range(world)]
    dist.all_gather(outs, part)
    dist.all_gather(lses, part_lse)
    want, want_lse = dcp.combine_partials(torch.stack(outs), torch.stack(lses))
    rank = dist.get_rank()
    for method in dcp.FULL_METHODS:
        got, got_lse = dcp.merge_partials(part, part_lse, method=method)
        check.close(f"merge_partials {method}, D=3, fp16", got, got_lse, want.half(), want_lse)
    for method in dcp.SCATTERED_METHODS:
        got, got_lse = dcp.merge_partials_scattered(part, part_lse, method=method)
        mine = slice(2 * rank, 2 * rank + 2)
        check.close(f"merge_partials_scattered {method}, D=3, fp16", got, got_lse, want[:, mine].half(),
                    want_lse[:, mine])


def spawn(world_size: int, tmp_path: Path, seed: int, device_kind: str, backends: tuple[str, ...],
          timeout: float = 240.0, target: Callable[..., None] = worker, extra: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    """Run `target(rank, world_size, init_file, seed, result_dir, device_kind, backends, *extra)` on
    `world_size` spawned processes and return each rank's JSON result (a rank that died without
    writing one is reported with its exit code)."""
    import torch.multiprocessing as mp

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    init_file = tmp_path / "rendezvous"
    result_dir = tmp_path / "results"
    result_dir.mkdir(exist_ok=True)
    ctx = mp.start_processes(
        target, args=(world_size, str(init_file), seed, str(result_dir), device_kind, backends, *extra),
        nprocs=world_size, join=False, start_method="spawn",
    )
    import time

    deadline = time.monotonic() + timeout
    died: str | None = None
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                died = f"ranks still running after {timeout:.0f} s (a collective hung?)"
                break
    except Exception as exc:  # noqa: BLE001 - a rank raised outside its own handler
        died = f"{type(exc).__name__}: {exc}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for rank in range(world_size):
        path = result_dir / f"rank{rank}.json"
        if path.exists():
            results.append(json.loads(path.read_text()))
        else:
            results.append({"rank": rank, "checks": 0,
                            "failures": [f"rank {rank} wrote no result ({died or 'exit code ' + str(ctx.processes[rank].exitcode)})"]})
    return results


def partial_scale(local: dict[str, Any], rank_slice: slice | None = None) -> torch.Tensor:
    """sum_r w_r |out_r| over the group's partials of `local` (a collective): the magnitude whose
    bf16 rounding every merge inherits."""
    world = dist.get_world_size()
    part, part_lse = msa.sparse_decode(**local, backend="reference", return_lse=True)
    outs = [torch.empty_like(part) for _ in range(world)]
    lses = [torch.empty_like(part_lse) for _ in range(world)]
    dist.all_gather(outs, part)
    dist.all_gather(lses, part_lse)
    scale, _ = dcp.combine_partials(torch.stack(outs).abs(), torch.stack(lses))
    return scale if rank_slice is None else scale[:, rank_slice]


GRAPH_FORMS = [("all_gather", False), ("all_to_all", False), ("reduce_scatter", True), ("all_to_all", True)]


class GraphStep:
    """Static buffers of a captured step and a generator of new steps written into them in place."""

    def __init__(self, layout: str, seed: int, rank: int, world_size: int, device: torch.device) -> None:
        g = self.geometry = msa.MINIMAX_M3_TP[2]  # 32/2 heads, D=128, P=128, K=16
        self.batch, self.length, self.context = 6, 2, 128 * 40
        self.seed, self.rank, self.world_size = seed, rank, world_size
        step = make_decode_step(g, batch_size=self.batch, decode_query_len=self.length, context_len=self.context,
                                kv_cache_dtype=layout, device=device, seed=seed)
        self.layout, self.cache, self.k_scale, self.v_scale = layout, step.kv_cache, step.k_scale, step.v_scale
        self.num_pages, self.max_blocks = step.kv_cache.shape[0], step.block_table.shape[1]
        self.rows = self.batch * self.length
        self.q = torch.empty_like(step.q)
        self.topk = torch.empty((self.rows, g.num_kv_heads, g.topk), dtype=torch.int32, device=device)  # token-major
        self.seq_lens = torch.empty((self.batch,), dtype=torch.int32, device=device)
        self.table = torch.empty((self.batch, self.max_blocks), dtype=torch.int32, device=device)
        self.rotation = torch.zeros((self.batch,), dtype=torch.int64, device=device)
        self.local_table = torch.empty_like(self.table)

    def new_step(self, i: int) -> None:
        """Step `i`'s lengths, tables, rotations, lists and q, written in place (the same on every rank)."""
        from msa.workload import indexer_topk

        g, b = self.geometry, self.batch
        gen = torch.Generator()
        gen.manual_seed(self.seed * 7919 + i)
        lens = torch.randint(self.length, self.context + 1, (b,), generator=gen).int()
        lens[i % b] = 0  # a padded request, a different one each step
        self.seq_lens.copy_(lens)
        pages = torch.randperm(self.num_pages, generator=gen)[: b * self.max_blocks]
        self.table.copy_(pages.view(b, self.max_blocks))
        self.rotation.copy_(torch.randint(0, self.world_size, (b,), generator=gen))
        topk = indexer_topk(lens, decode_query_len=self.length, num_kv_heads=g.num_kv_heads, topk=g.topk,
                            page_size=g.page_size, max_blocks=self.max_blocks, generator=gen)
        self.topk.copy_(topk.transpose(0, 1))
        self.topk[0, 0, :2] = -1
        self.q.copy_(torch.randn(self.q.shape, generator=gen).to(self.q.dtype))
        dcp.rank_local_block_table(self.table, self.rank, self.world_size, rotation=self.rotation,
                                   out=self.local_table)

    def kwargs(self, table: torch.Tensor) -> dict[str, Any]:
        return dict(q=self.q, kv_cache=self.cache, topk_indices=self.topk.transpose(0, 1), block_table=table,
                    seq_lens=self.seq_lens, decode_query_len=self.length, kv_cache_dtype=self.layout,
                    k_scale=self.k_scale, v_scale=self.v_scale)


def check_graph(st: GraphStep, method: str, scatter: bool, steps: int, check: Checker) -> None:
    """Capture the planner form once, replay it over `steps` new steps, compare each replay."""
    rank, device, length = st.rank, st.q.device, st.length
    tag = f"graph {st.layout} {method}{' scattered' if scatter else ''}"
    planner = dcp.DistributedDecodePlanner(st.geometry, method=method, scatter_heads=scatter,
                                           kv_cache_dtype=st.layout, backend="triton", device=device)
    heads, dim = planner.out_heads, st.geometry.head_dim
    out = torch.full((st.rows, heads, dim), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((st.rows, heads), float("nan"), device=device)
    st.new_step(0)
    plan = planner.plan(st.local_table, st.seq_lens, decode_query_len=length)

    def run() -> None:
        planner.run(plan, st.q, st.cache, st.topk.transpose(0, 1), out=out, lse=lse, k_scale=st.k_scale,
                    v_scale=st.v_scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up: compilation, NCCL set-up
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    mine = slice(rank * heads, (rank + 1) * heads) if scatter else slice(None)
    for i in range(1, steps + 1):
        st.new_step(i)
        again = planner.plan(st.local_table, st.seq_lens, decode_query_len=length)
        check.checks += 1
        if again is not plan:
            check.failures.append(f"rank {rank}, {tag}: plan() returned another object at step {i}")
        out.fill_(float("nan"))
        graph.replay()
        ref_out, ref_lse = msa.sparse_decode(**st.kwargs(st.table), backend="reference", return_lse=True)
        scale = partial_scale(st.kwargs(st.local_table), mine)
        check.close(f"{tag} step {i}", out, lse, ref_out[:, mine], ref_lse[:, mine], scale)


def graph_worker(rank: int, world_size: int, init_file: str, seed: int, result_dir: str, device_kind: str,
                 backends: tuple[str, ...], steps: int = 20) -> None:
    """CUDA-graph capture of the planner form (NCCL), replayed over `steps` steps while seq_lens,
    the block tables, the rotation, the top-k lists and q change in place; every replay is
    compared with the single-process reference."""
    with rank_report(rank, result_dir) as result:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120), device_id=device)
        check = Checker(rank)
        for layout in ("fp8", "nvfp4"):
            st = GraphStep(layout, seed, rank, world_size, device)
            for method, scatter in GRAPH_FORMS:
                try:
                    check_graph(st, method, scatter, steps, check)
                except Exception:  # noqa: BLE001 - reported by the parent
                    check.failures.append(f"rank {rank}, graph {layout} {method}: {traceback.format_exc()}")
        result["failures"], result["checks"] = check.failures, check.checks


# -- rank-local errors, empty steps and coverage (spawned by tests/test_distributed.py) ------------

#: The process group's timeout in the worker below: a collective that hangs fails in seconds.
COLLECTIVE_TIMEOUT_S = 15.0
#: Where the cases below put their tensors ("cpu" with gloo, "cuda:<rank>" with NCCL).
CASE_DEVICE = {"device": "cpu"}


@dataclass
class Sharded:
    """A small global step, its reference result and this rank's share of it."""

    kw: dict[str, Any]
    local: dict[str, Any]
    ref_out: torch.Tensor
    ref_lse: torch.Tensor
    geometry: msa.Geometry


def sharded_step(seed: int, *, batch: int = 2, context: int = 16 * 6, seq_lens: list[int] | None = None) -> Sharded:
    """A bf16 step of SMALL (every rank builds the same one from `seed`) and this rank's share."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step = make_decode_step(SMALL, batch_size=batch, context_len=context, kv_cache_dtype="bfloat16", seed=seed)
    kw = step.kwargs()
    if seq_lens is not None:
        kw["seq_lens"] = torch.tensor(seq_lens, dtype=torch.int32)
    ref_out, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
    cache, table = dcp.shard_cache("bfloat16", kw["kv_cache"], kw["block_table"], rank, world)
    device = CASE_DEVICE["device"]
    local = _to(dict(kw, kv_cache=cache, block_table=table), device)
    return Sharded(_to(kw, device), local, ref_out.to(device), ref_lse.to(device), SMALL)


def _planner(sh: Sharded, method: str = "all_gather", scatter: bool = False) -> dcp.DistributedDecodePlanner:
    return dcp.DistributedDecodePlanner(sh.geometry, method=method, scatter_heads=scatter, kv_cache_dtype="bfloat16",
                                        backend="reference", device=CASE_DEVICE["device"])


def _planner_run(sh: Sharded, table: torch.Tensor, validate: bool, method: str = "all_gather",
                 scatter: bool = False, local: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    kw = local if local is not None else sh.local
    planner = _planner(sh, method, scatter)
    plan = planner.plan(table, kw["seq_lens"], decode_query_len=kw["decode_query_len"],
                        query_start_loc=kw.get("query_start_loc"),
                        num_rows=kw["q"].shape[0] if kw.get("query_start_loc") is not None else None)
    rows, dim = kw["q"].shape[0], kw["q"].shape[2]
    out = torch.full((rows, planner.out_heads, dim), float("nan"), dtype=torch.bfloat16, device=kw["q"].device)
    lse = torch.full((rows, planner.out_heads), float("nan"), device=kw["q"].device)
    planner.run(plan, kw["q"], kw["kv_cache"], kw["topk_indices"], out=out, lse=lse, k_scale=kw["k_scale"],
                v_scale=kw["v_scale"], validate=validate)
    return out, lse


def _expect_everywhere(check: Checker, what: str, fn: Callable[[], object], argument: str,
                       failing: int | None) -> None:
    """`fn()` raises MSAInputError naming `argument` on every rank; where `failing` is another
    rank, the message names it (the error was found there)."""
    check.checks += 1
    rank = dist.get_rank()
    try:
        fn()
    except msa.MSAInputError as exc:
        problems = []
        if exc.argument != argument:
            problems.append(f"names {exc.argument!r}, not {argument!r}")
        if failing is not None and failing != rank and f"rank {failing}" not in str(exc):
            problems.append(f"does not name rank {failing}: {exc}")
        if problems:
            check.failures.append(f"rank {rank}, {what}: MSAInputError " + "; ".join(problems))
        return
    except Exception as exc:  # noqa: BLE001 - a timed-out collective lands here
        check.failures.append(f"rank {rank}, {what}: raised {type(exc).__name__}: {exc}")
        return
    check.failures.append(f"rank {rank}, {what}: did not raise MSAInputError")


def _bad_pages(table: torch.Tensor, num_pages: int) -> torch.Tensor:
    """Every page this rank holds moved out of its cache (a data error only this rank has)."""
    return torch.where(table >= 0, torch.full_like(table, num_pages + 3), table)


def local_error_cases(check: Checker, seed: int) -> None:
    """Defect 5: an error on one rank is raised on every rank, before any other collective."""
    rank = dist.get_rank()
    sh = sharded_step(seed)
    local, table = sh.local, sh.local["block_table"]
    pages = local["kv_cache"].shape[0]
    bad = _bad_pages(table, pages) if rank == 1 else table
    _expect_everywhere(check, "bad page on rank 1, validate=True",
                       lambda: dcp.sparse_decode(**dict(local, block_table=bad), validate=True, backend="reference"),
                       "block_table", 1)
    _expect_everywhere(check, "bad page on rank 1, planner validate=True",
                       lambda: _planner_run(sh, bad, True), "block_table", 1)
    wide = table.long() if rank == 1 else table
    for validate in (False, True):
        _expect_everywhere(check, f"int64 block table on rank 1, validate={validate}",
                           lambda v=validate: dcp.sparse_decode(**dict(local, block_table=wide), validate=v,
                                                                backend="reference"),
                           "block_table", 1)
    wider = torch.cat([table, torch.full_like(table[:, :1], -1)], dim=1) if rank == 1 else table
    _expect_everywhere(check, "tables of different widths, validate=True",
                       lambda: dcp.sparse_decode(**dict(local, block_table=wider), validate=True, backend="reference"),
                       "block_table", None)
    _expect_everywhere(check, "tables of different widths, planner validate=True",
                       lambda: _planner_run(sh, wider, True), "block_table", None)
    # what the merge's buffers are shaped by, different on one rank: raised on every rank
    first = dict(local, q=local["q"][:1], topk_indices=local["topk_indices"][:, :1], block_table=table[:1],
                 seq_lens=local["seq_lens"][:1])
    _expect_everywhere(check, "a different row count on rank 1",
                       lambda: dcp.sparse_decode(**(first if rank == 1 else local), backend="reference"), "q", None)
    _expect_everywhere(check, "a different method on rank 1",
                       lambda: dcp.sparse_decode(**local, method="all_reduce" if rank == 1 else "all_gather",
                                                 backend="reference"), "method", None)
    _expect_everywhere(check, "validate on rank 1 only",
                       lambda: dcp.sparse_decode(**local, validate=rank == 1, backend="reference"), "validate", None)
    device = CASE_DEVICE["device"]
    part = torch.zeros((3 + rank, 4, 8), dtype=torch.bfloat16, device=device)
    _expect_everywhere(check, "merge_partials with a different row count on rank 1",
                       lambda: dcp.merge_partials(part, torch.zeros(part.shape[:2], device=device)), "out", None)
    odd = torch.zeros((3, 4, 8), dtype=torch.bfloat16, device=device)
    _expect_everywhere(check, "merge_partials with an lse of the wrong shape on rank 1",
                       lambda: dcp.merge_partials(odd, torch.zeros((3, 4 + rank), device=device)), "lse", 1)
    # the group is still in step: tables of different widths are fine without validate, and a
    # correct step after all those errors gives the right answer
    scale = partial_scale(local)
    out, lse = dcp.sparse_decode(**dict(local, block_table=wider), return_lse=True, backend="reference")
    check.close("tables of different widths without validate", out, lse, sh.ref_out, sh.ref_lse, scale)
    out, lse = dcp.sparse_decode(**local, validate=True, return_lse=True, backend="reference")
    check.close("a correct step after the errors", out, lse, sh.ref_out, sh.ref_lse, scale)


def _empty_like_step(local: dict[str, Any], rows: int, batch: int) -> dict[str, Any]:
    return dict(local, q=local["q"][:rows], topk_indices=local["topk_indices"][:, :rows],
                block_table=local["block_table"][:batch], seq_lens=local["seq_lens"][:batch])


def _check_empty(check: Checker, what: str, fn: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                 shape: tuple[int, int, int]) -> None:
    check.checks += 1
    try:
        out, lse = fn()
    except Exception as exc:  # noqa: BLE001
        check.failures.append(f"rank {dist.get_rank()}, {what}: raised {type(exc).__name__}: {exc}")
        return
    if tuple(out.shape) != shape or tuple(lse.shape) != shape[:2]:
        check.failures.append(f"rank {dist.get_rank()}, {what}: shapes {tuple(out.shape)}, {tuple(lse.shape)}")


def zero_row_cases(check: Checker, seed: int) -> None:
    """Defect 6: steps of no rows (B = 0, or a ragged step of no tokens) on every merge and the
    planner, and merge_partials of T = 0 in bf16."""
    world = dist.get_world_size()
    sh = sharded_step(seed)
    heads, dim = sh.ref_out.shape[1:]
    empty = _empty_like_step(sh.local, 0, 0)
    device = CASE_DEVICE["device"]
    ragged = dict(_empty_like_step(sh.local, 0, 2), query_start_loc=torch.zeros(3, dtype=torch.int32, device=device))
    for name, kw in (("B=0", empty), ("ragged, 0 rows of 2 requests", ragged)):
        for validate in (False, True):
            for method in dcp.FULL_METHODS:
                _check_empty(check, f"{name} sparse_decode {method} validate={validate}",
                             lambda m=method, k=kw, v=validate: dcp.sparse_decode(
                                 **k, method=m, return_lse=True, validate=v, backend="reference"),
                             (0, heads, dim))
            for method in dcp.SCATTERED_METHODS:
                _check_empty(check, f"{name} sparse_decode scattered {method} validate={validate}",
                             lambda m=method, k=kw, v=validate: dcp.sparse_decode(
                                 **k, method=m, scatter_heads=True, return_lse=True, validate=v, backend="reference"),
                             (0, heads // world, dim))
            for method, scatter in (("all_gather", False), ("all_to_all", False), ("all_reduce", False),
                                    ("reduce_scatter", True), ("all_to_all", True)):
                _check_empty(check, f"{name} planner {method}{' scattered' if scatter else ''} validate={validate}",
                             lambda m=method, s=scatter, k=kw, v=validate: _planner_run(
                                 sh, k["block_table"], v, m, s, local=k),
                             (0, heads // world if scatter else heads, dim))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        part = torch.zeros((0, 2 * world, 3), dtype=dtype, device=device)
        part_lse = torch.zeros((0, 2 * world), device=device)
        for method in dcp.FULL_METHODS:
            _check_empty(check, f"merge_partials T=0 {dtype} {method}",
                         lambda m=method, p=part, pl=part_lse: dcp.merge_partials(p, pl, method=m), (0, 2 * world, 3))
        for method in dcp.SCATTERED_METHODS:
            _check_empty(check, f"merge_partials_scattered T=0 {dtype} {method}",
                         lambda m=method, p=part, pl=part_lse: dcp.merge_partials_scattered(p, pl, method=m),
                         (0, 2, 3))


def coverage_cases(check: Checker, seed: int) -> None:
    """Defect 8: validate=True counts only the blocks rows use (selected and visible)."""
    world = dist.get_world_size()
    page = SMALL.page_size
    # request 0 sees 50 tokens (blocks 0..3); request 1 is padding (seq_lens 0)
    sh = sharded_step(seed, seq_lens=[50, 0])
    topk = sh.kw["topk_indices"].clone()
    topk[:, 0, :] = torch.tensor([0, 1, 3, 5], dtype=torch.int32, device=topk.device)  # 5: past row 0's reach
    kw = dict(sh.kw, topk_indices=topk)
    ref_out, ref_lse = msa.sparse_decode(**kw, backend="reference", return_lse=True)
    table = sh.local["block_table"].clone()
    table[1, :] = 0  # the padded request's row holds page 0 on every rank, as engines pad tables
    table[0, -(-50 // page):] = 0  # so do request 0's blocks past its length (block 5 among them)
    local = dict(sh.local, topk_indices=topk, block_table=table)
    scale = partial_scale(local)
    out, lse = dcp.sparse_decode(**local, validate=True, return_lse=True, backend="reference")
    check.close("padded request with page 0 on every rank, validate=True", out, lse, ref_out, ref_lse, scale)
    out, lse = _planner_run(sh, table, True, local=local)
    check.close("padded request with page 0 on every rank, planner validate=True", out, lse, ref_out, ref_lse, scale)
    # a used block held by two ranks, or by none, is still an error (on every rank)
    twice = table.clone()
    twice[0, 0] = 0  # block 0 (every list's first) held by every rank
    _expect_everywhere(check, "a used block on every rank",
                       lambda: dcp.sparse_decode(**dict(local, block_table=twice), validate=True, backend="reference"),
                       "block_table", None)
    if world > 1:
        none = table.clone()
        none[0, 0] = -1  # block 0 held by no rank
        _expect_everywhere(check, "a used block on no rank",
                           lambda: dcp.sparse_decode(**dict(local, block_table=none), validate=True,
                                                     backend="reference"),
                           "block_table", None)


def lse_on_some_ranks_cases(check: Checker, seed: int) -> None:
    """Whether a rank asks for the LSE is its own choice (not agreed on): rank 1 asks, rank 0 does
    not, and rank 1's LSE is the whole step's on every merge method, one-shot and planner (the
    all-heads all_to_all sent a head chunk's LSE only from ranks that asked: rank 1 read rank 0's
    unwritten buffer)."""
    sh = sharded_step(seed)
    wants = dist.get_rank() == 1
    scale = partial_scale(sh.local)
    for method in dcp.FULL_METHODS:
        got = dcp.sparse_decode(**sh.local, method=method, return_lse=wants, backend="reference")
        out, lse = got if isinstance(got, tuple) else (got, None)
        check.close(f"{method}, LSE asked on rank 1 only", out, lse, sh.ref_out, sh.ref_lse, scale)
        planner = _planner(sh, method)
        plan = planner.plan(sh.local["block_table"], sh.local["seq_lens"], decode_query_len=1)
        out = torch.full_like(sh.ref_out, float("nan"))
        lse = torch.full_like(sh.ref_lse, float("nan")) if wants else None
        planner.run(plan, sh.local["q"], sh.local["kv_cache"], sh.local["topk_indices"], out=out, lse=lse,
                    k_scale=sh.local["k_scale"], v_scale=sh.local["v_scale"])
        check.close(f"planner {method}, LSE asked on rank 1 only", out, lse, sh.ref_out, sh.ref_lse, scale)


AGREEMENT_CASES: dict[str, Callable[[Checker, int], None]] = {
    "local errors": local_error_cases,
    "zero rows": zero_row_cases,
    "coverage": coverage_cases,
    "lse on some ranks": lse_on_some_ranks_cases,
}


def agreement_worker(rank: int, world_size: int, init_file: str, seed: int, result_dir: str, device_kind: str,
                     backends: tuple[str, ...], cases: list[str]) -> None:
    """One rank of the `AGREEMENT_CASES` named, in a gloo (or, for device_kind "cuda", NCCL)
    group whose collectives time out after `COLLECTIVE_TIMEOUT_S` (a hang fails quickly instead
    of blocking the test)."""
    with rank_report(rank, result_dir) as result:
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if device_kind == "cuda":
            torch.cuda.set_device(rank)
            CASE_DEVICE["device"] = f"cuda:{rank}"
            dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                    timeout=timeout, device_id=torch.device("cuda", rank))
        else:
            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                    timeout=timeout)
        check = Checker(rank)
        for name in cases:
            try:
                AGREEMENT_CASES[name](check, seed)
            except Exception:  # noqa: BLE001 - reported by the parent
                check.failures.append(f"rank {rank}, {name}: {traceback.format_exc()}")
        result["failures"], result["checks"] = check.failures, check.checks
