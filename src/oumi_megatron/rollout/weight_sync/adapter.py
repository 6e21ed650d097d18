"""Adapter-only sync (LoRA, ``megatron.lora_sync: adapter``, vLLM engines): the engines keep the base they started
from and take the policy's adapter alone at each sync, in memory (an adapter's bytes, not a model's), then the probe
(probe.py) taken by the engine with it: a sync that delivered nothing would leave the engine on the base.

``AdapterSync`` is the trainer's side, for colocated engines (every rank loads its engine's part) and a separate engine
process (its owner hands the adapter over its pipe; asynchronous GRPO queues it behind the generations in flight).
``load_in_engine`` is the engine's side: each vLLM worker's adapter manager takes the tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from oumi_megatron.rollout.base import WeightSyncStats
from oumi_megatron.rollout.weight_sync.base import WeightSyncError
from oumi_megatron.rollout.weight_sync.probe import largest_over_ranks, policy_logprobs, probe_sequence

if TYPE_CHECKING:
    from oumi_megatron.engine.peft import AdapterWeights
    from oumi_megatron.rollout.base import PolicyWeights

Probe = tuple[list[int], list[float]]
"""The probe's sequence and the trainer's logprobs of it (probe.py), for the engine to compare its own with."""


def adapter_and_probe(weights: PolicyWeights, trainer_engine: Any, vocab: int) -> tuple[AdapterWeights, Probe]:
    """Collective: the whole adapter (gathered on every rank), and the probe's sequence with the trainer's logprobs of
    it, for the engine to compare its own with once the adapter is in."""
    adapter = weights.adapters()
    if adapter is None:
        raise WeightSyncError("megatron.lora_sync: adapter, but the policy carries no LoRA adapter")
    sequence = probe_sequence(vocab)
    return adapter, (sequence, policy_logprobs(trainer_engine, sequence).tolist())


class AdapterSync:
    """The trainer's side. ``load(tensors, config, probe)``: into this rank's engine now, the engine's probe gap back
    (None where this rank talks to no engine); ``submit(tensors, config, version, probe)``: queued on the engine behind
    its generations in flight, a future of the probe gap (asynchronous GRPO; None where this rank talks to no engine);
    ``wait_for(future, what)``: its result. ``trainer_engine``: the MegatronEngine (the probe's reference logprobs), with
    a tokenizer of ``vocab``; ``is_owner``: whether this rank counts the bytes it sends."""

    def __init__(self, trainer_engine: Any, vocab: int, is_owner: bool,
                 load: Callable[[dict[str, torch.Tensor], dict[str, Any], Probe], float | None],
                 submit: Callable[[dict[str, torch.Tensor], dict[str, Any], int, Probe], Future] | None = None,
                 wait_for: Callable[[Future, str], Any] | None = None) -> None:
        self.trainer_engine, self.vocab, self.is_owner = trainer_engine, vocab, is_owner
        self.load, self.submit, self.wait_for = load, submit, wait_for
        self.pending: Future | None = None
        """The adapter load queued on the engine (asynchronous GRPO)."""
        self.pushed_probe: float | None = None
        """The last queued load's probe, known once it is done."""

    def sync(self, weights: PolicyWeights) -> WeightSyncStats:
        """Collective over the training ranks: the whole adapter into every engine, then the probe taken by the engine
        with it (the largest over every engine)."""
        adapter, probe = adapter_and_probe(weights, self.trainer_engine, self.vocab)
        gap = self.load(adapter.tensors, adapter.config, probe)
        stats = WeightSyncStats("in_memory_adapter", len(adapter.tensors), adapter.nbytes if self.is_owner else 0, 0.0)
        stats.probe_max_diff = largest_over_ranks(gap or 0.0, self.trainer_engine.device)
        return stats

    def push(self, weights: PolicyWeights, version: int) -> WeightSyncStats:
        """Collective over the training ranks: the adapter gathered now and queued on the engine behind its generations
        in flight (the owner's pipe keeps the order), with the probe the engine takes once it is in; the previous push's
        probe goes in these stats (it is known by now)."""
        started = time.perf_counter()
        adapter, probe = adapter_and_probe(weights, self.trainer_engine, self.vocab)
        self.wait()
        if self.submit is not None:
            self.pending = self.submit(adapter.tensors, adapter.config, version, probe)
        return WeightSyncStats("in_memory_adapter", len(adapter.tensors), adapter.nbytes if self.is_owner else 0,
                               time.perf_counter() - started, probe_max_diff=self.pushed_probe)

    def wait(self) -> float | None:
        """Wait for the push in flight; the seconds its transfer took (None: none was in flight)."""
        if self.pending is None:
            return None
        assert self.wait_for is not None, "a queued adapter load is waited for where it was submitted"
        started = time.perf_counter()
        self.pushed_probe = self.wait_for(self.pending, "load_adapter")
        self.pending = None
        return time.perf_counter() - started


def load_in_engine(llm: Any, tensors: dict[str, torch.Tensor], config: dict[str, Any], adapter_id: int) -> None:
    """The engine's side: the policy's adapter (HF PEFT's tensors and config) into every worker of ``llm`` (a
    ``vllm.LLM``) under ``adapter_id``, replacing the one before; the base stays. vLLM 0.26 loads adapters from folders
    only: here each worker's adapter manager takes a ``LoRAModel`` built from the tensors as its own folder loader
    builds one (its private ``_adapter_manager``: pinned by tests/test_vllm.py)."""

    def load(worker: Any, tensors: dict[str, torch.Tensor], config: dict[str, Any], adapter_id: int) -> None:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = worker.model_runner.lora_manager
        helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)
        model = manager._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            adapter_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size, weights_mapper=None if mapper is None else mapper.get_unstacked_mapper(),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        for old in manager.list_adapters():
            manager.remove_adapter(old)
        manager._adapter_manager.add_adapter(lora)
        manager._adapter_manager.activate_adapter(adapter_id)

    llm.collective_rpc(load, args=(tensors, config, adapter_id))
