"""Per-GPU memory of a MEGATRON_GRPO layout, and layout advice (``oumi-megatron plan``).

The estimate is arithmetic on the model's shape (config.json, read offline as ``validate`` reads it) and the
config, for the pipeline stage that needs the most (docs/plan.md explains each term; tests/test_plan.py pins
hand-computed cases; docs/benchmarks.md compares it with ``torch.cuda.max_memory_allocated()`` of real steps):

- **weights**: bf16, 2 B per parameter the GPU holds (dense layers / TP, experts / EP, the embedding on the first
  stage and the output layer on the last, both split over TP);
- **grads**: fp32 main gradients, 4 B per parameter (Megatron-Core's DDP buffer; not sharded);
- **optimizer**: Adam's fp32 master weights and two moments, 12 B per parameter, divided over the data-parallel
  ranks (x CP) by the distributed optimizer; optimizer CPU offload moves the moments (8 B x fraction) to the host
  (the master weights stay: measured, docs/benchmarks.md);
- **activations**: per layer and token, bf16: the two norms' inputs and outputs (8h), Q/K/V before and after RoPE and
  the attention output (4q + 6kv), the MLP's gate/up outputs and their SwiGLU product (6F, MoE: top-k experts of
  F_moe each); the norms' share splits over TP only with sequence parallelism, the rest always; CP divides the tokens.
  Full recompute keeps each recompute block's input (2h) and one block's activations; the stage holds as many
  microbatches as its schedule keeps in flight (1F1B: PP - stage; interleaved: Megatron's warm-up count; ZB-H1:
  1F1B's plus its deferred weight-gradient inputs, +10% as measured: the schedule entry's ``activation_factor``);
- **logits** (last stage): full logits keep bf16 logits and their fp32 log-softmax (6 B per token x vocabulary
  / TP); chunked logprobs keep about three fp32 chunks;
- **rollout**: a colocated vLLM engine's bf16 weights (the whole model over TP: every layer, whatever the pipeline
  stage) plus ``vllm_kv_cache_gib`` where that is set, else the larger of those weights and its
  ``vllm_gpu_memory_utilization`` share of the GPU; it sleeps (holding nothing) while the trainer trains, or, with
  ``vllm_sleep: false``, holds it beside training's activations and logits (the total adds the two); embedded
  rollouts: the static KV cache of the stage's layers (2 x layers x KV heads / TP x head dim x bf16, for this rank's
  completions x ``max_sequence_length`` slots) and four fp32 [rows, vocabulary] sampling buffers on the last stage.
  It lives while generating, when no training activations or logits do: the total takes the larger of the two,
  except where the decoder keeps its CUDA graphs (``rollout_cuda_graphs_kept`` > 0, one stage, dense layers): the
  kept generations' caches stay beside training's memory, and the total adds them (kept x one generation's), each with
  its prefill graph's activations (``kept_prefill_bytes``);
- **overhead**: the CUDA context, NCCL buffers and allocator reserve outside ``max_memory_allocated`` (measured).

With LoRA (``training.use_peft``, docs/lora.md) the base keeps its bf16 weights alone (frozen: no gradient buffer, no
master weights, no moments), and the adapters take 2 + 4 + 12 B per parameter as above: r x (in + out) per targeted
projection, over TP (``lora_params``).

ModuleQueue (last stage) subtracts seed 000's saving from the weights held during the passes, never below the
persistent state (the optimizer step needs every weight).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from oumi_megatron.config.lora import CANONICAL, HF_TO_MEGATRON, LoraSettings, lora_settings
from oumi_megatron.engine.kernels.chunked_logprobs import auto_chunk_tokens, worth_chunking
from oumi_megatron.engine.parallel.layout import ParallelLayout, divisors, resolve_layout
from oumi_megatron.model_shape import ModelShape
from oumi_megatron.rollout.registry import DECODER_CACHE, ENGINE_SHARE, own_gpu_engine_problem, rollout_mode
from oumi_megatron.state_plan import StatePlan, estimate_state
from oumi_megatron.utils.disk import GIB

if TYPE_CHECKING:
    from oumi_megatron.config.training_config import MegatronTrainingConfig
    from oumi_megatron.validation import ValidationReport

CUDA_OVERHEAD_GIB = 4.0
"""What a GPU holds outside PyTorch's allocator: the CUDA context, NCCL communicators, cuBLAS workspaces (measured
2.8 GiB on one H200, 3.3-4.1 GiB with NCCL on two: docs/benchmarks.md). The caching allocator may reserve more
than it hands out (5-12 GiB there at the peak); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True narrows that."""
COMPONENTS = ("weights", "grads", "optimizer", "activations", "logits", "rollout", "overhead")


@dataclass(frozen=True)
class MemoryPlan:
    """GiB per GPU on the stage that needs the most, and whether it fits."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    rollout: float
    overhead: float
    total: float
    stage: int
    gpu_memory_gib: float | None
    notes: tuple[str, ...] = field(default=())
    by_stage: tuple[float, ...] = field(default=())
    """Each stage's training peak (weights to logits), GiB."""
    engine_problem: str | None = None
    """Why a rollout engine on GPUs of its own (separate, ray) cannot hold the model there (rollout/registry.py)."""
    engine_weights: float = 0.0
    """GiB of bf16 weights a colocated vLLM engine holds on every GPU (the whole model over TP); 0 without one."""
    kept_rollout: float = 0.0
    """Of ``rollout``, the GiB the embedded decoder keeps across steps with its CUDA graphs (the allocator's: part of
    a training step's peak)."""

    @property
    def training_peak(self) -> float:
        """What ``torch.cuda.max_memory_allocated()`` of a training step should read (no rollout, no overhead)."""
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.kept_rollout

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_memory_gib is None else self.total <= self.gpu_memory_gib and self.engine_problem is None

    def as_dict(self) -> dict[str, Any]:
        """The JSON form: a GiB figure per component and the total, the stage, whether it fits, notes."""
        d = asdict(self)
        d["notes"], d["by_stage"] = list(self.notes), [round(x, 2) for x in self.by_stage]
        d["fits"] = self.fits
        d["training_peak"] = round(self.training_peak, 2)
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in d.items()}


@dataclass(frozen=True)
class _Params:
    """Parameters one GPU of a stage holds: dense (split over TP: layers, embedding, output layer) and experts
    (split over EP); ``layers``: the transformer layers' share of both."""

    dense: float
    experts: float
    layers: float

    @property
    def total(self) -> float:
        return self.dense + self.experts


def _stage_params(shape: ModelShape, layout: ParallelLayout, stage: int, expert_split: int) -> _Params:
    """``expert_split``: the ranks each expert layer's parameters are divided over, EP x expert TP."""
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    dense, experts = shape.layer_params()
    layers = shape.num_layers / pp
    embedding = shape.vocab_size * shape.hidden_size
    extra = 0.0
    if stage == 0:
        extra += embedding
    if stage == pp - 1 and (not shape.tie_word_embeddings or pp > 1):  # tied: the last stage keeps its own copy
        extra += embedding
    return _Params(dense=(layers * dense + extra) / tp, experts=layers * experts / expert_split,
                   layers=layers * dense / tp + layers * experts / expert_split)


def lora_params(shape: ModelShape, lora: LoraSettings, tp: int = 1, pp: int = 1) -> float:
    """The LoRA adapters' parameters on one GPU of a pipeline stage of ``pp`` (they live in its transformer layers),
    over TP ``tp`` (1, 1: the whole model's): r x (in + out) per targeted projection, both of an adapter's matrices
    split over TP (Megatron-Bridge's ParallelLinearAdapter: A over its rank, B over its outputs)."""
    sides = _projection_sides(shape)
    per_layer = sum(lora.rank * (sides[t][0] + sides[t][1]) for t in lora.targets)
    return per_layer * shape.num_layers / pp / tp


def _projection_sides(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection a LoRA target names: Megatron's fused ones and canonical LoRA's per-HF ones."""
    h, q, kv, ffn, _ = shape.widths()
    return {"linear_qkv": (h, q + 2 * kv), "linear_fc1": (h, 2 * ffn), "linear_q": (h, q), "linear_k": (h, kv),
            "linear_v": (h, kv), "linear_fc1_gate": (h, ffn), "linear_fc1_up": (h, ffn), "linear_proj": (q, h),
            "linear_fc2": (ffn, h)}


def lora_merged_base_params(shape: ModelShape, lora: LoraSettings, tp: int = 1, pp: int = 1) -> float:
    """The base parameters of the LoRA-adapted layers on one GPU of a pipeline stage: what the embedded backend keeps
    aside while it decodes from merged weights (engine/peft.py ``adapters_merged``). A canonical adapter adapts the
    whole fused projection it sits in (q_proj: linear_qkv)."""
    sides = _projection_sides(shape)
    owner = {CANONICAL[hf]: HF_TO_MEGATRON[hf] for hf in CANONICAL}  # a canonical target's fused projection
    per_layer = sum(sides[name][0] * sides[name][1] for name in {owner.get(t, t) for t in lora.targets})
    return per_layer * shape.num_layers / pp / tp


def rank_params(cfg: MegatronTrainingConfig, shape: ModelShape, layout: ParallelLayout) -> float:
    """The parameters one GPU of the busiest pipeline stage holds."""
    expert_split = layout.expert_parallel * cfg.megatron.expert_tensor_parallel_size
    return max(_stage_params(shape, layout, stage, expert_split).total for stage in range(layout.pipeline_parallel))


def _token_bytes(shape: ModelShape, layout: ParallelLayout) -> tuple[float, float]:
    """(bytes per token per layer of the activations a layer keeps for its backward, of its input alone), bf16,
    per GPU: TP splits what lies between the sequence-parallel regions, all of it with SP."""
    h, q, kv, ffn, expert_ffn = shape.widths()
    if shape.is_moe:  # the experts each token is routed to
        ffn = expert_ffn * max(shape.num_experts_per_tok, 1)
    norms = 2 * (4 * h)  # two norms, input and output each
    split = 2 * (2 * q + 3 * kv) + 2 * q + 2 * (3 * ffn)  # Q/K/V (+ after RoPE), attention out, gate/up + SwiGLU
    tp = layout.tensor_parallel
    per_layer = (norms / tp if layout.sequence_parallel else norms) + split / tp
    layer_input = 2 * h / (tp if layout.sequence_parallel else 1)
    return per_layer, layer_input


def _in_flight(layout: ParallelLayout, stage: int, microbatches: int) -> float:
    """Microbatches' worth of this stage's layers whose activations are alive at the stage's peak."""
    pp, vpp = layout.pipeline_parallel, layout.virtual_pipeline
    if pp == 1:
        return 1.0
    if vpp:  # Megatron's interleaved warm-up, in model chunks of layers / (pp x vpp)
        chunks = min(microbatches * vpp, (pp - stage - 1) * 2 + (vpp - 1) * pp + 1)
        return chunks / vpp
    return float(min(pp - stage, microbatches))


def kv_cache_bytes_per_token(shape: ModelShape, layers: float, tensor_parallel: int = 1, dtype_bytes: int = 2) -> float:
    """Keys and values one token keeps in the embedded backend's static cache on one GPU holding ``layers`` layers
    (the KV heads split over TP, one each at least)."""
    return 2 * layers * max(shape.num_key_value_heads / tensor_parallel, 1) * shape.head_size * dtype_bytes


def _embedded_rollout_bytes(cfg: MegatronTrainingConfig, shape: ModelShape, layout: ParallelLayout, stage: int) -> float:
    """The embedded backend's generation memory on one GPU of ``stage`` (rollout/decoding/): the static KV cache of
    its layers for this rank's completions, and the last stage's fp32 logits-sized sampling buffers. Multi-turn
    episodes (``grpo.environment``) keep one cache for all turns: the prompt, a slot per token of the completion
    budget, and a scratch slot (rollout/decoding/episodes.py ``episode_slots``)."""
    from oumi_megatron.rollout.decoding.episodes import episode_slots

    g = cfg.grpo
    rows = layout.completions_per_rollout / layout.data_parallel
    per_token = kv_cache_bytes_per_token(shape, shape.num_layers / layout.pipeline_parallel, layout.tensor_parallel)
    slots = g.max_sequence_length
    if g.environment is not None:
        slots = episode_slots(g.max_prompt_length, g.max_completion_length)
    cache = per_token * rows * slots
    sampling = 4 * 4 * rows * shape.vocab_size if stage == layout.pipeline_parallel - 1 else 0.0
    return cache + sampling


def kept_prefill_bytes(cfg: MegatronTrainingConfig, shape: ModelShape, layout: ParallelLayout) -> float:
    """The memory a kept generation's prefill graph holds on one GPU (rollout/decoding/decoder.py
    ``PREFILL_GRAPH_TOKENS``): the prefill's activations, a layer's at a time (the residual stream, the norm's output,
    the attention's input and output, the MLP's gate-and-up output and its activation), for this rank's prompts at
    their bucketed width, at most the captured limit's tokens (a batch of shorter prompts may be captured)."""
    from oumi_megatron.rollout.decoding.decoder import PREFILL_GRAPH_TOKENS, bucketed_width

    prompts = layout.prompts_per_rollout / layout.data_parallel
    width = bucketed_width(cfg.grpo.max_prompt_length)
    tokens = min(prompts * width, PREFILL_GRAPH_TOKENS)
    ffn = shape.intermediate_size or 4 * shape.hidden_size
    return tokens * (4 * shape.hidden_size + 3 * ffn / layout.tensor_parallel) * 2


def _decoder_keeps_graphs(m: Any, shape: ModelShape, layout: ParallelLayout) -> bool:
    """Whether the embedded decoder's CUDA graphs (and so its kept caches) run on a GPU for this run
    (rollout/decoding/decoder.py ``resolve_cuda_graphs``: one pipeline stage, dense layers)."""
    return (m.rollout_cuda_graphs_kept > 0 and m.rollout_cuda_graphs_choice != "false"
            and layout.pipeline_parallel == 1 and not shape.is_moe)


def estimate_memory(cfg: MegatronTrainingConfig, shape: ModelShape, layout: ParallelLayout, gpu_memory_gib: float | None = None,
                    overhead_gib: float = CUDA_OVERHEAD_GIB) -> MemoryPlan:
    """Per-GPU memory of ``cfg`` (a MegatronTrainingConfig) for ``shape`` on ``layout`` (from validation)."""
    from oumi_megatron.engine.parallel.schedules import SCHEDULES

    m = cfg.megatron
    activation_factor = SCHEDULES.get(layout.pipeline_schedule).activation_factor  # ZB-H1's deferred W inputs: +10%
    t = m.transformer_config
    dp, cp, pp = layout.data_parallel, layout.context_parallel, layout.pipeline_parallel
    tokens = layout.micro_batch_size * cfg.grpo.max_sequence_length / cp  # per microbatch, per GPU
    per_layer, layer_input = _token_bytes(shape, layout)
    layers = shape.num_layers / pp
    microbatches = layout.microbatches_per_step
    offload = m.optimizer_config.optimizer_offload_fraction if m.optimizer_config.optimizer_cpu_offload else 0.0
    full = t.recompute_granularity == "full"
    block = (t.recompute_num_layers or 1) if full else 1
    mode = rollout_mode(m)  # where the rollout engines' memory lives (rollout/registry.py)
    colocated_vllm = mode.memory == ENGINE_SHARE
    engine_weights = shape.vllm_weight_bytes(layout.tensor_parallel) if colocated_vllm else 0.0
    # experts: split over EP x expert TP (MegatronParams' rule); the distributed optimizer shards over DP x CP (dense)
    # and over the experts' own DP, TP x CP x DP / (EP x expert TP)
    expert_split = layout.expert_parallel * m.expert_tensor_parallel_size
    shards = (cp * dp, layout.tensor_parallel * cp * dp // expert_split) if m.ddp_config.use_distributed_optimizer else (1, 1)
    notes: list[str] = []
    stage_plans: list[MemoryPlan] = []
    lora, _ = lora_settings(cfg)
    # the embedded decoder merges LoRA into its weights for a rollout (MegatronRolloutBackend._rollout_weights decides the same)
    merged_rollouts = lora is not None and mode.memory == DECODER_CACHE and m.lora_sync == "merged"
    for stage in range(pp):
        params = _stage_params(shape, layout, stage, expert_split)
        weights, grads = 2 * params.total, 4 * params.total
        optimizer = (4 + 8 * (1 - offload)) * (params.dense / shards[0] + params.experts / shards[1])
        if lora is not None:  # the base frozen in bf16; gradients and Adam for the adapters alone
            adapters = lora_params(shape, lora, layout.tensor_parallel, pp)
            weights, grads = 2 * (params.total + adapters), 4 * adapters
            optimizer = (4 + 8 * (1 - offload)) * adapters / shards[0]
        if full:  # each block's input kept; one block's activations rebuilt during its backward
            per_microbatch = tokens * (layers / block) * layer_input
            activations = _in_flight(layout, stage, microbatches) * per_microbatch + tokens * block * per_layer
        else:
            saved = per_layer - (2 * shape.widths()[1] / layout.tensor_parallel if t.recompute_granularity == "selective" else 0)
            activations = _in_flight(layout, stage, microbatches) * tokens * layers * saved
        activations *= activation_factor
        logits = 0.0
        if stage == pp - 1:
            vocab_shard = shape.vocab_size / layout.tensor_parallel
            chunk: float | None = m.logprob_chunk_tokens
            if chunk is None:  # auto (CUDA): the engine's rule, on a TP rank's rows of the output layer
                rows = math.ceil(vocab_shard)
                chunk = auto_chunk_tokens(rows) if worth_chunking(math.ceil(tokens), rows) else 0
            logits = 12 * min(chunk, tokens) * vocab_shard if chunk else 6 * tokens * vocab_shard
            if m.enable_module_queue:  # seed 000's saving: N x layer size - V x H / num_chunks (bf16)
                output = shape.vocab_size * shape.hidden_size / layout.tensor_parallel
                saving = 2 * (params.layers - output / m.module_queue_num_chunks)
                weights -= min(max(saving, 0.0), activations + logits)  # the optimizer step needs every weight back
        overhead = overhead_gib * GIB
        merge_copy = 0.0  # LoRA merged into the embedded decoder's weights: their base kept aside while decoding
        if mode.memory == DECODER_CACHE:  # generation and training take turns on the same memory
            rollout = _embedded_rollout_bytes(cfg, shape, layout, stage)
            if merged_rollouts:
                assert lora is not None
                merge_copy = 2 * lora_merged_base_params(shape, lora, layout.tensor_parallel, pp)
        elif colocated_vllm:
            # each engine holds the whole model over its TP (every layer: a pipeline stage's engine serves all of them)
            # and its KV cache; it takes at least its share of the GPU (vllm_gpu_memory_utilization,
            # sglang_mem_fraction_static) where no cache size is set
            assert mode.gpu_share is not None
            gpu_share = mode.gpu_share(m)
            engine = engine_weights + gpu_share.kv_cache_gib * GIB
            share = gpu_share.fraction * gpu_memory_gib * GIB if gpu_memory_gib else 0.0
            rollout = engine if gpu_share.kv_cache_gib else max(engine, share)
        else:
            rollout = 0.0
        # a colocated vLLM engine sleeps while the trainer trains (its weights dropped, its KV cache freed): turns too;
        # one that stays awake (vllm_sleep: false) holds its memory beside training's
        resident = colocated_vllm and mode.resident_while_training(m)
        kept = 0.0
        if mode.memory == DECODER_CACHE and _decoder_keeps_graphs(m, shape, layout):
            rollout = kept = (rollout + kept_prefill_bytes(cfg, shape, layout)) * m.rollout_cuda_graphs_kept
            resident = True
        training = activations + logits
        # kept decoder buffers (or an awake engine) stay beside training; the merge's copy lives while decoding only
        busy = rollout + max(training, merge_copy) if resident else max(training, rollout + merge_copy)
        rollout += merge_copy
        total = weights + grads + optimizer + busy + overhead
        plan = MemoryPlan(weights=weights / GIB, grads=grads / GIB, optimizer=optimizer / GIB, activations=activations / GIB,
                          logits=logits / GIB, rollout=rollout / GIB, overhead=overhead / GIB, total=total / GIB, stage=stage,
                          gpu_memory_gib=gpu_memory_gib, kept_rollout=kept / GIB)
        stage_plans.append(plan)
    best = max(stage_plans, key=lambda x: x.total)
    if colocated_vllm and not gpu_memory_gib and mode.gpu_share is not None and not mode.gpu_share(m).kv_cache_gib:
        field = mode.gpu_share(m).fraction_field.removeprefix("megatron.")
        notes.append(f"a colocated engine takes {field} of the GPU: pass --gpu-memory-gib to count it")
    if mode.memory == DECODER_CACHE:
        notes.append("embedded rollouts: the KV cache lives while generating, when no activations do (the larger counts)")
        if merged_rollouts:
            notes.append("LoRA, lora_sync: merged: the rollout decodes merged weights, the adapted layers' base weights "
                         "kept aside meanwhile (counted in rollout); lora_sync: adapter keeps no copy, decodes slower")
    engine_problem = own_gpu_engine_problem(m, shape, gpu_memory_gib) if gpu_memory_gib else None
    return MemoryPlan(**{**asdict(best), "notes": tuple(notes), "by_stage": tuple(x.training_peak for x in stage_plans),
                         "engine_problem": engine_problem, "engine_weights": engine_weights / GIB})


def advice(plan: MemoryPlan, cfg: MegatronTrainingConfig, layout: ParallelLayout) -> list[str]:
    """What to change when the plan does not fit, largest lever first."""
    if plan.fits is not False:
        return []
    m, t = cfg.megatron, cfg.megatron.transformer_config
    if plan.engine_problem and plan.total <= (plan.gpu_memory_gib or 0):  # training fits; the engines do not
        return [plan.engine_problem]
    over = plan.total - (plan.gpu_memory_gib or 0)
    tips = [f"over by {over:.1f} GiB on pipeline stage {plan.stage}", *([plan.engine_problem] if plan.engine_problem else [])]
    if not m.ddp_config.use_distributed_optimizer and layout.data_parallel * layout.context_parallel > 1:
        tips.append("megatron.ddp_config.use_distributed_optimizer: true (shards the optimizer over DP)")
    if plan.optimizer > 0.2 * plan.total and not m.optimizer_config.optimizer_cpu_offload:
        tips.append(f"megatron.optimizer_config.optimizer_cpu_offload: true with optimizer_offload_fraction: 1.0 "
                    f"(moves Adam's moments, {plan.optimizer * 2 / 3:.1f} GiB, to the host; slower steps)")
    if t.recompute_granularity != "full" and plan.activations > 0.15 * plan.total:
        tips.append("megatron.transformer_config.recompute_granularity: full (keeps one input per layer)")
    if plan.rollout:
        mode = rollout_mode(m)
        if mode.memory == ENGINE_SHARE and mode.resident_while_training(m):
            tips.append("megatron.vllm_sleep: true (the colocated engine hands its memory to training)")
        if plan.engine_weights > 0.5 * (plan.gpu_memory_gib or 0):  # the engine's weights alone: no share can fix it
            tips.append(f"each colocated engine holds the whole model over TP {layout.tensor_parallel}: at least "
                        f"{plan.engine_weights:.1f} GiB of weights on every GPU; use rollout_placement: separate or ray "
                        "(engines on GPUs of their own, rollout_gpus_per_engine for their TP), or the embedded backend "
                        "(megatron.inference_backend: megatron)")
        share_field = mode.gpu_share(m).fraction_field if mode.gpu_share is not None else "the engine's memory share"
        tips.append(f"a lower {share_field}, or rollout_placement: separate")
    tips.append("more pipeline stages or tensor parallelism (more GPUs), see --suggest")
    return tips


@dataclass(frozen=True)
class Suggestion:
    tensor_parallel: int
    pipeline_parallel: int
    context_parallel: int
    data_parallel: int
    plan: MemoryPlan
    relative_speed: float
    why: str


def suggest_layouts(cfg: MegatronTrainingConfig, shape: ModelShape, gpus: int, gpus_per_node: int | None, gpu_memory_gib: float,
                    top: int = 5) -> list[Suggestion]:
    """Valid TP x PP x CP x DP layouts of ``gpus`` GPUs ranked by fit, then by a simple throughput model:
    the pipeline bubble (PP - 1) / (m + PP - 1), TP's per-layer all-reduces (10% per doubling within a node,
    30% across nodes), CP's K/V all-gather (5% per doubling) and DP's gradient all-reduce (5% once DP > 1)."""
    node = gpus_per_node or min(gpus, 8)
    out: list[Suggestion] = []
    for tp in divisors(min(gpus, node)):
        if shape.num_attention_heads % tp or shape.num_key_value_heads % tp:
            continue
        for pp in divisors(gpus // tp):
            if shape.num_layers % pp:
                continue
            for cp in (1, 2, 4):
                if gpus % (tp * pp * cp) or cfg.grpo.max_sequence_length % (2 * cp):
                    continue
                # only the layout changes between trials: resolve it alone (no re-validation of the config)
                schedule = "1f1b" if cfg.megatron.pipeline_schedule == "interleaved" or pp == 1 else cfg.megatron.pipeline_schedule
                trial = copy.copy(cfg)
                trial.megatron = dataclasses.replace(
                    cfg.megatron, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                    virtual_pipeline_model_parallel_size=None, sequence_parallel=tp > 1, pipeline_schedule=schedule)
                resolution = resolve_layout(trial, gpus, gpus_per_node, shape)
                if resolution.layout is None or resolution.problems:
                    continue
                lay = resolution.layout
                plan = estimate_memory(trial, shape, lay, gpu_memory_gib)
                bubble = (pp - 1) / (lay.microbatches_per_step + pp - 1)
                tp_cost = (0.1 if tp <= node else 0.3) * math.log2(tp)
                speed = (1 - bubble) / (1 + tp_cost + 0.05 * math.log2(cp) + (0.05 if lay.data_parallel > 1 else 0))
                why = (f"{plan.total:.1f} of {gpu_memory_gib:.0f} GiB, bubble {bubble:.0%}"
                       + (f", TP {tp} all-reduces with sequence parallelism" if tp > 1 else "")
                       + (f", CP {cp} K/V all-gathers" if cp > 1 else "") + (f", DP {lay.data_parallel}" if lay.data_parallel > 1 else ""))
                out.append(Suggestion(tp, pp, cp, lay.data_parallel, plan, speed, why))
    out.sort(key=lambda s: (not s.plan.fits, -s.relative_speed if s.plan.fits else s.plan.total))
    return out[:top]


@dataclass
class PlanResult:
    """``plan_config``'s answer: the validation report, the memory plan (None if the config or shape is not
    valid), what to change when it does not fit, and ranked layouts (``suggest``)."""

    report: ValidationReport
    plan: MemoryPlan | None
    advice: list[str]
    suggestions: list[Suggestion]
    state: StatePlan | None = None
    """Host memory per node and disk (state_plan.py)."""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.report.ok, "problems": [f"{p.field}: {p.message}" for p in self.report.problems]}
        if self.plan is not None:
            out.update(self.plan.as_dict())
            out["advice"] = self.advice
        if self.state is not None:
            out["host_and_disk"] = self.state.as_dict()
        if self.suggestions:
            out["suggestions"] = [{"tp": s.tensor_parallel, "pp": s.pipeline_parallel, "cp": s.context_parallel,
                                   "dp": s.data_parallel, "total": round(s.plan.total, 2), "fits": s.plan.fits,
                                   "relative_speed": round(s.relative_speed, 3), "why": s.why} for s in self.suggestions]
        return out


def plan_config(config: MegatronTrainingConfig, gpus: int, gpus_per_node: int | None = None, gpu_memory_gib: float | None = None,
                model_config_path: str | None = None, suggest: bool = False,
                overhead_gib: float = CUDA_OVERHEAD_GIB) -> PlanResult:
    """Validate ``config`` (a MegatronTrainingConfig) for ``gpus`` GPUs and estimate per-GPU memory."""
    from oumi_megatron.validation import validate_config

    report = validate_config(config, world_size=gpus, gpus_per_node=gpus_per_node, model_config_path=model_config_path,
                             check_bridge=False)
    if report.layout is None or report.model_shape is None or not report.ok:
        return PlanResult(report, None, [], [])
    plan = estimate_memory(config, report.model_shape, report.layout, gpu_memory_gib, overhead_gib)
    suggestions = (suggest_layouts(config, report.model_shape, gpus, gpus_per_node, gpu_memory_gib)
                   if suggest and gpu_memory_gib else [])
    state = plan_state(config, report.model_shape, report.layout, gpus_per_node)
    return PlanResult(report, plan, advice(plan, config, report.layout), suggestions, state)


def plan_state(config: MegatronTrainingConfig, shape: ModelShape, layout: ParallelLayout,
               gpus_per_node: int | None) -> StatePlan:
    """The state paths' plan (state_plan.py) for ``config``: under LoRA, the adapters' share of each path."""
    lora, _ = lora_settings(config)
    adapters = None
    if lora is not None:
        adapters = (lora_params(shape, lora, layout.tensor_parallel, layout.pipeline_parallel), lora_params(shape, lora),
                    lora.save_mode)
    return estimate_state(config, shape, layout, rank_params(config, shape, layout), gpus_per_node, adapters)
