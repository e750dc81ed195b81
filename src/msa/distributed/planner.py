"""CUDA-graph-stable distributed decode: plan every step, capture `run` once per batch size.

    planner = DistributedDecodePlanner(msa.MINIMAX_M3, group=dcp_group, kv_cache_dtype="fp8", device="cuda")
    plan = planner.plan(local_block_table, seq_lens, decode_query_len=L)   # every step, outside capture
    planner.run(plan, q, local_cache, topk_indices, out=out, k_scale=k, v_scale=v)  # capturable

`plan` delegates to an internal `msa.DecodePlanner` (created with `with_lse=True`) and attaches
the step shape's `Exchange`: the buffers the local partial is written into and every
communication buffer, allocated once per shape. `run` decodes into those buffers, runs the
collectives into preallocated tensors (`all_gather_into_tensor` / `all_to_all_single` /
`reduce_scatter_tensor` / `all_reduce` with their output tensors given) and combines into the
caller's `out` / `lse` with one kernel. It allocates nothing, never synchronises with the host
and never copies device data to the host, so with NCCL it can be captured in a CUDA graph.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import torch

from msa.distributed.agreement import Fact, agree, dtype_code, name_code
from msa.distributed.checks import check_coverage, check_outputs_apart, run_checked, shard_usage
from msa.distributed.exchange import METHODS, Exchange, check_method
from msa.distributed.group import GroupInfo, ProcessGroup, group_info
from msa.errors import MSAInputError, check_flag
from msa.layouts import KVCache
from msa.planner import DecodePlan, DecodePlanner, PlanKey
from msa.planner.guard import thread_token
from msa.planner.runs import check_planned_layout
from msa.planning import PlanCache
from msa.platform import Platform
from msa.policy import SelectionPolicy
from msa.problem import Geometry
from msa.scales import Scale
from msa.validation import check_decode_inputs, output_dtype, validation_requested

__all__ = ["DistributedDecodePlan", "DistributedDecodePlanner"]


@attrs.define(eq=False)
class DistributedDecodePlan:
    """A planned step shape on one rank: the local plan and the exchange that merges it.

    Attributes:
        local: the internal `msa.DecodePlan` (rank-local table, LSE on).
        exchange: the buffers and collectives of the merge.
    """

    local: DecodePlan
    exchange: Exchange
    owner: object = attrs.field(repr=False)
    retired: bool = False

    @property
    def key(self) -> PlanKey:
        return self.local.key

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every device buffer a captured graph depends on (local plan and exchange)."""
        found = {f"local.{k}": v for k, v in self.local.buffers().items()}
        found.update({f"exchange.{k}": v for k, v in self.exchange.buffers().items()})
        return found


def _inputs(plan: DistributedDecodePlan, q: object, kv_cache: object, topk_indices: object, sm_scale: object,
            q_scale: object, k_scale: object, v_scale: object) -> tuple[tuple[str, object], ...]:
    """Everything a run reads, by name (for `check_outputs_apart`)."""
    tables = plan.local.tables
    return (("q", q), ("kv_cache", kv_cache), ("topk_indices", topk_indices), ("block_table", tables.block_table),
            ("seq_lens", tables.seq_lens), ("query_start_loc", tables.query_start_loc), ("sm_scale", sm_scale),
            ("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale))


class DistributedDecodePlanner:
    """Plans and runs decode steps over a KV cache spread across a process group.

    Args:
        geometry: heads, head dim, page size, top-k of this rank (the whole DCP group's query
            heads when scattering heads).
        group: the process group (None: the default group). Its size `W` and this rank are read
            once, here.
        method: how to merge (see `msa.distributed.merge_partials`): default "all_gather", or
            "reduce_scatter" with `scatter_heads`.
        scatter_heads: each rank keeps its `Hq / W` heads (`out` `[B*L, Hq/W, D]`).
        reduce_dtype: dtype of the summed partials for "reduce_scatter" / "all_reduce" (default
            fp32; bf16/fp16 halve those bytes at one rounding per rank).
        kv_cache_dtype, backend, device, q_dtype, max_plans, platform, policy, kv_form,
            graph_capture, vector_aligned: as for `msa.DecodePlanner` (the internal planner
            always returns the LSE).

    Every rank makes the same calls in the same order: `run` is a collective.
    """

    def __init__(
        self,
        geometry: Geometry,
        *,
        group: ProcessGroup | None = None,
        method: str | None = None,
        scatter_heads: bool = False,
        reduce_dtype: torch.dtype | None = None,
        kv_cache_dtype: str = "auto",
        backend: str = "auto",
        device: torch.device | str | None = None,
        q_dtype: torch.dtype = torch.bfloat16,
        max_plans: int = 128,
        platform: Platform | None = None,
        policy: SelectionPolicy | None = None,
        kv_form: str = "packed",
        graph_capture: bool = False,
        vector_aligned: bool = True,
    ) -> None:
        check_flag("scatter_heads", scatter_heads)
        self.method = check_method(
            method if method is not None else ("reduce_scatter" if scatter_heads else "all_gather"), scatter_heads
        )
        self.info: GroupInfo = group_info(group)
        self.local = DecodePlanner(  # a rank holds ~1/W of each selection: the kernel choice knows it
            geometry, kv_cache_dtype=kv_cache_dtype, backend=backend, device=device, q_dtype=q_dtype,
            with_lse=True, max_plans=max_plans, platform=platform, policy=policy, kv_form=kv_form,
            graph_capture=graph_capture, vector_aligned=vector_aligned, dcp_size=self.info.world_size,
        )
        w = self.info.world_size
        if (scatter_heads or self.method == "all_to_all") and geometry.num_q_heads % w:
            raise MSAInputError(
                "geometry", f"num_q_heads divisible by the group size {w} (method {self.method!r}, "
                f"scatter_heads={scatter_heads})", geometry.num_q_heads,
            )
        self.geometry = geometry
        self.scatter_heads = scatter_heads
        self.reduce_dtype = reduce_dtype
        self.out_heads = geometry.num_q_heads // w if scatter_heads else geometry.num_q_heads
        self.plans: PlanCache[PlanKey, DistributedDecodePlan] = PlanCache(max_plans)
        self._token = object()
        self._busy = threading.Lock()

    def __repr__(self) -> str:
        form = "scattered heads" if self.scatter_heads else "all heads"
        return f"DistributedDecodePlanner({self.method}, {form}, {self.info}, {self.local!r})"

    @property
    def device(self) -> torch.device:
        return self.local.device

    def plan(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        decode_query_len: int,
        seq_lens_cpu: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
        num_rows: int | None = None,
    ) -> DistributedDecodePlan:
        """The plan for this step's shape (see `msa.DecodePlanner.plan`), with `block_table`
        this rank's table. Call outside graph capture, every step; the same shape returns the
        same object, refreshed in place. Not a collective.

        Raises:
            MSAInputError: a bad argument, or a call while another thread uses this planner
                (`plan`, `run` and `clear` are one atomic step each: a planner serves one thread).
        """
        with self._exclusive():
            return self._plan(block_table, seq_lens, decode_query_len, seq_lens_cpu, query_start_loc, num_rows)

    def _plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, decode_query_len: int,
              seq_lens_cpu: torch.Tensor | None, query_start_loc: torch.Tensor | None,
              num_rows: int | None) -> DistributedDecodePlan:
        local = self.local.plan(
            block_table, seq_lens, decode_query_len=decode_query_len, seq_lens_cpu=seq_lens_cpu,
            query_start_loc=query_start_loc, num_rows=num_rows,
        )

        def create() -> DistributedDecodePlan:
            g = self.geometry
            exchange = Exchange(
                self.info, rows=local.problem.num_rows, heads=g.num_q_heads, head_dim=g.head_dim,
                dtype=output_dtype(self.local.q_dtype), device=self.local.device, method=self.method,
                scatter_heads=self.scatter_heads, reduce_dtype=self.reduce_dtype, heads_from="geometry / method",
            )
            return DistributedDecodePlan(local, exchange, self._token)

        plan = self.plans.get_or_create(local.key, create)
        if plan.local is not local:  # cannot happen while the plan is alive; never run a stale pair
            plan.local = local
        return plan

    def run(
        self,
        plan: DistributedDecodePlan,
        q: torch.Tensor,
        kv_cache: KVCache,
        topk_indices: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        sm_scale: Scale | None = None,
        q_scale: Scale = 1.0,
        k_scale: Scale = 1.0,
        v_scale: Scale = 1.0,
        validate: bool = False,
    ) -> None:
        """Decode this rank's share and merge over the group into `out` (and `lse`).

        A collective. Capturable in a CUDA graph with NCCL: it allocates nothing (the partial
        and communication buffers belong to the plan), never synchronises with the host and
        never copies device data to the host (`validate=True` or `MSA_VALIDATE=1` do: they run
        the checks of `msa.distributed.checks`, collectives included, on every rank). Before
        capturing, run it once eagerly on every rank (warm-up: Triton compilation, NCCL
        communicator set-up) — with `validate=True`, so that errors are raised on every rank.

        Errors: with `validate=True` every rank checks its arguments and decodes its share, then
        the group agrees on the outcome (`msa.distributed.agreement`: one small all-gather read
        on the host) before any other collective, so an error found on one rank — or shapes
        that differ between ranks — is raised on every rank. Without it `run` makes no host
        round trip (it is what a graph captures): an argument error is raised before any
        collective, but on its own rank only, and the other ranks wait in the merge until the
        group's timeout. Pass the same `validate` on every rank.

        Args:
            q: `[B*L, Hq, D]` of the planner's `q_dtype` (global: the same on every rank).
            kv_cache: this rank's cache, in the planner's layout.
            topk_indices: int32 `[Hkv, B*L, K]` (global), any strides.
            out: `[B*L, Hq, D]` (`[B*L, Hq/W, D]` when scattering heads), q's dtype (bf16 for
                fp8 q), unit last stride.
            lse: optional fp32 `[B*L, Hq]` (or `Hq/W`) for the merged natural-log LSE.
            sm_scale, q_scale, k_scale, v_scale: floats or one-element fp32 device tensors.
        """
        with self._exclusive():  # the plan's checks, the local decode and the merge: one atomic step
            if isinstance(validate, bool) and validation_requested(validate):
                self._run_validated(plan, q, kv_cache, topk_indices, out, lse, sm_scale, q_scale, k_scale, v_scale)
                return
            self._check_plan(plan)
            check_flag("validate", validate)
            exchange = plan.exchange
            exchange.check_outputs(out, lse)  # before the local decode
            check_outputs_apart(out, lse, _inputs(plan, q, kv_cache, topk_indices, sm_scale, q_scale, k_scale, v_scale))
            self.local.run(
                plan.local, q, kv_cache, topk_indices, out=exchange.local_out, lse=exchange.local_lse,
                sm_scale=sm_scale, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
            )
            exchange.merge(out, lse)

    def _run_validated(self, plan: DistributedDecodePlan, q: torch.Tensor, kv_cache: KVCache,
                       topk_indices: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                       sm_scale: Scale | None, q_scale: Scale, k_scale: Scale, v_scale: Scale) -> None:
        """`run` with the deep checks: this rank's checks and local decode, the group's
        agreement on them (raised on every rank alike), the coverage check, the merge."""
        facts = self._facts(plan)
        usage: torch.Tensor | None = None
        error: Exception | None = None
        try:
            self._check_plan(plan)
            exchange = plan.exchange
            exchange.check_outputs(out, lse)
            tables, length = plan.local.tables, plan.local.problem.query_len
            check_outputs_apart(out, lse, _inputs(plan, q, kv_cache, topk_indices, sm_scale, q_scale, k_scale, v_scale))
            problem, inputs = check_decode_inputs(
                q, kv_cache, topk_indices, tables.block_table, tables.seq_lens, decode_query_len=length,
                kv_cache_dtype=self.local.kv_cache_dtype, sm_scale=sm_scale, q_scale=q_scale, k_scale=k_scale,
                v_scale=v_scale, out=exchange.local_out, lse=exchange.local_lse, query_start_loc=tables.query_start_loc,
                dcp_size=self.info.world_size,
            )
            if problem.geometry != self.geometry or problem.q_dtype != self.local.q_dtype:
                raise MSAInputError(
                    "q / kv_cache / topk_indices", f"the planner's geometry ({self.geometry.describe()}) and q dtype "
                    f"{self.local.q_dtype}", f"{problem.geometry.describe()}, {problem.q_dtype}",
                )
            check_planned_layout(problem, plan.local.problem, type(self).__name__)  # (as unvalidated runs do)
            usage = shard_usage(problem, inputs, decode_query_len=length, kv_cache_dtype=self.local.kv_cache_dtype)
            run_checked(problem, inputs, plan.local.backend, exchange.local_out, exchange.local_lse)
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank alike
            error = exc
        agree(self.info, "DistributedDecodePlanner.run", facts, error, self.local.device)
        assert usage is not None
        check_coverage(self.info, usage)
        plan.exchange.merge(out, lse)

    def _facts(self, plan: object) -> list[Fact]:
        """What every rank's validated run must have alike (the merge's and the coverage
        check's shapes), computed without raising."""
        g = self.geometry
        facts = [
            Fact("method", "merge method", *name_code(self.method, METHODS)),
            Fact("scatter_heads", "scatter_heads", int(self.scatter_heads)),
            Fact("reduce_dtype", "reduce_dtype", *dtype_code(self.reduce_dtype)),
            Fact("geometry", "head count", g.num_q_heads),
            Fact("geometry", "head dim", g.head_dim),
            Fact("q_dtype", "q_dtype", *dtype_code(self.local.q_dtype)),
        ]
        rows = batch = width = length = ragged = -1
        if isinstance(plan, DistributedDecodePlan):
            rows, length = plan.exchange.rows, plan.local.problem.query_len
            batch, width = (int(x) for x in plan.local.tables.block_table.shape)
            ragged = int(plan.local.problem.ragged)
        return facts + [
            Fact("plan", "row count", rows),
            Fact("block_table", "row count B", batch),
            Fact("block_table", "width max_blocks (validate compares the tables block by block)", width),
            Fact("decode_query_len", "decode_query_len", length),
            Fact("query_start_loc", "presence of query_start_loc", ragged),
        ]

    def _check_plan(self, plan: object) -> None:
        if not isinstance(plan, DistributedDecodePlan):
            raise MSAInputError(
                "plan", "a DistributedDecodePlan from DistributedDecodePlanner.plan", type(plan).__name__
            )
        if plan.owner is not self._token:
            raise MSAInputError("plan", "a plan made by this planner", "a plan of another planner")
        if plan.retired:
            raise MSAInputError(
                "plan", "a live plan", "a plan retired by DistributedDecodePlanner.clear()",
                "Call plan() again and capture new graphs with the plan it returns.",
            )
        if plan.local.thread is not thread_token():
            raise MSAInputError(
                "plan", "a plan refreshed by this thread's last plan() call", "a plan last refreshed by another thread",
                "A planner serves one thread: create one per thread.",
            )

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Refuse concurrent use from two threads (a planner is not thread-safe): the whole of
        `plan`, `run` and `clear`, checks included, happens under one non-blocking lock."""
        if not self._busy.acquire(blocking=False):
            raise MSAInputError(
                "DistributedDecodePlanner", "use from one thread at a time", "a call while another thread is using it",
                "A planner serves one thread: create one per thread.",
            )
        try:
            yield
        finally:
            self._busy.release()

    def clear(self) -> None:
        """Forget every plan and retire those still held (graphs captured with them must be
        captured again)."""
        with self._exclusive():
            for plan in self.plans.clear():
                plan.retired = True
            self.local.clear()
