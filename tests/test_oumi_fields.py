"""Oumi's own fields are honoured (config/oumi_fields.py): the design document's Quick Start YAML copied
verbatim, and Oumi's VERL_GRPO gsm8k example migrated by the guide's steps, load and validate as meant."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import REPO, base_config_dict, write_yaml

SHAPE_70B = str(REPO / "configs/model_shapes/llama-3.1-70b-instruct/config.json")

# The design document's Quick Start (seed 001), verbatim.
QUICK_START = """
model:
  model_name: "meta-llama/Llama-3.1-70B-Instruct"
  torch_dtype_str: "bfloat16"
  load_pretrained_weights: True

data:
  train:
    datasets:
      - dataset_name: "gsm8k"
        split: "train"

training:
  trainer_type: "MEGATRON_GRPO"
  max_steps: 1000
  per_device_train_batch_size: 1
  gradient_accumulation_steps: 4
  learning_rate: 5.0e-7
  output_dir: "output/llama70b_megatron"

megatron:
  tensor_model_parallel_size: 8
  pipeline_model_parallel_size: 2
  enable_sequence_packing: True
  inference_backend: "vllm"

grpo:
  num_generations: 4
  temperature: 0.9
  epsilon: 0.2
"""


def verl_gsm8k_migrated() -> dict:
    """Oumi's configs/examples/grpo_verl_gsm8k/train.yaml (same fields and values), migrated by the
    guide's steps: trainer_type MEGATRON_GRPO, a megatron: section, FSDP off. Nothing else moved."""
    return {
        "model": {"model_name": "Qwen/Qwen2.5-0.5B-Instruct"},
        "data": {
            "train": {"datasets": [{"dataset_name": "openai/gsm8k", "subset": "main", "split": "train"}]},
            "validation": {"datasets": [{"dataset_name": "openai/gsm8k", "subset": "main", "split": "test"}]},
        },
        "training": {
            "trainer_type": "MEGATRON_GRPO",
            "num_train_epochs": 15,
            "save_steps": 10,
            "eval_strategy": "steps",
            "eval_steps": 10,
            "learning_rate": 1.0e-6,
            "enable_gradient_checkpointing": True,
            "reward_functions": ["gsm8k"],
            "grpo": {"use_vllm": True, "temperature": 1.0, "vllm_gpu_memory_utilization": 0.4},
            "verl_config_overrides": {
                "data": {"train_batch_size": 256, "max_prompt_length": 512, "max_response_length": 256},
                "actor_rollout_ref": {
                    "actor": {"use_kl_loss": True, "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl",
                              "ppo_mini_batch_size": 64, "ppo_micro_batch_size_per_gpu": 4},
                    "rollout": {"log_prob_micro_batch_size_per_gpu": 8, "tensor_model_parallel_size": 1, "n": 16},
                    "ref": {"log_prob_micro_batch_size_per_gpu": 4},
                },
                "algorithm": {"kl_ctrl": {"kl_coef": 0.001}},
                "trainer": {"val_before_train": False, "n_gpus_per_node": 1, "nnodes": 1},
            },
            "output_dir": "output/grpo_verl_gsm8k",
            "run_name": "grpo_verl_gsm8k",
            "enable_wandb": True,
        },
        "megatron": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1},
        "fsdp": {"enable_fsdp": False},
    }


def _load(path: Path, overrides: list[str] | None = None):  # noqa: ANN202
    from oumi.core.configs import TrainingConfig

    config = TrainingConfig.from_yaml_and_arg_list(str(path), overrides or [])
    config.finalize_and_validate()  # Oumi's own checks (which reject training.reward_functions for other trainers)
    return config


def test_quick_start_yaml_verbatim_validates_for_16_gpus(tmp_path: Path) -> None:
    from oumi_megatron.validation import validate_config

    path = tmp_path / "train_70b_grpo.yaml"
    path.write_text(QUICK_START)
    config = _load(path)
    d = config.data.train.datasets[0]
    assert (d.dataset_name, d.subset) == ("openai/gsm8k", "main")  # "gsm8k" is Oumi's openai/gsm8k
    assert [r.name for r in config.grpo.reward_functions] == ["gsm8k"]  # the dataset's own reward
    report = validate_config(config, world_size=16, gpus_per_node=8, model_config_path=SHAPE_70B)
    assert report.ok, report.format_problems()
    assert any("'gsm8k' is the reward of 'openai/gsm8k'" in n for n in report.notes), report.notes
    assert any("dataset_name = 'openai/gsm8k'" in n for n in report.notes), report.notes
    lay = report.layout
    assert (lay.tensor_parallel, lay.pipeline_parallel, lay.micro_batch_size, lay.global_batch_size) == (8, 2, 1, 4)


def test_the_validate_cli_prints_what_it_took_over(tmp_path: Path) -> None:
    from conftest import run_cli

    path = tmp_path / "qs.yaml"
    path.write_text(QUICK_START)
    out = run_cli(["oumi-megatron", "validate", "-c", str(path), "--world-size", "16", "--model-config", SHAPE_70B])
    assert out.returncode == 0, out.stderr
    assert "note: grpo.reward_functions = ['gsm8k']" in out.stderr and "OK" in out.stdout


def test_migrated_verl_example_is_taken_over_as_meant(tmp_path: Path) -> None:
    from oumi_megatron.validation import validate_config

    config = _load(write_yaml(tmp_path / "verl.yaml", verl_gsm8k_migrated()))
    g, m = config.grpo, config.megatron
    assert [r.name for r in g.reward_functions] == ["gsm8k"] and config.training.reward_functions is None
    assert (g.temperature, g.num_generations, g.max_prompt_length, g.max_completion_length) == (1.0, 16, 512, 256)
    assert (g.beta, g.kl_estimator) == (0.001, "k3")  # use_kl_loss + low_var_kl
    # verl counts prompts: 256 per step, 64 per optimizer step; ours counts completions
    assert (m.global_batch_size, g.num_mini_batches, m.micro_batch_size) == (64 * 16, 4, 4)
    assert (m.inference_backend, m.vllm_gpu_memory_utilization) == ("vllm", 0.4)
    t = m.transformer_config
    assert (t.recompute_granularity, t.recompute_method, t.recompute_num_layers) == ("full", "uniform", 1)
    report = validate_config(config, world_size=1, model_shape=_qwen05b_shape(), check_bridge=False)
    assert report.ok, report.format_problems()
    assert report.layout.prompts_per_rollout == 256
    warnings = " ".join(report.warnings)
    assert "eval" not in warnings  # data.validation + eval_strategy steps / eval_steps 10: evaluated, as written
    for ignored in ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "algorithm.kl_ctrl.kl_coef",
                    "trainer.n_gpus_per_node"):
        assert ignored in warnings
    assert "actor_rollout_ref.rollout.n" not in warnings  # taken over, not ignored


def _qwen05b_shape():  # noqa: ANN202
    from oumi_megatron.model_shape import ModelShape

    return ModelShape(source="qwen", model_type="qwen2", architectures=("Qwen2ForCausalLM",), num_layers=24,
                      hidden_size=896, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                      max_position_embeddings=32768, tie_word_embeddings=True)


def test_our_sections_win_and_conflicts_name_both_fields(tmp_path: Path, tiny_model_dir: Path) -> None:
    from oumi_megatron.validation import validate_config

    base = base_config_dict(tiny_model_dir)
    base["training"]["grpo"] = {"temperature": 0.7, "num_generations": 4}
    config = _load(write_yaml(tmp_path / "a.yaml", base))
    assert config.grpo.temperature == 0.7  # training.grpo fills what grpo: leaves unset
    base["grpo"]["temperature"] = 0.5
    config = _load(write_yaml(tmp_path / "b.yaml", base))
    report = validate_config(config, world_size=1, check_bridge=False)
    assert "grpo.temperature" in report.fields()
    assert "is 0.5 but training.grpo.temperature is 0.7" in report.format_problems()
    # the same value in both places is fine; a command-line override counts as set
    base["grpo"]["temperature"] = 0.7
    assert validate_config(_load(write_yaml(tmp_path / "c.yaml", base)), world_size=1, check_bridge=False).ok
    config = _load(write_yaml(tmp_path / "d.yaml", base), ["grpo.temperature=0.3"])
    assert "grpo.temperature" in validate_config(config, world_size=1, check_bridge=False).fields()


@pytest.mark.parametrize(
    ("training", "field", "text"),
    [
        ({"optimizer": "sgd"}, "training.optimizer", "Use adamw_torch"),
        ({"grpo": {"repetition_penalty": 1.2}}, "training.grpo.repetition_penalty", "without a repetition penalty"),
    ],
)
def test_oumi_fields_that_cannot_be_honoured_are_rejected(tmp_path: Path, tiny_model_dir: Path, training, field, text) -> None:  # noqa: ANN001
    from oumi_megatron.validation import validate_config

    cfg = base_config_dict(tiny_model_dir)
    cfg["training"].update(training)
    report = validate_config(_load(write_yaml(tmp_path / "x.yaml", cfg)), world_size=1, check_bridge=False)
    assert field in report.fields() and text in report.format_problems(), report.format_problems()


def test_two_reward_lists_are_a_conflict(tmp_path: Path, tiny_model_dir: Path) -> None:
    from oumi_megatron.validation import validate_config

    cfg = base_config_dict(tiny_model_dir)
    cfg["training"]["reward_functions"] = ["gsm8k"]
    report = validate_config(_load(write_yaml(tmp_path / "x.yaml", cfg)), world_size=1, check_bridge=False)
    assert "grpo.reward_functions" in report.fields() and "keep one list" in report.format_problems()


def test_shipped_quick_start_config_is_the_seed_yaml() -> None:
    shipped = yaml.safe_load((REPO / "configs" / "quickstart_70b_grpo.yaml").read_text())
    assert shipped == yaml.safe_load(QUICK_START)


def test_one_reward_name_on_the_command_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`--training.reward_functions=gsm8k` (a string, not a list) is one function, not five letters."""
    cfg = base_config_dict(tiny_model_dir)
    cfg["grpo"]["reward_functions"] = []
    config = _load(write_yaml(tmp_path / "x.yaml", cfg), ["training.reward_functions=gsm8k"])
    assert [r.name for r in config.grpo.reward_functions] == ["gsm8k"]


def test_evaluation_fields_need_their_data(make_config) -> None:  # noqa: ANN001
    from oumi_megatron.validation import validate_config

    report = validate_config(make_config(training={"eval_strategy": "steps", "eval_steps": 5}), world_size=1,
                             check_bridge=False)
    assert not report.ok
    assert "training.eval_strategy" in report.format_problems() and "data.validation" in report.format_problems()
    validation = {"datasets": [{"dataset_name": "oumi-megatron/char-class",
                                "dataset_path": str(REPO / "data/char_class_eval.jsonl")}]}
    report = validate_config(make_config(data={"validation": validation}), world_size=1, check_bridge=False)
    assert report.ok and any("not evaluated during training" in n for n in report.notes)
    bad = make_config(data={"validation": validation}, training={"eval_strategy": "steps", "eval_steps": 0})
    report = validate_config(bad, world_size=1, check_bridge=False)
    assert not report.ok and "training.eval_steps" in report.format_problems()
