"""What a planner keeps: the plan of each step shape (`PlanKey` -> `DecodePlan`), the backend the
policy chose for it (asked once per shape), and which plans are this planner's."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import attrs
import torch

from msa.backends.base import AnyBackend
from msa.planning import PlanCache, StepTables
from msa.problem import DecodeProblem

__all__ = ["PlanKey", "DecodePlan", "PlanBook", "StepShape"]

#: A step's shape as a planner sees it before selection: (batch, query length, block-table row
#: stride, rows of a ragged step or None).
StepShape = tuple[int, int, int, int | None]


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


@attrs.define(eq=False, repr=False)
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
        owner: the token of the planner that made it.
        retired: set by `DecodePlanner.clear()`; a retired plan never runs.
        thread: the token (`guard.thread_token`) of the thread whose `plan()` refreshed it last
            (its tables describe that thread's step).
        runs: the checks of earlier runs, by call signature.
    """

    key: PlanKey
    backend: AnyBackend
    problem: DecodeProblem
    tables: StepTables
    backend_plan: Any
    owner: object
    retired: bool = False
    thread: object = None
    runs: dict[Hashable, Any] = attrs.field(factory=dict)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The device buffers whose addresses a captured graph depends on."""
        return self.tables.rows.buffers()

    def __repr__(self) -> str:
        state = "retired" if self.retired else "live"
        return f"DecodePlan({self.key.describe()}, {state})"


class PlanBook:
    """The plans of one planner: the policy's choice per step shape (asked once per shape: it
    depends on the shape alone) and the bounded `PlanCache` of plans by key.

    Args:
        max_plans: plans kept by the cache itself (see `PlanCache`).
        problem_of: the `DecodeProblem` of a step shape (the planner's geometry, layout, ...).
        device: the planner's device (part of every key).
    """

    def __init__(self, max_plans: int, problem_of: Callable[[StepShape], DecodeProblem], device: str) -> None:
        self.plans: PlanCache[PlanKey, DecodePlan] = PlanCache(max_plans)
        self.problem_of = problem_of
        self.device = device
        self.token = object()  # marks the plans of this book
        self._keys: dict[StepShape, PlanKey] = {}

    def key(self, shape: StepShape, select: Callable[[DecodeProblem], AnyBackend]) -> PlanKey:
        """The plan key of a step shape, with the backend `select` picks for its problem (asked
        once per shape)."""
        key = self._keys.get(shape)
        if key is None:
            problem = self.problem_of(shape)
            chosen = select(problem)
            if len(self._keys) > 4 * self.plans.max_plans:
                self._keys.clear()
            key = self._keys[shape] = PlanKey(problem, chosen.name, self.device)
        return key

    def get_or_create(
        self, key: PlanKey, build: Callable[[], tuple[AnyBackend, StepTables, Any]]
    ) -> tuple[DecodePlan, bool]:
        """The plan for `key` (cached, or released but still held), or a new one from `build()`
        -> (backend, tables, backend plan); and whether it is new."""
        created = False

        def create() -> DecodePlan:
            nonlocal created
            created = True
            backend, tables, backend_plan = build()
            return DecodePlan(key, backend, key.problem, tables, backend_plan, self.token)

        return self.plans.get_or_create(key, create), created

    def owns(self, plan: DecodePlan) -> bool:
        return plan.owner is self.token

    def retire_all(self) -> None:
        """Forget every plan and key; plans still held are marked retired."""
        for plan in self.plans.clear():
            plan.retired = True
        self._keys.clear()
