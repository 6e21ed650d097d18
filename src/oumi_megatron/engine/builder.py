"""Assembling a MegatronEngine for a resolved ParallelLayout from a converted (or trained) checkpoint.

The layout comes from the caller (``resolve_layout`` of a config, or ``engine_layout`` of bare MegatronParams):
nothing here resolves the schedule or the sizes again."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from oumi_megatron.engine.engine import MegatronEngine
from oumi_megatron.engine.kernels.cuda_graphs import attach_cuda_graphs, cuda_graphs_enabled
from oumi_megatron.engine.model import build_model_chunks, configure_provider, default_dtype, load_bridge
from oumi_megatron.engine.optimizer import OptimSettings, build_optimizer, build_scheduler
from oumi_megatron.engine.parallel.distributed import init_model_parallel
from oumi_megatron.engine.state.conversion import build_from_checkpoint

if TYPE_CHECKING:
    from oumi_megatron.config.lora import LoraSettings
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.engine.parallel.layout import ParallelLayout


def check_ddp(config: Any, found: Findings) -> None:
    """``megatron.ddp_config``: ``average_in_collective`` cannot apply (``ddp_config_from_params``), so it only warns."""
    if config.megatron.ddp_config.average_in_collective:
        found.warn("megatron.ddp_config.average_in_collective: True is not used: GRPO losses are normalized by the global "
                   "token/sequence count, which Megatron-Core does by summing gradients in the collective and dividing "
                   "once (averaging as well would divide twice). The gradient is the same average. Remove the setting.")


def ddp_config_from_params(params: MegatronParams) -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig

    d = params.ddp_config
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=d.grad_reduce_in_fp32,
        overlap_grad_reduce=d.overlap_grad_reduce,
        overlap_param_gather=d.overlap_param_gather,
        # GRPO losses are normalized by global token/sequence counts (calculate_per_token_loss):
        # Megatron-Core then sums in the collective and divides by the count once; averaging in the
        # collective as well would divide twice, so average_in_collective cannot apply here.
        average_in_collective=False,
        use_distributed_optimizer=d.use_distributed_optimizer,
    )


def build_engine(
    checkpoint_dir: str | Path,
    layout: ParallelLayout,
    params: MegatronParams,
    settings: OptimSettings,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    lora: LoraSettings | None = None,
) -> tuple[Any, MegatronEngine]:
    """(bridge, engine): model chunks wrapped in Megatron DDP, optimizer and LR schedule, for ``layout`` (its process
    groups and its pipeline schedule). ``lora``: LoRA adapters on the frozen base (engine/peft.py), the optimizer over
    the adapters alone."""
    from oumi_megatron.engine.peft import bridge_peft

    dtype = dtype or default_dtype()
    peft = bridge_peft(lora) if lora is not None else None
    bridge, chunks = build_from_checkpoint(checkpoint_dir, layout, params, dtype=dtype,
                                           ddp_config=ddp_config_from_params(params), trust_remote_code=trust_remote_code,
                                           peft=peft)
    optimizer = build_optimizer(chunks, params, settings, dtype)
    scheduler = build_scheduler(optimizer, settings)
    return bridge, MegatronEngine(chunks, optimizer, scheduler, params, schedule=layout.pipeline_schedule, peft=peft,
                                  lora=lora, base_dir=Path(checkpoint_dir) if lora is not None else None)


def build_inference_engine(
    hf_path: str | Path,
    layout: ParallelLayout,
    params: MegatronParams,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, MegatronEngine]:
    """(bridge, engine) with an HF folder's weights loaded in memory by Megatron-Bridge, for generation
    only (``oumi-megatron eval``): no conversion on disk, no DDP, no optimizer. The schedule (forward-only passes
    under PP) is ``layout``'s, as in ``build_engine``."""
    dtype = dtype or default_dtype()
    init_model_parallel(layout)
    bridge = load_bridge(hf_path, trust_remote_code=trust_remote_code)
    provider = configure_provider(bridge.to_megatron_provider(load_weights=True), params, dtype)
    chunks = build_model_chunks(provider, ddp_config=None, load_hf_weights=True)
    for chunk in chunks:
        chunk.eval()
    return bridge, MegatronEngine(chunks, None, None, params, schedule=layout.pipeline_schedule)


def build_engine_from_hf_config(
    hf_config: Any,
    layout: ParallelLayout,
    params: MegatronParams,
    settings: OptimSettings,
    dtype: torch.dtype | None = None,
    lora: LoraSettings | None = None,
) -> tuple[Any, MegatronEngine]:
    """A randomly initialized engine for an HF config and ``layout`` (benchmarks; no weights are read); ``lora``: LoRA
    adapters on the random base, as ``build_engine`` applies them."""
    from oumi_megatron.bridge_utils import import_megatron_bridge
    from oumi_megatron.engine.peft import bridge_peft, pre_wrap_hooks

    dtype = dtype or default_dtype()
    init_model_parallel(layout, cuda_graphs=cuda_graphs_enabled(params))
    import_megatron_bridge()
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_config(hf_config)
    provider = configure_provider(bridge.to_megatron_provider(load_weights=False), params, dtype,
                                  cuda_graphs=cuda_graphs_enabled(params), schedule=layout.pipeline_schedule)
    peft = bridge_peft(lora) if lora is not None else None
    chunks = build_model_chunks(provider, ddp_config=ddp_config_from_params(params), load_hf_weights=True,
                                pre_wrap_hooks=pre_wrap_hooks(peft, lambda bare: None) if peft is not None else None)
    if cuda_graphs_enabled(params):
        attach_cuda_graphs(chunks)
    optimizer = build_optimizer(chunks, params, settings, dtype)
    return bridge, MegatronEngine(chunks, optimizer, build_scheduler(optimizer, settings), params,
                                  schedule=layout.pipeline_schedule, peft=peft, lora=lora)
