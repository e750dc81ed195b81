"""The process group of a merge: its size and this rank, and the collectives msa uses, written
into caller-given tensors (`out=` forms only: nothing is allocated, so they can be captured in a
CUDA graph with NCCL).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from msa.errors import MSAInputError

__all__ = ["GroupInfo", "group_info", "all_gather_into", "reduce_scatter_into", "all_to_all_into", "all_reduce_"]

ProcessGroup = Any  # torch.distributed.ProcessGroup (typed loosely across torch versions)


class GroupInfo:
    """A process group with its size and this process's rank in it.

    Attributes:
        group: the torch.distributed group (None: the default group).
        world_size: ranks in the group (`W`).
        rank: this process's rank in the group.
    """

    def __init__(self, group: ProcessGroup | None, world_size: int, rank: int) -> None:
        self.group = group
        self.world_size = world_size
        self.rank = rank

    def __repr__(self) -> str:
        return f"GroupInfo(rank {self.rank} of {self.world_size})"


def group_info(group: ProcessGroup | None) -> GroupInfo:
    """Size and rank of `group` (None: the default group).

    Raises:
        MSAInputError: torch.distributed is not initialised, or this process is not in `group`.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise MSAInputError(
            "group", "an initialised torch.distributed process group", "torch.distributed not initialised",
            "Call torch.distributed.init_process_group (gloo on CPU, nccl on CUDA) first.",
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise MSAInputError("group", "a process group this process belongs to", "a group without this rank")
    return GroupInfo(group, dist.get_world_size(group), rank)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    """`output` `[W, *tensor.shape]` (contiguous) <- every rank's `tensor` (contiguous)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output.view(-1), tensor.view(-1), group=group)


def reduce_scatter_into(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    """`output` <- the sum over ranks of chunk `rank` of `tensor` `[W, *output.shape]`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output.view(-1), tensor.view(-1), group=group)


def all_to_all_into(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    """`output[s]` <- chunk `rank` of rank `s`'s `tensor`; both `[W, ...]`, contiguous."""
    dist.all_to_all_single(output.view(-1), tensor.view(-1), group=group)


def all_reduce_(tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    """`tensor` <- its sum over ranks, in place."""
    dist.all_reduce(tensor, group=group)
