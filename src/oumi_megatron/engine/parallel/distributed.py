"""torch.distributed and Megatron-Core process groups (TP, PP, CP, EP, DP, VPP) of a resolved ParallelLayout."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.cpu_shims import install_cpu_shims
from oumi_megatron.utils.net import LOOPBACK, free_port, route_address

if TYPE_CHECKING:
    from oumi_megatron.engine.parallel.layout import ParallelLayout


def node_address() -> str:
    """This node's address as other nodes reach it: the local end of a route to the rendezvous host (MASTER_ADDR),
    127.0.0.1 when the rendezvous is on this host. Where a rank hosts a store others connect to (a weight sender's
    group)."""
    return route_address(os.environ.get("MASTER_ADDR", LOOPBACK), int(os.environ.get("MASTER_PORT", "29500")))


def _single_host() -> bool:
    """Every rank of the world runs on this host (torchrun's LOCAL_WORLD_SIZE is the world's size)."""
    return os.environ.get("LOCAL_WORLD_SIZE", "1") == os.environ.get("WORLD_SIZE", "1")


def init_distributed(timeout_minutes: int = 30) -> None:
    """Create the default process group: NCCL on GPUs, gloo on CPU. Works without torchrun (1 rank).

    Nothing of it listens beyond this host where the world is on this host: a world of one keeps its store in memory
    (no TCP rendezvous at all), and a single-host world's gloo connections go over the loopback interface
    (GLOO_SOCKET_IFNAME, where the user did not set it). NCCL's bootstrap takes NCCL_SOCKET_IFNAME's interface (a
    single-host trainer may still stream weights to engines on other nodes over NCCL, so it is left to the user), and
    torchrun's own rendezvous store (MASTER_PORT) is torchrun's: docs/security.md says how to keep both private."""
    if dist.is_initialized():
        return
    one = "RANK" not in os.environ  # a plain `python`/`oumi train` run: a world of one
    if one:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR=LOOPBACK)
        os.environ.setdefault("MASTER_PORT", str(free_port()))  # read by code that asks where the rendezvous is
    loopback = _loopback_interface()
    if _single_host() and loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    timeout = timedelta(minutes=timeout_minutes)
    if one:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)


def _loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux); None where there is none by that name."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def init_model_parallel(layout: ParallelLayout, seed: int = 1234, cuda_graphs: bool = False) -> None:
    """Megatron-Core's process groups and its model-parallel RNG, for the resolved ``layout`` (a CUDA-graph-safe
    RNG when the layers will be captured: engine/kernels/cuda_graphs.py)."""
    from megatron.core import parallel_state, tensor_parallel

    init_distributed()
    install_cpu_shims()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_parallel,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline,
        context_parallel_size=layout.context_parallel,
        expert_model_parallel_size=layout.expert_parallel,
        expert_tensor_parallel_size=layout.expert_tensor_parallel,
    )
    if cuda_graphs:
        tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True, force_reset_rng=True)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def data_parallel() -> tuple[int, int, Any]:
    """(size, rank, group) of this rank's data-parallel group; (1, 0, None) before model parallelism."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0, None
    return ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), ps.get_data_parallel_group()


_replica_groups: tuple[Any, tuple[Any, list[int]]] | None = None
"""(the data-parallel group it was built for, replica_group's answer): built once per model-parallel state."""


def replica_group() -> tuple[Any, list[int]]:
    """Collective over the world the first time for a model-parallel state: a gloo group of the ranks that share this
    rank's data-parallel rank (its model replica: TP x PP x CP ranks, which train on the same completions), and their
    ranks in order. Every rank creates every replica's group, as torch.distributed requires; objects (rollouts,
    scores) travel in it on the CPU. The rollout backend and the reward scorer share one set of groups."""
    global _replica_groups
    from megatron.core import parallel_state as ps

    dp_group = ps.get_data_parallel_group()
    if _replica_groups is not None and _replica_groups[0] is dp_group:  # the same parallel state: the same groups
        return _replica_groups[1]
    dp_ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(dp_ranks, ps.get_data_parallel_rank())
    mine: tuple[Any, list[int]] | None = None
    for d in sorted(set(dp_ranks)):
        ranks = [r for r, x in enumerate(dp_ranks) if x == d]
        group = dist.new_group(ranks, backend="gloo")
        if d == dp_ranks[dist.get_rank()]:
            mine = (group, ranks)
    assert mine is not None
    _replica_groups = (dp_group, mine)  # holding the group keeps its identity unique while cached
    return mine


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
