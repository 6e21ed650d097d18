"""Megatron-Core's optimizer (plain or distributed Adam, grad clipping, CPU offload) and LR schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class OptimSettings:
    """Optimizer hyper-parameters; ``from_training_params`` reads them from Oumi's ``training:``."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    total_steps: int = 1
    lr_decay_style: str = "constant"  # constant | linear | cosine

    @classmethod
    def from_training_params(cls, training: Any, updates_per_step: int = 1) -> OptimSettings:
        """``training.max_steps`` and ``warmup_steps`` count GRPO steps; the schedule advances once per
        optimizer step, and each GRPO step makes ``updates_per_step`` of them (ppo_epochs x
        num_mini_batches), so both are scaled by it."""
        total = max(1, int(training.max_steps)) * updates_per_step
        warmup = int(training.warmup_steps or 0) * updates_per_step or int(round((training.warmup_ratio or 0.0) * total))
        scheduler = str(getattr(training.lr_scheduler_type, "value", training.lr_scheduler_type) or "constant")
        style = {"linear": "linear", "cosine": "cosine", "cosine_with_restarts": "cosine"}.get(scheduler, "constant")
        return cls(
            lr=float(training.learning_rate),
            weight_decay=float(training.weight_decay),
            adam_beta1=float(training.adam_beta1),
            adam_beta2=float(training.adam_beta2),
            adam_eps=float(training.adam_epsilon),
            clip_grad=float(training.max_grad_norm or 0.0),
            warmup_steps=warmup,
            total_steps=total,
            lr_decay_style=style,
        )


def build_optimizer(model_chunks: list[torch.nn.Module], params: Any, settings: OptimSettings, dtype: torch.dtype) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt = params.optimizer_config
    config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=params.ddp_config.use_distributed_optimizer,
        overlap_param_gather=params.ddp_config.overlap_param_gather,
        optimizer_cpu_offload=opt.optimizer_cpu_offload,
        optimizer_offload_fraction=opt.optimizer_offload_fraction if opt.optimizer_cpu_offload else 0.0,
        overlap_cpu_optimizer_d2h_h2d=opt.overlap_cpu_optimizer_d2h_h2d,
    )
    return get_megatron_optimizer(config, model_chunks)


def build_scheduler(optimizer: Any, settings: OptimSettings) -> Any:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if settings.warmup_steps else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr if settings.lr_decay_style != "constant" else settings.lr,
        lr_warmup_steps=settings.warmup_steps,
        lr_decay_steps=max(settings.total_steps, settings.warmup_steps + 1),
        lr_decay_style=settings.lr_decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=max(1, settings.total_steps),
        wd_incr_style="constant",
    )
