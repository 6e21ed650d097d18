"""Megatron-Core's local CUDA graphs for the transformer layers (``transformer_config.cuda_graph_impl: local``).

Without TransformerEngine the one-GPU training step is bound by the host: Python launches every kernel
of every layer (measured on an H200 with the 0.8B benchmark model: the GPU idles for a large part of
the step). Megatron-Core's own ``cuda_graph_impl="local"`` (transformer/cuda_graphs.py) records each
TransformerLayer's forward and backward in the first training step, captures them as CUDA graphs at
the end of that step's schedule, and replays them from then on: one launch per layer and direction.

What it needs, and what the engine does for it:
- fixed shapes: every microbatch is right-padded to ``cuda_graph_seq_length`` (a longer one is an
  error), and every step uses the same micro batch size;
- a graph-safe RNG tracker, set up before the model is built (``init_model_parallel``);
- forward-only passes (old/reference logprobs, evaluation) run eagerly under ``torch.inference_mode``:
  after capture Megatron-Core would otherwise replay the training graphs for them; KV-cached
  generation runs eagerly anyway;
- no activation recompute (Megatron-Core skips it while capturing) and PP = 1 (the only layout tested):
  ``check_cuda_graph_fields`` says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from oumi_megatron.config.megatron_params import CUDA_GRAPH_IMPLS
from oumi_megatron.config.problems import choices
from oumi_megatron.engine.wrappers import unwrap

if TYPE_CHECKING:
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig


def cuda_graphs_enabled(params: MegatronParams) -> bool:
    return params.transformer_config.cuda_graph_impl == "local"


def check_cuda_graph_fields(config: MegatronTrainingConfig, found: Findings) -> None:
    """``megatron.transformer_config.cuda_graph_impl`` and what local graphs need (the module docstring)."""
    m = config.megatron
    t = m.transformer_config
    if t.cuda_graph_impl not in CUDA_GRAPH_IMPLS:
        found.add("megatron.transformer_config.cuda_graph_impl",
                  f"unknown value {t.cuda_graph_impl!r}. Choose from {choices(CUDA_GRAPH_IMPLS)}.")
        return
    if t.cuda_graph_impl != "local":
        return
    longest = config.grpo.max_prompt_length + config.grpo.max_completion_length
    if not t.cuda_graph_seq_length or t.cuda_graph_seq_length <= 0:
        found.add("megatron.transformer_config.cuda_graph_seq_length",
                  f"CUDA graphs have fixed shapes: set it to the longest prompt + completion ({longest}); "
                  "every microbatch is padded to it.")
    elif t.cuda_graph_seq_length < longest:
        found.add("megatron.transformer_config.cuda_graph_seq_length",
                  f"{t.cuda_graph_seq_length} is shorter than grpo.max_prompt_length + grpo.max_completion_length = "
                  f"{longest}. Set cuda_graph_seq_length: {longest}.")
    if m.enable_sequence_packing:
        found.add("megatron.enable_sequence_packing", "packed rows (block-diagonal masks) are not supported with CUDA "
                                                      "graphs. Set enable_sequence_packing: False, or cuda_graph_impl: none.")
    if m.pipeline_model_parallel_size > 1:
        found.add("megatron.transformer_config.cuda_graph_impl", "local CUDA graphs are tested with "
                  "pipeline_model_parallel_size 1 only. Set cuda_graph_impl: none for PP > 1.")
    if t.recompute_granularity is not None:
        # Megatron-Core refuses full recompute under graphs and skips selective recompute while capturing
        found.add("megatron.transformer_config.recompute_granularity", "activation recompute does not run inside CUDA "
                  "graphs. Set recompute_granularity: null, or cuda_graph_impl: none.")


def check_cuda_graphs(params: MegatronParams, cuda: bool) -> None:
    if cuda_graphs_enabled(params) and not cuda:
        raise ValueError("megatron.transformer_config.cuda_graph_impl: local needs a CUDA GPU; set it to none on the CPU")


def attach_cuda_graphs(chunks: list[Any]) -> None:
    """Gives every TransformerLayer of ``chunks`` the CudaGraphManager Megatron-Core's own constructor makes
    under ``cuda_graph_impl="local"``.

    Why after the build: Megatron-Bridge 0.6.2's ``GPTModelProvider.provide()`` refuses
    ``cuda_graph_impl="local"`` for training (its ``validate_cuda_graph_configuration`` allows it only for
    full-iteration graphs, and it asserts ``use_te_rng_tracker``, a flag Megatron-Core itself never reads),
    while Megatron-Core supports it (probed on an H200). So the model is built eager and the managers are
    attached here, exactly as ``TransformerLayer.create_mcore_cudagraph_manager`` does at construction.
    """
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs
    from megatron.core.transformer.transformer_layer import TransformerLayer

    # Megatron-Core records and captures graphs process-wide (one global record of runners, one flag
    # "graphs created"); a model built after another one's capture would find the flag set and no runners
    # of its own. Start each graphed model from an empty record.
    delete_cuda_graphs()

    config = unwrap(chunks[0]).config  # one TransformerConfig object, shared by every module
    config.cuda_graph_impl = "local"
    config.cuda_graph_warmup_steps = 1  # eager runs of each layer before its capture (memory and time)
    for chunk in chunks:
        for module in unwrap(chunk).modules():
            if isinstance(module, TransformerLayer):
                module.create_mcore_cudagraph_manager(module.config)
