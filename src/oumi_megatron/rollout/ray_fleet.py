"""``megatron.rollout_placement: ray``: a fleet of vLLM engines as Ray actors, on any node of a Ray cluster.

The trainer stays under torchrun. Its rank 0 connects to Ray (``megatron.ray_address``: an address, ``auto``, or
``local`` to start a head that sees only this node's GPUs the trainer's ranks do not use) and places
``megatron.rollout_engines`` engines, each an actor in a placement group of its own (``rollout_gpus_per_engine``
GPUs, STRICT_PACK). Multi-node recipe: ``ray start --head`` on one node, ``ray start --address=HEAD:6379`` on the
rollout nodes, then the trainer with ``ray_address: HEAD:6379`` (README).

- Requests: each replica's first rank hands its prompts to rank 0 (a gather), which spreads each replica's prompts over
  the engines and hands each replica's first rank its rollouts back (a scatter), which passes them on in its replica:
  a rank moves its replica's share, never every replica's.
- Weights: the first replica's ranks send, each its share of its pipeline stage's tensors (weight_sync/senders.py),
  over a process group of its own with every engine worker (weight_sync/stream.py ``WeightSyncGroup``: a TCP store
  on the sender, NCCL on GPUs, gloo on CPU): bucketed broadcasts into each engine's vLLM weight-transfer session
  (weight_sync/vllm_stream.py ``oumi_stream``), which receives from every sender at once; every update carries its
  policy version (weight_sync/push.py).
- Asynchronous GRPO (``grpo.max_staleness``): the same ``submit`` / ``collect`` / ``push_weights`` as a separate
  engine (rollout/vllm_backend.py); a batch's version is the oldest of the engines that generated it.
- Asynchronous episodes (``grpo.environment``, ``grpo.partial_rollouts``): rank 0 runs every replica's episode jobs on
  a thread of its own (``_FleetEngine``: each turn, or each piece of a turn, a call to the actors, which take a weight
  push between two calls) and hands each replica its samples at ``collect``.
- Faults: an engine actor that dies is started again in its placement group, re-synced, and its prompts issued again
  (``RayRolloutBackend``; ``megatron.rollout_engine_restarts`` bounds how often).
- ``rollout_gpus_per_engine`` > 1: an engine's vLLM runs tensor-parallel over its GPUs (a worker process each, vLLM's
  ``mp`` executor inside the actor); every worker is a member of every sender's group and receives the full tensors.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import queue
import socket
import threading
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.parallel.distributed import replica_group
from oumi_megatron.rollout.base import (
    DecodeProfile,
    EngineSleep,
    EpisodeJob,
    PolicyWeights,
    Rollout,
    TaggedRollouts,
    VersionedCalls,
    WeightSyncStats,
)
from oumi_megatron.rollout.sampling import SamplingParams
from oumi_megatron.rollout.vllm_common import engine_spec, vllm_rollouts, vllm_sampling
from oumi_megatron.rollout.weight_sync.base import WeightSyncError
from oumi_megatron.rollout.weight_sync.push import WeightPusher
from oumi_megatron.rollout.weight_sync.senders import SenderRole, open_links, probe_raw, replica_stats, sender_role
from oumi_megatron.rollout.weight_sync.stream import RAW_PROBE_REPEATS, WeightSyncGroup
from oumi_megatron.utils.disk import GIB

if TYPE_CHECKING:
    from oumi_megatron.rollout.vllm_engine import EngineSpec

logger = logging.getLogger("oumi")


class EngineActor:
    """One vLLM engine in a Ray actor (decorated by ``ray.remote`` where the fleet is placed). Ray runs an actor's
    calls one at a time, in the order they were made: generations queued before a weight update run before it."""

    def __init__(self, spec: EngineSpec) -> None:
        from oumi_megatron.rollout.vllm_engine import VllmEngineHost
        from oumi_megatron.utils.launcher_env import forget_launcher_env

        forget_launcher_env()  # a local head's workers inherit the trainer's torchrun variables
        self.host = VllmEngineHost(spec)

    def node(self) -> str:
        return socket.gethostname()

    def generate_tagged(self, prompts: list[list[int]], sampling: dict[str, Any]) -> tuple[int, float, Any]:
        return self.host.generate_tagged(prompts, sampling)

    def init_transfer(self, init_info: dict[str, Any]) -> None:
        self.host.init_transfer(init_info)

    def receive_raw(self, nbytes: int, repeats: int) -> None:
        self.host.receive_raw(nbytes, repeats)

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


def preflight(params: Any, model_name: str) -> None:
    """``rollout_placement: ray``, on rank 0 before conversion: the cluster is reachable, has the engines' GPUs, and an
    engine's GPU(s) hold the model."""
    if dist_rank() == 0:
        connect(params.ray_address, params.rollout_engines, params.rollout_gpus_per_engine)
        check_engine_fits(params, model_name)


def check_engine_fits(params: Any, model_name: str) -> None:
    """An engine's share of the weights (bf16, split over its GPUs), plus ``vllm_kv_cache_gib`` where set, within what
    vLLM may use of one GPU (``vllm_gpu_memory_utilization`` of a GPU of the cluster, asked of Ray); on CPU, within
    the largest node's memory."""
    from oumi_megatron.model_shape import ModelShape

    g, cuda = params.rollout_gpus_per_engine, torch.cuda.is_available()
    # one GPU's share of the weights; on CPU the engine's workers share one node's memory
    weights = ModelShape.resolve(model_name).vllm_weight_bytes(g if cuda else 1)
    need = weights + (params.vllm_kv_cache_gib or 0.0) * GIB
    if cuda:
        total = _gpu_memory_in_cluster()
        have = total * params.vllm_gpu_memory_utilization
        where = (f"{have / GIB:.1f} GiB ({total / GIB:.0f} GiB GPU x megatron.vllm_gpu_memory_utilization "
                 f"{params.vllm_gpu_memory_utilization})")
        fix = ("Give each engine more GPUs (megatron.rollout_gpus_per_engine: vLLM tensor parallelism), raise "
               "vllm_gpu_memory_utilization (engines of the fleet have their GPUs to themselves: 0.9 is usual), or lower "
               "vllm_kv_cache_gib.")
    else:
        have = _largest_node_memory()
        where = f"{have / GIB:.1f} GiB (the largest Ray node's memory)"
        fix = "Add a node with more memory to the Ray cluster, or use a smaller model."
    if need > have:
        kv = f" + {params.vllm_kv_cache_gib:g} GiB KV cache (megatron.vllm_kv_cache_gib)" if params.vllm_kv_cache_gib else ""
        share = f"over rollout_gpus_per_engine = {g} GPU(s)" if cuda else "in one node's memory"
        raise ValueError(f"megatron.rollout_placement: ray: an engine needs {weights / GIB:.1f} GiB for {model_name}'s "
                         f"weights (bf16, {share}){kv}, more than it may use: {where} {fix}")


def _gpu_memory_in_cluster() -> int:
    """One GPU's memory, asked of a task that Ray places on a GPU (the fleet's engines are not started yet)."""
    import ray

    def total_memory() -> int:
        return int(torch.cuda.get_device_properties(0).total_memory)

    return int(ray.get(ray.remote(num_gpus=1, num_cpus=0)(total_memory).remote(), timeout=300))


def _largest_node_memory() -> float:
    import ray

    return max((float(n["Resources"].get("memory", 0.0)) for n in ray.nodes() if n.get("Alive")), default=0.0)


def dist_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def place_groups(engines: int, gpus_per_engine: int) -> list[Any]:
    """One placement group per engine (STRICT_PACK: an engine's GPUs on one node), ready. An engine that dies gives
    its bundle back to its group, where its replacement starts."""
    import ray
    from ray.util.placement_group import placement_group

    bundle = {"CPU": 1.0, **({"GPU": float(gpus_per_engine)} if torch.cuda.is_available() else {})}
    groups = [placement_group([bundle], strategy="STRICT_PACK") for _ in range(engines)]
    ray.get([g.ready() for g in groups])
    return groups


def start_engine(spec: EngineSpec, group: Any, index: int, start: int, gpus_per_engine: int) -> Any:
    """Engine ``index``'s actor (its ``start``-th start) in its placement group; not waited for (``node`` is)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote = ray.remote(EngineActor)
    # vLLM tensor parallelism over the engine's GPUs: its workers are processes the engine starts (the actor holds the
    # GPUs, so they see just those)
    mine = dataclasses.replace(spec, seed=spec.seed + index, tensor_parallel_size=gpus_per_engine,
                               executor="mp" if gpus_per_engine > 1 else "uni")
    return remote.options(num_cpus=1, num_gpus=gpus_per_engine if torch.cuda.is_available() else 0,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group),
                          name=f"oumi-megatron-vllm-{index}.{start}").remote(mine)


def _engine_died(error: BaseException | None) -> bool:
    """An actor that is gone (its process killed or crashed, its node lost), as opposed to an engine that raised."""
    import ray

    return isinstance(error, ray.exceptions.RayActorError)


@dataclass
class _Part:
    """A share of one replica's prompts sent to one engine: what is issued again if the engine dies before answering."""

    engine: int
    indices: list[int]
    """The prompts' positions in the replica's request."""
    prompts: list[list[int]]
    sampling: dict[str, Any]
    future: Future


Plan = dict[int, list[_Part]]
"""Rank 0's view of one generation: each replica's parts, by data-parallel rank."""

ByReplica = dict[int, tuple[int, float, Any]]
"""Rank 0's results of a submission: per data-parallel rank, (the oldest version, the engines' seconds, the results)."""


@dataclass
class _InFlight:
    """An asynchronous submission not collected yet: a single generation (``plan``) or episode jobs (``jobs``)."""

    prompts: list[list[int]]
    plan: Plan | None = None
    """Rank 0: the generation's parts (what is issued again to a replaced engine)."""
    jobs: Future | None = None
    """Rank 0: every replica's episode jobs (their ``ByReplica``)."""
    episodes: bool = False


class _FleetEngine(VersionedCalls):
    """The fleet as what rank 0's episode thread generates with (rollout/base.py ``Generates``), called on the actors
    directly: a call's requests are spread over the engines in contiguous blocks (rows keep their order between turns,
    so an episode's next turn mostly finds its prefix in the same engine's cache). A call that an engine's death cuts
    short parks until the trainer's collective recovery has queued the policy on its replacement, then goes again
    there. A call's seconds are its slowest engine's."""

    def __init__(self, fleet: RayRolloutBackend) -> None:
        super().__init__()
        self.fleet = fleet

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        if not prompts:
            return []
        fleet, sampling = self.fleet, vllm_sampling(params, n)
        engines = len(fleet.actors)
        size = -(-len(prompts) // engines)
        pending = {e: list(range(e * size, min((e + 1) * size, len(prompts)))) for e in range(engines) if e * size < len(prompts)}
        got: dict[int, tuple[int, Any]] = {}  # prompt position -> (version, its results)
        took = 0.0
        while pending:
            with fleet.swap:  # no replacement is under way: these are live engines, or ones with the policy queued
                seen = fleet.recoveries
                calls = {e: fleet.actors[e].generate_tagged.remote([prompts[i] for i in idx], sampling).future()
                         for e, idx in pending.items()}
            futures.wait(calls.values())
            dead = {}
            for e, future in calls.items():
                error = future.exception()
                if error is None:
                    version, seconds, results = future.result()
                    took = max(took, seconds)
                    got.update({i: (version, r) for i, r in zip(pending[e], results, strict=True)})
                elif _engine_died(error):
                    dead[e] = _first_line(error)
                else:
                    raise WeightSyncError(f"Ray engine {e} failed: {error}")
            pending = {e: pending[e] for e in dead}
            if dead:
                fleet.wait_replaced(seen, set(dead), f"engine(s) {sorted(dead)} died ({next(iter(dead.values()))})")
        rollouts = vllm_rollouts(prompts, [got[i][1] for i in range(len(prompts))])
        for i, group in enumerate(rollouts):  # a push may land between two calls: each keeps its engine's version
            for r in group:
                r.version = got[i][0]
        self.tally(min(v for v, _ in got.values()), took)
        return rollouts


class _EnginesLost(Exception):
    """Rank 0, waiting for a generation: engines died (or a push to them failed) and must be restarted."""

    def __init__(self, engines: set[int], cause: str) -> None:
        super().__init__(cause)
        self.engines, self.cause = engines, cause


class RayRolloutBackend:
    """``inference_backend: vllm`` with ``rollout_placement: ray``. Collective over the training ranks like the other
    backends; only rank 0 talks to Ray.

    Faults: an engine whose actor dies is started again in its placement group (``megatron.rollout_engine_restarts``
    restarts per run at most), every engine joins a new weight-sync group, the policy is pushed again (the version the
    engines had) and the dead engine's prompts are issued again, in order, to its replacement: every prompt is
    answered once. A push that fails restarts every engine (an engine mid-update cannot be told apart from a dead
    one). A warning says why; ``rollout/engine_restarts`` counts them."""

    def __init__(self, hf_model: str, dtype: torch.dtype, params: Any, grpo: Any, seed: int,
                 trust_remote_code: bool = False) -> None:
        from megatron.core import parallel_state as ps

        from oumi_megatron.rollout.weight_sync.vllm_stream import STREAM_ENGINE

        self.method, self.bucket_bytes = params.weight_sync_method, int(params.weight_sync_bucket_mb * 2**20)
        self.rank, self.dp_rank = dist.get_rank(), ps.get_data_parallel_rank()
        self.gpus_per_engine, self.max_restarts = params.rollout_gpus_per_engine, params.rollout_engine_restarts
        self.actors: list[Any] = []
        self.placement_groups: list[Any] = []
        self.starts: list[int] = []
        """How many times each engine was started."""
        self.restarts = 0
        self.engines = params.rollout_engines
        # the first replica's ranks send (every replica holds the same weights); the others only take part in exports
        self.replica_group, self.replica = replica_group()
        role = sender_role(self.replica_group, self.replica)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (self.dp_rank, self.rank == self.replica[0]))
        self.replica_firsts: list[tuple[int, bool]] = every
        """Per global rank: its data-parallel rank, and whether it is its replica's first rank (where results go)."""
        self.role = role if self.dp_rank == 0 else SenderRole(role.ranks, None, role.share, role.shares)
        self.link: WeightSyncGroup | None = None
        """This rank's group with every engine worker, if it sends."""
        self.raw_gbps: float | None = None
        self.in_flight: collections.deque[_InFlight] = collections.deque()
        """Asynchronous GRPO: what was submitted and not collected yet, oldest first."""
        self.episode_thread: ThreadPoolExecutor | None = None
        """Rank 0: where every replica's episode jobs run, one submission at a time, in order (``submit_episodes``)."""
        self.swap = threading.RLock()
        """Rank 0: held while engines are replaced, until the replacements have the policy queued; the episode thread
        issues its calls under it, so none reaches a replacement before its weights."""
        self.replaced = threading.Condition(self.swap)
        self.recoveries = 0
        """Rank 0: how many times engines were replaced (under ``swap``): an episode call parked on a dead engine goes
        again once this grows."""
        self.lost: queue.Queue[tuple[int, set[int], str]] = queue.Queue()
        """Rank 0: engines the episode thread found dead, ``(recoveries when it called, engines, cause)``."""
        self.closed = False
        self.pusher = WeightPusher(self.method)
        self.push_failed: str | None = None
        """Rank 0: why the last push failed, until the engines are restarted for it."""
        self.weights: PolicyWeights | None = None
        self.version = 0
        """The last push's weights and version (every rank): what restarted engines get. None: the engines still hold
        the weights they started from, the policy's own."""
        if self.rank == 0:
            self.spec = engine_spec(hf_model, dtype, params, grpo, seed, trust_remote_code, transfer_backend=STREAM_ENGINE)
            connect(params.ray_address, params.rollout_engines, params.rollout_gpus_per_engine)
            self.placement_groups = place_groups(params.rollout_engines, params.rollout_gpus_per_engine)
            self.starts = [1] * params.rollout_engines
            self.actors = [start_engine(self.spec, g, i, 1, self.gpus_per_engine) for i, g in enumerate(self.placement_groups)]
            self._wait_started(range(len(self.actors)))
        if self.dp_rank == 0:
            self._open_weight_groups()
            self.raw_gbps = probe_raw(self.link, self.replica_group, 0, self._receive_raw if self.rank == 0 else None)
        dist.barrier()

    def _wait_started(self, engines: Any) -> None:
        """Rank 0: until the engines have loaded their model (an engine that failed to start raises its error)."""
        import ray

        ray.get([self.actors[i].node.remote() for i in engines])

    def _open_weight_groups(self) -> None:
        """Collective over the first replica: a group of each sender and every engine worker; the engines join while
        the senders open their stores and wait for them (after the generations queued before). Groups formed after a
        restart replace the old ones everywhere: a sender's old group is given up and its push in flight waited out."""
        if self.link is not None:
            self.link.close()
            self.link = None
            self._previous_push()  # failed with the old engines, as a rule: the new group starts clean
            self.push_failed = None
        self.link = open_links(self.role, self.replica_group, 0, self.method, receivers=self.engines * self.gpus_per_engine,
                               join_engines=self._join if self.rank == 0 else None)

    def _join(self, senders: list[tuple[str, int]]) -> Any:
        """Rank 0: every engine joins every sender's group (engine i's workers are ranks 1 + i * g ..)."""
        import ray

        g = self.gpus_per_engine
        world = 1 + len(self.actors) * g
        joined = [a.init_transfer.remote({"senders": [list(x) for x in senders], "backend": self.method,
                                          "rank": 1 + i * g, "world_size": world}) for i, a in enumerate(self.actors)]
        return lambda: ray.get(joined)

    def _receive_raw(self, nbytes: int) -> Any:
        """Rank 0: the engines' side of the raw-bandwidth probe (``weight_sync/fraction_of_raw`` compares with it)."""
        import ray

        received = [a.receive_raw.remote(nbytes, RAW_PROBE_REPEATS) for a in self.actors]
        return lambda: ray.get(received)

    # -- requests: every replica's prompts through rank 0 ---------------------------------------------------------------
    def _gather_requests(self, prompts: list[list[int]], n: int) -> dict[int, tuple[list[list[int]], int]] | None:
        """Collective: every replica's request (its ranks ask for the same prompts), on rank 0, sent by the replica's
        first rank alone: each rank sends at most its replica's prompts and only rank 0 receives (not every rank every
        replica's, as an all-gather would)."""
        requests: list[Any] | None = [None] * dist.get_world_size() if self.rank == 0 else None
        mine = (self.dp_rank, prompts, n) if self.rank == self.replica[0] else None
        dist.gather_object(mine, requests, dst=0)
        return {r[0]: (r[1], r[2]) for r in requests if r is not None} if requests is not None else None

    def _submit_all(self, requests: dict[int, tuple[list[list[int]], int]], sampling: Any) -> Plan:
        """Rank 0: each replica's prompts spread over the engines round-robin."""
        plan: Plan = {}
        for dp, (prompts, n) in sorted(requests.items()):
            plan[dp] = []
            for e in range(len(self.actors)):
                mine = list(range(e, len(prompts), len(self.actors)))
                if mine:
                    part = _Part(e, mine, [prompts[i] for i in mine], vllm_sampling(sampling, n), Future())
                    self._issue(part)
                    plan[dp].append(part)
        return plan

    def _issue(self, part: _Part) -> None:
        part.future = self.actors[part.engine].generate_tagged.remote(part.prompts, part.sampling).future()

    def _await(self, plan: Plan, timeout_s: float = 3600.0) -> dict[int, tuple[int, float, list[Any]]]:
        """Rank 0: each replica's results in its prompts' order, the oldest version among its engines, their longest
        time. Raises ``_EnginesLost`` for engines that died, or for all of them when a push failed (their queued
        generations would wait behind an update that never comes)."""
        everyone = set(range(len(self.actors)))
        if self.push_failed is not None:
            raise _EnginesLost(everyone, self.push_failed)
        parts = [p for ps in plan.values() for p in ps]
        pushing = self.pusher.pushing
        pending = {p.future for p in parts} | ({pushing} if pushing is not None else set())
        deadline = time.monotonic() + timeout_s
        while True:
            failed = [p for p in parts if p.future.done() and p.future.exception() is not None]
            dead = {p.engine for p in failed if _engine_died(p.future.exception())}
            if dead:
                raise _EnginesLost(dead, f"engine(s) {sorted(dead)} died ({_first_line(failed[0].future.exception())})")
            if failed:  # an engine that raised, and lives: training stops with its error
                raise WeightSyncError(f"Ray engine {failed[0].engine} failed: {failed[0].future.exception()}")
            if pushing is not None and pushing.done() and pushing.exception() is not None:
                self._previous_push()
                raise _EnginesLost(everyone, str(self.push_failed))
            if all(p.future.done() for p in parts):
                break
            pending = {f for f in pending if not f.done()}
            done, _ = futures.wait(pending, timeout=max(deadline - time.monotonic(), 0.0),
                                   return_when=futures.FIRST_COMPLETED)
            if not done:
                raise WeightSyncError(f"the Ray engines did not answer in {timeout_s:.0f} s")
        out = {}
        for dp, mine in plan.items():
            by_index: dict[int, Any] = {}
            versions, seconds = [], []
            for part in mine:
                version, took, results = part.future.result()
                versions.append(version)
                seconds.append(took)
                by_index.update(zip(part.indices, results))
            out[dp] = (min(versions, default=0), max(seconds, default=0.0), [by_index[i] for i in range(len(by_index))])
        return out

    def _results(self, submitted: _InFlight, later: list[_InFlight]) -> tuple[int, float, Any]:
        """Collective: this replica's (version, engine seconds, results) of ``submitted``, restarting lost engines (and
        issuing their parts of the generations in flight again; a parked episode call goes again by itself) until
        every prompt is answered. An episode job that failed raises on every rank."""
        while True:
            outcome: Any = None
            if self.rank == 0:
                try:
                    if submitted.jobs is not None:
                        outcome = ("done", self._await_jobs(submitted.jobs))
                    else:
                        assert submitted.plan is not None
                        outcome = ("done", self._await(submitted.plan))
                except _EnginesLost as lost:
                    outcome = ("lost", (lost.engines, lost.cause))
                except Exception as e:  # noqa: BLE001 - an episode job's own error: every rank raises it
                    outcome = ("failed", f"{type(e).__name__}: {e}")
            # every rank learns whether engines were lost (a few bytes); the results travel by need: rank 0 hands each
            # replica's first rank its replica's (scatter), which passes them on in the replica
            box: list[Any] = [(outcome[0], None if outcome[0] == "done" else outcome[1]) if outcome is not None else None]
            dist.broadcast_object_list(box, src=0)
            kind, value = box[0]
            if kind == "done":
                return self._scatter_results(outcome[1] if outcome is not None else None)
            if kind == "failed":
                raise RuntimeError(f"asynchronous episodes failed on the Ray fleet: {value}")
            engines, cause = value
            self._recover(engines, cause, [p.plan for p in (submitted, *later)])

    def _await_jobs(self, jobs: Future, timeout_s: float = 3600.0) -> ByReplica:
        """Rank 0: every replica's episode jobs of one submission. Raises ``_EnginesLost`` for engines the episode
        thread found dead, or for all of them when a push failed (its calls wait behind an update that never comes)."""
        everyone = set(range(len(self.actors)))
        deadline = time.monotonic() + timeout_s
        while True:
            while not self.lost.empty():
                seen, engines, cause = self.lost.get()
                if seen == self.recoveries:  # not replaced since (a failed push may have replaced every engine)
                    raise _EnginesLost(engines, cause)
            pushing = self.pusher.pushing
            if self.push_failed is None and pushing is not None and pushing.done() and pushing.exception() is not None:
                self._previous_push()
            if self.push_failed is not None:
                raise _EnginesLost(everyone, self.push_failed)
            try:
                return jobs.result(timeout=0.1)
            except futures.TimeoutError:
                if time.monotonic() > deadline:
                    raise WeightSyncError(f"the Ray fleet's episodes did not finish in {timeout_s:.0f} s") from None

    def wait_replaced(self, seen: int, engines: set[int], cause: str) -> None:
        """The episode thread: its call to ``engines`` (made when ``recoveries`` was ``seen``) found them dead. Unless
        they were replaced since, tell the trainer (its next ``collect`` recovers them, collectively), then wait."""
        with self.swap:
            if self.recoveries == seen:
                self.lost.put((seen, engines, cause))
            while self.recoveries == seen:
                if self.closed:
                    raise WeightSyncError("the Ray fleet closed while an episode waited for its engine")
                self.replaced.wait(timeout=1.0)

    def _scatter_results(self, by_replica: dict[int, tuple[int, float, list[Any]]] | None) -> tuple[int, float, list[Any]]:
        """Collective: this replica's results, from rank 0's ``by_replica`` (data-parallel rank -> results): each rank
        receives its replica's share once, not every replica's."""
        firsts: list[Any] = [None] * dist.get_world_size()
        if self.rank == 0:
            assert by_replica is not None
            firsts = [by_replica[dp] if first else None for dp, first in self.replica_firsts]
        got: list[Any] = [None]
        dist.scatter_object_list(got, firsts if self.rank == 0 else None, src=0)
        if len(self.replica) > 1:
            dist.broadcast_object_list(got, src=self.replica[0], group=self.replica_group)
        return got[0]

    def _recover(self, engines: set[int], cause: str, plans: list[Plan | None]) -> None:
        """Collective: rank 0 restarts ``engines``; every rank exports the policy the engines had, which rank 0 pushes
        to all of them; rank 0 issues the restarted engines' parts of ``plans`` again, oldest first."""
        with self.swap if self.rank == 0 else contextlib.nullcontext():
            if self.rank == 0:
                engines = self._restart(engines, cause)
            if self.dp_rank == 0:
                self._open_weight_groups()
            if self.weights is not None:
                self.push_weights(self.weights, self.version)
                self._raise_if_push_failed()
            if self.rank == 0:
                self._reissue(plans, engines)

    def _restart(self, engines: set[int], cause: str) -> set[int]:
        """Rank 0: kill and start again ``engines`` (every engine if a push failed), in their placement groups; the
        first replica then forms new weight-sync groups (``_open_weight_groups``). Returns the engines restarted."""
        import ray

        self._previous_push()
        if self.push_failed is not None:
            engines, cause = set(range(len(self.actors))), self.push_failed
            self.push_failed = None
        self.restarts += len(engines)
        if self.restarts > self.max_restarts:
            raise WeightSyncError(f"{cause}. That is {self.restarts} engine restarts in this run, more than "
                                  f"megatron.rollout_engine_restarts ({self.max_restarts}): stopping. Look at the engines' "
                                  "logs (Ray's session folder, /tmp/ray/session_latest/logs), or allow more restarts.")
        logger.warning(f"Rollout fleet: {cause}. Restarting engine(s) {sorted(engines)} "
                       f"({self.restarts} restart(s) of {self.max_restarts} allowed).")
        for i in engines:
            ray.kill(self.actors[i], no_restart=True)
            self.starts[i] += 1
            self.actors[i] = start_engine(self.spec, self.placement_groups[i], i, self.starts[i], self.gpus_per_engine)
        try:
            self._wait_started(engines)
        except Exception as e:  # noqa: BLE001 - the replacement's own failure is the cause to report
            raise WeightSyncError(f"a restarted Ray engine failed to start: {e}") from e
        return engines

    def _reissue(self, plans: list[Plan | None], engines: set[int]) -> None:
        """Rank 0: the restarted engines' parts of ``plans`` (oldest first) to their replacements: queued behind the
        push, so generated by the policy the engines had, and answered once. An episode call parked on one of them
        goes again now (``wait_replaced``)."""
        for plan in plans:
            for part in (p for ps in (plan or {}).values() for p in ps):
                if part.engine in engines:
                    self._issue(part)
        if engines:
            with self.swap:
                self.recoveries += 1
                self.replaced.notify_all()

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int, seed: int | None = None) -> list[list[Rollout]]:
        """Every rank gets its replica's rollouts, ``n`` per prompt, grouped per prompt (engines are seeded once)."""
        requests = self._gather_requests(prompts, n)
        plan = self._submit_all(requests, params) if requests is not None else None
        return vllm_rollouts(prompts, self._results(_InFlight(prompts, plan), later=list(self.in_flight))[2])

    # -- asynchronous GRPO ---------------------------------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], params: SamplingParams, n: int) -> None:
        requests = self._gather_requests(prompts, n)
        self.in_flight.append(_InFlight(prompts, plan=self._submit_all(requests, params) if requests is not None else None))

    def submit_episodes(self, prompts: list[list[int]], job: EpisodeJob) -> None:
        """Queue a batch of episodes of every replica and return at once: each replica's first rank hands its batch to
        rank 0 (a gather), whose episode thread runs them all, one replica's after another, with its own ``job.run``
        (its tokenizer and environment: the environment's calls are made on rank 0). Submissions run in order, so a
        batch's first call reaches the engines after every push made before its submission. Collective."""
        self.in_flight.append(self._submit_jobs(prompts, job))

    def run_episode_job(self, prompts: list[list[int]], job: EpisodeJob) -> TaggedRollouts:
        """Synchronous episodes (and evaluation's), as a job of every replica on rank 0's episode thread (after the
        submissions in flight), waited for: a replica's turns never wait on another's collectives. Collective."""
        version, seconds, results = self._results(self._submit_jobs(prompts, job), later=list(self.in_flight))
        return TaggedRollouts([], version, seconds, results)

    def _submit_jobs(self, prompts: list[list[int]], job: EpisodeJob) -> _InFlight:
        batches: list[Any] | None = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object((self.dp_rank, job.batch) if self.rank == self.replica[0] else None, batches, dst=0)
        jobs = None
        if batches is not None:
            if self.episode_thread is None:
                self.episode_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oumi-megatron-fleet-episodes")
            mine = {b[0]: b[1] for b in batches if b is not None}
            jobs = self.episode_thread.submit(self._run_jobs, mine, job.run)
        return _InFlight(prompts, jobs=jobs, episodes=True)

    def _run_jobs(self, batches: dict[int, Any], run: Any) -> ByReplica:
        """Rank 0's episode thread: each replica's batch with the fleet (``_FleetEngine``)."""
        return {dp: _FleetEngine(self).run(EpisodeJob(batch, run)) for dp, batch in sorted(batches.items())}

    def collect(self) -> TaggedRollouts:
        submitted = self.in_flight.popleft()
        version, seconds, results = self._results(submitted, later=list(self.in_flight))
        if submitted.episodes:
            return TaggedRollouts([], version, seconds, results)
        return TaggedRollouts(vllm_rollouts(submitted.prompts, results), version, seconds)

    # -- weights -------------------------------------------------------------------------------------------------------
    def push_weights(self, weights: PolicyWeights, version: int) -> WeightSyncStats:
        """Collective over the training ranks: every sender's share of the export now (as a snapshot it keeps), every
        engine's update queued behind its generations (rank 0 asks), each sender's broadcasts from a background thread
        once the engines have opened their sessions. If any sender's previous push failed, every engine is restarted
        first and the generations in flight are issued again behind this push."""
        self.weights, self.version = weights, version
        share = self.role.pairs(weights.stage_tensors())
        if self.dp_rank != 0:
            start = time.perf_counter()
            n = sum(1 for _ in share)  # take part in the collective export
            return WeightSyncStats(self.method, n, 0, time.perf_counter() - start)
        self._previous_push()
        failures: list[Any] = [None] * dist.get_world_size(self.replica_group)
        dist.all_gather_object(failures, self.push_failed, group=self.replica_group)
        failed = next((f for f in failures if f is not None), None)
        restarted: set[int] = set()
        if failed is not None:  # a sender's push failed: every engine again, and new groups
            if self.rank == 0:
                self.swap.acquire()  # until the replacements have this push queued (``_reissue``)
                self.push_failed = failed
                restarted = self._restart(set(), "")
            self._open_weight_groups()
        actors = list(self.actors)

        def open_sessions() -> tuple[list[Future], list[Future]]:
            if self.rank != 0:
                return [], []
            return ([a.open_update.remote().future() for a in actors],
                    [a.finish_update.remote(version).future() for a in actors])

        if self.link is not None:
            stats = self.pusher.push(share, self.link, self.bucket_bytes, open_sessions, lambda f, _what: _wait(f))
        else:  # the first replica's ranks of CP rank > 0 take part in the export only
            stats = WeightSyncStats(self.method, 0, 0, 0.0)
            for _ in share:
                pass
        if self.rank == 0:
            self._reissue([p.plan for p in self.in_flight], restarted)
            if restarted:
                self.swap.release()
        return replica_stats(self.replica_group, stats)

    def _previous_push(self) -> float | None:
        """A sender: wait for its push in flight; its transfer seconds (None: none, or it failed: ``push_failed``)."""
        try:
            return self.pusher.wait()
        except WeightSyncError as e:
            self.push_failed = f"a weight push failed ({_first_line(e)})"  # one log line: Ray's text runs on
            return None

    def _raise_if_push_failed(self) -> None:
        if self.rank == 0 and self._previous_push() is None and self.push_failed is not None:
            raise WeightSyncError(f"{self.push_failed}, right after restarting the engines: stopping")

    def wait_pushed(self) -> float | None:
        """Wait for this sender's push in flight. A failure is not raised here: the next generation or push restarts
        the engines (``_await``, ``push_weights``)."""
        return self._previous_push() if self.link is not None else None

    def sync_weights(self, weights: PolicyWeights) -> WeightSyncStats:
        """The synchronous loop's sync: a push, waited for."""
        start = time.perf_counter()
        stats = self.push_weights(weights, version=-1)
        self.wait_pushed()
        stats.seconds = time.perf_counter() - start
        return stats

    def engine_metrics(self) -> dict[str, float]:
        if self.rank != 0:
            return {}
        return {"rollout/engine_restarts": float(self.restarts), "weight_sync/raw_gbps": self.raw_gbps or 0.0}

    def decode_profile(self) -> DecodeProfile:
        return DecodeProfile(path="vllm ray fleet")  # its decode loops run in the engines: the calls are their share

    def wake(self) -> float:
        return 0.0  # the fleet's engines keep their GPUs

    def sleep(self) -> EngineSleep:
        return EngineSleep()

    def close(self) -> None:
        with self.swap:
            self.closed = True
            self.replaced.notify_all()
        if self.episode_thread is not None:
            self.episode_thread.shutdown(wait=False, cancel_futures=True)
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


def _first_line(error: BaseException | None) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _wait(future: Future, timeout_s: float = 3600.0) -> Any:
    """A fleet call's result (the weight push's thread); an engine that died or failed fails the push with its error."""
    try:
        return future.result(timeout=timeout_s)
    except futures.TimeoutError:
        raise WeightSyncError(f"a Ray engine did not answer in {timeout_s:.0f} s") from None
    except Exception as e:  # noqa: BLE001 - RayActorError, RayTaskError: the engine's own error is in the message
        raise WeightSyncError(f"a Ray engine failed: {e}") from e
