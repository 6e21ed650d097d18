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
  validation says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from oumi_megatron.engine.wrappers import unwrap

if TYPE_CHECKING:
    from oumi_megatron.config.megatron_params import MegatronParams


def cuda_graphs_enabled(params: MegatronParams) -> bool:
    return params.transformer_config.cuda_graph_impl == "local"


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
