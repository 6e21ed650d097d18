"""``megatron.rollout_placement: ray``: a fleet of vLLM engines as Ray actors, on any node of a Ray cluster.

The trainer stays under torchrun. Its rank 0 connects to Ray (``megatron.ray_address``: an address, ``auto``, or
``local`` to start a head that sees only this node's GPUs the trainer's ranks do not use) and places
``megatron.rollout_engines`` engines, each an actor in a placement group of its own (``rollout_gpus_per_engine``
GPUs, STRICT_PACK). Multi-node recipe: ``ray start --head`` on one node, ``ray start --address=HEAD:6379`` on the
rollout nodes, then the trainer with ``ray_address: HEAD:6379`` (README).

- Requests: every rank hands its data-parallel replica's prompts to rank 0 (one all-gather), which spreads each
  replica's prompts over the engines and hands each replica its rollouts back, in order.
- Weights: one process group of rank 0 and every engine (rollout/weight_stream.py ``WeightSyncGroup``: a TCP store on
  rank 0, NCCL on GPUs, gloo on CPU), bucketed broadcasts into each engine's vLLM weight-transfer session
  (rollout/vllm_engine.py ``oumi_stream``); every update carries its policy version.
- Asynchronous GRPO (``grpo.max_staleness``): the same ``submit`` / ``collect`` / ``push_weights`` as a separate
  engine (rollout/vllm_backend.py); a batch's version is the oldest of the engines that generated it.

Not built yet: an engine's vLLM tensor parallelism inside the fleet (``rollout_gpus_per_engine`` > 1), and
restarting an engine actor that died (the run stops with ``WeightSyncError``).
"""

from __future__ import annotations

import collections
import os
import socket
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.parallel.distributed import free_port
from oumi_megatron.rollout import weight_stream
from oumi_megatron.rollout.base import EngineSleep, PolicyWeights, Rollout, WeightSyncStats
from oumi_megatron.rollout.sampling import SamplingParams
from oumi_megatron.rollout.vllm_backend import TaggedRollouts, _rollouts, _vllm_sampling
from oumi_megatron.rollout.weight_push import WeightPusher, WeightSyncError

if TYPE_CHECKING:
    from oumi_megatron.rollout.vllm_engine import EngineSpec


class EngineActor:
    """One vLLM engine in a Ray actor (decorated by ``ray.remote`` where the fleet is placed). Ray runs an actor's
    calls one at a time, in the order they were made: generations queued before a weight update run before it."""

    def __init__(self, spec: EngineSpec) -> None:
        from oumi_megatron.rollout.vllm_engine import VllmEngineHost, forget_launcher_env

        forget_launcher_env()  # a local head's workers inherit the trainer's torchrun variables
        self.host = VllmEngineHost(spec)

    def node(self) -> str:
        return socket.gethostname()

    def generate_tagged(self, prompts: list[list[int]], sampling: dict[str, Any]) -> tuple[int, float, Any]:
        return self.host.generate_tagged(prompts, sampling)

    def init_transfer(self, init_info: dict[str, Any]) -> None:
        self.host.init_transfer(init_info)

    def open_update(self) -> None:
        self.host.open_update()

    def finish_update(self, version: int) -> None:
        self.host.finish_update(version)


def _spare_gpus() -> list[str]:
    """This node's GPUs after the ones torchrun's ranks here use (rank i on GPU i): what a local head may hand out."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return gpus[int(os.environ.get("LOCAL_WORLD_SIZE", "1")):]


_started_ray = False
"""Whether this process started Ray (``ray_address: local``): the fleet's ``close`` then shuts it down."""


def connect(address: str, engines: int, gpus_per_engine: int) -> None:
    """Connect to the Ray cluster (or start a local head) and check it can hold the fleet. Errors name the field and
    the fix. train.py calls it on rank 0 before converting the model (``preflight``); the backend again (a no-op)."""
    global _started_ray
    import ray

    cuda = torch.cuda.is_available()
    if not ray.is_initialized():
        if address == "local":
            saved = os.environ.get("CUDA_VISIBLE_DEVICES")
            spare = _spare_gpus() if cuda else []
            # the head's raylet takes its GPU ids from CUDA_VISIBLE_DEVICES: only the ones the trainer leaves free
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(spare)
            try:
                ray.init(num_cpus=os.cpu_count() or 1, num_gpus=len(spare), include_dashboard=False,
                         log_to_driver=False, configure_logging=False)
            finally:
                if saved is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = saved
            _started_ray = True
        else:
            fix = ("Start it with `ray start --head` (rollout nodes: `ray start --address=HEAD:6379`) and give its address, "
                   "or use ray_address: local for this node's spare GPUs.")
            if ":" in address and not address.startswith("ray://"):  # HOST:PORT: a quick probe (Ray retries for minutes)
                host, port = address.rsplit(":", 1)
                try:
                    socket.create_connection((host, int(port)), timeout=10).close()
                except (OSError, ValueError) as e:
                    raise ValueError(f"megatron.ray_address: nothing answers at {address!r} ({e}). {fix}") from e
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
            except Exception as e:  # noqa: BLE001 - any failure to reach the cluster is the same fix
                raise ValueError(f"megatron.ray_address: cannot reach the Ray cluster at {address!r} ({e}). {fix}") from e
    need = engines * gpus_per_engine
    have = ray.cluster_resources().get("GPU", 0.0) if cuda else ray.cluster_resources().get("CPU", 0.0)
    if have < need:
        kind = "GPU(s)" if cuda else "CPU(s)"
        raise ValueError(f"megatron.rollout_engines x rollout_gpus_per_engine = {engines} x {gpus_per_engine} needs {need} "
                         f"{kind} in the Ray cluster, which has {have:g}. Add nodes (`ray start --address=...`), start "
                         "fewer trainer ranks on this node (ray_address: local sees only the GPUs they leave), or ask "
                         "for fewer rollout_engines.")


def preflight(params: Any) -> None:
    """``rollout_placement: ray``, on rank 0 before conversion: the cluster is reachable and can hold the fleet."""
    if params.inference_backend == "vllm" and params.rollout_placement == "ray" and dist_rank() == 0:
        connect(params.ray_address, params.rollout_engines, params.rollout_gpus_per_engine)


def dist_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def place_engines(spec: EngineSpec, engines: int, gpus_per_engine: int) -> tuple[list[Any], list[Any]]:
    """Start the engine actors, one placement group each (STRICT_PACK: an engine's GPUs on one node); waits until
    every engine has loaded its model. Returns (actors, placement groups)."""
    import dataclasses

    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cuda = torch.cuda.is_available()
    bundle = {"CPU": 1.0, **({"GPU": float(gpus_per_engine)} if cuda else {})}
    groups = [placement_group([bundle], strategy="STRICT_PACK") for _ in range(engines)]
    ray.get([g.ready() for g in groups])
    remote = ray.remote(EngineActor)
    actors: list[Any] = [remote.options(num_cpus=1, num_gpus=gpus_per_engine if cuda else 0,
                                        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=g),
                                        name=f"oumi-megatron-vllm-{i}").remote(dataclasses.replace(spec, seed=spec.seed + i))
                         for i, g in enumerate(groups)]
    ray.get([a.node.remote() for a in actors])  # raises with the engine's error if one failed to start
    return actors, groups


class RayRolloutBackend:
    """``inference_backend: vllm`` with ``rollout_placement: ray``. Collective over the training ranks like the other
    backends; only rank 0 talks to Ray."""

    def __init__(self, hf_model: str, dtype: torch.dtype, params: Any, grpo: Any, seed: int,
                 trust_remote_code: bool = False) -> None:
        from megatron.core import parallel_state as ps

        from oumi_megatron.rollout.vllm_backend import _vllm_cuda_graphs
        from oumi_megatron.rollout.vllm_engine import STREAM_ENGINE, EngineSpec

        self.method, self.bucket_bytes = params.weight_sync_method, int(params.weight_sync_bucket_mb * 2**20)
        self.rank, self.dp_rank = dist.get_rank(), ps.get_data_parallel_rank()
        self.actors: list[Any] = []
        self.placement_groups: list[Any] = []
        self.group: weight_stream.WeightSyncGroup | None = None
        self.in_flight: collections.deque[Any] = collections.deque()
        self.pusher = WeightPusher(self.method)
        if self.rank == 0:
            spec = EngineSpec(
                model=str(hf_model), dtype=str(dtype).removeprefix("torch."), seed=seed,
                max_model_len=grpo.max_prompt_length + grpo.max_completion_length,
                gpu_memory_utilization=params.vllm_gpu_memory_utilization,
                kv_cache_bytes=int(params.vllm_kv_cache_gib * 2**30) if torch.cuda.is_available() else 64 * 2**20,
                extra={"trust_remote_code": True} if trust_remote_code else {},
                cuda_graphs=_vllm_cuda_graphs(params.rollout_cuda_graphs_choice), transfer_backend=STREAM_ENGINE)
            connect(params.ray_address, params.rollout_engines, params.rollout_gpus_per_engine)
            self.actors, self.placement_groups = place_engines(spec, params.rollout_engines, params.rollout_gpus_per_engine)
            self._open_weight_group()
        dist.barrier()

    def _open_weight_group(self) -> None:
        """One group of rank 0 and every engine: the engines join while rank 0 opens the store and waits for them."""
        import ray

        host = ray.util.get_node_ip_address() or "127.0.0.1"
        port = free_port()
        world = 1 + len(self.actors)
        joined = [a.init_transfer.remote({"host": host, "port": port, "backend": self.method, "rank": i + 1,
                                          "world_size": world}) for i, a in enumerate(self.actors)]
        self.group = weight_stream.WeightSyncGroup(host, port, rank=0, backend=self.method, world_size=world)
        ray.get(joined)

    # -- requests: every replica's prompts through rank 0 ---------------------------------------------------------------
    def _gather_requests(self, prompts: list[list[int]], n: int) -> dict[int, tuple[list[list[int]], int]] | None:
        """Collective: every replica's request (its ranks ask for the same prompts), on rank 0."""
        requests: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(requests, (self.dp_rank, prompts, n))
        return {dp: (p, k) for dp, p, k in requests} if self.rank == 0 else None

    def _submit_all(self, requests: dict[int, tuple[list[list[int]], int]], sampling: Any) -> dict[int, list[tuple[list[int], Any]]]:
        """Rank 0: each replica's prompts spread over the engines round-robin: (prompt indices, the engine's future)."""
        plan: dict[int, list[tuple[list[int], Any]]] = {}
        for dp, (prompts, n) in sorted(requests.items()):
            parts = []
            for e, actor in enumerate(self.actors):
                mine = list(range(e, len(prompts), len(self.actors)))
                if mine:
                    parts.append((mine, actor.generate_tagged.remote([prompts[i] for i in mine], _vllm_sampling(sampling, n)).future()))
            plan[dp] = parts
        return plan

    @staticmethod
    def _assemble(plan: dict[int, list[tuple[list[int], Any]]]) -> dict[int, tuple[int, float, list[Any]]]:
        """Rank 0: each replica's results in its prompts' order, the oldest version among its engines, their longest time."""
        out = {}
        for dp, parts in plan.items():
            by_index: dict[int, Any] = {}
            versions, seconds = [], []
            for mine, future in parts:
                version, took, results = _wait(future)
                versions.append(version)
                seconds.append(took)
                by_index.update(zip(mine, results))
            out[dp] = (min(versions, default=0), max(seconds, default=0.0), [by_index[i] for i in range(len(by_index))])
        return out

    def _scatter(self, assembled: dict[int, tuple[int, float, list[Any]]] | None) -> tuple[int, float, list[Any]]:
        box = [assembled]
        dist.broadcast_object_list(box, src=0)
        assert box[0] is not None
        return box[0][self.dp_rank]

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int, seed: int | None = None) -> list[list[Rollout]]:
        """Every rank gets its replica's rollouts, ``n`` per prompt, grouped per prompt (engines are seeded once)."""
        requests = self._gather_requests(prompts, n)
        assembled = self._assemble(self._submit_all(requests, params)) if requests is not None else None
        return _rollouts(prompts, self._scatter(assembled)[2])

    # -- asynchronous GRPO ---------------------------------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], params: SamplingParams, n: int) -> None:
        requests = self._gather_requests(prompts, n)
        self.in_flight.append((prompts, self._submit_all(requests, params) if requests is not None else None))

    def collect(self) -> TaggedRollouts:
        prompts, plan = self.in_flight.popleft()
        version, seconds, results = self._scatter(self._assemble(plan) if plan is not None else None)
        return TaggedRollouts(_rollouts(prompts, results), version, seconds)

    # -- weights -------------------------------------------------------------------------------------------------------
    def push_weights(self, weights: PolicyWeights, version: int) -> WeightSyncStats:
        """Collective over the training ranks: the export now (rank 0 keeps a snapshot), every engine's update queued
        behind its generations, the broadcast from a background thread once every engine has opened its session."""
        if self.rank != 0:
            start = time.perf_counter()
            n = sum(1 for _ in weights())  # take part in the collective export
            return WeightSyncStats(self.method, n, 0, time.perf_counter() - start)
        assert self.group is not None
        actors = self.actors

        def open_sessions() -> tuple[list[Future], list[Future]]:
            return ([a.open_update.remote().future() for a in actors],
                    [a.finish_update.remote(version).future() for a in actors])

        return self.pusher.push(weights, self.group, self.bucket_bytes, open_sessions, lambda f, _what: _wait(f))

    def wait_pushed(self) -> float | None:
        return self.pusher.wait()

    def sync_weights(self, weights: PolicyWeights) -> WeightSyncStats:
        """The synchronous loop's sync: a push, waited for."""
        start = time.perf_counter()
        stats = self.push_weights(weights, version=-1)
        self.wait_pushed()
        stats.seconds = time.perf_counter() - start
        return stats

    def wake(self) -> float:
        return 0.0  # the fleet's engines keep their GPUs

    def sleep(self) -> EngineSleep:
        return EngineSleep()

    def close(self) -> None:
        self.pusher.close()
        if self.rank != 0 or not self.actors:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor)
        for group in self.placement_groups:
            remove_placement_group(group)
        self.actors = []
        if _started_ray:
            ray.shutdown()


def _wait(future: Future, timeout_s: float = 3600.0) -> Any:
    """A fleet call's result; an engine that died or failed stops training with its error."""
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError:
        raise WeightSyncError(f"a Ray engine did not answer in {timeout_s:.0f} s") from None
    except Exception as e:  # noqa: BLE001 - RayActorError, RayTaskError: the engine's own error is in the message
        raise WeightSyncError(f"a Ray engine failed: {e}") from e
