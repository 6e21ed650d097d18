"""Every validation rule: one bad config each, asserting the field named in the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from oumi_megatron.model_shape import ModelShape
from oumi_megatron.validation import MegatronConfigError, validate_config

REPO = Path(__file__).resolve().parent.parent

DENSE = ModelShape(
    source="test", model_type="llama", architectures=("LlamaForCausalLM",), num_layers=8,
    hidden_size=256, num_attention_heads=8, num_key_value_heads=4, vocab_size=1000,
)
MOE = ModelShape(
    source="test", model_type="mixtral", architectures=("MixtralForCausalLM",), num_layers=8,
    hidden_size=256, num_attention_heads=8, num_key_value_heads=4, vocab_size=1000, num_experts=8,
)


def check(cfg, world_size: int = 1, shape: ModelShape | None = DENSE, **kw):  # noqa: ANN001, ANN201
    return validate_config(cfg, world_size=world_size, model_shape=shape, check_bridge=False, **kw)


def problem_fields(report) -> list[str]:  # noqa: ANN001
    return report.fields()


def test_valid_config_resolves_layout(make_config) -> None:  # noqa: ANN001
    cfg = make_config(megatron={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                "micro_batch_size": 2, "global_batch_size": 16})
    r = check(cfg, world_size=8)
    assert r.ok, r.format_problems()
    lay = r.layout
    assert (lay.tensor_parallel, lay.pipeline_parallel, lay.data_parallel) == (2, 2, 2)
    assert lay.microbatches_per_step == 4  # 16 / (2 x DP 2)
    assert lay.pipeline_schedule == "1f1b"
    assert lay.prompts_per_rollout == 4 and lay.completions_per_rollout == 16
    text = lay.describe()
    assert "TP 2 x PP 2 x CP 1 x DP 2 = world size 8" in text
    assert "microbatches per step per DP rank: 4" in text


def test_batch_sizes_default_from_training_section(make_config) -> None:  # noqa: ANN001
    cfg = make_config(
        training={"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4},
        megatron={"micro_batch_size": None, "global_batch_size": None},
    )
    r = check(cfg, world_size=2)
    assert r.ok, r.format_problems()
    assert (r.layout.micro_batch_size, r.layout.global_batch_size) == (2, 16)  # 2 x 4 x DP 2


def test_world_size_not_divisible_uses_the_seed_message(make_config) -> None:  # noqa: ANN001
    cfg = make_config(megatron={"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4})
    r = check(cfg, world_size=16, shape=None)
    assert "megatron.tensor_model_parallel_size" in problem_fields(r)
    assert "world_size (16) must be divisible by the product of all model parallel sizes (32)" in r.format_problems()


@pytest.mark.parametrize(
    ("megatron", "shape", "world", "field", "text"),
    [
        ({"tensor_model_parallel_size": 3}, DENSE, 3, "megatron.tensor_model_parallel_size", "8 attention heads"),
        ({"tensor_model_parallel_size": 8}, DENSE, 8, "megatron.tensor_model_parallel_size", "4 key/value heads"),
        ({"pipeline_model_parallel_size": 3}, DENSE, 3, "megatron.pipeline_model_parallel_size", "8 layers = 8 cannot be split"),
        ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 8}, DENSE, 2,
         "megatron.virtual_pipeline_model_parallel_size", "model chunks per pipeline rank"),
        ({"virtual_pipeline_model_parallel_size": 2}, DENSE, 1,
         "megatron.virtual_pipeline_model_parallel_size", "needs pipeline_model_parallel_size > 1"),
        ({"sequence_parallel": True}, DENSE, 1, "megatron.sequence_parallel", "needs tensor_model_parallel_size > 1"),
        ({"expert_model_parallel_size": 2}, DENSE, 2, "megatron.expert_model_parallel_size", "dense model"),
        ({"expert_model_parallel_size": 3}, MOE, 3, "megatron.expert_model_parallel_size", "8 experts"),
        ({"expert_model_parallel_size": 4}, MOE, 2, "megatron.expert_model_parallel_size", "TP x CP x DP = 2 (experts are split"),
        ({"tensor_model_parallel_size": 2}, MOE, 2, "megatron.sequence_parallel", "Set sequence_parallel: true"),
        ({"micro_batch_size": 3, "global_batch_size": 8}, DENSE, 1, "megatron.global_batch_size", "not divisible by micro_batch_size x DP"),
        ({"micro_batch_size": 2, "global_batch_size": 8}, DENSE, 3, "megatron.global_batch_size", "2 x 3 = 6"),
        ({"inference_backend": "sglang", "tensor_model_parallel_size": 2}, DENSE, 2, "megatron.rollout_placement",
         "one per trainer rank, on Megatron TP 1 and PP 1"),
        ({"inference_backend": "sglang", "rollout_placement": "ray"}, DENSE, 1, "megatron.rollout_placement",
         "'ray' is not a placement of the 'sglang' backend. Use one of ['colocated', 'separate']"),
        ({"inference_backend": "sglang", "sglang_engine_args": {"chunked_prefil_size": 64}}, DENSE, 1,
         "megatron.sglang_engine_args", "'chunked_prefil_size' is not an argument of sglang.Engine"),
        ({"inference_backend": "sglang", "sglang_engine_args": {"tp_size": 2}}, DENSE, 1,
         "megatron.sglang_engine_args", "'tp_size' is set by the backend itself"),
        ({"inference_backend": "sglang", "sglang_engine_args": {"trust_remote_code": True}}, DENSE, 1,  # the model's own field
         "megatron.sglang_engine_args", "'trust_remote_code' is set by the backend itself; use its own field (model.model_name, "
                                        "model.torch_dtype_str, model.trust_remote_code"),
        ({"inference_backend": "sglang", "sglang_mem_fraction_static": 1.5}, DENSE, 1, "megatron.sglang_mem_fraction_static",
         "must be in (0, 1]"),
        ({"inference_backend": "sglang", "rollout_placement": "separate", "weight_sync_method": "checkpoint"}, DENSE, 1,
         "megatron.weight_sync_method", "use nccl (GPUs) or gloo (CPU)"),
        ({"inference_backend": "tgi"}, DENSE, 1, "megatron.inference_backend", "'megatron', 'sglang', 'vllm'"),
        ({"weight_sync_method": "rdma"}, DENSE, 1, "megatron.weight_sync_method", "'nccl', 'gloo', 'checkpoint'"),
        ({"vllm_kv_cache_gib": -1.0}, DENSE, 1, "megatron.vllm_kv_cache_gib", "must be >= 0"),
        ({"rollout_cuda_graphs": "always"}, DENSE, 1, "megatron.rollout_cuda_graphs", "'auto', 'true', 'false'"),
        ({"rollout_cuda_graphs": "true", "pipeline_model_parallel_size": 2}, DENSE, 2, "megatron.rollout_cuda_graphs",
         "pipeline_model_parallel_size > 1"),
        ({"rollout_decode_kernels": "fast"}, DENSE, 1, "megatron.rollout_decode_kernels", "'auto', 'true', 'false'"),
        ({"rollout_decode_kernels": "true", "inference_backend": "vllm"}, DENSE, 1, "megatron.rollout_decode_kernels",
         "vllm's engines decode with their own kernels"),
        ({"rollout_decode_kernels": True, "transformer_config": {"attention_backend": "local"}}, DENSE, 1,
         "megatron.rollout_decode_kernels", "true needs the layers on SDPA"),
        ({"pipeline_schedule": "gpipe"}, DENSE, 1, "megatron.pipeline_schedule", "Registered: '1f1b', 'interleaved', 'none', 'zb_h1'"),
        ({"pipeline_model_parallel_size": 2, "pipeline_schedule": "interleaved"}, DENSE, 2,
         "megatron.pipeline_schedule", "needs megatron.virtual_pipeline_model_parallel_size"),
        ({"optimizer_config": {"optimizer_offload_fraction": 1.5}}, DENSE, 1,
         "megatron.optimizer_config.optimizer_offload_fraction", "[0, 1]"),
        ({"optimizer_config": {"optimizer_offload_fraction": -0.1}}, DENSE, 1,
         "megatron.optimizer_config.optimizer_offload_fraction", "[0, 1]"),
        ({"transformer_config": {"recompute_granularity": "some"}}, DENSE, 1,
         "megatron.transformer_config.recompute_granularity", "'full', 'selective'"),
        ({"transformer_config": {"attention_backend": "flash"}}, DENSE, 1,
         "megatron.transformer_config.attention_backend", "'auto', 'sdpa', 'local'"),
        ({"logprob_chunk_tokens": -1}, DENSE, 1, "megatron.logprob_chunk_tokens", "0 (off: full logits)"),
        ({"transformer_config": {"packed_attention": "dense"}}, DENSE, 1,
         "megatron.transformer_config.packed_attention", "'auto', 'varlen', 'mask'"),
        ({"transformer_config": {"cuda_graph_impl": "full"}}, DENSE, 1, "megatron.transformer_config.cuda_graph_impl", "'none', 'local'"),
        ({"transformer_config": {"cuda_graph_impl": "local", "recompute_granularity": None}}, DENSE, 1,
         "megatron.transformer_config.cuda_graph_seq_length", "CUDA graphs have fixed shapes"),
        ({"transformer_config": {"cuda_graph_impl": "local", "cuda_graph_seq_length": 8, "recompute_granularity": None}}, DENSE, 1,
         "megatron.transformer_config.cuda_graph_seq_length", "Set cuda_graph_seq_length: "),
        ({"transformer_config": {"cuda_graph_impl": "local", "cuda_graph_seq_length": 4096}}, DENSE, 1,
         "megatron.transformer_config.recompute_granularity", "recompute_granularity: null"),
        ({"pipeline_model_parallel_size": 2,
          "transformer_config": {"cuda_graph_impl": "local", "cuda_graph_seq_length": 4096, "recompute_granularity": None}},
         DENSE, 2, "megatron.transformer_config.cuda_graph_impl", "pipeline_model_parallel_size 1 only"),
        ({"enable_sequence_packing": True,
          "transformer_config": {"cuda_graph_impl": "local", "cuda_graph_seq_length": 4096, "recompute_granularity": None}},
         DENSE, 1, "megatron.enable_sequence_packing", "cuda_graph_impl: none"),
        ({"transformer_config": {"recompute_modules": ["attn"]}}, DENSE, 1, "megatron.transformer_config.recompute_modules", "'core_attn'"),
        ({"tensor_model_parallel_size": 0}, DENSE, 1, "megatron.tensor_model_parallel_size", "positive integer"),
        ({"checkpoint_config": {"keep_last_n_checkpoints": -1}}, DENSE, 1, "megatron.checkpoint_config.keep_last_n_checkpoints", ">= 0"),
    ],
)
def test_layout_rules_name_the_field(make_config, megatron, shape, world, field, text) -> None:  # noqa: ANN001
    r = check(make_config(megatron=megatron), world_size=world, shape=shape)
    assert field in problem_fields(r), r.format_problems()
    assert text in r.format_problems()


def test_context_parallel_needs_sequence_divisible_by_2cp(make_config) -> None:  # noqa: ANN001
    vllm = {"context_parallel_size": 2, "inference_backend": "vllm"}
    cfg = make_config(megatron=vllm, grpo={"max_prompt_length": 30, "max_completion_length": 15})
    r = check(cfg, world_size=2)
    assert "grpo.max_completion_length" in problem_fields(r)
    assert "Set grpo.max_completion_length to 18 (total 48)" in r.format_problems()
    # a divisible length runs (engine/parallel/context_parallel.py)
    r = check(make_config(megatron=vllm, grpo={"max_prompt_length": 32, "max_completion_length": 16}), world_size=2)
    assert r.ok, r.format_problems()
    assert r.layout.context_parallel == 2 and r.layout.data_parallel == 1


@pytest.mark.parametrize(("megatron", "field", "fix"), [
    ({"transformer_config": {"attention_backend": "local"}}, "megatron.transformer_config.attention_backend",
     "Set attention_backend: auto or sdpa"),
], ids=["local_attention"])
def test_context_parallel_rejects_what_it_does_not_cover(make_config, megatron, field, fix) -> None:  # noqa: ANN001
    base = {"context_parallel_size": 2, "inference_backend": "vllm"}
    r = check(make_config(megatron={**base, **megatron}), world_size=2)
    assert problem_fields(r) == [field] and fix in r.format_problems(), r.format_problems()


def test_context_parallel_with_embedded_generation_warns_how_it_generates(make_config) -> None:  # noqa: ANN001
    r = check(make_config(megatron={"context_parallel_size": 2, "inference_backend": "megatron"}), world_size=2)
    assert r.ok, r.format_problems()
    assert any("generation (KV cache) runs whole sequences on each CP rank" in w for w in r.warnings), r.warnings


def test_expert_parallelism_runs_inside_data_parallelism(make_config) -> None:  # noqa: ANN001
    """EP splits experts over data-parallel ranks (Megatron-Core's expert groups): DP stays world / (TP x PP x CP)."""
    from oumi_megatron.engine.parallel.layout import default_world_size

    cfg = make_config(megatron={"expert_model_parallel_size": 2, "global_batch_size": 8})
    r = check(cfg, world_size=2, shape=MOE)
    assert r.ok, r.format_problems()
    assert (r.layout.data_parallel, r.layout.expert_parallel) == (2, 2)
    assert "TP 1 x PP 1 x CP 1 x DP 2 = world size 2" in r.layout.describe() and "expert parallel: EP 2" in r.layout.describe()
    assert default_world_size(make_config(megatron={"expert_model_parallel_size": 4, "tensor_model_parallel_size": 2,
                                                    "pipeline_model_parallel_size": 2})) == 8  # PP x lcm(TP x CP, EP)


def test_sequence_parallel_with_tensor_parallelism_is_accepted(make_config) -> None:  # noqa: ANN001
    r = check(make_config(megatron={"sequence_parallel": True, "tensor_model_parallel_size": 2}), world_size=2)
    assert "megatron.sequence_parallel" not in problem_fields(r), r.format_problems()


def test_average_in_collective_is_warned_not_silently_dropped(make_config) -> None:  # noqa: ANN001
    r = check(make_config(megatron={"ddp_config": {"average_in_collective": True}}))
    assert r.ok, r.format_problems()
    assert any("average_in_collective: True is not used" in w for w in r.warnings), r.warnings
    assert not any("average_in_collective" in w for w in check(make_config()).warnings)


def test_vllm_placement_rules(make_config) -> None:  # noqa: ANN001
    for placement, method in [("colocated", "nccl"), ("separate", "nccl"), ("separate", "checkpoint")]:
        ok = check(make_config(megatron={"inference_backend": "vllm", "rollout_placement": placement,
                                         "weight_sync_method": method, "tensor_model_parallel_size": 2}), world_size=4)
        assert ok.ok, (placement, method, ok.format_problems())
    r = check(make_config(megatron={"inference_backend": "vllm", "rollout_placement": "nearby"}))
    assert "megatron.rollout_placement" in problem_fields(r)
    r = check(make_config(megatron={"inference_backend": "vllm", "weight_sync_bucket_mb": 0}))
    assert "megatron.weight_sync_bucket_mb" in problem_fields(r)
    ok = check(make_config(megatron={"inference_backend": "vllm", "rollout_placement": "separate", "weight_sync_method": "gloo"}),
               world_size=2)
    assert ok.ok, ok.format_problems()


ASYNC = {"inference_backend": "vllm", "rollout_placement": "separate", "weight_sync_method": "gloo"}


@pytest.mark.parametrize(
    ("megatron", "grpo", "field", "text"),
    [
        ({}, {"max_staleness": 1}, "grpo.max_staleness", "rollout_placement: separate"),
        ({"inference_backend": "vllm"}, {"max_staleness": 1}, "grpo.max_staleness", "now 'vllm' / 'colocated'"),
        (ASYNC, {"max_staleness": 5}, "grpo.max_staleness", "from 0 (synchronous) to 4"),
        (ASYNC, {"max_staleness": -1}, "grpo.max_staleness", "from 0 (synchronous) to 4"),
        ({**ASYNC, "weight_sync_method": "checkpoint"}, {"max_staleness": 1}, "grpo.max_staleness", "Use nccl (GPUs) or gloo"),
        ({**ASYNC, "enable_weight_sync": False}, {"max_staleness": 1}, "grpo.max_staleness", "enable_weight_sync: true"),
        (ASYNC, {"max_staleness": 1, "dynamic_sampling": True}, "grpo.dynamic_sampling", "not built for asynchronous GRPO"),
        ({}, {"partial_rollouts": True}, "grpo.partial_rollouts", "needs asynchronous GRPO"),
        ({"inference_backend": "vllm", "rollout_placement": "colocated"},
         {"max_staleness": 1, "partial_rollouts": True}, "grpo.partial_rollouts", "not built for vllm colocated"),
        ({}, {"streaming_groups": True}, "grpo.streaming_groups", "needs asynchronous GRPO"),
        ({"inference_backend": "vllm", "rollout_placement": "ray", "weight_sync_method": "gloo"},
         {"max_staleness": 1, "streaming_groups": True}, "grpo.streaming_groups", "not built for vllm ray"),
        (ASYNC, {"off_policy_correction": "popice"}, "grpo.off_policy_correction", "'none', 'tis', 'seq_mask_tis', 'icepop'"),
        (ASYNC, {"off_policy_correction": "none", "tis_cap": 3.0}, "grpo.tis_cap", "does not read it"),
        (ASYNC, {"off_policy_correction": "icepop", "tis_cap": 3.0}, "grpo.tis_cap", "does not read it"),
        (ASYNC, {"off_policy_correction": "tis", "icepop_upper": 4.0}, "grpo.icepop_upper", "only icepop reads it"),
        (ASYNC, {"icepop_lower": 0.4}, "grpo.icepop_lower", "only icepop reads it"),
        (ASYNC, {"off_policy_correction": "icepop", "icepop_lower": 1.5}, "grpo.icepop_lower", "0 < icepop_lower < 1 < icepop_upper"),
        (ASYNC, {"off_policy_correction": "icepop", "icepop_upper": 0.9}, "grpo.icepop_lower", "0 < icepop_lower < 1 < icepop_upper"),
        ({"inference_backend": "vllm", "rollout_placement": "ray", "rollout_gpus_per_engine": 0}, {},
         "megatron.rollout_gpus_per_engine", "positive integer"),
        ({"inference_backend": "vllm", "rollout_placement": "ray", "rollout_engines": 0}, {},
         "megatron.rollout_engines", "positive integer"),
        ({"inference_backend": "vllm", "rollout_placement": "ray", "rollout_engine_restarts": -1}, {},
         "megatron.rollout_engine_restarts", "integer >= 0"),
        ({"inference_backend": "vllm", "rollout_placement": "ray", "ray_address": " "}, {}, "megatron.ray_address", "is empty"),
        ({"inference_backend": "vllm", "rollout_placement": "ray", "weight_sync_method": "checkpoint"}, {},
         "megatron.weight_sync_method", "every node of the Ray cluster"),
    ],
)
def test_asynchronous_grpo_rules_name_the_field(make_config, megatron, grpo, field, text) -> None:  # noqa: ANN001
    r = check(make_config(megatron=megatron, grpo=grpo), world_size=2 if megatron.get("rollout_placement") == "separate" else 1)
    assert field in problem_fields(r), r.format_problems()
    assert text in r.format_problems()


def test_asynchronous_grpo_is_accepted_on_separate_engines_and_ray(make_config) -> None:  # noqa: ANN001
    for placement in ("separate", "ray"):
        for staleness in (0, 1, 4):
            for correction in (None, "none", "tis", "seq_mask_tis", "icepop"):
                r = check(make_config(megatron={**ASYNC, "rollout_placement": placement},
                                      grpo={"max_staleness": staleness, "off_policy_correction": correction}), world_size=2)
                assert r.ok, (placement, staleness, correction, r.format_problems())
    r = check(make_config(megatron=ASYNC, grpo={"max_staleness": 1, "partial_rollouts": True}), world_size=2)
    assert r.ok, r.format_problems()
    r = check(make_config(megatron=ASYNC, grpo={"max_staleness": 1, "streaming_groups": True}), world_size=2)
    assert r.ok, r.format_problems()  # 2 prompts a step over DP 2: a whole group each
    r = check(make_config(megatron={**ASYNC, "global_batch_size": 12}, grpo={"max_staleness": 1, "streaming_groups": True}),
              world_size=2)  # 3 prompts a step over DP 2
    assert "grpo.streaming_groups" in r.fields() and "multiple of the data-parallel size (2)" in r.format_problems()


def test_off_policy_correction_resolves_from_tis_cap() -> None:
    from oumi_megatron.config.grpo_params import MegatronGrpoParams

    assert (MegatronGrpoParams().off_policy_correction_choice, MegatronGrpoParams().importance_cap) == ("none", None)
    assert (MegatronGrpoParams(tis_cap=3.0).off_policy_correction_choice, MegatronGrpoParams(tis_cap=3.0).importance_cap) == ("tis", 3.0)
    assert MegatronGrpoParams(off_policy_correction="seq_mask_tis").importance_cap == 2.0  # verl's default threshold
    assert MegatronGrpoParams(off_policy_correction="none", tis_cap=3.0).importance_cap is None  # validation refuses it
    icepop = MegatronGrpoParams(off_policy_correction="icepop")
    assert (icepop.importance_cap, icepop.icepop_band) == (None, (0.5, 5.0))  # the IcePop paper's alpha and beta
    assert MegatronGrpoParams(off_policy_correction="icepop", icepop_lower=0.8, icepop_upper=1.25).icepop_band == (0.8, 1.25)


@pytest.mark.parametrize(
    ("grpo", "field", "text"),
    [
        ({"temperature": 0.0}, "grpo.temperature", "(0, 2]"),
        ({"temperature": 2.5}, "grpo.temperature", "(0, 2]"),
        ({"num_generations": 1}, "grpo.num_generations", "at least 2"),
        ({"num_generations": 3}, "grpo.num_generations", "multiple of grpo.num_generations (3)"),
        ({"top_p": 0.0}, "grpo.top_p", "(0, 1]"),
        ({"kl_estimator": "k4"}, "grpo.kl_estimator", "'k1', 'k2', 'k3'"),
        ({"loss_aggregation": "sum"}, "grpo.loss_aggregation", "'token_mean', 'seq_mean', 'seq_mean_token_sum_norm'"),
        ({"beta": -1.0}, "grpo.beta", ">= 0"),
        ({"epsilon": 0.0}, "grpo.epsilon", "> 0"),
        ({"tis_cap": 0.5}, "grpo.tis_cap", ">= 1 or null"),
        ({"ppo_epochs": 0}, "grpo.ppo_epochs", "positive integer"),
        ({"on_reward_error": "ignore"}, "grpo.on_reward_error", "'raise' or 'skip'"),
        ({"reward_functions": [{"name": "no_such_reward"}]}, "grpo.reward_functions[0].name", "REWARD_FUNCTION registry"),
    ],
)
def test_grpo_rules_name_the_field(make_config, grpo, field, text) -> None:  # noqa: ANN001
    r = check(make_config(grpo=grpo))
    assert field in problem_fields(r), r.format_problems()
    assert text in r.format_problems()


def test_no_reward_and_no_default_reward_is_an_error(make_config) -> None:  # noqa: ANN001
    data = {"train": {"datasets": [{"dataset_name": "trl-lib/tldr"}]}}
    r = check(make_config(grpo={"reward_functions": []}, data=data))
    assert "grpo.reward_functions" in problem_fields(r)
    assert "needs a reward" in r.format_problems() and "no default reward" in r.format_problems()


def test_oumi_registered_reward_functions_are_accepted(make_config) -> None:  # noqa: ANN001
    cfg = make_config(grpo={"reward_functions": [{"name": "gsm8k", "weight": 1.0}, {"name": "countdown", "weight": 0.5}]})
    assert check(cfg).ok


def test_fsdp_and_deepspeed_are_rejected(make_config) -> None:  # noqa: ANN001
    r = check(make_config(fsdp={"enable_fsdp": True}))
    assert "fsdp.enable_fsdp" in problem_fields(r)
    r = check(make_config(deepspeed={"enable_deepspeed": True}))
    assert "deepspeed.enable_deepspeed" in problem_fields(r)


def test_missing_and_unreadable_model(make_config, tmp_path: Path) -> None:  # noqa: ANN001
    r = check(make_config(model={"model_name": ""}), shape=None)
    assert "model.model_name" in problem_fields(r)
    assert "is empty" in r.format_problems()
    r = validate_config(make_config(model={"model_name": str(tmp_path / "nope")}), world_size=1, check_bridge=False)
    assert "model.model_name" in problem_fields(r)
    assert "does not exist" in r.format_problems()
    # A hub name with the hub unreachable (HF_HUB_OFFLINE=1 in tests) says how to validate offline.
    r = validate_config(make_config(model={"model_name": "org-that-is-not/cached-model"}), world_size=1, check_bridge=False)
    assert "model.model_name" in problem_fields(r)
    assert "--model-config" in r.format_problems()


def test_a_shipped_shape_resolves_offline_in_one_line_and_other_names_say_what_to_pass(make_config) -> None:  # noqa: ANN001
    """HF_HUB_OFFLINE=1 (the tests' setting) and no cached copy: a name configs/model_shapes/ ships resolves to that copy,
    with one note; another name's problem names --model-config and the shipped names."""
    from oumi_megatron.model_shape import download_problem, resolve_shape, shipped_shapes

    assert set(shipped_shapes()) == {"meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-70B-Instruct",
                                     "meta-llama/Llama-3.1-405B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct"}
    assert all(path.is_file() for path in shipped_shapes().values())
    r = validate_config(make_config(model={"model_name": "Qwen/Qwen2.5-1.5B-Instruct"}), world_size=1, check_bridge=False)
    assert r.ok, r.format_problems()
    assert r.model_shape.hidden_size == 1536 and r.model_shape.num_layers == 28
    assert r.notes == ["model.model_name: Qwen/Qwen2.5-1.5B-Instruct's config.json read from the shipped "
                       "configs/model_shapes/qwen2.5-1.5b-instruct/config.json: the Hub is not read (HF_HUB_OFFLINE is "
                       "set) and the local cache has no copy."]
    r = validate_config(make_config(model={"model_name": "org-that-is-not/cached-model"}), world_size=1, check_bridge=False)
    (problem,) = [p for p in r.problems if p.field == "model.model_name"]
    assert problem.message.startswith("cannot read config.json of 'org-that-is-not/cached-model' (nor is it a local "
                                      f"folder: {Path.cwd() / 'org-that-is-not/cached-model'} does not exist): the Hub is not read "
                                      "(HF_HUB_OFFLINE is set) and the local cache has no copy. Pass `--model-config "
                                      "PATH/config.json`"), problem.message
    assert "shapes shipped in configs/model_shapes/: Qwen/Qwen2.5-1.5B-Instruct, meta-llama/Llama-3.1-405B-Instruct" in problem.message
    with pytest.raises(Exception) as e:
        from huggingface_hub import snapshot_download

        snapshot_download("org-that-is-not/cached-model")
    assert download_problem("org-that-is-not/cached-model", e.value) == (
        "model.model_name: org-that-is-not/cached-model could not be downloaded: the Hub is not read (HF_HUB_OFFLINE is "
        "set) and the local cache has no copy; download it once where the Hub can be reached (`hf download "
        "org-that-is-not/cached-model` with the same HF_HOME), or set model.model_name to a local folder.")
    assert resolve_shape("meta-llama/llama-3.1-70b-instruct").shape.num_layers == 80  # Hub names ignore case
    # training's first read of the model (its tokenizer, before conversion) says the same in one line
    from oumi.core.configs import ModelParams

    from oumi_megatron.assembly import _hub_tokenizer
    from oumi_megatron.errors import UserInputError

    with pytest.raises(UserInputError, match=r"^model.model_name: Qwen/Qwen2.5-1.5B-Instruct could not be downloaded: "
                                             r"the Hub is not read \(HF_HUB_OFFLINE is set\)"):
        _hub_tokenizer(ModelParams(model_name="Qwen/Qwen2.5-1.5B-Instruct"))


def test_wrong_trainer_type_with_megatron_section(make_config) -> None:  # noqa: ANN001
    r = check(make_config(training={"trainer_type": "TRL_GRPO"}))
    assert "training.trainer_type" in problem_fields(r)


def test_all_problems_are_reported_together_and_raise(make_config) -> None:  # noqa: ANN001
    cfg = make_config(megatron={"pipeline_schedule": "x", "inference_backend": "x"}, grpo={"temperature": 9.0})
    r = check(cfg)
    assert {"megatron.pipeline_schedule", "megatron.inference_backend", "grpo.temperature"} == set(problem_fields(r))
    with pytest.raises(MegatronConfigError) as e:
        r.raise_if_invalid()
    assert "3 problems" in str(e.value)


@pytest.mark.parametrize(
    ("megatron", "world", "used", "warning"),
    [
        ({"pipeline_schedule": "zb_h1"}, 1, "none", "pipeline_model_parallel_size is 1"),
        ({"pipeline_schedule": "zb_h1", "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}, 2,
         "interleaved", "virtual_pipeline_model_parallel_size is set"),
        ({"pipeline_schedule": "zb_h1", "pipeline_model_parallel_size": 2, "ddp_config": {"overlap_grad_reduce": True}}, 2,
         "1f1b", "overlap_grad_reduce is on"),
    ],
)
def test_zb_h1_falls_back_with_one_warning(make_config, megatron, world, used, warning) -> None:  # noqa: ANN001
    r = check(make_config(megatron=megatron), world_size=world)
    assert r.ok, r.format_problems()
    assert r.layout.pipeline_schedule == used
    zb = [w for w in r.warnings if "zb_h1" in w]
    assert len(zb) == 1 and warning in zb[0]


def test_zb_h1_is_used_where_supported(make_config) -> None:  # noqa: ANN001
    r = check(make_config(megatron={"pipeline_schedule": "zb_h1", "pipeline_model_parallel_size": 2}), world_size=2)
    assert r.ok and r.layout.pipeline_schedule == "zb_h1" and not r.warnings


def test_zb_h1_needs_the_gradient_accumulation_path(make_config) -> None:  # noqa: ANN001
    r = check(make_config(megatron={"pipeline_schedule": "zb_h1", "pipeline_model_parallel_size": 2,
                                    "transformer_config": {"gradient_accumulation_fusion": False}}), world_size=2)
    assert problem_fields(r) == ["megatron.transformer_config.gradient_accumulation_fusion"], r.format_problems()
    assert "Set gradient_accumulation_fusion: null" in r.format_problems()


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_module_queue_warns_where_it_acts(make_config, recompute: str | None) -> None:  # noqa: ANN001
    r = check(make_config(megatron={"enable_module_queue": True, "pipeline_model_parallel_size": 2,
                                    "transformer_config": {"recompute_granularity": recompute}}), world_size=2)
    assert r.ok, r.format_problems()
    mq = [w for w in r.warnings if "enable_module_queue" in w]
    assert len(mq) == 1 and "last pipeline stage" in mq[0] and "logprobs" in mq[0]


@pytest.mark.parametrize(("megatron", "fix"), [
    ({"ddp_config": {"overlap_param_gather": True, "overlap_grad_reduce": True}}, "Set overlap_param_gather: false"),
    ({"transformer_config": {"cuda_graph_impl": "local", "recompute_granularity": None}}, "Set cuda_graph_impl: none"),
], ids=["overlap_param_gather", "cuda_graphs"])
def test_module_queue_rejects_what_it_cannot_run_with(make_config, megatron: dict, fix: str) -> None:  # noqa: ANN001
    r = check(make_config(megatron={"enable_module_queue": True, **megatron}), world_size=1)
    assert "megatron.enable_module_queue" in problem_fields(r), r.format_problems()
    assert fix in r.format_problems()


def test_megatron_bridge_missing_gives_the_seed_import_error(make_config, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    import importlib.util

    from oumi_megatron import bridge_utils

    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return None if name.startswith("megatron.bridge") else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match="megatron-bridge is not available") as e:
        bridge_utils.check_megatron_bridge_available()
    assert "pip install megatron-bridge megatron-core megatron-lm" in str(e.value)
    r = validate_config(make_config(), world_size=1, model_shape=DENSE, check_bridge=True)
    assert "megatron-bridge" in problem_fields(r)


def test_unsupported_architecture_is_named(make_config, tmp_path: Path) -> None:  # noqa: ANN001
    import json

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2, "num_hidden_layers": 2,
        "hidden_size": 64, "num_attention_heads": 2, "vocab_size": 100,
    }))
    r = validate_config(make_config(model={"model_name": str(gpt2)}), world_size=1, check_bridge=True)
    assert problem_fields(r) == ["model.model_name"]
    assert "GPT2LMHeadModel model, which Megatron-Bridge cannot convert" in r.format_problems()


def test_check_megatron_bridge_available_passes_here() -> None:
    import sys

    from oumi_megatron import check_megatron_bridge_available

    check_megatron_bridge_available()
    assert "megatron.bridge" in sys.modules
    assert not any(name.startswith("transformer_engine") for name in sys.modules)
    flagged = [
        name for name, mod in list(sys.modules.items())
        if name.startswith("megatron") and mod is not None and getattr(mod, "HAVE_TE", False) is True
    ]
    assert flagged == [], f"modules that believe TransformerEngine is installed: {flagged}"


SHIPPED = [
    ("tiny_cpu_grpo.yaml", 1, None, None),
    ("tiny_cpu_grpo.yaml", 2, None, None),
    ("one_gpu_grpo.yaml", 1, None, "qwen2.5-1.5b-instruct"),
    ("train_70b_grpo.yaml", 16, 8, "llama-3.1-70b-instruct"),
    ("llama8b_grpo_8gpu.yaml", 8, 8, "llama-3.1-8b-instruct"),
    ("llama8b_grpo_8gpu_async.yaml", 4, None, "llama-3.1-8b-instruct"),
    ("train_405b_grpo.yaml", 256, 8, "llama-3.1-405b-instruct"),
    ("tiny_cpu_code.yaml", 1, None, None),
    ("tiny_cpu_grpo_agentic_async.yaml", 1, None, None),
    ("qwen2_5_coder_0_5b_code_gpu.yaml", 1, None, "qwen2.5-coder-0.5b-instruct"),
    ("qwen2_5_coder_0_5b_code_python_gpu.yaml", 1, None, "qwen2.5-coder-0.5b-instruct"),
]


@pytest.mark.parametrize(("name", "world", "gpn", "shape_dir"), SHIPPED)
def test_shipped_configs_validate_for_their_world_size(name, world, gpn, shape_dir, tiny_model_dir) -> None:  # noqa: ANN001
    from oumi_megatron.cli import load_config

    overrides = [f"model.model_name={tiny_model_dir}"] if shape_dir is None else []
    cfg = load_config(str(REPO / "configs" / name), overrides)
    model_cfg = str(REPO / "configs/model_shapes" / shape_dir / "config.json") if shape_dir else None
    r = validate_config(cfg, world_size=world, gpus_per_node=gpn, model_config_path=model_cfg)
    assert r.ok, r.format_problems()
    assert r.layout.world_size == world


def test_seed_405b_vpp32_is_explained(tiny_model_dir) -> None:  # noqa: ANN001
    from oumi_megatron.cli import load_config

    cfg = load_config(str(REPO / "configs/train_405b_grpo.yaml"), ["megatron.virtual_pipeline_model_parallel_size=32"])
    r = validate_config(cfg, world_size=256, model_config_path=str(REPO / "configs/model_shapes/llama-3.1-405b-instruct/config.json"),
                        check_bridge=False)
    assert problem_fields(r) == ["megatron.virtual_pipeline_model_parallel_size"]
    msg = r.format_problems()
    assert "PP 16 x VPP 32 = 512 virtual stages" in msg and "use one of [2, 4, 8]" in msg


def test_405b_layout_is_the_design_documents(tiny_model_dir) -> None:  # noqa: ANN001
    from oumi_megatron.cli import load_config

    cfg = load_config(str(REPO / "configs/train_405b_grpo.yaml"), [])
    r = validate_config(cfg, world_size=256, model_config_path=str(REPO / "configs/model_shapes/llama-3.1-405b-instruct/config.json"),
                        check_bridge=False)
    assert r.ok, r.format_problems()
    lay = r.layout
    assert (lay.tensor_parallel, lay.pipeline_parallel, lay.context_parallel, lay.virtual_pipeline, lay.data_parallel) == (8, 16, 2, 2, 1)


def test_70b_layout_matches_the_seed(tiny_model_dir) -> None:  # noqa: ANN001
    from oumi_megatron.cli import load_config

    cfg = load_config(str(REPO / "configs/train_70b_grpo.yaml"), [])
    r = validate_config(cfg, world_size=16, model_config_path=str(REPO / "configs/model_shapes/llama-3.1-70b-instruct/config.json"),
                        check_bridge=False)
    assert r.ok
    assert (r.layout.tensor_parallel, r.layout.pipeline_parallel, r.layout.data_parallel) == (8, 2, 1)
    bad = validate_config(cfg, world_size=12, model_config_path=str(REPO / "configs/model_shapes/llama-3.1-70b-instruct/config.json"),
                          check_bridge=False)
    assert "world_size (12) must be divisible by the product of all model parallel sizes (16)" in bad.format_problems()


def test_separate_engines_take_the_gpus_after_the_trainers() -> None:
    from oumi_megatron.rollout.engine_gpus import engine_gpu

    assert engine_gpu([str(i) for i in range(8)], trainer_gpus=4, engine_index=0) == "4"
    assert engine_gpu([str(i) for i in range(8)], trainer_gpus=4, engine_index=3) == "7"
    assert engine_gpu(["2", "5", "6"], trainer_gpus=1, engine_index=1) == "6"  # CUDA_VISIBLE_DEVICES respected
    with pytest.raises(ValueError, match="megatron.rollout_placement.*--nproc-per-node"):
        engine_gpu([str(i) for i in range(8)], trainer_gpus=8, engine_index=0)


# --------------------------------------------------------------------------------------------------
# Issue 10: inputs that used to fail late (after conversion) or silently
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("training", "field", "text"),
    [
        ({"max_steps": 0}, "training.max_steps", "is 0: nothing would be trained"),
        ({"save_steps": -1}, "training.save_steps", "must be >= 0 (0: save only at the end)"),
        ({"learning_rate": -1e-5}, "training.learning_rate", "must be a finite number >= 0"),
        ({"warmup_ratio": 1.5}, "training.warmup_ratio", "must be in [0, 1]"),
    ],
)
def test_training_fields_are_checked_up_front(make_config, training, field, text) -> None:  # noqa: ANN001
    r = check(make_config(training={"trainer_type": "MEGATRON_GRPO", **training}))
    assert field in problem_fields(r) and text in r.format_problems(), r.format_problems()


def test_epochs_without_max_steps_are_accepted(make_config) -> None:  # noqa: ANN001
    r = check(make_config(training={"trainer_type": "MEGATRON_GRPO", "max_steps": -1, "num_train_epochs": 2}))
    assert r.ok, r.format_problems()


def test_output_dir_that_cannot_be_written_is_named(make_config, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    r = check(make_config(training={"output_dir": str(a_file)}))
    assert "training.output_dir" in problem_fields(r) and "exists and is not a folder" in r.format_problems()
    r = check(make_config(training={"output_dir": str(a_file / "run")}))
    assert "training.output_dir" in problem_fields(r) and "is a file" in r.format_problems()
    # not writable (faked: the tests may run as root, who can write anywhere)
    import oumi_megatron.trainer.run_dir as run_dir  # where the output_dir rule lives

    monkeypatch.setattr(run_dir.os, "access", lambda path, mode: False)
    r = check(make_config(training={"output_dir": str(tmp_path / "new" / "run")}))
    assert "training.output_dir" in problem_fields(r) and "is not writable" in r.format_problems()


def test_sequence_longer_than_the_model_positions_is_rejected(make_config) -> None:  # noqa: ANN001
    short = ModelShape(**{**DENSE.__dict__, "max_position_embeddings": 40})
    r = check(make_config(grpo={"max_prompt_length": 32, "max_completion_length": 16}), shape=short)
    assert "grpo.max_completion_length" in problem_fields(r)
    assert "32 + 16 = 48 exceeds the model's max_position_embeddings (40)" in r.format_problems()
    assert check(make_config(grpo={"max_prompt_length": 24, "max_completion_length": 16}), shape=short).ok


def test_gpt2_gets_architecture_not_supported(make_config, tmp_path: Path) -> None:  # noqa: ANN001
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path / "gpt2")
    cfg = make_config(model={"model_name": str(tmp_path / "gpt2")})
    r = validate_config(cfg, world_size=1, check_bridge=True)
    assert problem_fields(r) == ["model.model_name"], r.format_problems()
    assert "GPT2LMHeadModel model: architecture not supported" in r.format_problems()
    assert "lacks" not in r.format_problems()


def test_model_with_its_own_code_needs_trust_remote_code(make_config, tmp_path: Path, tiny_model_dir: Path) -> None:  # noqa: ANN001
    import json
    import shutil

    remote = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, remote)
    config = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "configuration_x.XConfig"}}))
    r = check(make_config(model={"model_name": str(remote)}), shape=None)
    assert "model.trust_remote_code" in problem_fields(r) and "set model.trust_remote_code: true" in r.format_problems()
    r = check(make_config(model={"model_name": str(remote), "trust_remote_code": True}), shape=None)
    assert "model.trust_remote_code" not in problem_fields(r), r.format_problems()


def test_trust_remote_code_reaches_transformers(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A folder whose config class is its own code loads only with trust_remote_code (the engine's loader)."""
    import json
    import shutil

    from oumi_megatron.engine.model import UnsupportedModelError, load_bridge

    remote = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, remote)
    (remote / "configuration_tiny.py").write_text(
        "from transformers import Qwen2Config\n\nclass TinyRemoteConfig(Qwen2Config):\n    model_type = 'tiny_remote'\n"
    )
    config = json.loads((remote / "config.json").read_text())
    config.update(model_type="tiny_remote", auto_map={"AutoConfig": "configuration_tiny.TinyRemoteConfig"})
    (remote / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="set model.trust_remote_code: true"):
        load_bridge(remote, config_only=True)
    # with it, transformers runs the folder's own config class
    bridge = load_bridge(remote, trust_remote_code=True, config_only=True)
    assert type(bridge.hf_pretrained).__name__ == "TinyRemoteConfig"


def test_an_unresolvable_layout_is_a_message_not_an_assert(make_config) -> None:  # noqa: ANN001
    """train.py and cli.py used `assert report.layout is not None`: a bare AssertionError."""
    cfg = make_config(megatron={"micro_batch_size": None, "global_batch_size": None},
                      training={"per_device_train_batch_size": 0})
    r = check(cfg)
    assert problem_fields(r) == ["megatron.micro_batch_size"], r.format_problems()
    assert "resolves to 0 (from training.per_device_train_batch_size)" in r.format_problems()
    with pytest.raises(MegatronConfigError, match="megatron.micro_batch_size"):
        r.require_layout()
    assert check(make_config()).require_layout().world_size == 1


def test_eval_metric_prefixes_one_per_validation_dataset(make_config) -> None:  # noqa: ANN001
    dataset = {"dataset_name": "oumi-megatron/char-class", "dataset_path": str(REPO / "data/char_class_eval.jsonl")}
    ok = make_config(data={"validation": {"datasets": [dataset, dataset]}}, grpo={"eval_metric_prefixes": ["eval", "eval_b"]})
    assert check(ok).ok, check(ok).format_problems()
    short = make_config(data={"validation": {"datasets": [dataset, dataset]}}, grpo={"eval_metric_prefixes": ["eval"]})
    r = check(short)
    assert r.fields() == ["grpo.eval_metric_prefixes"] and "one prefix per validation dataset" in r.format_problems()
    bad = make_config(data={"validation": {"datasets": [dataset]}}, grpo={"eval_metric_prefixes": ["eval/unseen"]})
    assert check(bad).fields() == ["grpo.eval_metric_prefixes[0]"]


def test_plugin_registered_schedule_and_rollout_backend_are_accepted(make_config, tmp_path: Path,  # noqa: ANN001
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation checks names against the live registries: what a grpo.plugins module registers is accepted like
    a built-in, and an unknown name's message lists the registered ones."""
    import sys

    from oumi_megatron.engine.parallel.schedules import SCHEDULES
    from oumi_megatron.rollout.registry import ROLLOUT_BACKENDS

    (tmp_path / "my_seams.py").write_text(
        "from oumi_megatron.engine.parallel.schedules import SCHEDULES, PipelineSchedule, schedule_function\n"
        "from oumi_megatron.rollout.registry import register_rollout_backend, build_rollout_backend\n\n"
        "SCHEDULES.add('my_1f1b', PipelineSchedule(lambda: schedule_function('1f1b')))\n\n"
        "@register_rollout_backend('my_backend')\n"
        "def build(ctx):\n    raise NotImplementedError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    wanted = {"pipeline_schedule": "my_1f1b", "inference_backend": "my_backend", "pipeline_model_parallel_size": 2}
    try:
        bad = check(make_config(megatron=wanted), world_size=2)
        assert set(problem_fields(bad)) == {"megatron.pipeline_schedule", "megatron.inference_backend"}, bad.format_problems()
        assert "Registered: 'megatron', 'sglang', 'vllm'" in bad.format_problems()
        good = check(make_config(megatron=wanted, grpo={"plugins": ["my_seams"]}), world_size=2)
        assert good.ok, good.format_problems()
        assert good.layout.pipeline_schedule == "my_1f1b"
    finally:
        SCHEDULES.remove("my_1f1b")
        ROLLOUT_BACKENDS.remove("my_backend")
        sys.modules.pop("my_seams", None)


def test_registry_refuses_a_second_object_under_one_name_and_lists_names() -> None:
    from oumi_megatron.utils.registry import Registry

    reg: Registry[int] = Registry("thing", "section.thing", "register yours in a plugin")
    one, two = object(), object()
    reg.add("a", one)  # type: ignore[arg-type]
    reg.add("a", one)  # type: ignore[arg-type]  # the same object again: a module imported twice
    with pytest.raises(ValueError, match="a thing named 'a' is registered already"):
        reg.add("a", two)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"section.thing: unknown value 'b'. Registered: 'a' \(register yours in a plugin\)"):
        reg.get("b")
    assert reg.get("a") is one and "a" in reg and list(reg) == ["a"] and len(reg) == 1


def test_resolve_layout_alone_gives_validations_layout(make_config) -> None:  # noqa: ANN001
    """plan.py resolves trial layouts without re-validating the config: the same layout, problems and fallbacks."""
    from oumi_megatron.engine.parallel.layout import resolve_layout

    cfg = make_config(megatron={"pipeline_schedule": "zb_h1", "pipeline_model_parallel_size": 2,
                                "ddp_config": {"overlap_grad_reduce": True}})
    report = check(cfg, world_size=4)
    alone = resolve_layout(cfg, 4, shape=DENSE)
    assert alone.layout == report.layout and alone.layout.pipeline_schedule == "1f1b" and alone.layout.data_parallel == 2
    assert [w for w in alone.warnings if "zb_h1" in w] == [w for w in report.warnings if "zb_h1" in w] != []
    broken = resolve_layout(make_config(megatron={"tensor_model_parallel_size": 3}), 4, shape=DENSE)
    assert broken.layout is None and {p.field for p in broken.problems} == {"megatron.tensor_model_parallel_size"}
