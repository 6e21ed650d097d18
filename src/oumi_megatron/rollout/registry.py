"""Rollout backends by ``megatron.inference_backend`` name: the one place that builds them (training, the
trainer's default, ``oumi-megatron eval``). A new backend registers a builder here with
``@register_rollout_backend("name")`` and implements rollout/base.py's ``RolloutBackend``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oumi_megatron.rollout.base import RolloutBackend


@dataclass
class RolloutContext:
    """What a backend may need: the training engine, the config, the tokenizer, the dtype and a folder for the
    backend's files. Weights reach a backend through ``sync_weights`` (the engine's exporter), never from here."""

    engine: Any
    config: Any  # MegatronTrainingConfig
    tokenizer: Any
    dtype: Any
    work_dir: Path


ROLLOUT_BACKENDS: dict[str, Callable[[RolloutContext], RolloutBackend]] = {}


def register_rollout_backend(name: str) -> Callable[[Callable[[RolloutContext], RolloutBackend]], Callable[[RolloutContext], RolloutBackend]]:
    def decorate(builder: Callable[[RolloutContext], RolloutBackend]) -> Callable[[RolloutContext], RolloutBackend]:
        ROLLOUT_BACKENDS[name] = builder
        return builder

    return decorate


def build_rollout_backend(ctx: RolloutContext) -> RolloutBackend:
    name = ctx.config.megatron.inference_backend
    if name not in ROLLOUT_BACKENDS:
        raise ValueError(f"megatron.inference_backend: no rollout backend named {name!r}; registered: "
                         f"{', '.join(sorted(ROLLOUT_BACKENDS))}")
    return ROLLOUT_BACKENDS[name](ctx)


@register_rollout_backend("megatron")
def _embedded(ctx: RolloutContext) -> RolloutBackend:
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend

    return MegatronRolloutBackend(ctx.engine, vocab_size=len(ctx.tokenizer), seed=ctx.config.training.seed)


@register_rollout_backend("vllm")
def _vllm(ctx: RolloutContext) -> RolloutBackend:
    from oumi_megatron.rollout.vllm_backend import VllmRolloutBackend

    c = ctx.config
    return VllmRolloutBackend(c.model.model_name, ctx.dtype, c.megatron, c.grpo, seed=c.training.seed, work_dir=ctx.work_dir,
                              trust_remote_code=bool(c.model.trust_remote_code))
