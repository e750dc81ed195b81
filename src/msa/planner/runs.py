"""The checks of a planned run: the step's tensors against the contract (docs/semantics.md §6)
and against the plan they run with — a step of another shape than the plan's would make its
kernels read and write outside the tensors (the plan's row metadata and workspaces are sized for
its own shape). A run whose call signature was checked before repeats only the checks that
depend on pointers."""

from __future__ import annotations

import attrs
import torch

from msa.errors import MSAInputError
from msa.layouts import KVCache
from msa.planner.plans import DecodePlan
from msa.problem import DecodeProblem
from msa.scales import Scale
from msa.validation import (
    CheckedCall,
    DecodeInputs,
    call_signature,
    check_decode_data,
    check_decode_inputs,
    validation_requested,
)

__all__ = ["checked_run_inputs", "check_against_plan", "check_planned_layout"]

#: Call signatures a plan remembers before it forgets them all.
MAX_REMEMBERED_RUNS = 32


def check_planned_layout(problem: DecodeProblem, planned: DecodeProblem, planner: str = "DecodePlanner") -> None:
    """The step's cache is of the planned layout (a backend's kernels were chosen and built for
    it); `planner`: the class to name in the hint."""
    if problem.kv_layout != planned.kv_layout:
        raise MSAInputError(
            "kv_cache", f"a {planned.kv_layout} cache, as planned", f"a {problem.kv_layout} cache",
            f"Give {planner} the cache's layout as kv_cache_dtype ('auto' plans for the output dtype's).",
        )


def check_against_plan(problem: DecodeProblem, plan: DecodePlan) -> None:
    """The step's shape is the plan's: geometry, q dtype, cache layout, batch, query length and
    rows (a ragged plan is sized for its `num_rows`), and an LSE only from a backend that returns
    one."""
    planned = plan.problem
    if problem.geometry != planned.geometry:
        raise MSAInputError(
            "q / kv_cache / topk_indices", f"the planner's geometry ({planned.geometry.describe()})",
            problem.geometry.describe(),
        )
    if problem.q_dtype != planned.q_dtype:
        raise MSAInputError("q", f"dtype {planned.q_dtype} (the planner's q_dtype)", problem.q_dtype)
    check_planned_layout(problem, planned)
    if problem.num_rows != planned.num_rows:
        how = f"num_rows={planned.num_rows} given to plan()" if planned.ragged else (
            f"B*L = {planned.batch_size}*{planned.query_len}")
        raise MSAInputError(
            "q", f"{planned.num_rows} rows, as planned ({how})", f"{problem.num_rows} rows",
            "Plan the step with the rows you run (plan(..., num_rows=q.shape[0]) for a ragged step).",
        )
    if problem.return_lse and not plan.backend.capabilities.lse:
        raise MSAInputError(
            "lse", f"None: backend {plan.backend.name!r} does not return the LSE", "a tensor",
            "Create the planner with with_lse=True to choose a backend that does.",
        )


def checked_run_inputs(
    plan: DecodePlan,
    q: torch.Tensor,
    kv_cache: KVCache,
    topk_indices: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    scales: tuple[Scale | None, Scale, Scale, Scale],
    *,
    kv_cache_dtype: str,
    validate: bool,
) -> DecodeInputs:
    """The checked inputs of a run of `plan` (with its tables as of the last `plan()`), its call
    signature attached for the backend's launch memo (None with `validate`: nothing remembered)."""
    if out is None:  # (`sparse_decode` allocates one; a run, capturable, never does)
        raise MSAInputError("out", "a [B*L, Hq, D] tensor to write into (run allocates nothing)", "None")
    tables = plan.tables
    signature = None if validate else call_signature(
        (q, kv_cache, topk_indices, tables.block_table, tables.seq_lens, out, lse, tables.query_start_loc),
        (*scales, plan.key),
    )
    known: CheckedCall | None = plan.runs.get(signature) if signature is not None else None
    if known is not None:  # checked before, with the same signature: only pointers are new
        return known.inputs(
            q, kv_cache, topk_indices, tables.block_table, tables.seq_lens, tables.query_start_loc, scales, out, lse,
            signature,
        )
    sm_scale, q_scale, k_scale, v_scale = scales
    problem, inputs = check_decode_inputs(
        q, kv_cache, topk_indices, tables.block_table, tables.seq_lens, decode_query_len=plan.problem.query_len,
        kv_cache_dtype=kv_cache_dtype, sm_scale=sm_scale, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
        out=out, lse=lse, query_start_loc=tables.query_start_loc,
    )
    check_against_plan(problem, plan)
    if validation_requested(validate):
        check_decode_data(problem, inputs)
        return inputs
    if signature is not None:
        if len(plan.runs) >= MAX_REMEMBERED_RUNS:
            plan.runs.clear()
        plan.runs[signature] = CheckedCall.of(problem, inputs)
        inputs = attrs.evolve(inputs, signature=signature)
    return inputs
