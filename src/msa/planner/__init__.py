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
- `run()` takes only plans made by this planner (`MSAInputError` otherwise), refuses plans
  retired by `clear()`, and refuses a step whose shape is not the plan's (rows, batch, query
  length, geometry, q dtype): the plan's buffers are sized for its own shape.
- A planner serves one sequence of steps: `plan()` then `run()` from one thread, on one CUDA
  stream (or with the streams synchronised). It is not thread-safe: two threads using it at
  once, or a `run()` of a plan last refreshed by another thread (whose tables describe that
  thread's step), raise `MSAInputError`; `run()` checks the plan's thread in the same hold of
  the planner as its launch, so no `plan()` from another thread can come between the two. Use
  one planner per thread (`msa.sparse_decode` does, per thread and stream).

The parts: `plans` (the plan of each step shape and the backend chosen for it), `refresh`
(`plan()`'s checks and the in-place refresh), `runs` (a run's checks, against the contract and
its plan), `guard` (the one-thread rule), `planner` (`DecodePlanner`, which composes them).
"""

from msa.planner.planner import DecodePlanner
from msa.planner.plans import DecodePlan, PlanKey

__all__ = ["PlanKey", "DecodePlan", "DecodePlanner"]
