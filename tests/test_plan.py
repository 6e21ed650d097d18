"""oumi_megatron/plan.py: the memory arithmetic pinned on hand-computed cases, and the `plan` CLI.

How close the estimate comes to torch.cuda.max_memory_allocated() of real steps is a GPU measurement
(docs/benchmarks.md, "Memory plan"); these tests pin the arithmetic itself.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from conftest import REPO, run_cli
from oumi_megatron.config.megatron_params import MegatronParams
from oumi_megatron.engine.parallel.layout import ParallelLayout
from oumi_megatron.model_shape import ModelShape
from oumi_megatron.plan import GIB, estimate_memory

LLAMA_70B = ModelShape.from_file(REPO / "configs" / "model_shapes" / "llama-3.1-70b-instruct" / "config.json")
TINY = ModelShape(source="tiny", model_type="llama", architectures=("LlamaForCausalLM",), num_layers=4, hidden_size=64,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=320, head_dim=16, intermediate_size=128)


def _plan(shape: ModelShape, *, tp: int = 1, pp: int = 1, dp: int = 1, sp: bool = False, seq: int = 32, mbs: int = 2,
          microbatches: int = 1, vpp: int | None = None, episodes: tuple[int, int] | None = None,
          environment_workers: int = 0, lora_targets: list[str] | None = None, **megatron):  # noqa: ANN003, ANN202
    params = MegatronParams(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
                            virtual_pipeline_model_parallel_size=vpp)
    params.transformer_config.recompute_granularity = megatron.pop("recompute", None)
    params.logprob_chunk_tokens = megatron.pop("logprob_chunk_tokens", 0)
    params.ddp_config.use_distributed_optimizer = megatron.pop("distributed_optimizer", True)
    params.optimizer_config.optimizer_cpu_offload = megatron.pop("offload", 0) > 0
    params.optimizer_config.optimizer_offload_fraction = float(params.optimizer_config.optimizer_cpu_offload)
    params.inference_backend = megatron.pop("inference_backend", "megatron")
    params.vllm_kv_cache_gib = megatron.pop("vllm_kv_cache_gib", 0.0)
    params.vllm_sleep = megatron.pop("vllm_sleep", True)
    params.sglang_mem_fraction_static = megatron.pop("sglang_mem_fraction_static", 0.4)
    params.lora_sync = megatron.pop("lora_sync", "merged")
    params.rollout_cuda_graphs_kept = megatron.pop("kept", params.rollout_cuda_graphs_kept)
    gpu_memory_gib = megatron.pop("gpu_memory_gib", None)
    assert not megatron, megatron
    layout = ParallelLayout(tp * pp * dp, tp, pp, 1, 1, dp, vpp, sp, mbs, mbs * microbatches * dp,
                            ("interleaved" if vpp else "1f1b") if pp > 1 else "none", 2, 1)
    completion, turns = episodes or (seq, 1)  # multi-turn: (max_completion_length, max_turns)
    grpo = SimpleNamespace(max_sequence_length=seq, environment="calculator" if episodes else None,
                           max_prompt_length=seq - completion, max_completion_length=completion, max_turns=turns,
                           environment_workers=environment_workers)
    cfg = SimpleNamespace(megatron=params, grpo=grpo, training=SimpleNamespace(use_peft=lora_targets is not None),
                          peft=SimpleNamespace(lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_target_modules=lora_targets,
                                               peft_save_mode="adapter_only"))
    return estimate_memory(cfg, shape, layout, overhead_gib=0.0, gpu_memory_gib=gpu_memory_gib)


# Llama-3.1-70B by hand: a layer = QKV 8192 x (8192 + 2 x 1024) + output 8192 x 8192 + 2 norms + MLP 3 x 8192 x 28672
# = 855,654,400; stage 0 of PP 2 = 40 layers + the embedding (128,256 x 8192) = 35,276,849,152, over TP 8:
STAGE0_70B = (40 * 855_654_400 + 128_256 * 8192) / 8  # 4,409,606,144 parameters per GPU


@pytest.mark.parametrize(("dp", "distributed", "optimizer_bytes"), [(1, True, 12), (1, False, 12), (2, True, 6), (2, False, 12)])
def test_70b_on_tp8_pp2_by_hand(dp: int, distributed: bool, optimizer_bytes: float) -> None:
    """2 + 4 + 12 bytes per parameter: ~80 GB before activations at DP 1 (the issue's by-hand figure); the
    distributed optimizer halves Adam's 12 bytes at DP 2 and changes nothing at DP 1."""
    plan = _plan(LLAMA_70B, tp=8, pp=2, dp=dp, seq=2048, mbs=1, microbatches=4, distributed_optimizer=distributed)
    assert plan.stage == 0
    assert plan.weights == pytest.approx(2 * STAGE0_70B / GIB, rel=1e-9)  # 8.21 GiB
    assert plan.grads == pytest.approx(4 * STAGE0_70B / GIB, rel=1e-9)
    assert plan.optimizer == pytest.approx(optimizer_bytes * STAGE0_70B / GIB, rel=1e-9)
    if dp == 1:
        assert (plan.weights + plan.grads + plan.optimizer) * GIB / 1e9 == pytest.approx(79.4, abs=0.1)


def test_optimizer_offload_moves_the_moments_not_the_master_weights() -> None:
    plan = _plan(LLAMA_70B, tp=8, pp=2, seq=2048, mbs=1, microbatches=4, offload=1)
    assert plan.optimizer == pytest.approx(4 * STAGE0_70B / GIB, rel=1e-9)


# The tiny shape by hand, bytes per token per layer (bf16): norms 2 x (in + out) x 64 x 2 B = 512; Q/K/V before and
# after RoPE 2 x (2 x 64 + 3 x 32) x 2 B... = 2 x (2q + 3kv) = 448, attention output 2q = 128, MLP 2 x 3 x 128 = 768.
PER_TOKEN_LAYER = 512 + 448 + 128 + 768  # 1,856
TOKENS = 2 * 32  # micro batch 2 x sequence 32


@pytest.mark.parametrize(("tp", "sp", "per_token_layer"), [(1, False, PER_TOKEN_LAYER), (2, False, 512 + 1344 / 2),
                                                           (2, True, PER_TOKEN_LAYER / 2)])
def test_activations_by_hand(tp: int, sp: bool, per_token_layer: float) -> None:
    """TP splits what lies between the norms; sequence parallelism splits the norms' share too."""
    plan = _plan(TINY, tp=tp, sp=sp)
    assert plan.activations * GIB == pytest.approx(4 * TOKENS * per_token_layer)


def test_full_recompute_keeps_layer_inputs_and_one_layer() -> None:
    plan = _plan(TINY, recompute="full")
    assert plan.activations * GIB == pytest.approx(4 * TOKENS * 2 * 64 + TOKENS * PER_TOKEN_LAYER)


def test_pipeline_stages_hold_their_in_flight_microbatches() -> None:
    """1F1B: stage s of PP holds PP - s microbatches (at most the step's), the first stage the embedding, the
    last the output layer and the logits (full logits: bf16 + fp32 log-softmax, 6 B per token x vocabulary)."""
    plan = _plan(TINY, pp=4, microbatches=8)
    one = TOKENS * PER_TOKEN_LAYER  # one microbatch of one layer (a stage holds 1 layer here)
    assert plan.stage == 0 and plan.activations * GIB == pytest.approx(4 * one)
    last = plan.by_stage[-1] * GIB
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 2 * 64 + 3 * 64 * 128
    assert last == pytest.approx(18 * (layer + 320 * 64) + one + 6 * TOKENS * 320, rel=1e-3)  # rounded to 0.01 GiB
    interleaved = _plan(TINY, pp=2, vpp=2, microbatches=8)
    assert interleaved.activations * GIB == pytest.approx((2 * 1 + 1 * 2 + 1) / 2 * 2 * one)  # Megatron's warm-up


def test_plan_cli_prints_the_parts_and_says_whether_it_fits() -> None:
    """The shipped 70B config on 16 x 80 GiB: fits with Adam's moments on the host (configs/train_70b_grpo.yaml),
    and the JSON names every component; without the offload it does not, and the advice says what to change."""
    shape = str(REPO / "configs" / "model_shapes" / "llama-3.1-70b-instruct" / "config.json")
    base = ["oumi-megatron", "plan", "-c", str(REPO / "configs" / "train_70b_grpo.yaml"), "--gpus", "16",
            "--gpus-per-node", "8", "--gpu-memory-gib", "80", "--model-config", shape]
    proc = run_cli([*base, "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert {"weights", "grads", "optimizer", "activations", "logits", "rollout", "overhead", "total"} <= set(r)
    assert r["fits"] is True and r["rollout"] == 20.0 and r["total"] < 80
    host = r["host_and_disk"]  # per node and on disk (state_plan.py, pinned by hand below)
    assert host["ranks_per_node"] == 8 and host["host_per_node"] > 8 * 64 and host["checkpoints_coexisting"] == 3
    proc = run_cli([*base, "--megatron.optimizer_config.optimizer_cpu_offload", "false"])
    assert proc.returncode == 2, proc.stderr[-3000:]  # the exit status says it will not fit (0: it fits)
    assert "will not fit" in proc.stdout and "optimizer_cpu_offload: true" in proc.stdout, proc.stdout
    assert "host per node" in proc.stdout and "disk: one checkpoint" in proc.stdout, proc.stdout


def test_embedded_rollout_kv_cache_by_hand_and_the_total_takes_the_larger_of_training_and_generation() -> None:
    """TINY on PP 2, 128 completions of 32 tokens per step: the last stage's 2 layers cache K and V for 2 KV heads of 16
    (bf16) per token, 2 x 2 x 2 x 16 x 2 x 128 x 32 = 1,048,576 B, plus four fp32 [128, 320] sampling buffers
    (655,360 B); generation and training take turns, so the total counts the larger, not both."""
    plan = _plan(TINY, pp=2, seq=32, mbs=2, microbatches=64)
    assert plan.stage == 1
    assert plan.rollout * GIB == pytest.approx(1_048_576 + 655_360, rel=1e-9)
    assert plan.rollout > plan.activations + plan.logits  # many rows, short sequences: generation is the peak here
    persistent = plan.weights + plan.grads + plan.optimizer
    assert plan.total == pytest.approx(persistent + plan.rollout, rel=1e-9)
    assert plan.training_peak == pytest.approx(persistent + plan.activations + plan.logits, rel=1e-9)
    few = _plan(TINY, pp=2, seq=32, mbs=2, microbatches=1)  # 2 completions: training's activations are the peak
    assert few.total == pytest.approx(few.training_peak, rel=1e-9)


def test_kept_generations_hold_their_prefill_graphs_activations() -> None:
    """One stage, graphs kept (a GPU run's default): the kept generation's prefill graph keeps the prefill's activations
    (rollout/decoding/decoder.py ``PREFILL_GRAPH_TOKENS``): 64 completions in groups of 2 = 32 prompts of 8 tokens,
    padded to 64 slots, 2,048 tokens x (4 x 64 + 3 x 128) x 2 B = 2,621,440 B beside the cache; over TP 2 the MLP's
    share halves. Without kept graphs (``rollout_cuda_graphs_kept: 0``) no prefill is captured."""
    def prefill(**kw):  # noqa: ANN003, ANN202
        kept = _plan(TINY, seq=32, mbs=2, microbatches=32, episodes=(24, 1), **kw)
        return kept.kept_rollout * GIB - _plan(TINY, seq=32, mbs=2, microbatches=32, episodes=(24, 1), kept=0, **kw).rollout * GIB

    assert prefill() == pytest.approx(2_048 * (4 * 64 + 3 * 128) * 2, rel=1e-9)
    assert prefill(tp=2) == pytest.approx(2_048 * (4 * 64 + 3 * 128 / 2) * 2, rel=1e-9)
    assert _plan(TINY, seq=32, mbs=2, microbatches=32, episodes=(24, 1), kept=0).kept_rollout == 0


@pytest.mark.parametrize(("turns", "workers"), [(1, 0), (4, 0), (4, 2)])
def test_multi_turn_episodes_cache_a_slot_per_completion_token_whatever_the_rows_wait(turns: int, workers: int) -> None:
    """Episodes keep one cache for every turn (rollout/decoding/episodes.py ``episode_slots``): the prompt, a slot per
    token of the completion budget (each row at its own slots: a row that waits for its answer, in line or from the
    background, takes none), and the scratch slot: the cache above, 32 slots (8 prompt + 24 completion), becomes 33
    whatever the turns and the environment's workers."""
    single = _plan(TINY, pp=2, seq=32, mbs=2, microbatches=64)
    plan = _plan(TINY, pp=2, seq=32, mbs=2, microbatches=64, episodes=(24, turns), environment_workers=workers)
    assert (plan.rollout - single.rollout) * GIB == pytest.approx(1_048_576 * 1 / 32, rel=1e-9)


@pytest.mark.parametrize(("tp", "targets", "adapters"), [
    # r 8 x (in + out) per projection, 4 layers: QKV 8 x (64 + 128) + fc1 8 x (64 + 256) + output 8 x (64 + 64)
    # + fc2 8 x (128 + 64) = 6,656 a layer
    (1, ["all-linear"], 4 * 6_656),
    # TP 2: both matrices of every adapter split (Bridge's ParallelLinearAdapter: A over r, B over its outputs)
    (2, ["all-linear"], 4 * 6_656 / 2),
    # q_proj and v_proj alone (canonical): 8 x (64 + 64) + 8 x (64 + 32)
    (1, ["q_proj", "v_proj"], 4 * 1_792),
])
def test_lora_keeps_the_base_in_bf16_and_trains_the_adapters_alone(tp: int, targets: list[str], adapters: float) -> None:
    """training.use_peft: the base's 2 B per parameter and nothing else; the adapters 2 + 4 + 12 B (Adam over DP 2 with
    the distributed optimizer)."""
    full = _plan(TINY, tp=tp, dp=2)
    plan = _plan(TINY, tp=tp, dp=2, lora_targets=targets)
    base = full.weights * GIB / 2
    assert plan.weights * GIB == pytest.approx(2 * (base + adapters), rel=1e-9)
    assert plan.grads * GIB == pytest.approx(4 * adapters, rel=1e-9)
    assert plan.optimizer * GIB == pytest.approx(12 * adapters / 2, rel=1e-9)
    assert plan.total < full.total


@pytest.mark.parametrize(("tp", "targets", "copied"), [
    # every adapted layer's base weight, bf16: QKV 64 x 128 + output 64 x 64 + fc1 64 x 256 + fc2 128 x 64 = 36,864
    # a layer, 4 layers
    (1, ["all-linear"], 2 * 4 * 36_864),
    (2, ["all-linear"], 2 * 4 * 36_864 / 2),
    # canonical q_proj and v_proj: the whole fused QKV weight they sit in
    (1, ["q_proj", "v_proj"], 2 * 4 * 8_192),
])
def test_lora_merged_rollouts_count_the_base_kept_aside_while_decoding(tp: int, targets: list[str], copied: float) -> None:
    """Embedded rollouts under lora_sync: merged keep the adapted layers' base weights aside while decoding (engine/peft.py
    ``adapters_merged``): counted in rollout, beside the KV cache, not beside training's activations (the kept decode
    buffers stay beside both); adapter keeps none."""
    merged = _plan(TINY, tp=tp, lora_targets=targets)
    adapter = _plan(TINY, tp=tp, lora_targets=targets, lora_sync="adapter")
    copy = merged.rollout - adapter.rollout
    assert copy * GIB == pytest.approx(copied, rel=1e-9)
    persistent = merged.weights + merged.grads + merged.optimizer
    kept = merged.kept_rollout
    assert kept == adapter.kept_rollout > 0  # the decoder's kept graph buffers (a GPU run's default)
    assert merged.total == pytest.approx(persistent + kept + max(merged.activations + merged.logits, copy), rel=1e-9)
    assert adapter.total == pytest.approx(persistent + kept + adapter.activations + adapter.logits, rel=1e-9)
    assert any("lora_sync: merged" in n for n in merged.notes) and not any("lora_sync" in n for n in adapter.notes)
    full = _plan(TINY, tp=tp)
    assert full.rollout == adapter.rollout


def test_colocated_vllm_engine_by_hand_sleeps_while_training() -> None:
    """A colocated vLLM engine on TP 2: its bf16 weights are the whole TINY model over TP (4 layers of 64 x 128 (QKV)
    + 64 x 64 (output) + 2 x 64 (norms) + 3 x 64 x 128 (MLP) = 36,992, plus input and output embeddings 2 x 320 x 64
    = 40,960: 188,928 parameters, 377,856 B over 2 = 188,928 B) plus vllm_kv_cache_gib; or its
    vllm_gpu_memory_utilization share of the GPU. It sleeps while the trainer trains: the total counts the larger."""
    plan = _plan(TINY, tp=2, inference_backend="vllm", vllm_kv_cache_gib=0.5)
    assert plan.rollout * GIB == pytest.approx(188_928 + 0.5 * GIB, rel=1e-9)
    persistent = plan.weights + plan.grads + plan.optimizer
    assert plan.total == pytest.approx(persistent + max(plan.rollout, plan.activations + plan.logits), rel=1e-9)
    share = _plan(TINY, tp=2, inference_backend="vllm", gpu_memory_gib=80.0)
    assert share.rollout == pytest.approx(0.4 * 80.0, rel=1e-9)  # vllm_gpu_memory_utilization's default
    # awake while training (vllm_sleep: false): the engine's memory adds to training's
    awake = _plan(TINY, tp=2, inference_backend="vllm", vllm_kv_cache_gib=0.5, vllm_sleep=False)
    assert awake.rollout == pytest.approx(plan.rollout, rel=1e-9)
    assert awake.total == pytest.approx(persistent + plan.rollout + plan.activations + plan.logits, rel=1e-9)
    assert awake.total > plan.total


def test_host_memory_and_disk_of_the_70b_run_by_hand() -> None:
    """state_plan.py's arithmetic for configs/train_70b_grpo.yaml's layout (TP 8 x PP 2, DP 1, Adam's state on the host):
    per rank the process, 16 B per offloaded parameter and the largest path (the HF export's 5 GB shard); per node 8 of
    them; on disk 14 B per parameter a checkpoint, three at once while one is saved (keep 2), the converted model and
    the export 2 B each."""
    from oumi_megatron.state_plan import PROCESS_HOST_GIB, estimate_state

    params = MegatronParams(tensor_model_parallel_size=8, pipeline_model_parallel_size=2)
    params.optimizer_config.optimizer_cpu_offload, params.optimizer_config.optimizer_offload_fraction = True, 1.0
    layout = ParallelLayout(16, 8, 2, 1, 1, 1, None, False, 1, 4, "1f1b", 1, 1)
    state = estimate_state(SimpleNamespace(megatron=params), LLAMA_70B, layout, STAGE0_70B, gpus_per_node=8)
    total = 80 * 855_654_400 + 2 * 128_256 * 8192  # every parameter but the final norm's 8,192
    assert state.resident_per_rank == pytest.approx(PROCESS_HOST_GIB + 16 * STAGE0_70B / GIB, rel=1e-9)  # 67.7 GiB
    embedding = 128_256 * 8192  # the largest tensor
    assert state.transient_per_rank == pytest.approx({"convert": 1.4 * 2 * embedding / GIB,
                                                      "checkpoint_save": 2 * 4 * embedding / 8 / GIB,
                                                      "checkpoint_load": 2 * 4 * embedding / 8 / GIB, "hf_export": 5e9 / GIB})
    assert state.host_per_node == pytest.approx(8 * (state.resident_per_rank + 5e9 / GIB), rel=1e-9)
    assert state.checkpoint == pytest.approx(14 * total / GIB, rel=1e-6) and state.checkpoints_coexisting == 3
    assert state.converted == state.hf_export == pytest.approx(2 * total / GIB, rel=1e-6)
    assert state.disk_total == pytest.approx((4 + 3 * 14) * total / GIB, rel=1e-6)  # 3.0 TiB
    params.checkpoint_config.keep_last_n_checkpoints = 0  # every checkpoint kept: the disk grows with the run
    assert estimate_state(SimpleNamespace(megatron=params), LLAMA_70B, layout, STAGE0_70B).disk_total is None


def test_colocated_engines_are_counted_with_the_whole_model_over_tp() -> None:
    """A colocated vLLM engine holds every layer over TP, whatever the pipeline stage: configs/train_405b_grpo.yaml with
    colocated vLLM (TP 8: 405B x 2 B / 8 = 94 GiB of engine weights on every GPU) does not fit 80 GiB GPUs, where the
    vllm_gpu_memory_utilization share alone (32 GiB) said it did, and the advice names the placements that do."""
    from oumi_megatron.model_shape import ModelShape

    shape_file = REPO / "configs" / "model_shapes" / "llama-3.1-405b-instruct" / "config.json"
    base = ["oumi-megatron", "plan", "-c", str(REPO / "configs" / "train_405b_grpo.yaml"), "--gpus", "256", "--gpus-per-node",
            "8", "--gpu-memory-gib", "80", "--model-config", str(shape_file)]
    proc = run_cli([*base, "--json", "--megatron.inference_backend", "vllm"])
    assert proc.returncode == 2, proc.stderr[-3000:]  # will not fit
    r = json.loads(proc.stdout)
    weights = ModelShape.from_file(shape_file).vllm_weight_bytes(8) / GIB
    assert 90 < weights < 100 and r["rollout"] == pytest.approx(weights, abs=0.01) and r["fits"] is False
    # the advice the text report prints after "will not fit" (its printing: test_plan_cli_prints_the_parts_...)
    assert any("rollout_placement: separate or ray" in a for a in r["advice"]), r["advice"]
    embedded = json.loads(run_cli([*base, "--json"]).stdout)  # the shipped config (embedded rollouts) still fits
    assert embedded["fits"] is True, embedded


def test_engines_on_gpus_of_their_own_must_hold_the_model() -> None:
    """A separate engine (vLLM TP 1) holds the whole model on one GPU: Llama-3.1-70B (131 GiB of bf16 weights) does not
    fit an 80 GiB GPU's 0.4 share, and the plan says so with the fix although training fits; a Ray fleet engine over
    4 GPUs (33 GiB each) at vllm_gpu_memory_utilization 0.9 does."""
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.model_shape import ModelShape
    from oumi_megatron.rollout.registry import own_gpu_engine_problem

    shape = ModelShape.from_file(REPO / "configs" / "model_shapes" / "llama-3.1-70b-instruct" / "config.json")
    separate = MegatronParams(inference_backend="vllm", rollout_placement="separate")
    problem = own_gpu_engine_problem(separate, shape, 80.0)
    assert problem is not None and "131." in problem and "rollout_gpus_per_engine" in problem, problem
    fleet = MegatronParams(inference_backend="vllm", rollout_placement="ray", rollout_gpus_per_engine=4,
                           vllm_gpu_memory_utilization=0.9)
    assert own_gpu_engine_problem(fleet, shape, 80.0) is None
    assert own_gpu_engine_problem(MegatronParams(inference_backend="vllm", rollout_placement="colocated"), shape, 80.0) is None
    base = ["oumi-megatron", "plan", "-c", str(REPO / "configs" / "train_70b_grpo.yaml"), "--gpus", "16",
            "--gpus-per-node", "8", "--gpu-memory-gib", "80", "--model-config",
            str(REPO / "configs" / "model_shapes" / "llama-3.1-70b-instruct" / "config.json")]
    r = json.loads(run_cli([*base, "--json", "--megatron.inference_backend", "vllm", "--megatron.rollout_placement", "separate",
                            "--megatron.weight_sync_method", "nccl"]).stdout)
    assert r["fits"] is False and r["total"] < 80 and "131." in r["engine_problem"], r


def test_a_colocated_sglang_engine_takes_its_mem_fraction_static_of_the_gpu() -> None:
    """SGLang's mem_fraction_static holds its weights and KV pool: the plan counts that share of the GPU (or the
    engine's weights where they are more), in turns with training (the engine releases its memory while it trains)."""
    plan = _plan(TINY, inference_backend="sglang", sglang_mem_fraction_static=0.3, gpu_memory_gib=80.0)
    assert plan.rollout == pytest.approx(0.3 * 80.0, rel=1e-9)
    persistent = plan.weights + plan.grads + plan.optimizer
    assert plan.total == pytest.approx(persistent + max(plan.rollout, plan.activations + plan.logits) + plan.overhead, rel=1e-9)
    unknown = _plan(TINY, inference_backend="sglang")  # no GPU size given: the engine's weights, and a note to pass it
    assert unknown.rollout * GIB == pytest.approx(2 * 188_928, rel=1e-9)
    assert any("sglang_mem_fraction_static" in n for n in unknown.notes), unknown.notes


def test_70b_lora_config_fits_one_node_where_full_fine_tuning_does_not() -> None:
    """configs/train_70b_grpo_lora.yaml on 8 x 80 GiB: the frozen bf16 base over TP 8 and the adapters' state fit
    (docs/lora.md); the same layout training every weight is over by its gradients and Adam's state. The adapters
    (r 16, every linear layer) by hand: a layer's QKV 16 x (8192 + 10240) + output 16 x (8192 + 8192) + fc1 16 x
    (8192 + 57344) + fc2 16 x (28672 + 8192) = 2,195,456, x 80 layers = 175,636,480; a checkpoint holds their 14 B each,
    the export (adapter_only) their fp32 PEFT file."""
    from oumi.core.configs import TrainingConfig

    from oumi_megatron.plan import plan_config

    shape = str(REPO / "configs" / "model_shapes" / "llama-3.1-70b-instruct" / "config.json")
    path = str(REPO / "configs" / "train_70b_grpo_lora.yaml")
    lora = plan_config(TrainingConfig.from_yaml_and_arg_list(path, []), 8, 8, 80.0, shape)
    full = plan_config(TrainingConfig.from_yaml_and_arg_list(path, ["training.use_peft=false"]), 8, 8, 80.0, shape)
    assert lora.plan is not None and full.plan is not None and lora.state is not None
    assert lora.plan.fits and not full.plan.fits, (lora.plan.total, full.plan.total)
    adapters = 175_636_480
    assert lora.plan.grads * GIB == pytest.approx(4 * adapters / 8, rel=1e-3)  # every layer's adapters over TP 8 (PP 1)
    assert lora.state.checkpoint * GIB == pytest.approx(14 * adapters, rel=1e-9)
    assert lora.state.hf_export * GIB == pytest.approx(4 * adapters, rel=1e-9)
