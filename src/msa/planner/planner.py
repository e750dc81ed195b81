"""`DecodePlanner`: plans (`plans.PlanBook`), refreshed every step (`refresh`), run after their
checks (`runs`) under the one-thread rule (`guard`). The contract is the package's docstring."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from msa.backends.base import AnyBackend
from msa.errors import MSAInputError, check_flag, is_int
from msa.layouts import KVCache, get_layout
from msa.planner.guard import OneThreadGuard
from msa.planner.plans import DecodePlan, PlanBook, PlanKey, StepShape
from msa.planner.refresh import check_host_lens, check_ragged, check_tables, refresh
from msa.planner.runs import checked_run_inputs
from msa.planning import PlanCache, StepTables
from msa.platform import Platform, detect, resolve_device
from msa.policy import SelectionPolicy, default_policy
from msa.problem import CACHE_FORMS, DecodeProblem, Geometry
from msa.scales import Scale
from msa.validation import Q_DTYPES, DecodeInputs, output_dtype

__all__ = ["DecodePlanner"]


class DecodePlanner:
    """Plans and runs decode steps of one geometry and cache layout on one device.

    Args:
        geometry: heads, head dim, page size, top-k of this rank.
        kv_cache_dtype: the cache layout ("auto", "bfloat16", "float16", "fp8", "nvfp4", ...).
            "auto" plans for the 16-bit layout of the output dtype (bf16 q: "bfloat16"); a run
            refuses a cache of another layout than planned, so give an f16 cache beside a bf16
            query (or the other way round) its layout.
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
        dcp_size: the ranks each request's pages are spread over, when this planner decodes one
            rank's share under decode context parallelism (`msa.distributed` passes its group's
            size): a share of each selection changes which kernel pays.

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
        dcp_size: int = 1,
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
        if not is_int(dcp_size) or dcp_size < 1:
            raise MSAInputError("dcp_size", "the ranks each request's pages are spread over (an int >= 1)",
                                repr(dcp_size))
        self.dcp_size = dcp_size
        self.platform = platform if platform is not None else detect(self.device)
        self.policy = policy
        self.kv_layout = self.layout.resolve(output_dtype(q_dtype)).name
        self._book = PlanBook(max_plans, self._problem, str(self.device))
        self._guard = OneThreadGuard(type(self).__name__)

    def __repr__(self) -> str:
        return (
            f"DecodePlanner({self.geometry.describe()}, {self.layout.name}, backend={self.backend_name!r}, "
            f"device={self.device}, {self.plans.stats()})"
        )

    @property
    def plans(self) -> PlanCache[PlanKey, DecodePlan]:
        """The plan cache (`stats()`, `keys()`, `len()`)."""
        return self._book.plans

    def _problem(self, shape: StepShape) -> DecodeProblem:
        """The `DecodeProblem` the policy judges for a step shape of this planner."""
        batch, length, stride, rows = shape
        return DecodeProblem(
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
            dcp_size=self.dcp_size,
        )

    def plan(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        decode_query_len: int = 1,
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
            decode_query_len: `L` (default 1: one token per request).
            seq_lens_cpu: the same lengths on the host, int32 `[B]` (any strides, pinned or
                not), if the caller has them (saves a copy when a kernel library plans on the host).
            query_start_loc: int32 `[B+1]` for ragged steps (speculative lengths that differ per
                request): request `b` owns rows `[qsl[b], qsl[b+1])`; `decode_query_len` is then
                the largest length, and `num_rows` the rows of `q` (a fixed token budget; rows
                past `qsl[B]` are padding and come out as zeros). `run` refuses a `q` of other
                rows.
            num_rows: the rows of `q` for a ragged step.
        """
        table, lens = check_tables(block_table, seq_lens, self.device, decode_query_len)
        host_lens = check_host_lens(seq_lens_cpu, lens)
        ragged_rows = check_ragged(query_start_loc, num_rows, lens.shape[0], self.device)
        with self._guard.exclusive():
            return self._plan(table, lens, decode_query_len, query_start_loc, ragged_rows, host_lens)

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
        """`plan()` on checked tables, inside the guard."""
        policy = self.policy if self.policy is not None else default_policy()

        def select(problem: DecodeProblem) -> AnyBackend:
            return policy.select(problem, self.platform, self.backend_name)[0]

        key = self._book.key((lens.shape[0], decode_query_len, table.stride(0), ragged_rows), select)

        def build() -> tuple[AnyBackend, StepTables, object]:
            backend = policy.registry.get(key.backend)
            tables = StepTables.build(key.problem, table, lens, query_start_loc=query_start_loc,
                                      seq_lens_cpu=seq_lens_cpu)
            return backend, tables, backend.plan(key.problem, tables)

        plan, created = self._book.get_or_create(key, build)
        self._guard.claim(plan)
        if not created:  # a cached plan, or a released one still held: refresh it in place
            refresh(plan, table, lens, query_start_loc, seq_lens_cpu, reuse=reuse_refresh)
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
            q: `[B*L, Hq, D]` of the planner's `q_dtype` (the plan's rows: `num_rows` for a
                ragged plan).
            kv_cache: the cache, in the planner's layout (one tensor, or a `(k_cache, v_cache)`
                pair for the split layouts).
            topk_indices: int32 `[Hkv, B*L, K]`, any strides.
            out: `[B*L, Hq, D]` (q's dtype; bf16 for fp8 q), unit last stride.
            lse: optional fp32 `[B*L, Hq]` (the planner must have `with_lse=True` for backends
                that cannot return it).
            sm_scale, q_scale, k_scale, v_scale: floats or one-element fp32 device tensors.

        Raises:
            MSAInputError: a bad argument, a step of another shape than the plan's, a plan of
                another planner or retired, or a plan last refreshed by another thread (checked
                in the same hold of the planner as the launch).
        """
        check_flag("validate", validate)
        with self._guard.exclusive():
            self._guard.check(plan, self._book.token)
            inputs = checked_run_inputs(
                plan, q, kv_cache, topk_indices, out, lse, (sm_scale, q_scale, k_scale, v_scale),
                kv_cache_dtype=self.kv_cache_dtype, validate=validate,
            )
            assert inputs.out is not None
            plan.backend.run(plan.backend_plan, inputs, inputs.out, inputs.lse)

    def run_one_shot(self, problem: DecodeProblem, inputs: DecodeInputs, out: torch.Tensor,
                     lse: torch.Tensor | None) -> None:
        """`msa.sparse_decode`'s use: plan checked inputs (reusing the refresh of an eager
        step's earlier layers) and run them, in one hold of the planner."""
        with self._guard.exclusive():
            plan = self._plan(
                inputs.block_table, inputs.seq_lens, problem.query_len, inputs.query_start_loc,
                problem.num_rows if problem.ragged else None, reuse_refresh=True,
            )
            plan.backend.run(plan.backend_plan, inputs, out, lse)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the planner (see `OneThreadGuard.exclusive`)."""
        with self._guard.exclusive():
            yield

    def clear(self) -> None:
        """Forget every plan and retire those still held: `run()` of a retired plan raises (a
        graph captured with it must be captured again with a new plan)."""
        with self._guard.exclusive():
            self._book.retire_all()
