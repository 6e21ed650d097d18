"""``megatron.inference_backend: sglang``: rollouts on SGLang engines, token ids in, token ids and their logprobs out.

An engine is ``sglang.Engine`` (SGLang's offline engine): the object lives in a trainer process and drives SGLang's
scheduler, which runs in processes of its own (on the engine's GPUs). Two placements (rollout/registry.py):
- **colocated**: every trainer rank holds an engine on its own GPU (Megatron TP 1, PP 1: one engine per data-parallel
  rank); on GPU it releases its memory while the trainer trains (``release_memory_occupation``) and takes it back
  before the next generation. The sync hands the engine the rank's HF tensors in memory (weight_sync/in_process.py
  ``SglangInProcess``).
- **separate**: one engine per model replica on a GPU of its own, owned by the replica's first rank; the weights
  travel over a weight-update group of the owner and the engine in flattened buckets (weight_sync/sglang_group.py: NCCL
  on GPU, gloo on CPU). The owner's replica peers get its rollouts by broadcast.
Multi-turn episodes run as chains of requests on the engine's continuous batching (rollout/turns.py
``request_chains``, ``async_generate`` tasks on the engine's event loop; SGLang's radix cache serves each history).
After every sync a probe (``weight_sync/probe_max_diff``, weight_sync/probe.py) compares the engine's logprobs of a
fixed token sequence with the trainer's: a sync that silently did nothing is the most reported rollout-engine bug across
the peers.

SGLang's logprobs are those of softmax(logits / T), the trainer's quantity. On the CPU (tests) the engine runs SGLang's
``torch_native`` attention and ``pytorch`` sampling with no kernel package, its KV pool sized from the step's rollouts.
"""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.parallel.distributed import replica_group
from oumi_megatron.errors import UserInputError
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
from oumi_megatron.rollout.sampling import SamplingParams
from oumi_megatron.rollout.turns import FinishedRequest, request_chains, turn_by_turn
from oumi_megatron.rollout.weight_sync.base import WeightSync, synced
from oumi_megatron.rollout.weight_sync.in_process import SglangInProcess
from oumi_megatron.rollout.weight_sync.probe import PROBE_TOKENS, decoded_gap, probe_sequence
from oumi_megatron.rollout.weight_sync.sglang_group import ENGINE_THREAD, SglangUpdateGroup
from oumi_megatron.utils.launcher_env import without_launcher_env

logger = logging.getLogger("oumi")

SGLANG_INSTALL = ("`bash scripts/setup.sh --gpu --sglang` on a GPU machine (SGLang 0.5.17 from the GPU lock, its CUDA "
                  "kernels beside it); `bash scripts/setup.sh` on the CPU")
"""The one way SGLang is installed (README.md and docs/rollouts.md say the same)."""
OWNED_ENGINE_ARGS = frozenset({"model_path", "dtype", "tp_size", "random_seed", "device", "skip_tokenizer_init",
                               "context_length", "mem_fraction_static", "attention_backend", "base_gpu_id",
                               "enable_memory_saver", "max_total_tokens", "trust_remote_code"})
"""sglang.Engine arguments the backend sets itself (``megatron.sglang_engine_args`` may not)."""
FA3_KERNELS = "sgl_kernel.flash_ops"
"""The sglang-kernel module that holds FlashAttention 3, SGLang's attention on Hopper by default (326 of the wheel's
365 MiB: trimmed or partial installs leave it out)."""


def sglang_engine_fields() -> set[str]:
    """The arguments ``sglang.Engine`` takes (its ``ServerArgs`` fields); ``UserInputError`` naming the install where
    SGLang is missing."""
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError as e:
        raise UserInputError(f"megatron.inference_backend: sglang, but SGLang is not installed ({e}). Install it: "
                             f"{SGLANG_INSTALL}.") from e
    import dataclasses

    return {f.name for f in dataclasses.fields(ServerArgs)}


@dataclass
class EngineSpec:
    """What an SGLang engine is started with."""

    model: str
    dtype: str
    seed: int
    context_length: int
    mem_fraction_static: float
    attention_backend: str | None
    max_total_tokens: int
    """The KV pool on the CPU (tokens); on GPU ``mem_fraction_static`` sizes it."""
    base_gpu_id: int | None = None
    memory_saver: bool = False
    trust_remote_code: bool = False
    """``model.trust_remote_code``: the model folder's own code may run (never through ``sglang_engine_args``)."""
    extra: dict[str, Any] = field(default_factory=dict)


def gpu_attention_backend(choice: str | None) -> str | None:
    """The attention backend a GPU engine starts with: ``megatron.sglang_attention_backend`` where set; else SGLang's
    own choice (None), except on Hopper where the installed sglang-kernel lacks FA3's kernels (SGLang would pick FA3 and
    fail at its first forward): there ``triton``, which needs no kernel package, said in the log."""
    if choice:
        return choice
    try:
        has_fa3 = importlib.util.find_spec(FA3_KERNELS) is not None
    except ImportError:  # no sglang-kernel at all: SGLang's own error says what to install
        return None
    if torch.cuda.get_device_capability()[0] == 9 and not has_fa3:
        logger.warning("megatron.sglang_attention_backend: null resolves to triton: this sglang-kernel has no FlashAttention "
                       "3 kernels (%s), SGLang's default on Hopper. Install the whole sglang-kernel wheel for FA3, or set "
                       "megatron.sglang_attention_backend to say which backend to use.", FA3_KERNELS)
        return "triton"
    return None


def start_engine(spec: EngineSpec) -> Any:
    """An ``sglang.Engine`` for ``spec`` (its scheduler started, the weights loaded); on GPU ``spec.attention_backend``
    becomes the backend it runs where it was left to SGLang and had to be decided (``gpu_attention_backend``)."""
    try:
        import sglang
    except ImportError as e:
        raise UserInputError(f"megatron.inference_backend: sglang, but SGLang is not installed ({e}). Install it: "
                             f"{SGLANG_INSTALL}.") from e
    kwargs: dict[str, Any] = dict(model_path=spec.model, dtype=spec.dtype, random_seed=spec.seed, skip_tokenizer_init=True,
                                  context_length=spec.context_length, log_level="warning",
                                  trust_remote_code=spec.trust_remote_code)
    if torch.cuda.is_available():
        kwargs.update(mem_fraction_static=spec.mem_fraction_static, enable_memory_saver=spec.memory_saver)
        if spec.base_gpu_id is not None:
            kwargs["base_gpu_id"] = spec.base_gpu_id
        spec.attention_backend = gpu_attention_backend(spec.attention_backend)
        if spec.attention_backend:
            kwargs["attention_backend"] = spec.attention_backend
    else:
        # no kernel package on the CPU: SGLang's own torch paths; its threads on every core this process may use
        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", f"0-{max(len(os.sched_getaffinity(0)), 1) - 1}")
        kwargs.update(device="cpu", attention_backend=spec.attention_backend or "torch_native", sampling_backend="pytorch",
                      disable_cuda_graph=True, max_total_tokens=spec.max_total_tokens)
    kwargs.update(spec.extra)
    with without_launcher_env():  # SGLang's scheduler processes are no ranks of the trainer's world
        return sglang.Engine(**kwargs)


def _sampling(params: SamplingParams, n: int, max_new_tokens: int) -> dict[str, Any]:
    """SGLang's sampling parameters for ``n`` samples: its greedy is temperature 0; rows end at ``params``' end tokens
    (and at the model's own EOS, which SGLang always adds: the tokenizer's, the one ``params`` names in a run)."""
    return {"n": n, "temperature": 0.0 if params.greedy else params.temperature, "top_p": params.top_p,
            "max_new_tokens": max_new_tokens, "stop_token_ids": list(params.end_ids)}


def _sample(output: dict[str, Any]) -> tuple[list[int], list[float], bool]:
    """An output's token ids, their logprobs, and whether it ended at an end token."""
    ids = list(output["output_ids"])
    logprobs = [float(lp) for lp, _, _ in output["meta_info"].get("output_token_logprobs") or []]
    return ids, logprobs, (output["meta_info"].get("finish_reason") or {}).get("type") == "stop"


class _SglangBackend:
    """What both placements share: the engine's spec, its requests, episodes, the probe."""

    placement = ""

    def __init__(self, hf_model: str, dtype: torch.dtype, params: Any, grpo: Any, seed: int, engine: Any,
                 vocab_size: int, rows_per_step: int, trust_remote_code: bool = False) -> None:
        """``engine``: the trainer's MegatronEngine (the probe's reference logprobs); ``vocab_size``: the tokenizer's;
        ``rows_per_step``: this rank's rollouts per step (the CPU KV pool holds them)."""
        self.trainer_engine = engine
        self.group, self.replica = replica_group()
        self.context_length = grpo.max_prompt_length + grpo.max_completion_length
        self.spec = EngineSpec(model=str(hf_model), dtype=str(dtype).removeprefix("torch."), seed=seed,
                               context_length=self.context_length, mem_fraction_static=params.sglang_mem_fraction_static,
                               attention_backend=params.sglang_attention_backend,
                               max_total_tokens=max(4 * self.context_length, 2 * rows_per_step * self.context_length),
                               extra=dict(params.sglang_engine_args or {}), trust_remote_code=trust_remote_code)
        self.engine: Any = None
        """The ``sglang.Engine`` this rank drives (None where it drives none)."""
        self.last_probe: float | None = None
        self.vocab = vocab_size
        self.bucket_bytes = int(params.weight_sync_bucket_mb * 2**20)
        self.weight_sync: WeightSync
        """How the weights reach the engine (each placement's: rollout/weight_sync/)."""

    # -- rollouts -------------------------------------------------------------------------------------
    @property
    def drives(self) -> bool:
        return self.engine is not None

    def _generate_here(self, prompts: list[list[int]], params: SamplingParams, n: int) -> list[list[Any]]:
        """``n`` samples of each prompt from this rank's engine, grouped per prompt (SGLang returns them prompt by
        prompt)."""
        sampling = [_sampling(params, n, max(1, min(params.max_new_tokens, self.context_length - len(p)))) for p in prompts]
        outputs = self.engine.generate(input_ids=prompts, sampling_params=sampling, return_logprob=True)
        return [[_sample(o) for o in outputs[i * n:(i + 1) * n]] for i in range(len(prompts))]

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        """``n`` completions of each prompt, on every rank of the replica. ``seed`` is not passed per request: each
        engine samples from its own seed (set at start), so a run is reproducible as long as the engine receives the
        same requests in the same order."""
        samples = self._shared(lambda: self._generate_here(prompts, params, n) if prompts else [])
        return [[Rollout(list(p), ids, finished, logprobs) for ids, logprobs, finished in group]
                for p, group in zip(prompts, samples, strict=True)]

    def _shared(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` where this rank drives the engine, its result on every rank of the replica (separate placement);
        colocated ranks each drive their own."""
        return fn()

    def run_episodes(self, prompts: list[list[int]], params: SamplingParams, n: int, turns: TurnHandler, budget: int,
                     max_turns: int, seed: int | None = None) -> EpisodeRun:
        """Multi-turn episodes as chains of requests on the engine's continuous batching: each next request added as
        soon as its episode's observation is ready (rollout/turns.py ``request_chains``)."""
        if max_turns <= 1:
            return turn_by_turn(self, prompts, params, n, turns, seed)
        requests = _RequestTasks(self.engine, self.context_length) if self.drives else None

        def add(batch: list[tuple[str, list[int], Any]]) -> None:
            if requests is not None:
                requests.add(batch)

        def step() -> list[FinishedRequest]:
            return self._shared(lambda: requests.step() if requests is not None else [])

        return request_chains(add, step, lambda room: _sampling(params, 1, room), prompts, params, n, turns)

    # -- weights --------------------------------------------------------------------------------------
    def sync_weights(self, weights: PolicyWeights) -> WeightSyncStats:
        """Collective over the training ranks: the policy's weights into every engine, then the probe."""
        stats = synced(self.weight_sync, weights, f"sglang, {self.placement}")
        stats.probe_max_diff = self.probe()
        return stats

    def probe(self) -> float:
        """Collective over the training ranks: the largest |engine - trainer| logprob of ``PROBE_TOKENS`` tokens the
        engine decodes (top-1 at temperature 1) after a fixed prompt, the largest over every replica's engine. The
        prompt is the same at every probe, so the engine serves it from its prefix cache: a sync that left stale weights
        or a stale cache behind shows here."""
        prompt = probe_sequence(self.vocab, PROBE_TOKENS)

        def decoded() -> tuple[list[int], list[float]]:
            out = self.engine.generate(input_ids=[prompt], return_logprob=True,
                                       sampling_params={"temperature": 1.0, "top_k": 1, "max_new_tokens": PROBE_TOKENS,
                                                        "ignore_eos": True})
            ids, logprobs, _ = _sample(out[0])
            return ids, logprobs

        ids, theirs = self._shared(decoded)
        self.last_probe = decoded_gap(self.trainer_engine, prompt, ids, theirs)
        return self.last_probe

    def engine_metrics(self) -> dict[str, float]:
        return {}

    def decode_profile(self) -> DecodeProfile:
        # its decode loops run in SGLang's scheduler; the attention it was started with, where this backend chose it
        attention = f", {self.spec.attention_backend} attention" if self.spec.attention_backend else ""
        return DecodeProfile(path=f"sglang {self.placement}{attention}")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class _RequestTasks:
    """Requests in flight on one engine: ``async_generate`` tasks on its event loop, stepped by the caller."""

    def __init__(self, engine: Any, context_length: int) -> None:
        self.engine, self.context_length = engine, context_length
        self.tasks: dict[Any, str] = {}

    def add(self, batch: list[tuple[str, list[int], Any]]) -> None:
        for request_id, prompt, sampling in batch:
            sampling = {**sampling, "max_new_tokens": max(1, min(sampling["max_new_tokens"], self.context_length - len(prompt)))}
            coroutine = self.engine.async_generate(input_ids=prompt, sampling_params=sampling, return_logprob=True)
            self.tasks[self.engine.loop.create_task(coroutine)] = request_id

    def step(self) -> list[FinishedRequest]:
        """Run the engine's loop until at least one request finishes; those that did."""
        if not self.tasks:
            return []
        done, _ = self.engine.loop.run_until_complete(asyncio.wait(list(self.tasks), return_when=asyncio.FIRST_COMPLETED))
        out = []
        for task in done:
            ids, logprobs, finished = _sample(task.result())
            out.append((self.tasks.pop(task), ids, logprobs, "stop" if finished else "length"))
        return out


class ColocatedSglangBackend(_SglangBackend):
    """``rollout_placement: colocated``: an engine on every trainer rank's own GPU (Megatron TP 1 and PP 1, validation
    says so), asleep while the trainer trains (GPU)."""

    placement = "colocated"

    def __init__(self, hf_model: str, dtype: torch.dtype, params: Any, grpo: Any, seed: int, engine: Any,
                 vocab_size: int, rows_per_step: int, trust_remote_code: bool = False) -> None:
        super().__init__(hf_model, dtype, params, grpo, seed, engine, vocab_size, rows_per_step, trust_remote_code)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.spec.seed = seed + rank  # one seed per engine
        if torch.cuda.is_available():
            self.spec.base_gpu_id = torch.cuda.current_device()
            self.spec.memory_saver = True
        self.awake = True
        self.engine = start_engine(self.spec)
        self.weight_sync = SglangInProcess(self.engine, self.bucket_bytes)  # the rank's HF tensors, in memory

    def sync_weights(self, weights: PolicyWeights) -> WeightSyncStats:
        self.wake()  # the trainer woke it before the sync; waking is idempotent
        return super().sync_weights(weights)

    def wake(self) -> float:
        if self.awake:
            return 0.0
        start = time.perf_counter()
        torch.cuda.empty_cache()  # the memory training freed, back to the device for the engine
        self.engine.resume_memory_occupation()
        self.awake = True
        return time.perf_counter() - start

    def sleep(self) -> EngineSleep:
        """On GPU the engine releases its weights' and KV cache's memory (it keeps the weights' values: the next sync
        refreshes them anyway); CPU engines keep theirs."""
        if not torch.cuda.is_available() or not self.awake:
            return EngineSleep()
        start = time.perf_counter()
        self.engine.release_memory_occupation()
        self.awake = False
        return EngineSleep(time.perf_counter() - start)


class SeparateSglangBackend(_SglangBackend):
    """``rollout_placement: separate``: one engine per model replica, on a GPU of its own, owned by the replica's first
    rank, which sends it the whole model over a weight-update group; the replica's other ranks get its rollouts.

    Every call on the engine runs on one thread of the owner's, in the order it was made (the engine's event loop is
    driven by one thread at a time). Asynchronous GRPO (``grpo.max_staleness``) queues generations and whole episode
    jobs on it and the weight pushes behind them: the trainer goes on while they run, and a batch is generated by the
    policy version that was last pushed before it started (a job runs whole, no push lands inside it)."""

    placement = "separate"

    def __init__(self, hf_model: str, dtype: torch.dtype, params: Any, grpo: Any, seed: int, engine: Any,
                 vocab_size: int, rows_per_step: int, trust_remote_code: bool = False) -> None:
        super().__init__(hf_model, dtype, params, grpo, seed, engine, vocab_size, rows_per_step, trust_remote_code)
        self.owner = self.replica[0]
        self.is_owner = not dist.is_initialized() or dist.get_rank() == self.owner
        self.method = params.weight_sync_method
        if self.method == "nccl" and not torch.cuda.is_available():
            raise ValueError("megatron.weight_sync_method: nccl needs GPUs (none here). Use gloo on CPU.")
        gpu = engine_gpu_for_owner(self.is_owner) if dist.is_initialized() else None
        self.thread: ThreadPoolExecutor | None = None
        """The owner's engine thread."""
        self.partial = bool(getattr(grpo, "partial_rollouts", False))
        """``grpo.partial_rollouts``: episode jobs run on a thread of their own, each generation queued on the engine's
        thread (a push lands between two pieces), instead of whole on the engine's thread."""
        self.jobs: ThreadPoolExecutor | None = None
        """The owner's thread for such jobs (one at a time, in submission order)."""
        self.in_flight: collections.deque[tuple[list[list[int]], Future | None, bool]] = collections.deque()
        """Asynchronous GRPO: submitted generations (and whether an episode job), oldest first."""
        self.weight_sync: SglangUpdateGroup = SglangUpdateGroup(self.method, self.bucket_bytes, self.is_owner,
                                                                self.trainer_engine, self.vocab)
        """The owner's update group with the engine (every rank iterates the export); it knows the engine's policy
        version."""
        if not self.is_owner:
            return
        from megatron.core import parallel_state as ps

        self.spec.seed = seed + ps.get_data_parallel_rank()
        if gpu is not None:
            self.spec.base_gpu_id = int(gpu)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=ENGINE_THREAD)
        self.engine = self._on_engine(lambda: start_engine(self.spec))
        self.weight_sync.open(self.engine, self.thread)

    def _on_engine(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the engine's thread, after every call queued before it."""
        assert self.thread is not None, "only a separate engine's owner drives it"
        return self.thread.submit(fn).result()

    def _shared(self, fn: Callable[[], Any]) -> Any:
        box: list[Any] = [self._on_engine(fn) if self.is_owner else None]
        if dist.is_initialized() and len(self.replica) > 1:
            dist.broadcast_object_list(box, src=self.owner, group=self.group)
        return box[0]

    def wake(self) -> float:
        return 0.0  # the engine keeps its GPU

    def sleep(self) -> EngineSleep:
        return EngineSleep()

    # -- asynchronous GRPO: generations in flight while the trainer trains ------------------------------------------
    def submit(self, prompts: list[list[int]], params: SamplingParams, n: int) -> None:
        """Queue a generation on the engine's thread and return at once (every rank of the replica calls it)."""
        future = None
        if self.is_owner:
            assert self.thread is not None
            future = self.thread.submit(self._tagged, lambda: self._generate_here(prompts, params, n) if prompts else [])
        self.in_flight.append((prompts, future, False))

    def submit_episodes(self, prompts: list[list[int]], job: EpisodeJob) -> None:
        """Queue a batch of episodes (``job`` given this engine, run whole on its thread: the owner's environment
        calls included) and return at once."""
        future = None
        if self.is_owner and self.partial:
            if self.jobs is None:
                self.jobs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oumi-megatron-episodes")
            future = self.jobs.submit(self._run_queued, job)
        elif self.is_owner:
            assert self.thread is not None
            future = self.thread.submit(self._tagged, lambda: job(_OnEngineThread(self)))
        self.in_flight.append((prompts, future, True))

    def _run_queued(self, job: EpisodeJob) -> tuple[int, float, Any]:
        """A partial-rollout job: its generations queued on the engine's thread one by one; the oldest version of its
        turns."""
        return _ViaEngineThread(self).run(job)

    def start_stream(self, job: StreamJob) -> None:
        """``grpo.streaming_groups``: the owner runs ``job`` (the driver's stream of episodes) on a daemon thread of its
        own, each of its generations queued on the engine's thread in order with the weight pushes."""
        if self.is_owner:
            threading.Thread(target=job, args=(_ViaEngineThread(self),), daemon=True,
                             name="oumi-megatron-episode-stream").start()

    def from_owner(self, produce: Callable[[], Any]) -> Any:
        box = [produce() if self.is_owner else None]
        if dist.is_initialized() and len(self.replica) > 1:
            dist.broadcast_object_list(box, src=self.owner, group=self.group)
        return box[0]

    def _tagged(self, fn: Callable[[], Any]) -> tuple[int, float, Any]:
        """On the engine's thread: ``fn()`` with the policy version that ran it and its seconds."""
        version, started = self.weight_sync.version, time.perf_counter()
        value = fn()
        return version, time.perf_counter() - started, value

    def collect(self) -> TaggedRollouts:
        """The oldest submitted generation (or episode job), on every rank of the replica (waits for it); a job that
        failed raises on every rank of the replica."""
        prompts, future, episodes = self.in_flight.popleft()
        box: list[Any] = [None]
        if future is not None:
            try:
                box[0] = future.result()
            except Exception as e:  # noqa: BLE001 - the replica's peers raise it too
                box[0] = RuntimeError(f"asynchronous rollouts failed on the replica's SGLang engine: {e}")
        if dist.is_initialized() and len(self.replica) > 1:
            dist.broadcast_object_list(box, src=self.owner, group=self.group)
        if isinstance(box[0], Exception):
            raise box[0]
        version, seconds, value = box[0]
        if episodes:
            return TaggedRollouts([], version, seconds, value)  # the job's samples and stats
        samples = value
        rollouts = [[Rollout(list(p), ids, finished, logprobs) for ids, logprobs, finished in group]
                    for p, group in zip(prompts, samples, strict=True)]
        return TaggedRollouts(rollouts, version, seconds)

    def push_weights(self, weights: PolicyWeights, version: int) -> WeightSyncStats:
        """Collective over the training ranks: the whole policy (``version``) read now and queued for the engine behind
        the generations in flight, with the trainer's logprobs of a fixed sequence for the probe the engine's thread
        runs after the update (weight_sync/sglang_group.py ``SglangUpdateGroup.push``)."""
        return self.weight_sync.push(weights, version)

    def wait_pushed(self) -> float | None:
        """Wait for the push in flight; the seconds its update took (None: none in flight, or not the owner)."""
        return self.weight_sync.wait()

    def close(self) -> None:
        if self.thread is not None and self.engine is not None:
            self._on_engine(self.engine.shutdown)
            self.engine = None
        if self.thread is not None:
            self.thread.shutdown(wait=False, cancel_futures=True)
        if self.jobs is not None:
            self.jobs.shutdown(wait=False, cancel_futures=True)


class _ViaEngineThread(VersionedCalls):
    """The engine as a job on another thread sees it (partial rollouts, the stream of episodes): each generation is
    queued on the engine's thread, in order with the weight pushes, so a push lands between two; its rollouts carry
    the policy version that made them."""

    def __init__(self, backend: SeparateSglangBackend) -> None:
        super().__init__()
        self.backend = backend

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        backend = self.backend
        assert backend.thread is not None, "only a separate engine's owner drives it"
        version, seconds, samples = backend.thread.submit(
            backend._tagged, lambda: backend._generate_here(prompts, params, n) if prompts else []).result()
        self.tally(version, seconds)
        return [[Rollout(list(p), ids, finished, logprobs, version=version) for ids, logprobs, finished in group]
                for p, group in zip(prompts, samples, strict=True)]


class _OnEngineThread:
    """The engine as an episode job sees it (it runs on the engine's thread: calls go straight to the engine)."""

    def __init__(self, backend: SeparateSglangBackend) -> None:
        self.backend = backend

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        samples = self.backend._generate_here(prompts, params, n) if prompts else []
        return [[Rollout(list(p), ids, finished, logprobs) for ids, logprobs, finished in group]
                for p, group in zip(prompts, samples, strict=True)]

    def run_episodes(self, prompts: list[list[int]], params: SamplingParams, n: int, turns: TurnHandler, budget: int,
                     max_turns: int, seed: int | None = None) -> EpisodeRun:
        if max_turns <= 1:
            return turn_by_turn(self, prompts, params, n, turns, seed)
        requests = _RequestTasks(self.backend.engine, self.backend.context_length)
        return request_chains(requests.add, requests.step, lambda room: _sampling(params, 1, room), prompts, params, n,
                              turns)
