"""``MegatronTrainingConfig``: Oumi's TrainingConfig plus the top-level ``megatron:`` and ``grpo:`` sections.

Oumi's own YAML loading returns this class (instead of a stock TrainingConfig) only for configs that
ask for MEGATRON_GRPO or carry a ``megatron:`` / ``grpo:`` section; every other config loads exactly as
before. See ``oumi_megatron.integration.oumi_patches``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from oumi.core.configs import TrainingConfig
from oumi.core.configs.params.training_params import TrainerType

from oumi_megatron.config.grpo_params import MegatronGrpoParams
from oumi_megatron.config.megatron_params import MegatronParams
from oumi_megatron.config.problems import Findings
from oumi_megatron.config.trainer_type import MEGATRON_GRPO, add_megatron_grpo

add_megatron_grpo(TrainerType)  # configs parsed through this class may say MEGATRON_GRPO (the hook may be absent)


@dataclass
class MegatronTrainingConfig(TrainingConfig):
    """A TrainingConfig for ``training.trainer_type: MEGATRON_GRPO``."""

    megatron: MegatronParams = field(default_factory=MegatronParams)
    """Parallel layout, batching and engine options (see MegatronParams)."""

    grpo: MegatronGrpoParams = field(default_factory=MegatronGrpoParams)
    """GRPO algorithm settings (see MegatronGrpoParams)."""


def check_oumi_sections(cfg: MegatronTrainingConfig, found: Findings) -> None:
    """What MEGATRON_GRPO needs of Oumi's own sections: its trainer type, no FSDP / DeepSpeed, a model, and the
    ``training:`` fields it reads (steps, checkpoints, the learning rate and its warm-up)."""
    if cfg.training.trainer_type.name != MEGATRON_GRPO:
        found.add("training.trainer_type", f"is {cfg.training.trainer_type.name}, but the config has megatron:/grpo: "
                                           "sections, which only MEGATRON_GRPO reads. Set training.trainer_type: "
                                           "MEGATRON_GRPO or remove the megatron: and grpo: sections.")
    if cfg.fsdp.enable_fsdp:
        found.add("fsdp.enable_fsdp", "FSDP cannot be combined with MEGATRON_GRPO (Megatron-Core does the sharding). "
                                      "Set fsdp.enable_fsdp: False and use megatron.ddp_config / tensor/pipeline parallelism.")
    if cfg.deepspeed.enable_deepspeed:
        found.add("deepspeed.enable_deepspeed", "DeepSpeed cannot be combined with MEGATRON_GRPO. Set "
                                                "deepspeed.enable_deepspeed: False; megatron.ddp_config."
                                                "use_distributed_optimizer gives ZeRO-1 style optimizer sharding.")
    if not (cfg.model.model_name or "").strip():
        found.add("model.model_name", "is empty. Set it to a Hugging Face model name (e.g. meta-llama/Llama-3.1-8B-Instruct) "
                                      "or a local folder with config.json.")
    t = cfg.training
    if t.max_steps == 0:
        found.add("training.max_steps", "is 0: nothing would be trained. Set it to the number of GRPO steps to run, "
                                        "or to -1 to run training.num_train_epochs passes over the data.")
    elif (t.max_steps is None or t.max_steps < 0) and not (t.num_train_epochs or 0) > 0:
        found.add("training.max_steps", f"is {t.max_steps} and training.num_train_epochs is {t.num_train_epochs}: set "
                                        "max_steps (GRPO steps) or a positive num_train_epochs.")
    if not isinstance(t.save_steps, int) or t.save_steps < 0:
        found.add("training.save_steps", f"must be >= 0 (0: save only at the end), got {t.save_steps!r}.")
    lr = t.learning_rate
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        found.add("training.learning_rate", f"must be a finite number >= 0, got {lr!r}. Typical for GRPO: 1e-7 to 1e-5.")
    elif lr == 0:
        found.warn("training.learning_rate is 0: the policy will not change.")
    if t.warmup_steps is not None and t.warmup_steps < 0:
        found.add("training.warmup_steps", f"must be >= 0, got {t.warmup_steps!r}.")
    if t.warmup_ratio is not None and not 0.0 <= t.warmup_ratio <= 1.0:
        found.add("training.warmup_ratio", f"must be in [0, 1], got {t.warmup_ratio!r}.")
