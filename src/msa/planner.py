"""CUDA-graph-stable decode plans (docs/semantics.md §5).

    planner = msa.DecodePlanner(msa.MINIMAX_M3, kv_cache_dtype="fp8", device="cuda")
    # every step, outside graph capture:
    plan = planner.plan(block_table, seq_lens, decode_query_len=L)
    # capturable (allocates nothing, never synchronises, never copies to the host):
    planner.run(plan, q, kv_cache, topk_indices, out=out, k_scale=k_scale, v_scale=v_scale)

A plan is cached per step shape (`PlanKey`: batch, query length, block-table row stride,
geometry, layout, backend, ...). Planning the same shape again returns the same `DecodePlan`
object, whose buffers keep their addresses; only their contents are refreshed, on the device,
from `seq_lens`. So a graph captured once per batch size replays correctly while `seq_lens`,
`block_table`, `topk_indices`, `q` and the cache change in place. Requests padded with
`seq_lens = 0` (a graph captured for a larger batch) produce zeros and an LSE of -inf.

What a planner guarantees (and enforces):

- A plan you hold is never silently left behind: while you keep a reference to it (as an
  engine does for the plan a captured graph reads), `plan()` for its shape returns that same
  object, whatever `max_plans` says; only plans nobody holds are released.
- `run()` takes only plans made by this planner (`MSAInputError` otherwise), and refuses plans
  retired by `clear()`.
- A planner serves one sequence of steps: `plan()` then `run()` from one thread, on one CUDA
  stream (or with the streams synchronised). It is not thread-safe: two threads using it at
  once, or a `run()` of a plan last refreshed by another thread (whose tables describe that
  thread's step), raise `MSAInputError`. Use one planner per thread (`msa.sparse_decode` does,
  per thread and stream).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from msa.backends.base import AnyBackend
from msa.errors import MSAInputError
from msa.layouts import KVCache, get_layout
from msa.planning import PlanCache, StepTables
from msa.platform import Platform, detect, resolve_device
from msa.policy import SelectionPolicy, default_policy
from msa.problem import CACHE_FORMS, DecodeProblem, Geometry
from msa.scales import Scale
from msa.validation import (
    Q_DTYPES,
    CheckedCall,
    call_signature,
    check_decode_data,
    check_decode_inputs,
    check_flag,
    check_int32,
    check_tensor,
    output_dtype,
    validation_requested,
)

__all__ = ["PlanKey", "DecodePlan", "DecodePlanner"]


@attrs.frozen
class PlanKey:
    """What makes two steps share a plan (a frozen, hashable value): the step's shape as the
    policy saw it (`DecodePlan.problem`), the backend chosen for it, and the device."""

    problem: DecodeProblem
    backend: str
    device: str

    def describe(self) -> str:
        p = self.problem
        ragged = f", ragged {p.num_rows} rows" if p.ragged else ""
        shape = f"B={p.batch_size}, L={p.query_len}{ragged}"
        return f"{shape}, {p.geometry.describe()}, {p.kv_layout}, backend {self.backend}"


@attrs.define(eq=False)
class DecodePlan:
    """A planned step shape: the chosen backend, its workspaces, the step's tables and per-row
    metadata. Obtain it from `DecodePlanner.plan`; pass it to `DecodePlanner.run`.

    Attributes:
        key: the shape it serves.
        backend: the backend that runs it.
        problem: the step's shape as the policy saw it (`key.problem`; `num_pages` and
            `max_blocks` are 0: a plan does not depend on them).
        tables: block table, lengths and row metadata (refreshed by every `plan` call).
        backend_plan: the backend's own plan (workspaces, library plans).
    """

    key: PlanKey
    backend: AnyBackend
    problem: DecodeProblem
    tables: StepTables
    backend_plan: Any
    owner: object = attrs.field(repr=False)
    retired: bool = False
    thread: int = 0
    runs: dict[Hashable, CheckedCall] = attrs.field(factory=dict, repr=False)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The device buffers whose addresses a captured graph depends on."""
        return self.tables.rows.buffers()


def _check_tables(
    block_table: object, seq_lens: object, device: torch.device, decode_query_len: object
) -> tuple[torch.Tensor, torch.Tensor]:
    table = check_tensor("block_table", block_table, device, "the planner's device")
    check_int32("block_table", table, "[B, max_blocks]", 2)
    lens = check_tensor("seq_lens", seq_lens, device, "the planner's device")
    check_int32("seq_lens", lens, "[B]", 1)
    if table.shape[0] != lens.shape[0] or table.shape[1] < 1:
        expected = f"shape [{lens.shape[0]}, max_blocks >= 1] (B from seq_lens)"
        raise MSAInputError("block_table", expected, tuple(table.shape))
    if table.stride(-1) != 1:
        raise MSAInputError("block_table", "unit stride in the last dimension", table.stride())
    if not isinstance(decode_query_len, int) or isinstance(decode_query_len, bool) or decode_query_len < 1:
        raise MSAInputError("decode_query_len", "an int >= 1", repr(decode_query_len))
    return table, lens


def _check_ragged(query_start_loc: object, num_rows: object, batch: int, device: torch.device) -> int | None:
    """The rows of a ragged step, or None for a uniform one."""
    if query_start_loc is None:
        if num_rows is not None:
            raise MSAInputError("num_rows", "None for a uniform step (it is B * decode_query_len)", num_rows)
        return None
    starts = check_tensor("query_start_loc", query_start_loc, device, "the planner's device")
    check_int32("query_start_loc", starts, "[B+1]", 1)
    if starts.shape[0] != batch + 1:
        raise MSAInputError("query_start_loc", f"{batch + 1} entries (B+1, B from seq_lens)", starts.shape[0])
    if not isinstance(num_rows, int) or isinstance(num_rows, bool) or num_rows < 0:
        raise MSAInputError("num_rows", "the rows of q (an int >= 0) for a ragged step", repr(num_rows))
    return num_rows


class DecodePlanner:
    """Plans and runs decode steps of one geometry and cache layout on one device.

    Args:
        geometry: heads, head dim, page size, top-k of this rank.
        kv_cache_dtype: the cache layout ("auto", "bfloat16", "float16", "fp8", "nvfp4", ...).
        backend: "auto" or a backend name (chosen per step shape by the selection policy).
        device: the device of the caches and tables.
        q_dtype: the dtype of `q` (some backends take fp8 queries only).
        with_lse: runs will ask for the log-sum-exp (some backends cannot return it).
        max_plans: plans the planner itself keeps (least recently used released first). The
            default covers the batch sizes serving engines capture graphs for (vLLM's default
            list has 67); a released plan you still hold is found again, never replaced.
        platform: the machine to select for (default: `detect(device)`); tests pass pretend ones.
        policy: the selection policy (default: the process-wide one).
        kv_form: how the caches of the runs are held, one of `msa.problem.CACHE_FORMS`: "packed"
            (one contiguous tensor), "separate" (a contiguous `(k_cache, v_cache)` pair) or
            "strided" (views). Some kernel libraries read only some forms; every form runs on
            the built-in backends.
        graph_capture: the runs will be captured in CUDA graphs (backends whose `run` cannot be
            captured are not chosen).
        vector_aligned: the runs' q/out rows start on 4-byte boundaries and their caches' pages
            and heads on 16-byte ones (`msa.validation.vector_misalignment`; caches allocated by
            a layout are). False keeps backends that load them as vectors from being chosen.

    Raises:
        MSAInputError: a bad argument, or a CUDA device on a machine without one.
    """

    def __init__(
        self,
        geometry: Geometry,
        *,
        kv_cache_dtype: str = "auto",
        backend: str = "auto",
        device: torch.device | str | None = None,
        q_dtype: torch.dtype = torch.bfloat16,
        with_lse: bool = False,
        max_plans: int = 128,
        platform: Platform | None = None,
        policy: SelectionPolicy | None = None,
        kv_form: str = "packed",
        graph_capture: bool = False,
        vector_aligned: bool = True,
    ) -> None:
        if not isinstance(geometry, Geometry):
            raise MSAInputError("geometry", "an msa.Geometry", type(geometry).__name__)
        if q_dtype not in Q_DTYPES:
            raise MSAInputError("q_dtype", "bfloat16, float16 or float8_e4m3fn", q_dtype)
        check_flag("with_lse", with_lse)
        check_flag("graph_capture", graph_capture)
        check_flag("vector_aligned", vector_aligned)
        if kv_form not in CACHE_FORMS:
            raise MSAInputError("kv_form", f"one of {', '.join(CACHE_FORMS)}", repr(kv_form))
        if not isinstance(backend, str):
            raise MSAInputError("backend", "'auto' or a backend name (a str)", repr(backend))
        self.geometry = geometry
        self.kv_cache_dtype = kv_cache_dtype
        self.layout = get_layout(kv_cache_dtype)
        self.backend_name = backend
        self.device = resolve_device(device)
        self.q_dtype = q_dtype
        self.with_lse = with_lse
        self.kv_form = kv_form
        self.graph_capture = graph_capture
        self.vector_aligned = vector_aligned
        self.platform = platform if platform is not None else detect(self.device)
        self.policy = policy
        self.plans: PlanCache[PlanKey, DecodePlan] = PlanCache(max_plans)
        self.kv_layout = self.layout.resolve(output_dtype(q_dtype)).name
        self._shapes: dict[tuple[int, int, int, int | None], PlanKey] = {}
        self._token = object()  # marks the plans this planner made
        self._busy = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"DecodePlanner({self.geometry.describe()}, {self.layout.name}, backend={self.backend_name!r}, "
            f"device={self.device}, {self.plans.stats()})"
        )

    def _key(self, batch: int, length: int, stride: int, rows: int | None, policy: SelectionPolicy) -> PlanKey:
        """The plan key of a step shape; the policy is asked once per shape (its choice depends
        on the shape alone)."""
        shape = (batch, length, stride, rows)
        key = self._shapes.get(shape)
        if key is None:
            problem = DecodeProblem(
                geometry=self.geometry,
                batch_size=batch,
                query_len=length,
                kv_layout=self.kv_layout,
                q_dtype=self.q_dtype,
                out_dtype=output_dtype(self.q_dtype),
                device_type=self.device.type,
                num_pages=0,
                max_blocks=0,
                return_lse=self.with_lse,
                block_table_stride=stride,
                ragged=rows is not None,
                total_rows=rows,
                kv_form=self.kv_form,
                graph_capture=self.graph_capture,
                vector_aligned=self.vector_aligned,
            )
            chosen, _ = policy.select(problem, self.platform, self.backend_name)
            if len(self._shapes) > 4 * self.plans.max_plans:
                self._shapes.clear()
            key = self._shapes[shape] = PlanKey(problem, chosen.name, str(self.device))
        return key

    def plan(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        decode_query_len: int,
        seq_lens_cpu: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
        num_rows: int | None = None,
    ) -> DecodePlan:
        """The plan for this step's shape, its device metadata refreshed from `seq_lens`.

        Call outside graph capture, every step. The first call for a shape selects the backend
        and allocates the plan's buffers; later calls return the same object and only launch the
        refresh (one small kernel on CUDA).

        Args:
            block_table: int32 `[B, max_blocks]`, unit last stride.
            seq_lens: int32 `[B]`, lengths including the `L` new tokens (0 for padded requests).
            decode_query_len: `L`.
            seq_lens_cpu: the same lengths on the host, if the caller has them (saves a copy
                when a kernel library plans on the host).
            query_start_loc: int32 `[B+1]` for ragged steps (speculative lengths that differ per
                request): request `b` owns rows `[qsl[b], qsl[b+1])`; `decode_query_len` is then
                the largest length, and `num_rows` the rows of `q` (a fixed token budget; rows
                past `qsl[B]` are padding and come out as zeros).
            num_rows: the rows of `q` for a ragged step.
        """
        table, lens = _check_tables(block_table, seq_lens, self.device, decode_query_len)
        ragged_rows = _check_ragged(query_start_loc, num_rows, lens.shape[0], self.device)
        with self._exclusive():
            return self._plan(table, lens, decode_query_len, query_start_loc, ragged_rows, seq_lens_cpu)

    def _plan(
        self,
        table: torch.Tensor,
        lens: torch.Tensor,
        decode_query_len: int,
        query_start_loc: torch.Tensor | None,
        ragged_rows: int | None,
        seq_lens_cpu: torch.Tensor | None = None,
        *,
        reuse_refresh: bool = False,
    ) -> DecodePlan:
        """`plan()` on checked tables (the one-shot path checks them once, beforehand). With
        `reuse_refresh`, a plan whose tables are these very tensors, unchanged through torch since
        its last refresh, is not refreshed again (the later layers of an eager step)."""
        policy = self.policy if self.policy is not None else default_policy()
        key = self._key(lens.shape[0], decode_query_len, table.stride(0), ragged_rows, policy)
        created = False

        def create() -> DecodePlan:
            nonlocal created
            created = True
            backend = policy.registry.get(key.backend)
            tables = StepTables.build(
                key.problem, table, lens, query_start_loc=query_start_loc, seq_lens_cpu=seq_lens_cpu
            )
            return DecodePlan(key, backend, key.problem, tables, backend.plan(key.problem, tables), self._token)

        plan = self.plans.get_or_create(key, create)
        plan.thread = threading.get_ident()
        if created or (reuse_refresh and plan.tables.holds(table, lens, query_start_loc, seq_lens_cpu)):
            return plan
        # a cached plan, or a released one still held: refresh it in place
        plan.tables.update(table, lens, query_start_loc=query_start_loc, seq_lens_cpu=seq_lens_cpu)
        plan.backend.refresh(plan.backend_plan, plan.tables)
        return plan

    def run(
        self,
        plan: DecodePlan,
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
        """Run a planned step into `out` (and `lse`). Capturable: allocates nothing, never
        synchronises with the host, never copies device data to the host (`validate=True`
        does, to read the indices).

        Args:
            q: `[B*L, Hq, D]` of the planner's `q_dtype`.
            kv_cache: the cache, in the planner's layout (one tensor, or a `(k_cache, v_cache)`
                pair for the split layouts).
            topk_indices: int32 `[Hkv, B*L, K]`, any strides.
            out: `[B*L, Hq, D]` (q's dtype; bf16 for fp8 q), unit last stride.
            lse: optional fp32 `[B*L, Hq]` (the planner must have `with_lse=True` for backends
                that cannot return it).
            sm_scale, q_scale, k_scale, v_scale: floats or one-element fp32 device tensors.
        """
        self._check_plan(plan)
        check_flag("validate", validate)
        tables = plan.tables
        scales = (sm_scale, q_scale, k_scale, v_scale)
        signature = None if validate else call_signature(
            (q, kv_cache, topk_indices, tables.block_table, tables.seq_lens, out, lse, tables.query_start_loc),
            (*scales, plan.key),
        )
        known = plan.runs.get(signature) if signature is not None else None
        if known is not None:  # checked before, with the same signature: only pointers are new
            inputs = known.inputs(
                q, kv_cache, topk_indices, tables.block_table, tables.seq_lens, tables.query_start_loc, scales, out,
                lse, signature,
            )
            assert inputs.out is not None
            with self._exclusive():
                plan.backend.run(plan.backend_plan, inputs, inputs.out, inputs.lse)
            return
        problem, inputs = check_decode_inputs(
            q,
            kv_cache,
            topk_indices,
            tables.block_table,
            tables.seq_lens,
            decode_query_len=plan.problem.query_len,
            kv_cache_dtype=self.kv_cache_dtype,
            sm_scale=sm_scale,
            q_scale=q_scale,
            k_scale=k_scale,
            v_scale=v_scale,
            out=out,
            lse=lse,
            query_start_loc=tables.query_start_loc,
        )
        if problem.geometry != self.geometry:
            raise MSAInputError(
                "q / kv_cache / topk_indices",
                f"the planner's geometry ({self.geometry.describe()})",
                problem.geometry.describe(),
            )
        if problem.q_dtype != self.q_dtype:
            raise MSAInputError("q", f"dtype {self.q_dtype} (the planner's q_dtype)", problem.q_dtype)
        if lse is not None and not plan.backend.capabilities.lse:
            raise MSAInputError(
                "lse", f"None: backend {plan.backend.name!r} does not return the LSE", "a tensor",
                "Create the planner with with_lse=True to choose a backend that does.",
            )
        if validation_requested(validate):
            check_decode_data(problem, inputs)
        elif signature is not None:
            if len(plan.runs) >= 32:
                plan.runs.clear()
            plan.runs[signature] = CheckedCall.of(problem, inputs)
            inputs = attrs.evolve(inputs, signature=signature)
        assert inputs.out is not None
        with self._exclusive():
            plan.backend.run(plan.backend_plan, inputs, inputs.out, inputs.lse)

    def _check_plan(self, plan: object) -> None:
        if not isinstance(plan, DecodePlan):
            raise MSAInputError("plan", "a DecodePlan from DecodePlanner.plan", type(plan).__name__)
        if plan.owner is not self._token:
            raise MSAInputError(
                "plan", "a plan made by this planner", f"a plan of another planner ({plan.key.describe()})",
                "Run each plan with the planner that made it.",
            )
        if plan.retired:
            raise MSAInputError(
                "plan", "a live plan", "a plan retired by DecodePlanner.clear()",
                "Call plan() again and capture new graphs with the plan it returns.",
            )
        if plan.thread != threading.get_ident():
            raise MSAInputError(
                "plan", "a plan refreshed by this thread's last plan() call",
                "a plan last refreshed by another thread (its tables describe that thread's step)",
                "A DecodePlanner serves one thread: create one per thread.",
            )

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Refuse concurrent use from two threads (a planner is not thread-safe)."""
        if not self._busy.acquire(blocking=False):
            raise MSAInputError(
                "DecodePlanner", "use from one thread at a time", "a call while another thread is using it",
                "A DecodePlanner serves one thread: create one per thread (msa.sparse_decode does).",
            )
        try:
            yield
        finally:
            self._busy.release()

    def clear(self) -> None:
        """Forget every plan and retire those still held: `run()` of a retired plan raises (a
        graph captured with it must be captured again with a new plan)."""
        with self._exclusive():
            for plan in self.plans.clear():
                plan.retired = True
            self._shapes.clear()
