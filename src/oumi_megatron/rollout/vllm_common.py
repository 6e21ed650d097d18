"""What the vLLM-based backends share (rollout/vllm_backend.py: colocated and separate engines; rollout/ray_fleet.py: a
Ray fleet): the engine's spec from the config, its sampling arguments, and its results read as ``Rollout``s."""

from __future__ import annotations

from typing import Any

import torch

from oumi_megatron.rollout.base import Rollout
from oumi_megatron.rollout.sampling import SamplingParams
from oumi_megatron.rollout.vllm_engine import EngineSpec
from oumi_megatron.utils.disk import GIB


def vllm_cuda_graphs(choice: str) -> bool:
    """``megatron.rollout_cuda_graphs`` for vLLM engines: ``auto`` and ``true`` let vLLM compile and capture its decode
    steps on GPU (its default; eager on CPU), ``false`` runs them eagerly (``enforce_eager``)."""
    if choice == "true" and not torch.cuda.is_available():
        raise ValueError("megatron.rollout_cuda_graphs: true, but there is no CUDA device here for vLLM's CUDA graphs. "
                         "Set megatron.rollout_cuda_graphs: auto (eager steps without a GPU).")
    return choice != "false"


def engine_spec(hf_model: str, dtype: torch.dtype, params: Any, grpo: Any, seed: int, trust_remote_code: bool = False,
                **fields: Any) -> EngineSpec:
    """An engine's spec from the config (``params``: MegatronParams, ``grpo``: the grpo section), the same for every
    placement; ``fields``: what a placement sets beyond it (its weight-transfer backend, the adapter's rank)."""
    return EngineSpec(
        model=str(hf_model), dtype=str(dtype).removeprefix("torch."),
        max_model_len=grpo.max_prompt_length + grpo.max_completion_length, seed=seed,
        gpu_memory_utilization=params.vllm_gpu_memory_utilization,
        # CPU engines: a small fixed cache (start-up profiles it); GPU: vllm_kv_cache_gib when set
        kv_cache_bytes=int(params.vllm_kv_cache_gib * GIB) if torch.cuda.is_available() else 64 * 2**20,
        extra={"trust_remote_code": True} if trust_remote_code else {},
        cuda_graphs=vllm_cuda_graphs(params.rollout_cuda_graphs_choice),
        **fields,
    )


def vllm_sampling(params: SamplingParams, n: int) -> dict[str, Any]:
    """vLLM's SamplingParams arguments for ``n`` samples per prompt (its greedy decoding is temperature 0)."""
    return dict(n=n, temperature=0.0 if params.greedy else params.temperature, top_p=params.top_p,
                max_tokens=params.max_new_tokens,
                stop_token_ids=list(params.end_ids) or None)


def vllm_rollouts(prompts: list[list[int]], results: Any) -> list[list[Rollout]]:
    """An engine's (ids, logprobs, finish reason) per sample, per prompt, as Rollouts."""
    return [[Rollout(prompt_ids=list(prompt), completion_ids=list(ids), finished=reason == "stop",
                     logprobs=list(lps) if lps else None) for ids, lps, reason in samples]
            for prompt, samples in zip(prompts, results, strict=True)]
