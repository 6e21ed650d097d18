"""The megatron:/grpo: sections, Oumi wiring of the config, YAML round trip and CLI overrides."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from conftest import base_config_dict, write_yaml


def test_trainer_type_has_megatron_grpo_and_oumi_types_are_unchanged() -> None:
    from oumi.core.configs.params.training_params import TrainerType

    assert TrainerType["MEGATRON_GRPO"].value == "megatron_grpo"
    assert TrainerType("megatron_grpo") is TrainerType.MEGATRON_GRPO
    names = [t.name for t in TrainerType]
    assert names[-1] == "MEGATRON_GRPO"
    for stock in ("TRL_SFT", "TRL_GRPO", "VERL_GRPO", "HF", "OUMI"):
        assert stock in names


def test_megatron_params_defaults_follow_the_seed_reference() -> None:
    from oumi_megatron import MegatronParams

    m = MegatronParams()
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size) == (1, 1)
    assert (m.context_parallel_size, m.expert_model_parallel_size) == (1, 1)
    assert m.virtual_pipeline_model_parallel_size is None and m.sequence_parallel is False
    assert m.ddp_config.grad_reduce_in_fp32 is True
    assert m.ddp_config.overlap_grad_reduce is False
    assert m.ddp_config.overlap_param_gather is False
    # the seed's reference sets True; here it is off by default and warned about when set (it cannot apply)
    assert m.ddp_config.average_in_collective is False
    assert m.optimizer_config.optimizer_cpu_offload is False
    assert m.optimizer_config.optimizer_offload_fraction == 0.0
    assert m.transformer_config.recompute_granularity == "selective"
    assert m.transformer_config.recompute_method == "uniform"
    assert m.transformer_config.recompute_modules == ["core_attn"]
    assert m.checkpoint_config.use_async_checkpoint is False
    assert m.checkpoint_config.use_fully_parallel_strategy is True
    assert m.enable_weight_sync is True and m.weight_sync_method == "nccl"
    assert m.inference_backend == "megatron"  # issue 5: the embedded backend is the default
    assert m.enable_module_queue is False and m.module_queue_num_chunks == 4  # seed 000
    assert m.pipeline_schedule == "1f1b"


def test_grpo_params_share_oumi_grpo_field_names() -> None:
    from oumi.core.configs.params.grpo_params import GrpoParams

    from oumi_megatron import MegatronGrpoParams

    ours = {f.name for f in dataclasses.fields(MegatronGrpoParams)}
    oumi = {f.name for f in dataclasses.fields(GrpoParams)}
    shared = {"num_generations", "temperature", "epsilon", "max_prompt_length", "max_completion_length", "log_completions"}
    assert shared <= ours and shared <= oumi
    extras = {"epsilon_high", "beta", "kl_estimator", "loss_aggregation", "scale_rewards", "top_p",
              "ppo_epochs", "num_mini_batches", "reward_functions"}
    assert extras <= ours
    assert MegatronGrpoParams().temperature == GrpoParams().temperature == 0.9
    assert MegatronGrpoParams().epsilon == GrpoParams().epsilon == 0.2


def test_megatron_yaml_loads_through_oumis_loader(make_config) -> None:  # noqa: ANN001
    from oumi_megatron import MegatronTrainingConfig

    cfg = make_config(
        megatron={"tensor_model_parallel_size": 2, "ddp_config": {"overlap_grad_reduce": True}},
        grpo={"reward_functions": [{"name": "gsm8k", "weight": 0.5, "kwargs": {"strict": True}}]},
    )
    assert isinstance(cfg, MegatronTrainingConfig)
    assert cfg.training.trainer_type.name == "MEGATRON_GRPO"
    assert cfg.megatron.tensor_model_parallel_size == 2
    assert cfg.megatron.ddp_config.overlap_grad_reduce is True
    assert cfg.grpo.reward_functions[0].weight == 0.5
    assert cfg.grpo.reward_functions[0].kwargs == {"strict": True}


def test_yaml_round_trip_is_equal(make_config, tmp_path: Path) -> None:  # noqa: ANN001
    from oumi_megatron import MegatronTrainingConfig

    cfg = make_config(
        megatron={
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
            "transformer_config": {"recompute_granularity": "full", "recompute_num_layers": 1},
            "optimizer_config": {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5},
        },
        grpo={"epsilon_high": 0.28, "kl_estimator": "k2", "beta": 0.04},
    )
    out = tmp_path / "saved.yaml"
    cfg.to_yaml(str(out))
    saved = yaml.safe_load(out.read_text())
    assert saved["megatron"]["virtual_pipeline_model_parallel_size"] == 2
    assert saved["grpo"]["kl_estimator"] == "k2"
    reloaded = MegatronTrainingConfig.from_yaml(str(out))
    assert reloaded == cfg
    assert reloaded.megatron == cfg.megatron and reloaded.grpo == cfg.grpo


def test_dotted_cli_overrides(make_config) -> None:  # noqa: ANN001
    cfg = make_config(
        overrides=[
            "megatron.tensor_model_parallel_size=8",
            "megatron.ddp_config.overlap_grad_reduce=true",
            "grpo.temperature=0.7",
            "grpo.reward_functions[0].weight=2.0",
        ]
    )
    assert cfg.megatron.tensor_model_parallel_size == 8
    assert cfg.megatron.ddp_config.overlap_grad_reduce is True
    assert cfg.grpo.temperature == 0.7
    assert cfg.grpo.reward_functions[0].weight == 2.0


def test_stock_configs_still_load_as_stock_training_config(tmp_path: Path) -> None:
    from oumi.core.configs import TrainingConfig

    path = write_yaml(
        tmp_path / "sft.yaml",
        {"model": {"model_name": "gpt2"}, "training": {"trainer_type": "TRL_SFT", "max_steps": 3}},
    )
    cfg = TrainingConfig.from_yaml_and_arg_list(str(path), ["training.learning_rate=0.001"])
    assert type(cfg) is TrainingConfig
    assert cfg.training.learning_rate == 0.001
    assert not hasattr(cfg, "megatron")
    assert type(TrainingConfig.from_yaml(str(path))) is TrainingConfig


def test_megatron_override_alone_routes_a_stock_yaml(tmp_path: Path, tiny_model_dir: Path) -> None:
    from oumi.core.configs import TrainingConfig

    from oumi_megatron import MegatronTrainingConfig

    path = write_yaml(tmp_path / "c.yaml", {"model": {"model_name": str(tiny_model_dir)}})
    cfg = TrainingConfig.from_yaml_and_arg_list(str(path), ["training.trainer_type=MEGATRON_GRPO"])
    assert isinstance(cfg, MegatronTrainingConfig)


def test_unknown_megatron_key_is_rejected_with_its_name(tmp_path: Path, tiny_model_dir: Path) -> None:
    from oumi.core.configs import TrainingConfig
    from oumi.exceptions import OumiConfigError

    data = base_config_dict(tiny_model_dir, megatron={"tensor_parallel": 2})
    path = write_yaml(tmp_path / "bad.yaml", data)
    with pytest.raises(OumiConfigError, match="tensor_parallel"):
        TrainingConfig.from_yaml_and_arg_list(str(path), [])


STANDALONE_CONFIGS = ["tiny_cpu_grpo.yaml", "smollm2_arithmetic_gpu.yaml", "smollm2_arithmetic_large_calculator_gpu.yaml",
                      "llama70b_slice_1gpu.yaml", "one_gpu_grpo.yaml",
                      "llama8b_grpo_8gpu_async.yaml", "qwen2_5_coder_0_5b_code_python_gpu.yaml"]


@pytest.mark.parametrize("name", STANDALONE_CONFIGS)
def test_the_config_without_oumi_reads_what_oumi_reads(name: str) -> None:
    """config/standalone.py (the GPU image, no Oumi) against Oumi's own loading of the shipped configs, with overrides:
    every model/training field the run reads and the whole megatron:/grpo: sections are equal, so a benchmark runs what
    `oumi train` runs; the defaults of the fields a YAML leaves out are Oumi's."""
    from oumi_megatron.config.standalone import ModelSection, TrainingSection, load_config

    path = Path(__file__).resolve().parents[1] / "configs" / name
    overrides = ["training.max_steps=7", "megatron.micro_batch_size=4", "grpo.temperature=0.5"]
    ours, oumis = load_config(path, overrides, oumi=False), load_config(path, overrides, oumi=True)
    assert type(ours).__name__ == "StandaloneConfig" and type(oumis).__name__ == "MegatronTrainingConfig"
    for section, cls in (("model", ModelSection), ("training", TrainingSection)):
        for f in dataclasses.fields(cls):
            got, want = getattr(getattr(ours, section), f.name), getattr(getattr(oumis, section), f.name)
            want = getattr(want, "value", want) if f.name != "trainer_type" else want.name  # Oumi's enums by value
            assert got == want, f"{section}.{f.name}: {got!r} != Oumi's {want!r}"
    assert ours.model.torch_dtype == oumis.model.torch_dtype
    assert ours.megatron == oumis.megatron and ours.grpo == oumis.grpo
    assert (ours.training.max_steps, ours.megatron.micro_batch_size, ours.grpo.temperature) == (7, 4, 0.5)


def test_the_config_without_oumi_refuses_unknown_keys(tmp_path: Path) -> None:
    """A mistyped megatron:/grpo: key fails as under Oumi; Oumi-only training keys are listed, not silently applied."""
    from oumi_megatron.config.standalone import load_config

    path = tmp_path / "cfg.yaml"
    path.write_text("model: {model_name: m}\ntraining: {max_steps: 2, logging_steps: 5}\nmegatron: {micro_batch_sise: 2}\n")
    with pytest.raises(Exception, match="micro_batch_sise"):
        load_config(path, oumi=False)
    path.write_text("model: {model_name: m}\ntraining: {max_steps: 2, logging_steps: 5}\n")
    config = load_config(path, oumi=False)
    assert config.oumi_only == ["training.logging_steps"] and config.training.max_steps == 2
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.yaml", oumi=False)
