"""What every backend is: a name, its refusals as reasons, and `run`."""

from __future__ import annotations

import abc

import torch

from msa.problem import DecodeProblem
from msa.validation import DecodeInputs

__all__ = ["Backend"]


class Backend(abc.ABC):
    """A sparse-decode implementation.

    Attributes:
        name: the name users pass as `backend=`.
        description: one line for `msa backends`.
    """

    name: str
    description: str = ""

    def __repr__(self) -> str:
        return f"<msa backend {self.name}>"

    @abc.abstractmethod
    def not_supported_reasons(self, problem: DecodeProblem) -> list[str]:
        """Why this backend cannot run `problem` (empty when it can)."""

    @abc.abstractmethod
    def run(
        self,
        problem: DecodeProblem,
        inputs: DecodeInputs,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        """Compute the step into `out` `[B*L, Hq, D]` (and `lse` `[B*L, Hq]` when given)."""
