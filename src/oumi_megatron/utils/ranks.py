"""This process's ranks, for "rank 0 only" work (logs, files, plots), and the one collective that turns a failure on
some ranks into the same error on all of them."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist


def global_rank() -> int:
    """torch.distributed's rank once initialized; before that torchrun's ``RANK`` (the resume plan and the
    output-folder checks run before the process group exists); 0 in a plain single process."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``; 0 in a plain single process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def first_failure(problem: str | None) -> str | None:
    """Collective (where torch.distributed is initialized): the first rank's ``problem`` that is not None, on every rank,
    so that a failure some ranks see stops all of them alike instead of leaving the others waiting in a collective.
    Gathers one small object per rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    problems: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def from_rank0(value: Any) -> Any:
    """Collective: rank 0's ``value`` on every rank (a decision made once)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
