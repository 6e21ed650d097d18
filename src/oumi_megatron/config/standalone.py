"""A MEGATRON_GRPO YAML config where Oumi is not installed: ``load_config`` for every caller.

The lent GPU image has the engine's dependencies but not Oumi's (they do not fit a call), yet its benchmarks must
run what ``oumi train`` runs from the same YAML. There the ``model:`` and ``training:`` sections are read into
``ModelSection`` / ``TrainingSection``: the fields of Oumi's ``ModelParams`` / ``TrainingParams`` that the trainer,
the optimizer and the run folder read, with Oumi's defaults (tests/test_config.py checks both against Oumi's own
loading of the shipped configs). ``megatron:`` and ``grpo:`` are the same dataclasses as under Oumi. The keys of
Oumi's sections that only Oumi acts on (its data pipeline, its HF trainer's options) are listed in
``StandaloneConfig.oumi_only`` and do nothing here; ``data:`` is kept as read (the caller supplies the rows).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from oumi_megatron.config.grpo_params import MegatronGrpoParams
from oumi_megatron.config.megatron_params import MegatronParams


@dataclass
class ModelSection:
    """Oumi's ``model:`` fields the run reads."""

    model_name: str = ""
    torch_dtype_str: str = "float32"
    trust_remote_code: bool = False
    model_revision: str | None = None

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.torch_dtype_str)


@dataclass
class TrainingSection:
    """Oumi's ``training:`` fields the run reads, with Oumi's defaults."""

    trainer_type: str = "MEGATRON_GRPO"
    output_dir: str = "output"
    seed: int = 42
    max_steps: int = -1
    num_train_epochs: int = 3
    save_steps: int = 500
    save_final_model: bool = True
    try_resume_from_last_checkpoint: bool = False
    resume_from_checkpoint: str | None = None
    eval_strategy: str = "no"
    eval_steps: int = 500
    per_device_eval_batch_size: int = 8
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    include_performance_metrics: bool = False
    enable_tensorboard: bool = True
    enable_wandb: bool = False
    run_name: str | None = None
    learning_rate: float = 5e-05
    lr_scheduler_type: str = "linear"
    warmup_steps: int | None = None
    warmup_ratio: float | None = None
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-08
    max_grad_norm: float | None = 1.0
    use_peft: bool = False


@dataclass
class PeftSection:
    """Oumi's ``peft:`` fields (LoRA, config/lora.py), with Oumi's defaults."""

    lora_r: int = 8
    lora_alpha: int = 8
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None
    peft_save_mode: str = "adapter_only"
    q_lora: bool = False
    lora_modules_to_save: list[str] | None = None
    lora_exclude_modules: list[str] | None = None
    lora_target_parameters: list[str] | None = None
    lora_bias: str = "none"
    lora_init_weights: str = "default"
    lora_task_type: str = "CAUSAL_LM"


@dataclass
class StandaloneConfig:
    """The config's sections without Oumi (attribute for attribute what the trainer reads of a MegatronTrainingConfig)."""

    model: ModelSection = field(default_factory=ModelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    peft: PeftSection = field(default_factory=PeftSection)
    megatron: MegatronParams = field(default_factory=MegatronParams)
    grpo: MegatronGrpoParams = field(default_factory=MegatronGrpoParams)
    data: dict[str, Any] = field(default_factory=dict)
    oumi_only: list[str] = field(default_factory=list)
    """``model.*`` / ``training.*`` keys of the YAML that only Oumi acts on (not applied here)."""


def oumi_installed() -> bool:
    try:
        return importlib.util.find_spec("oumi") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as none
        return False


def load_config(path: str | Path, overrides: Sequence[str] = (), *, oumi: bool | None = None) -> Any:
    """The YAML at ``path`` with dotted ``overrides`` (``training.max_steps=5``, as ``oumi train`` takes them):
    Oumi's ``MegatronTrainingConfig`` where Oumi is installed (``oumi``: None = where importable), else a
    ``StandaloneConfig``."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    if oumi is None:
        oumi = oumi_installed()
    if oumi:
        from oumi_megatron.config.training_config import MegatronTrainingConfig

        return MegatronTrainingConfig.from_yaml_and_arg_list(str(path), list(overrides))
    return _load_standalone(Path(path), overrides)


def _load_standalone(path: Path, overrides: Sequence[str]) -> StandaloneConfig:
    from omegaconf import OmegaConf

    raw = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))
    tree: dict[str, Any] = OmegaConf.to_container(raw, resolve=True)  # type: ignore[assignment]
    unknown = sorted(set(tree) - {"model", "training", "peft", "megatron", "grpo", "data"})
    if unknown:
        raise ValueError(f"{path}: unknown top-level section(s) {unknown}; a MEGATRON_GRPO config has model:, data:, "
                         "training:, peft:, megatron: and grpo:.")
    config = StandaloneConfig(data=tree.get("data") or {})
    for name, section in (("model", config.model), ("training", config.training), ("peft", config.peft)):
        known = {f.name for f in fields(section)}
        for key, value in (tree.get(name) or {}).items():
            if key in known:
                setattr(section, key, value)
            else:
                config.oumi_only.append(f"{name}.{key}")
    # megatron:/grpo: through their dataclasses' schema: an unknown or mistyped key is an error, as under Oumi
    for name, cls in (("megatron", MegatronParams), ("grpo", MegatronGrpoParams)):
        merged = OmegaConf.merge(OmegaConf.structured(cls), tree.get(name) or {})
        setattr(config, name, OmegaConf.to_object(merged))
    return config
