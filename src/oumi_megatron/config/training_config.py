"""``MegatronTrainingConfig``: Oumi's TrainingConfig plus the top-level ``megatron:`` and ``grpo:`` sections.

Oumi's own YAML loading returns this class (instead of a stock TrainingConfig) only for configs that
ask for MEGATRON_GRPO or carry a ``megatron:`` / ``grpo:`` section; every other config loads exactly as
before. See ``oumi_megatron.integration.oumi_patches``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oumi.core.configs import TrainingConfig
from oumi.core.configs.params.training_params import TrainerType

from oumi_megatron.config.grpo_params import MegatronGrpoParams
from oumi_megatron.config.megatron_params import MegatronParams
from oumi_megatron.config.trainer_type import MEGATRON_GRPO, add_megatron_grpo

add_megatron_grpo(TrainerType)  # configs parsed through this class may say MEGATRON_GRPO (the hook may be absent)

def megatron_trainer_type() -> TrainerType:
    return TrainerType[MEGATRON_GRPO]


@dataclass
class MegatronTrainingConfig(TrainingConfig):
    """A TrainingConfig for ``training.trainer_type: MEGATRON_GRPO``."""

    megatron: MegatronParams = field(default_factory=MegatronParams)
    """Parallel layout, batching and engine options (see MegatronParams)."""

    grpo: MegatronGrpoParams = field(default_factory=MegatronGrpoParams)
    """GRPO algorithm settings (see MegatronGrpoParams)."""

    @property
    def is_megatron_grpo(self) -> bool:
        return self.training.trainer_type == megatron_trainer_type()
