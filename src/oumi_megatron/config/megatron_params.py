"""The ``megatron:`` section of a MEGATRON_GRPO config.

Field names follow Megatron-Core (``tensor_model_parallel_size``, ``ddp_config.overlap_grad_reduce``...)
so that a NeMo / Megatron-Bridge user reads them without a glossary. Defaults are the design
document's "Full configuration reference" except where it shows a 70B layout (parallel sizes default
to 1) and where an issue decided otherwise (``inference_backend`` defaults to the embedded Megatron
backend). Cross-field and model-dependent checks live in ``oumi_megatron.validation`` so that every
problem is reported at once, not just the first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from oumi_megatron.config.base import BaseParams

# Names selected from registries (pipeline_schedule, inference_backend) are checked against the live registries
# (engine/parallel/schedules.py, rollout/registry.py); the fixed choices of plain fields are listed here.
WEIGHT_SYNC_METHODS = ("nccl", "gloo", "checkpoint")
ROLLOUT_PLACEMENTS = ("colocated", "separate", "ray")
ROLLOUT_CUDA_GRAPHS = ("auto", "true", "false")
ROLLOUT_DECODE_KERNELS = ("auto", "true", "false")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
ATTENTION_BACKENDS = ("auto", "sdpa", "local")
PACKED_ATTENTIONS = ("auto", "varlen", "mask")
CUDA_GRAPH_IMPLS = ("none", "local")
"""Core attention of the local layer spec (engine/kernels/attention.py)."""
# Megatron-Core 0.19's allowed selective-recompute modules (TransformerConfig.__post_init__).
RECOMPUTE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
    "gdn_norm_out",
)


@dataclass
class MegatronDDPConfig(BaseParams):
    """Megatron-Core ``DistributedDataParallelConfig`` knobs."""

    grad_reduce_in_fp32: bool = True
    """Reduce gradients in fp32 (better numerical stability under bf16)."""

    overlap_grad_reduce: bool = False
    """Overlap the gradient reduce-scatter with backward (faster; harder to debug)."""

    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the next forward."""

    average_in_collective: bool = False
    """Average (rather than sum then scale) inside the collective. Not used by MEGATRON_GRPO: the GRPO
    losses are normalized by global token/sequence counts (Megatron-Core's per-token-loss path), which
    sums in the collective and divides once; averaging too would divide twice. Setting it True only
    warns (the design document's reference YAML sets it); the gradient is the same average either way."""

    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (ZeRO-1 style)."""


@dataclass
class MegatronOptimizerConfig(BaseParams):
    """Optimizer placement. Learning rate, betas, weight decay and warmup come from ``training:``."""

    optimizer_cpu_offload: bool = False
    """Keep (part of) the optimizer state and step on the CPU."""

    optimizer_offload_fraction: float = 0.0
    """Fraction of the optimizer state to offload, in [0, 1]."""

    overlap_cpu_optimizer_d2h_h2d: bool = False
    """Overlap device<->host copies of the offloaded optimizer with compute."""

    fused_kernels: bool | None = None
    """Without TransformerEngine or apex, Megatron-Core falls back to torch's multi-pass AdamW and to a
    gradient norm that syncs with the host once per parameter. ``null`` (default): on a GPU, torch's
    fused AdamW (one kernel per step) and foreach gradient norm / scale (no host sync) take their place;
    on the CPU Megatron-Core's fallbacks stay. ``true`` / ``false`` force it (to bisect a regression)."""


@dataclass
class MegatronTransformerConfig(BaseParams):
    """Activation recompute and pipeline-split knobs passed to Megatron-Core's TransformerConfig."""

    recompute_granularity: str | None = "selective"
    """``full``, ``selective`` or null (no recompute)."""

    recompute_method: str | None = "uniform"
    """``uniform`` or ``block``; Megatron-Core applies it to ``full`` recompute only."""

    recompute_num_layers: int | None = None
    """Layers per recompute unit (``full`` recompute; defaults to 1 there)."""

    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])
    """Modules to recompute under ``selective`` granularity."""

    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer when splitting layers over pipeline stages."""

    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer + loss as one layer when splitting layers over pipeline stages."""

    attention_backend: str = "auto"
    """Core attention of the local (non-TransformerEngine) layer spec: ``sdpa`` (PyTorch
    scaled_dot_product_attention: cuDNN/flash kernels on CUDA, native GQA, no score matrix), ``local``
    (Megatron-Core's DotProductAttention) or ``auto`` (sdpa on CUDA, local on the CPU)."""

    packed_attention: str = "auto"
    """How SDPA attends within packed rows (``enable_sequence_packing``): ``varlen`` (torch's
    variable-length flash kernel, sequence boundaries as cumulative lengths: no [T x T] mask; CUDA, bf16
    or fp16), ``mask`` (a block-diagonal boolean mask per row) or ``auto`` (varlen where it can run, mask
    elsewhere)."""

    gradient_accumulation_fusion: bool | None = None
    """Weight gradients accumulated into the fp32 ``main_grad`` inside the GEMM (torch.addmm; apex's
    kernel is not needed). null = on with CUDA, off on the CPU."""

    cuda_graph_impl: str = "none"
    """``local``: each transformer layer's forward and backward replayed as CUDA graphs (Megatron-Core's
    own implementation, no TransformerEngine), so the host no longer launches every kernel; ``none``:
    eager. Graphs have fixed shapes: every microbatch is right-padded to ``cuda_graph_seq_length``.
    CUDA only; PP = 1; no activation recompute (recompute_granularity: null); no sequence packing."""

    cuda_graph_seq_length: int | None = None
    """Sequence length every microbatch is padded to when ``cuda_graph_impl: local`` (prompt +
    completion at most; a longer sequence is an error)."""

    apply_rope_fusion: bool | None = None
    """Rotary embedding of query and key in one Triton kernel each way. null = on with CUDA, off on the CPU."""

    bias_activation_fusion: bool | None = None
    """SwiGLU in one Triton kernel each way. null = on with CUDA for SwiGLU MLPs, off on the CPU."""


@dataclass
class MegatronCheckpointConfig(BaseParams):
    """Distributed checkpointing (``megatron.core.dist_checkpointing``)."""

    use_async_checkpoint: bool = False
    """Write checkpoint tensors in the background while training continues (committed when done)."""

    use_fully_parallel_strategy: bool = True
    """Spread the save/load work over data-parallel ranks."""

    keep_last_n_checkpoints: int = 2
    """Training checkpoints kept in output_dir/checkpoints/ (older ones are deleted; 0 keeps all)."""

    optimizer_fully_reshardable: bool = False
    """The distributed optimizer's state on disk. ``false``: each rank writes and reads only its own shard (Megatron-Core's
    ``dp_reshardable``: no gather, host memory bounded by the rank's own state); a resume may change the data-parallel
    size but not TP / PP / VPP / CP / EP. ``true``: gathered into data-parallel rank 0's host memory (the whole model's
    fp32 master weights and Adam moments on one rank: 12 B per parameter) in a form any layout resumes from (Megatron-LM's
    ``--dist-ckpt-optim-fully-reshardable``)."""


@dataclass
class MegatronParams(BaseParams):
    """Parallel layout, batching and engine options for the MEGATRON_GRPO trainer."""

    # Core parallelism dimensions. TP x PP x CP x DP = world size; EP splits experts over TP x CP x DP ranks.
    tensor_model_parallel_size: int = 1
    """Split each layer's weights over this many GPUs (keep within a node)."""

    pipeline_model_parallel_size: int = 1
    """Split the layers into this many sequential stages."""

    context_parallel_size: int = 1
    """Split each sequence over this many GPUs (long sequences)."""

    expert_model_parallel_size: int = 1
    """Split each MoE layer's experts over this many GPUs of a pipeline stage (MoE models only; tokens travel
    to their experts by all-to-all). It must divide TP x CP x DP and the number of experts; it does not
    change DP (world size / (TP x PP x CP))."""

    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (Megatron-Core's meaning) for the interleaved schedule.

    PP=16 with 2x interleaving (32 virtual stages in all) is ``virtual_pipeline_model_parallel_size: 2``.
    """

    sequence_parallel: bool = False
    """Shard LayerNorm/dropout activations over the TP group (needs TP > 1)."""

    # Batch configuration.
    micro_batch_size: int | None = None
    """Sequences per microbatch per GPU. Default: ``training.per_device_train_batch_size``."""

    global_batch_size: int | None = None
    """Sequences per optimizer step over all data-parallel ranks.

    Default: micro_batch_size x ``training.gradient_accumulation_steps`` x DP.
    """

    # Features.
    logprob_chunk_tokens: int | None = None
    """Token logprobs and entropy from the last hidden states in chunks of this many tokens, without the
    full [tokens x vocab] fp32 logits (engine/kernels/chunked_logprobs.py). null = auto: with CUDA, chunks of
    ~512 MiB of fp32 logits where one microbatch's logits would pass that (full logits below); off on
    the CPU; 0 = off (full logits)."""

    logprob_fusion: bool | None = None
    """The chunked logprob path's softmax statistics (max, log-sum-exp, target logit, entropy; the backward's softmax
    gradient) each in one compiled kernel (torch.compile) that reads a chunk's logits once in the model dtype, instead
    of fp32 passes one by one (engine/kernels/chunked_logprobs.py). Same math, sums in another order (fp32 rounding).
    null = on with CUDA, off on the CPU."""

    enable_sequence_packing: bool = False
    """Pack variable-length sequences into microbatches (no padding)."""

    pipeline_schedule: str = "1f1b"
    """``1f1b``, ``interleaved`` (needs virtual_pipeline_model_parallel_size), ``zb_h1``, ``none`` (PP = 1) or a
    schedule a plugin registers (engine/parallel/schedules.py). ``1f1b`` stands for the layout's natural schedule."""

    enable_module_queue: bool = False
    """Use ModuleQueue on the last pipeline stage (offload layers while loading the output layer)."""

    module_queue_num_chunks: int = 4
    """Chunks the output layer is split into for ModuleQueue (2-8 recommended)."""

    ddp_config: MegatronDDPConfig = field(default_factory=MegatronDDPConfig)
    optimizer_config: MegatronOptimizerConfig = field(default_factory=MegatronOptimizerConfig)
    transformer_config: MegatronTransformerConfig = field(default_factory=MegatronTransformerConfig)
    checkpoint_config: MegatronCheckpointConfig = field(default_factory=MegatronCheckpointConfig)

    # Weight synchronization to the rollout engines.
    enable_weight_sync: bool = True
    """Push new weights to the rollout engines after every optimizer step."""

    lora_sync: str = "merged"
    """How rollouts see the LoRA policy (``training.use_peft``): ``merged`` (the base with the adapters merged in) or
    ``adapter`` (the base beside the adapter). vLLM engines: ``merged`` takes the whole merged model at each sync, as
    without LoRA; ``adapter`` keeps the base the engine started from and takes the adapter alone, in memory. SGLang
    and the Ray fleet take ``merged``. The embedded backend syncs nothing; under ``merged`` it decodes from the adapted
    layers' weights with the adapters folded in for the rollout (one GEMM a projection; their base weights kept aside
    meanwhile, which ``oumi-megatron plan`` counts, and restored bit-exactly after), under ``adapter`` it runs each
    adapter beside its layer (no copy, three GEMMs a projection). ``merged`` is the default because it measured faster
    where the engine shares the trainer's GPU (1.5B shape, one H100, vLLM: 2.13 s a step against 2.51; the adapter's
    sync, its level-1 sleep and vLLM's LoRA decode cost more than the whole model's copy; docs/benchmarks.md);
    ``adapter`` sends far fewer bytes to a separate engine."""

    weight_sync_method: str = "nccl"
    """How weights reach ``separate`` vLLM engines: ``nccl`` (GPUs), ``gloo`` (CPU / debugging), or
    ``checkpoint`` (an HF safetensors folder the engines reload; also for ``colocated``). Colocated
    engines otherwise load the weights in memory."""

    hf_max_shard_size: str = "5GB"
    """The largest safetensors file of an HF export (output_dir/hf_model, ``oumi-megatron export``, ``weight_sync_method:
    checkpoint``), as transformers' ``max_shard_size`` reads it (``5GB``, ``500MB``, or bytes). Each pipeline stage's
    ranks write their stage's shards, each rank holding at most one shard in host memory."""

    weight_sync_bucket_mb: float = 256.0
    """Tensors are streamed to separate engines packed in buckets of about this many MiB (a colocated engine loads
    them one by one as they are exported)."""

    inference_backend: str = "megatron"
    """``megatron`` (embedded: generate with the policy's own weights), ``vllm``, ``sglang``, or a backend a plugin
    registers (rollout/registry.py; docs/rollouts.md says when to pick which)."""

    rollout_cuda_graphs: str = "auto"
    """The embedded backend's decode steps as CUDA graphs (rollout/decoding/): ``auto`` where they can run (CUDA,
    one pipeline stage, dense layers; otherwise eager steps, and the log says why), ``true`` (an error where they
    cannot), ``false`` (eager steps). vLLM engines capture their own graphs."""

    rollout_decode_kernels: str = "auto"
    """The embedded backend's own Triton kernels for its forwards (where Triton runs on a CUDA device; the log says what
    runs): ``auto`` samples the token and its log-probability in one read of the logits
    (engine/kernels/token_sampling.py), rotates the step's query and key and writes the cache in one kernel a layer
    where the layers rotate with the project's RoPE kernel (engine/kernels/decode_attention.py), and fuses each
    residual add into the RMSNorm after it (rollout/decoding/residual_norms.py); ``true`` also attends over only the
    cache slots each row has reached (layers on ``attention_backend: sdpa``; an error where the kernels cannot run;
    cuDNN's SDPA over every slot was faster at every shape measured, docs/benchmarks.md). ``false``: torch's sampling
    ops, RoPE, adds, norms and SDPA (the reference when bisecting a rollout). Top-p below 1 samples through torch
    either way (a nucleus needs a sort)."""

    rollout_cuda_graphs_kept: int = 1
    """With the embedded backend's CUDA graphs: how many shapes (rows, prompt width rounded up to a multiple of 64,
    sampling settings) keep their decode-step graph and KV cache from one ``generate`` call to the next, so a step
    whose shape was seen replays without capturing again. The kept caches stay allocated while training (the memory
    plan adds them to the step's peak). ``0``: capture in every call and free the cache after it."""

    rollout_placement: str = "colocated"
    """vLLM engines: ``colocated`` (in the trainer's processes, sharing their GPUs, one engine per
    Megatron TP group with vLLM TP = Megatron TP; they sleep while training), ``separate`` (a
    single-GPU engine process per data-parallel replica, on the node's GPUs after the trainer's) or ``ray``
    (``rollout_engines`` engines as Ray actors on any node of a Ray cluster, rollout/ray_fleet.py)."""

    ray_address: str = "local"
    """``rollout_placement: ray``: the Ray cluster's address (``ray start --head`` prints it; ``auto`` for the one
    this node belongs to), or ``local``: a Ray head started by the trainer's rank 0 that sees only this node's GPUs
    the trainer does not use."""

    rollout_engines: int = 1
    """``rollout_placement: ray``: how many vLLM engines; the prompts of a step are spread over them."""

    rollout_gpus_per_engine: int = 1
    """``rollout_placement: ray``: GPUs per engine (one placement group each, packed on one node); above 1 the engine's
    vLLM runs tensor-parallel over them."""

    rollout_engine_restarts: int = 3
    """``rollout_placement: ray``: how many engine restarts a run allows. An engine actor that dies (its process
    killed, its node lost) is started again in its placement group, gets the policy, and its prompts are issued again;
    a push that fails restarts every engine (each counts). Past this many the run stops with the cause; 0: the first
    dead engine stops it. ``rollout/engine_restarts`` counts them."""

    vllm_gpu_memory_utilization: float = 0.4
    """Fraction of a GPU's memory a vLLM engine may use (colocated: leave room for training)."""

    vllm_sleep: bool = True
    """Colocated vLLM engines sleep while the trainer trains: ``true`` frees their KV cache and drops their weights
    (the next sync refills them), so training has the whole GPU, at the cost of a wake and a sleep per step
    (``time/wake_s``, ``time/sleep_s``); ``false`` keeps both resident (no wake or sleep; the engine's memory stays
    taken while training, as TRL's default ``vllm_enable_sleep_mode=False`` and verl's ``free_cache_engine=False``
    have it). ``oumi-megatron plan`` counts the engine beside training when it stays awake. Separate engines never
    sleep."""

    vllm_kv_cache_gib: float = 0.0
    """A vLLM engine's KV cache on GPU, in GiB per GPU (vLLM's ``kv_cache_memory_bytes``); 0: what
    ``vllm_gpu_memory_utilization`` leaves after the weights. A colocated engine maps its KV cache back at every wake
    and unmaps it at every sleep, so a cache sized to the rollout batch (``oumi-megatron plan`` prints the embedded
    backend's, the same bytes per token) wakes faster than most of a GPU."""

    sglang_mem_fraction_static: float = 0.4
    """Fraction of a GPU's memory an SGLang engine takes for its weights and KV cache (SGLang's
    ``mem_fraction_static``; colocated: leave room for training, the engine releases it while the trainer trains). On
    the CPU the KV pool is sized from the step's rollouts instead."""

    sglang_attention_backend: str | None = None
    """SGLang's attention backend (``fa3``, ``flashinfer``, ``triton``, ``torch_native``, ...); null: SGLang's choice
    on GPU (FlashAttention 3 on Hopper), or ``triton`` on Hopper where the installed sglang-kernel has no FA3 kernels
    (``sgl_kernel.flash_ops``; said in the log); ``torch_native`` on the CPU."""

    sglang_engine_args: dict[str, Any] = field(default_factory=dict)
    """More ``sglang.Engine`` arguments (its ``ServerArgs`` fields), passed as they are, e.g.
    ``{chunked_prefill_size: 4096, schedule_policy: lpm}``; checked against ``ServerArgs`` at validation. Those the
    backend sets itself (model_path, dtype, tp_size, random_seed, device, context_length, mem_fraction_static,
    attention_backend, base_gpu_id, ...) are refused there: set them through their own fields."""

    @property
    def rollout_cuda_graphs_choice(self) -> str:
        """``rollout_cuda_graphs`` spelled as in ROLLOUT_CUDA_GRAPHS: YAML reads true/false as booleans, which the
        string field then holds as 'True'/'False'."""
        return str(self.rollout_cuda_graphs).lower()

    @property
    def rollout_decode_kernels_choice(self) -> str:
        """``rollout_decode_kernels`` spelled as in ROLLOUT_DECODE_KERNELS (YAML's booleans, as above)."""
        return str(self.rollout_decode_kernels).lower()

    @property
    def parallel_sizes(self) -> tuple[int, int, int, int]:
        """(TP, PP, CP, EP)."""
        return (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
            self.expert_model_parallel_size,
        )

    @property
    def model_parallel_size(self) -> int:
        """TP x PP x CP: GPUs that hold one replica of the dense layers (world size / DP). Expert parallelism
        lives inside it and DP: Megatron-Core splits each MoE layer's experts over EP of the TP x CP x DP
        ranks of a pipeline stage."""
        tp, pp, cp, _ = self.parallel_sizes
        return tp * pp * cp

    @property
    def expert_tensor_parallel_size(self) -> int:
        """TP inside each expert: 1 under expert parallelism (Megatron-Bridge's choice: whole experts per
        rank), else the dense layers' TP (Megatron-Core's default)."""
        return 1 if self.expert_model_parallel_size > 1 else self.tensor_model_parallel_size
