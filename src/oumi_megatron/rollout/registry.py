"""Rollout backends by ``megatron.inference_backend`` name: the one place that builds them (training, the
trainer's default, ``oumi-megatron eval``). A new backend registers a builder with
``@register_rollout_backend("name")`` (here, or in a ``grpo.plugins`` module) and implements rollout/base.py's
``RolloutBackend``; validation checks ``megatron.inference_backend`` against this live table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from oumi_megatron.rollout.base import RolloutBackend
from oumi_megatron.utils.registry import Registry

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from oumi_megatron.config.training_config import MegatronTrainingConfig
    from oumi_megatron.engine.engine import MegatronEngine


@dataclass
class RolloutContext:
    """What a backend may need: the training engine, the config, the tokenizer, the dtype and a folder for the
    backend's files. Weights reach a backend through ``sync_weights`` (the engine's exporter), never from here."""

    engine: MegatronEngine
    config: MegatronTrainingConfig
    tokenizer: PreTrainedTokenizerBase
    dtype: torch.dtype
    work_dir: Path


RolloutBuilder = Callable[[RolloutContext], RolloutBackend]

ROLLOUT_BACKENDS: Registry[RolloutBuilder] = Registry(
    "rollout backend", "megatron.inference_backend",
    "your own: @register_rollout_backend('name') in a module named in grpo.plugins, docs/rollouts.md")


def register_rollout_backend(name: str) -> Callable[[RolloutBuilder], RolloutBuilder]:
    return ROLLOUT_BACKENDS.register(name)


def build_rollout_backend(ctx: RolloutContext) -> RolloutBackend:
    return ROLLOUT_BACKENDS.get(ctx.config.megatron.inference_backend)(ctx)


@register_rollout_backend("megatron")
def _embedded(ctx: RolloutContext) -> RolloutBackend:
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend

    return MegatronRolloutBackend(ctx.engine, vocab_size=len(ctx.tokenizer), seed=ctx.config.training.seed,
                                  cuda_graphs=ctx.config.megatron.rollout_cuda_graphs_choice)


@register_rollout_backend("vllm")
def _vllm(ctx: RolloutContext) -> RolloutBackend:
    from oumi_megatron.rollout.vllm_backend import VllmRolloutBackend

    c = ctx.config
    if c.megatron.rollout_placement == "ray":
        from oumi_megatron.rollout.ray_fleet import RayRolloutBackend

        return RayRolloutBackend(c.model.model_name, ctx.dtype, c.megatron, c.grpo, seed=c.training.seed,
                                 trust_remote_code=bool(c.model.trust_remote_code))
    return VllmRolloutBackend(c.model.model_name, ctx.dtype, c.megatron, c.grpo, seed=c.training.seed, work_dir=ctx.work_dir,
                              trust_remote_code=bool(c.model.trust_remote_code))
