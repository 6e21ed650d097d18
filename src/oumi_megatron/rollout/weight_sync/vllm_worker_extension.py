"""vLLM's ``worker_extension_cls`` for engines that stream weights (``oumi_stream``): vLLM imports this module in every
worker process before it loads the model, and the import registers the ``oumi_stream`` weight-transfer engine there.
An in-process engine (``uni``) has it registered already; a tensor-parallel engine's workers (``mp``, a Ray fleet
engine with ``rollout_gpus_per_engine`` > 1) are fresh processes that would not know the name."""

from oumi_megatron.rollout.weight_sync.vllm_stream import register_stream_engine

register_stream_engine()


class StreamWorkerExtension:
    """Adds nothing to the worker: importing this module is the point."""
