"""Building the Megatron-Core GPT model through Megatron-Bridge's provider.

The bridge maps an HF config (Llama, Qwen2, Qwen3, ... ) to a ``GPTModelProvider`` (a Megatron-Core
TransformerConfig that can build models) and knows how to move weights between the two formats.
We set the parallel layout, precision and recompute settings from ``MegatronParams`` on it, pick the
layer spec (TransformerEngine when installed, else Megatron-Core's local spec with fusions off, which
need TE/apex/torch.compile, and its core attention on torch SDPA where ``attention_backend`` says so:
engine/kernels/attention.py) and build one model chunk per virtual pipeline stage.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from oumi_megatron.bridge_utils import have_transformer_engine, import_megatron_bridge
from oumi_megatron.config.megatron_params import RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, RECOMPUTE_MODULES
from oumi_megatron.config.problems import choices
from oumi_megatron.engine.kernels.cuda_graphs import check_cuda_graphs
from oumi_megatron.errors import UserInputError

if TYPE_CHECKING:
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig


logger = logging.getLogger("oumi")  # Oumi's logger where Oumi is installed

# Fusions that need TransformerEngine or apex; off with the local spec, then engine/kernels/fusions.py turns
# on the ones PyTorch supplies.
_LOCAL_SPEC_FUSIONS_OFF = (
    "apply_rope_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "gradient_accumulation_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",
    # MoE: TE's fused token permutation and router; grouped expert GEMMs (TE or the grouped_gemm package).
    # Without them the local spec builds SequentialMLP experts (one MLP per local expert, Bridge maps them).
    "moe_permute_fusion",
    "moe_router_fusion",
    "moe_grouped_gemm",
)


class UnsupportedModelError(UserInputError, ValueError):
    """The model cannot be loaded: no Megatron-Bridge mapping for its architecture, or it needs its own code
    and model.trust_remote_code is off."""


def default_dtype() -> torch.dtype:
    """bf16 on GPU, fp32 on CPU (CPU bf16 matmuls are slow and the CPU runs are parity tests)."""
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def load_bridge(hf_path: str | Path, trust_remote_code: bool = False, config_only: bool = False) -> Any:
    """``AutoBridge`` for an HF model folder or hub name.

    With ``config_only`` the bridge knows the architecture but no weights (used for checkpoints we
    converted, whose weights live in Megatron format); otherwise HF weights are read lazily.
    """
    import_megatron_bridge()
    from megatron.bridge import AutoBridge
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(hf_path), trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise UnsupportedModelError(
            f"model.model_name: {hf_path} needs its own code (config.json has an auto_map) to load. If you trust "
            "that code, set model.trust_remote_code: true."
        ) from e
    if not AutoBridge.supports(hf_config):
        archs = getattr(hf_config, "architectures", None) or [type(hf_config).__name__]
        raise UnsupportedModelError(
            f"model.model_name: {hf_path} is a {', '.join(archs)} model, which Megatron-Bridge cannot "
            f"convert. Supported: {', '.join(sorted(AutoBridge.list_supported_models()))}."
        )
    if config_only:
        return AutoBridge.from_hf_config(hf_config)
    return AutoBridge.from_hf_pretrained(str(hf_path), trust_remote_code=trust_remote_code)


def check_recompute(config: MegatronTrainingConfig, found: Findings) -> None:
    """Activation recompute (``megatron.transformer_config.recompute_*``), as ``configure_provider`` hands it on."""
    t = config.megatron.transformer_config
    if t.recompute_granularity is not None and t.recompute_granularity not in RECOMPUTE_GRANULARITIES:
        found.add("megatron.transformer_config.recompute_granularity",
                  f"unknown value {t.recompute_granularity!r}. Use 'full', 'selective' or null (no recompute).")
    if t.recompute_method is not None and t.recompute_method not in RECOMPUTE_METHODS:
        found.add("megatron.transformer_config.recompute_method",
                  f"unknown value {t.recompute_method!r}. Use 'uniform', 'block' or null.")
    if t.recompute_granularity == "full" and t.recompute_method is None:
        found.add("megatron.transformer_config.recompute_method",
                  "full recompute needs a method. Set recompute_method: uniform (or block).")
    bad_modules = [mod for mod in t.recompute_modules or [] if mod not in RECOMPUTE_MODULES]
    if bad_modules:
        found.add("megatron.transformer_config.recompute_modules",
                  f"unknown module(s) {bad_modules}. Choose from {choices(RECOMPUTE_MODULES)}.")
    found.positive("megatron.transformer_config.recompute_num_layers", t.recompute_num_layers, allow_none=True)


def configure_provider(
    provider: Any,
    params: MegatronParams,
    dtype: torch.dtype,
    seq_length: int | None = None,
    cuda_graphs: bool = False,
    schedule: str = "none",
) -> Any:
    """Applies the layout, precision and recompute settings of ``params`` to a GPTModelProvider
    (``cuda_graphs``: the training engine's builders check that CUDA graphs can run; they are attached
    after the build, engine/kernels/cuda_graphs.py; ``schedule``: the pipeline schedule the engine will run, one that
    defers weight gradients needs the gradient accumulation path)."""
    provider.tensor_model_parallel_size = params.tensor_model_parallel_size
    provider.pipeline_model_parallel_size = params.pipeline_model_parallel_size
    provider.virtual_pipeline_model_parallel_size = params.virtual_pipeline_model_parallel_size
    provider.context_parallel_size = params.context_parallel_size
    provider.expert_model_parallel_size = params.expert_model_parallel_size
    provider.expert_tensor_parallel_size = params.expert_tensor_parallel_size  # as parallel_state gets it
    provider.sequence_parallel = params.sequence_parallel
    t = params.transformer_config
    provider.account_for_embedding_in_pipeline_split = t.account_for_embedding_in_pipeline_split
    provider.account_for_loss_in_pipeline_split = t.account_for_loss_in_pipeline_split
    provider.recompute_granularity = t.recompute_granularity
    if t.recompute_granularity == "full":
        provider.recompute_method = t.recompute_method
        provider.recompute_num_layers = t.recompute_num_layers or 1
    else:  # Megatron-Core uses recompute_method / num_layers for full recompute only
        provider.recompute_method = None
        provider.recompute_num_layers = None
    provider.recompute_modules = list(t.recompute_modules or ["core_attn"])
    if seq_length is not None:
        provider.seq_length = seq_length

    provider.params_dtype = dtype
    provider.pipeline_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = dtype == torch.float16
    # RL fine-tuning: no dropout (it would make old/new logprobs of the same tokens disagree).
    provider.hidden_dropout = 0.0
    provider.attention_dropout = 0.0
    # Losses are summed per microbatch and divided by the global token/sequence count
    # (GRPO's token_mean / seq_mean): Megatron then scales gradients by 1/count after the DP reduce.
    provider.calculate_per_token_loss = True
    if getattr(provider, "num_moe_experts", None):
        # MoE routers train on the GRPO loss alone: Megatron-Core's load-balancing loss is scaled for
        # pretraining's per-microbatch mean, not our division by the global token count, and would be computed
        # on each rank's share of the batch (its value then changes with DP). Routing itself is the model's.
        provider.moe_router_load_balancing_type = "none"
        provider.moe_aux_loss_coeff = 0.0
    if params.pipeline_model_parallel_size == 2:
        # With two stages the previous and the next stage are the same rank. Batched p2p posts
        # [send_prev, recv_prev, send_next, recv_next] on both ranks, so in the interleaved schedule's
        # steady state an activation and a gradient of the same shape travel between the same pair in
        # opposite orders and are swapped (seen on gloo: wrong losses from the 3rd microbatch on).
        # The unbatched path orders them per rank parity and uses two communicators for a pair.
        provider.batch_p2p_comm = False
    if not have_transformer_engine():
        from oumi_megatron.engine.kernels.attention import resolve_attention_backend
        from oumi_megatron.engine.kernels.fusions import apply_fusions
        from oumi_megatron.engine.parallel.schedules import SCHEDULES

        backend, why = resolve_attention_backend(t.attention_backend, provider, torch.cuda.is_available())
        provider.transformer_layer_spec = partial(_local_spec, backend=backend)
        for name in _LOCAL_SPEC_FUSIONS_OFF:
            if hasattr(provider, name):
                setattr(provider, name, False)
        deferring = SCHEDULES.get(schedule).defers_weight_gradients  # it needs the gradient accumulation path
        fusions = apply_fusions(provider, t, torch.cuda.is_available(), zero_bubble=deferring)  # the ones PyTorch can supply
        logger.info("core attention: %s (%s); fusions: %s", backend, why, fusions)
    if cuda_graphs:
        check_cuda_graphs(params, torch.cuda.is_available())
    # ModuleQueue (seed 000): read from the model's config, as in the seed; the stage with post_process
    # gets the ModuleQueue class (engine/parallel/module_queue.py asks which class each stage gets)
    provider.enable_module_queue = bool(params.enable_module_queue)
    provider.module_queue_num_chunks = int(params.module_queue_num_chunks)
    if provider.enable_module_queue:
        from oumi_megatron.engine.parallel.module_queue import module_queue_pre_wrap_hook

        provider.register_pre_wrap_hook(module_queue_pre_wrap_hook)
    provider.finalize()
    return provider


def _local_spec(provider: Any, vp_stage: int | None = None, *, backend: str) -> Any:
    """Megatron-Bridge's local layer spec with our core attention; under sequence parallelism a block spec
    whose norms run with it (engine/kernels/norms.py)."""
    from oumi_megatron.engine.kernels.attention import local_layer_spec_with_attention
    from oumi_megatron.engine.kernels.norms import sequence_parallel_block_spec

    spec = local_layer_spec_with_attention(provider, backend=backend)
    return sequence_parallel_block_spec(spec, provider, vp_stage) if provider.sequence_parallel else spec


def build_model_chunks(provider: Any, ddp_config: Any | None, load_hf_weights: bool,
                       pre_wrap_hooks: list[Any] | None = None) -> list[torch.nn.Module]:
    """Model chunks for this rank (one per virtual pipeline stage), DDP-wrapped if ``ddp_config``; ``pre_wrap_hooks``
    run on the bare chunks before DDP wraps them (LoRA: the base weights loaded, then the adapters, engine/peft.py)."""
    from megatron.core.transformer.module import Float16Module

    if not load_hf_weights:
        provider.perform_initialization = False  # weights come from a checkpoint right after
    return provider.provide_distributed_model(
        ddp_config=ddp_config,
        wrap_with_ddp=ddp_config is not None,
        use_cpu_initialization=not torch.cuda.is_available(),
        mixed_precision_wrapper=Float16Module,
        **({"pre_wrap_hook": pre_wrap_hooks} if pre_wrap_hooks else {}),
    )
