"""What every backend is: a name, capabilities as data, refusals as reasons (of the machine, of
the step), `plan` and `run`."""

from __future__ import annotations

import abc
from typing import Any, Generic, TypeVar

import torch

from msa.backends.capabilities import Capabilities
from msa.planning import StepTables
from msa.platform import Platform
from msa.problem import DecodeProblem
from msa.validation import DecodeInputs

__all__ = ["AnyBackend", "Backend", "PlanT"]

#: The type of a backend's own plan (what `plan` returns and `refresh` / `run` take).
PlanT = TypeVar("PlanT")


class Backend(abc.ABC, Generic[PlanT]):
    """A sparse-decode implementation, generic in the type of its own plan.

    Refusals have two homes: what the machine lacks (`platform_reasons`: the capabilities'
    machine rules plus `machine_reasons`) and what the step asks for that the backend does not
    support (`problem_reasons`: the step rules plus `extra_reasons`). `msa backends` shows the
    first, `msa explain` and the selection policy both.

    Attributes:
        name: the name users pass as `backend=`.
        description: one line for `msa backends`.
        capabilities: what it supports, as data (see `Capabilities`).
    """

    name: str
    description: str = ""
    capabilities: Capabilities = Capabilities()

    def __repr__(self) -> str:
        return f"<msa backend {self.name}>"

    def version(self) -> str:
        """The version of the library behind the backend ("" when it is msa itself)."""
        return ""

    def platform_reasons(self, platform: Platform, *, requested: bool = False) -> list[str]:
        """Why this backend cannot run on `platform` at all, whatever the step (empty: it can).

        Args:
            platform: the machine.
            requested: the caller names this backend (some run on a machine only when asked for).
        """
        return self.capabilities.machine_reasons(platform, requested) + self.machine_reasons(
            platform, requested=requested
        )

    def problem_reasons(
        self, problem: DecodeProblem, platform: Platform, *, requested: bool = False
    ) -> list[str]:
        """Why this backend cannot run the step `problem` (empty: it can), leaving out what the
        machine lacks (`platform_reasons`). `platform` is there for rules that depend on both
        (a batch floor that differs per compute capability)."""
        return self.capabilities.step_reasons(problem, requested) + self.extra_reasons(
            problem, platform, requested=requested
        )

    def not_supported_reasons(
        self, problem: DecodeProblem | None, platform: Platform, *, requested: bool = False
    ) -> list[str]:
        """Why this backend cannot run `problem` on `platform` (empty when it can): the machine's
        reasons, then the step's (None: the machine alone)."""
        reasons = self.platform_reasons(platform, requested=requested)
        if problem is not None:
            reasons += self.problem_reasons(problem, platform, requested=requested)
        return reasons

    def machine_reasons(self, platform: Platform, *, requested: bool = False) -> list[str]:
        """Backend-specific refusals of the machine beyond the declared capabilities (override)."""
        return []

    def extra_reasons(
        self, problem: DecodeProblem, platform: Platform, *, requested: bool = False
    ) -> list[str]:
        """Backend-specific refusals of the step beyond the declared capabilities (override)."""
        return []

    def strategy(self, problem: DecodeProblem, platform: Platform) -> str | None:
        """How this backend would run `problem` on `platform`, in a few words, for `msa explain`
        (override; None: nothing to say)."""
        return None

    @abc.abstractmethod
    def plan(self, problem: DecodeProblem, tables: StepTables) -> PlanT:
        """Prepare a step shape (outside CUDA-graph capture): allocate workspaces and metadata
        sized for `problem`. Called once per shape; the planner caches the result."""

    def refresh(self, plan: PlanT, tables: StepTables) -> None:
        """Bring `plan`'s device metadata up to date with `tables`, in place (outside capture,
        every step; device work only). The planner has already refreshed `tables.rows`."""

    @abc.abstractmethod
    def run(
        self,
        plan: PlanT,
        inputs: DecodeInputs,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        """Compute the step into `out` `[B*L, Hq, D]` (and `lse` `[B*L, Hq]` when given).
        Capturable: allocates nothing, never synchronises, never copies to the host — unless
        `capabilities.uncapturable` says why not (then it raises `MSAUnsupportedError` inside
        a capture, and the policy refuses steps declared `graph_capture`)."""

    def run_step(
        self, problem: DecodeProblem, inputs: DecodeInputs, out: torch.Tensor, lse: torch.Tensor | None = None
    ) -> None:
        """Plan and run one checked step without a planner (tests and benchmarks that force a
        backend's options). `problem, inputs` come from `msa.validation.check_decode_inputs`."""
        self.run(self.plan(problem, StepTables.for_inputs(problem, inputs)), inputs, out, lse)


#: Any backend, whatever its plan type (what the registry holds).
AnyBackend = Backend[Any]
