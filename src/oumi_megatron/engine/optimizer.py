"""Megatron-Core's optimizer (plain or distributed Adam, grad clipping, CPU offload) and LR schedule."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from oumi_megatron.utils.options import option_value

if TYPE_CHECKING:
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig

logger = logging.getLogger("oumi")


def check_optimizer(config: MegatronTrainingConfig, found: Findings) -> None:
    """``megatron.optimizer_config``: the offloaded fraction of the optimizer state."""
    opt = config.megatron.optimizer_config
    frac = opt.optimizer_offload_fraction
    if not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
        found.add("megatron.optimizer_config.optimizer_offload_fraction",
                  f"must be in [0, 1], got {frac!r}. Use 1.0 to offload all optimizer state, 0.0 for none.")
    elif frac > 0 and not opt.optimizer_cpu_offload:
        found.warn("megatron.optimizer_config.optimizer_offload_fraction > 0 has no effect unless "
                   "megatron.optimizer_config.optimizer_cpu_offload is True.")


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
        scheduler = option_value(training.lr_scheduler_type, "constant")
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


def build_optimizer(model_chunks: list[torch.nn.Module], params: MegatronParams, settings: OptimSettings, dtype: torch.dtype) -> Any:
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
    optimizer = get_megatron_optimizer(config, model_chunks)
    if _fused_kernels_on(opt.fused_kernels):
        use_fused_kernels(optimizer)
        logger.info("optimizer kernels: torch fused AdamW, foreach gradient norm and scale")
    else:
        logger.info("optimizer kernels: Megatron-Core's torch fallbacks (foreach AdamW, per-tensor gradient norm)")
    return optimizer


def _fused_kernels_on(setting: bool | None) -> bool:
    if setting is None:
        return torch.cuda.is_available()
    if setting and not torch.cuda.is_available():
        raise ValueError("megatron.optimizer_config.fused_kernels: true needs a CUDA GPU; set it to null or false on the CPU")
    return setting


def use_fused_kernels(optimizer: Any) -> None:
    """Replaces Megatron-Core's no-apex fallbacks on the GPU (see ``fused_kernels`` in MegatronOptimizerConfig).

    - Its torch AdamW is built without ``fused`` (the foreach path: several passes over the fp32 state);
      torch's fused kernel is the same update in one pass. Switched per param group, after the build,
      because Megatron-Core passes the constructor no such flag. Groups on the CPU (optimizer offload) keep
      their path.
    - Its local ``multi_tensor_l2norm`` turns each parameter's norm into a Python float (a host sync per
      parameter) and ``multi_tensor_scale`` loops over tensors; the foreach versions below implement
      apex's amp_C interface on the device.
    """
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as mcore_optimizer

    for inner in torch_optimizers(optimizer):
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for group in inner.param_groups:
                if group["params"] and all(p.is_cuda for p in group["params"]):
                    group["fused"], group["foreach"] = True, False
    clip_grads.l2_norm_impl = foreach_l2norm
    clip_grads.multi_tensor_scale_impl = foreach_scale
    mcore_optimizer.multi_tensor_scale_impl = foreach_scale


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron-Core's (possibly chained) optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in chained if isinstance(getattr(o, "optimizer", None), torch.optim.Optimizer)]


def kernel_choice(optimizer: Any) -> list[list[tuple[bool, bool]]]:
    """Each param group's (fused, foreach) flags, to restore after a checkpoint load (torch's
    ``load_state_dict`` takes them from the checkpoint, which may come from a run with other kernels)."""
    return [[(g.get("fused") or False, g.get("foreach") or False) for g in o.param_groups] for o in torch_optimizers(optimizer)]


def restore_kernel_choice(optimizer: Any, choice: list[list[tuple[bool, bool]]]) -> None:
    for inner, flags in zip(torch_optimizers(optimizer), choice, strict=True):
        for group, (fused, foreach) in zip(inner.param_groups, flags, strict=True):
            group["fused"], group["foreach"] = fused, foreach


def foreach_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                   per_tensor: bool, *args: Any) -> tuple[torch.Tensor, None]:
    """apex ``amp_C.multi_tensor_l2norm`` (as called through ``multi_tensor_applier``): the L2 norm of all
    tensors of ``tensor_lists[0]`` together, as a one-element fp32 tensor on their device."""
    norms = torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], scale: float) -> None:
    """apex ``amp_C.multi_tensor_scale``: ``dst = src * scale`` for each pair (any float dtypes), without a
    copy of the whole list: gradient clipping passes the gradients as both lists, and an out-of-place
    ``_foreach_mul`` there held a second copy of every fp32 gradient (14 GiB on a 7B model's stage)."""
    src, dst = tensor_lists
    if scale == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(s.data_ptr() == d.data_ptr() and s.dtype == d.dtype and s.shape == d.shape for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:  # one tensor's temporary at a time; the product rounds once, into dst's dtype, as apex does
        for s, d in zip(src, dst, strict=True):
            d.copy_(s * scale)


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
