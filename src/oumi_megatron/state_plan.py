"""Host memory per node and disk that a run's state needs: the other half of ``oumi-megatron plan``.

Arithmetic on the model's size, the layout and the config, per path (docs/plan.md; the per-path costs were measured
on CPU by scripts/bench_scale_laws.py and on one H200 with a Llama-3.1-70B-wide slice, docs/benchmarks.md):

- **resident** on each rank: the process itself (imports, CUDA's host side), Adam's offloaded state
  (``optimizer_cpu_offload``: the moments, and the fp32 parameters and gradients the host step reads, 16 B per
  offloaded parameter of the rank's optimizer shard), and with ``use_async_checkpoint`` the staged copy of what the
  rank saves (its bf16 weights' share and its optimizer shard, 14 B per parameter / (DP x CP));
- **transient**, one path at a time on every rank of a node at once: a synchronous checkpoint save or load moves one
  tensor at a time through the host (the rank's largest fp32 optimizer tensor, twice: its host copy and torch's bytes
  of it); the HF export holds at most one shard (``hf_max_shard_size``) on each rank that writes; the conversion reads
  one HF tensor at a time on every TP rank (1.4 x the largest bf16 tensor, as measured).

Measured on one H200 with the 70B-wide slice (configs/llama70b_slice_1gpu.yaml, docs/benchmarks.md), host memory above
each phase's start against these estimates: convert 2.8 / 2.7 GiB, save 7.8 / 7.8, load 7.8 / 7.8, export 4.4 / 4.7;
the process at the step's start 1.8 / 2.0.

Disk, on the shared ``output_dir``: a checkpoint holds the bf16 weights (2 B per parameter) and the optimizer state
(fp32 master weights and two moments, 12 B per parameter); ``keep_last_n_checkpoints`` + 1 coexist while a save
runs (the new one before the oldest is pruned); the converted model and the HF export hold the bf16 weights once each.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from oumi_megatron.utils.disk import GIB

if TYPE_CHECKING:
    from oumi_megatron.config.training_config import MegatronTrainingConfig
    from oumi_megatron.engine.parallel.layout import ParallelLayout
    from oumi_megatron.model_shape import ModelShape

PROCESS_HOST_GIB = 2.0
"""One rank's process in host memory before any state: Python, torch, Megatron-Core, Megatron-Bridge and Oumi
imported (1.1 GiB measured on CPU) and CUDA's host-side allocations."""
CHECKPOINT_BYTES_PER_PARAM = 14.0
"""bf16 weights (2) + fp32 master weights and Adam's two moments (12)."""


def model_params(shape: ModelShape) -> float:
    """Every parameter of the model (all layers, the embedding and, untied, the output layer)."""
    dense, experts = shape.layer_params()
    embeddings = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    return shape.num_layers * (dense + experts) + embeddings


def largest_tensor_params(shape: ModelShape) -> float:
    """The largest HF tensor: the embedding (vocabulary x hidden) or an MLP projection (FFN x hidden)."""
    h, _, _, ffn, expert_ffn = shape.widths()
    return max(shape.vocab_size * h, ffn * h, expert_ffn * h)


@dataclass(frozen=True)
class StatePlan:
    """GiB: host memory of the busiest node (per rank and per node, by path) and disk on output_dir."""

    ranks_per_node: int
    resident_per_rank: float
    transient_per_rank: dict[str, float]
    host_per_node: float
    """The resident state of every rank of a node plus its largest transient path on all of them."""
    checkpoint: float
    checkpoints_coexisting: int | None
    """``keep_last_n_checkpoints`` + 1; None: every checkpoint is kept (keep_last_n_checkpoints: 0)."""
    converted: float
    hf_export: float
    disk_total: float | None
    """The converted model, the checkpoints that coexist and the export; None when every checkpoint is kept."""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["transient_per_rank"] = {k: round(v, 2) for k, v in self.transient_per_rank.items()}
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in d.items()}


def estimate_state(cfg: MegatronTrainingConfig, shape: ModelShape, layout: ParallelLayout, rank_params: float,
                   gpus_per_node: int | None = None, adapters: tuple[float, float, str] | None = None) -> StatePlan:
    """``rank_params``: the parameters one GPU of the busiest pipeline stage holds (plan.py's count). ``adapters``
    (LoRA): the adapters' parameters on that GPU and in the whole model, and ``peft_save_mode``: the optimizer state,
    the checkpoints and (``adapter_only``) the export hold the adapters alone; the frozen base is the converted model."""
    from oumi_megatron.utils.disk import parse_size

    m = cfg.megatron
    shards = layout.data_parallel * layout.context_parallel  # the distributed optimizer's, and the model save's split
    trained = rank_params if adapters is None else adapters[0]  # what has master weights and moments
    optimizer_shard = trained / (shards if m.ddp_config.use_distributed_optimizer else 1)
    offload = m.optimizer_config.optimizer_offload_fraction if m.optimizer_config.optimizer_cpu_offload else 0.0
    resident = PROCESS_HOST_GIB * GIB + 16 * offload * optimizer_shard
    if m.checkpoint_config.use_async_checkpoint:
        resident += 2 * trained / shards + 12 * optimizer_shard
    largest = largest_tensor_params(shape)
    fp32_tensor = 4 * largest / layout.tensor_parallel / (shards if m.ddp_config.use_distributed_optimizer else 1)
    if adapters is not None:  # an adapter's tensors are far smaller than the base's largest: bounded by the whole lot
        fp32_tensor = min(fp32_tensor, 4 * optimizer_shard)
    transient = {
        "convert": 1.4 * 2 * largest,  # the HF tensor read on every TP rank, and the converted model's save
        "checkpoint_save": 2 * fp32_tensor,  # the rank's largest optimizer tensor: its host copy, torch's bytes of it
        "checkpoint_load": 2 * fp32_tensor,  # the bytes read, the tensor made of them (torch's reader)
        "hf_export": float(parse_size(m.hf_max_shard_size)),
    }
    node = min(gpus_per_node or layout.world_size, layout.world_size)
    params = model_params(shape)
    keep = m.checkpoint_config.keep_last_n_checkpoints
    checkpoint = CHECKPOINT_BYTES_PER_PARAM * (params if adapters is None else adapters[1])
    coexisting = keep + 1 if keep > 0 else None
    converted = hf_export = 2 * params
    if adapters is not None:  # hf_adapter/ (fp32 in PEFT's file), and hf_model/ unless adapter_only
        hf_export = 4 * adapters[1] + (0.0 if adapters[2] == "adapter_only" else 2 * params)
    total = None if coexisting is None else converted + coexisting * checkpoint + hf_export
    return StatePlan(ranks_per_node=node, resident_per_rank=resident / GIB,
                     transient_per_rank={k: v / GIB for k, v in transient.items()},
                     host_per_node=node * (resident + max(transient.values())) / GIB, checkpoint=checkpoint / GIB,
                     checkpoints_coexisting=coexisting, converted=converted / GIB, hf_export=hf_export / GIB,
                     disk_total=None if total is None else total / GIB)
