"""The resolved parallel layout: how a world of N processes is split, and how batches map onto it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    """TP x PP x CP x DP = world size (EP splits experts over ranks of TP x CP x DP), with the batch sizes
    and schedule actually used."""

    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    context_parallel: int
    expert_parallel: int
    data_parallel: int
    virtual_pipeline: int | None
    sequence_parallel: bool
    micro_batch_size: int
    global_batch_size: int
    pipeline_schedule: str
    """Schedule that runs: ``none`` (PP=1), ``1f1b``, ``interleaved`` or ``zb_h1``."""
    num_generations: int
    num_mini_batches: int
    gpus_per_node: int | None = None

    @property
    def microbatches_per_step(self) -> int:
        """Microbatches each data-parallel rank runs per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel)

    @property
    def completions_per_rollout(self) -> int:
        """Sequences generated per GRPO step (all mini-batches together)."""
        return self.global_batch_size * self.num_mini_batches

    @property
    def prompts_per_rollout(self) -> int:
        return self.completions_per_rollout // self.num_generations

    @property
    def num_nodes(self) -> int | None:
        if not self.gpus_per_node:
            return None
        return max(1, self.world_size // self.gpus_per_node)

    def describe(self) -> str:
        vpp = f" (VPP {self.virtual_pipeline} chunks/rank)" if self.virtual_pipeline else ""
        lines = [
            f"TP {self.tensor_parallel} x PP {self.pipeline_parallel}{vpp} x CP {self.context_parallel}"
            f" x DP {self.data_parallel} = world size {self.world_size}",
        ]
        if self.expert_parallel > 1:
            lines.append(f"expert parallel: EP {self.expert_parallel} (each MoE layer's experts split over "
                         f"{self.expert_parallel} ranks of a pipeline stage, tokens routed by all-to-all)")
        if self.num_nodes is not None:
            lines.append(f"nodes: {self.num_nodes} x {self.gpus_per_node} GPUs")
        lines += [
            f"sequence parallel: {'on' if self.sequence_parallel else 'off'}",
            f"micro batch: {self.micro_batch_size}, global batch: {self.global_batch_size}",
            f"microbatches per step per DP rank: {self.microbatches_per_step}",
            f"pipeline schedule: {self.pipeline_schedule}",
            f"rollout per GRPO step: {self.prompts_per_rollout} prompts x {self.num_generations} generations"
            f" = {self.completions_per_rollout} completions ({self.num_mini_batches} optimizer step(s) per epoch)",
        ]
        return "\n".join(lines)
