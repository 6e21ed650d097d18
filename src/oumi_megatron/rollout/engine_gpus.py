"""Where an engine with a GPU of its own runs (``rollout_placement: separate``, vLLM's and SGLang's): the node's GPUs
after the trainer's, one per engine, numbered in rank order among the node's owners."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist


def engine_gpu(visible: list[str], trainer_gpus: int, engine_index: int) -> str:
    """The GPU of the ``engine_index``-th engine process on a node (``separate`` placement): the node's
    GPUs after the ``trainer_gpus`` that torchrun's ranks use (rank i on GPU i). ``visible``: the
    node's GPUs as the trainer sees them (CUDA_VISIBLE_DEVICES entries, or "0".."N-1")."""
    needed = trainer_gpus + engine_index + 1
    if len(visible) < needed:
        raise ValueError(
            f"megatron.rollout_placement: separate puts each vLLM engine on a GPU of its own after the trainer's, "
            f"but this node has {len(visible)} GPU(s), the trainer uses {trainer_gpus} and engine "
            f"#{engine_index} would need GPU {needed - 1}. Start fewer trainer processes per node "
            "(torchrun --nproc-per-node), or use rollout_placement: colocated."
        )
    return visible[trainer_gpus + engine_index]


def engine_gpu_for_owner(is_owner: bool) -> str | None:
    """Collective over the world: this owner's engine GPU, None without CUDA or for non-owners.
    Owners on one node are numbered in rank order."""
    if not torch.cuda.is_available():
        return None
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (socket.gethostname(), is_owner))
    me = dist.get_rank()
    if not is_owner:
        return None
    index = sum(1 for host, owner in flags[:me] if owner and host == flags[me][0])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return engine_gpu(gpus, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), index)
