"""What every backend is: a name, capabilities as data, refusals as reasons (of the machine, of
the step), `plan` and `run`."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch

from msa.backends.capabilities import DEFAULT_RULES, Capabilities, Rule
from msa.planning import StepTables
from msa.platform import Platform
from msa.problem import DecodeProblem
from msa.validation import DecodeInputs

__all__ = ["Backend"]


class Backend(abc.ABC):
    """A sparse-decode implementation.

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

    def platform_reasons(
        self, platform: Platform, *, requested: bool = False, rules: Sequence[Rule] = DEFAULT_RULES
    ) -> list[str]:
        """Why this backend cannot run on `platform` at all, whatever the step (empty when it
        can): the machine rules (those that refuse without a step) and `machine_reasons`. This is
        what `msa backends` shows; `not_supported_reasons` starts with the same list.

        Args:
            platform: the machine.
            requested: the caller names this backend (some run on a machine only when asked for).
            rules: the rules to apply to `capabilities` (the policy's).
        """
        reasons = [
            reason
            for rule in rules
            if (reason := rule(self.capabilities, None, platform, requested)) is not None
        ]
        return reasons + self.machine_reasons(platform, requested=requested)

    def problem_reasons(
        self,
        problem: DecodeProblem,
        platform: Platform,
        *,
        requested: bool = False,
        rules: Sequence[Rule] = DEFAULT_RULES,
    ) -> list[str]:
        """Why this backend cannot run the step `problem` (empty when it can), leaving out the
        machine-level refusals (`platform_reasons`): the step rules and `extra_reasons`."""
        reasons = [
            reason
            for rule in rules
            if rule(self.capabilities, None, platform, requested) is None
            and (reason := rule(self.capabilities, problem, platform, requested)) is not None
        ]
        return reasons + self.extra_reasons(problem, platform, requested=requested)

    def not_supported_reasons(
        self,
        problem: DecodeProblem | None,
        platform: Platform,
        *,
        requested: bool = False,
        rules: Sequence[Rule] = DEFAULT_RULES,
    ) -> list[str]:
        """Why this backend cannot run `problem` on `platform` (empty when it can): the machine's
        reasons (`platform_reasons`), then the step's (`problem_reasons`).

        Args:
            problem: the step, or None to ask about the machine alone.
            platform: the machine.
            requested: the caller named this backend (some run only when asked for).
            rules: the rules to apply to `capabilities` (the policy's).
        """
        reasons = self.platform_reasons(platform, requested=requested, rules=rules)
        if problem is not None:
            reasons += self.problem_reasons(problem, platform, requested=requested, rules=rules)
        return reasons

    def machine_reasons(self, platform: Platform, *, requested: bool = False) -> list[str]:
        """Backend-specific refusals of the machine beyond the declared capabilities (override)."""
        return []

    def extra_reasons(
        self, problem: DecodeProblem, platform: Platform, *, requested: bool = False
    ) -> list[str]:
        """Backend-specific refusals of the step beyond the declared capabilities (override;
        refusals that depend on the machine alone belong in `machine_reasons`)."""
        return []

    @abc.abstractmethod
    def plan(self, problem: DecodeProblem, tables: StepTables) -> Any:
        """Prepare a step shape (outside CUDA-graph capture): allocate workspaces and metadata
        sized for `problem`. Called once per shape; the planner caches the result."""

    def refresh(self, plan: Any, tables: StepTables) -> None:
        """Bring `plan`'s device metadata up to date with `tables`, in place (outside capture,
        every step; device work only). The planner has already refreshed `tables.rows`."""

    @abc.abstractmethod
    def run(
        self,
        plan: Any,
        inputs: DecodeInputs,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        """Compute the step into `out` `[B*L, Hq, D]` (and `lse` `[B*L, Hq]` when given).
        Capturable: allocates nothing, never synchronises, never copies to the host."""
