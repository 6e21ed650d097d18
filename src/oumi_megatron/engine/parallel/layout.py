"""The parallel layout: how a world of N processes is split, how batches map onto it, which pipeline schedule
runs. Resolved once, here (``resolve_layout``), from the config and the world size; validation reports what
this finds, ``oumi-megatron plan`` calls it directly for every trial layout, and the engine's builders receive the
resolved ``ParallelLayout`` and never resolve again (torchtitan's ParallelDims). Callers that run the engine
without a GRPO config (test workers, benchmarks, convert/export) get theirs from ``engine_layout``.

It sits beside the schedule registry it reads (engine/parallel/schedules.py): of the engine it imports that registry
alone, and nothing above it imports back.

A setting that cannot act in a layout (ZB-H1 without a pipeline) falls back with a warning; one that cannot
run is a ``Problem`` naming the field and the fix.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from oumi_megatron.config.grpo_params import MegatronGrpoParams
from oumi_megatron.config.problems import Findings, Problem
from oumi_megatron.config.standalone import StandaloneConfig, TrainingSection

if TYPE_CHECKING:
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.model_shape import ModelShape

logger = logging.getLogger("oumi")  # Oumi's logger where Oumi is installed, plain logging elsewhere


class _BatchFields(Protocol):
    @property
    def per_device_train_batch_size(self) -> int: ...
    @property
    def gradient_accumulation_steps(self) -> int: ...


class LayoutConfig(Protocol):
    """What the resolver reads of a config: a MegatronTrainingConfig, or ``engine_layout``'s engine-only one."""

    @property
    def megatron(self) -> MegatronParams: ...
    @property
    def grpo(self) -> MegatronGrpoParams: ...
    @property
    def training(self) -> _BatchFields: ...


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
    expert_tensor_parallel: int | None = None
    """TP inside each expert (``megatron.expert_tensor_parallel_size``); None: Megatron-Core's default (TP)."""

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


@dataclass
class LayoutResolution:
    """``resolve_layout``'s answer: the layout (None when the sizes cannot form one), what is wrong, what fell back."""

    layout: ParallelLayout | None
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, field_name: str, message: str) -> None:
        self.problems.append(Problem(field_name, message))

    def require(self) -> ParallelLayout:
        """The layout; ``ValueError`` naming every problem when there is one (or no layout)."""
        if self.problems or self.layout is None:
            raise ValueError("the parallel layout cannot be resolved: "
                             + ("; ".join(str(p) for p in self.problems) or "no layout"))
        return self.layout


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (the sizes a parallel dimension over ``n`` ranks may take)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def default_world_size(cfg: LayoutConfig) -> int:
    """WORLD_SIZE under torchrun; otherwise the smallest world the layout fits: PP x lcm(TP x CP, EP)
    (DP = 1 unless EP needs more ranks per stage)."""
    env = os.environ.get("WORLD_SIZE")
    if env:
        return int(env)
    tp, pp, cp, ep = (s if isinstance(s, int) and s > 0 else 1 for s in cfg.megatron.parallel_sizes)
    return pp * math.lcm(tp * cp, ep)


def resolve_schedule(params: MegatronParams) -> tuple[str, str | None, list[Problem]]:
    """(schedule that runs, why it is not the requested one or None, problems) for ``megatron.pipeline_schedule``,
    from the live registry in engine/parallel/schedules.py."""
    from oumi_megatron.engine.parallel.schedules import SCHEDULES, natural_schedule

    requested, natural = params.pipeline_schedule, natural_schedule(params)
    if requested not in SCHEDULES:
        return natural, None, [Problem(SCHEDULES.field, SCHEDULES.unknown_message(requested))]
    entry = SCHEDULES.get(requested)
    if entry.natural:
        return natural, None, []
    refused = entry.refuses(params)
    if refused is not None:
        return natural, None, [Problem(*refused)]
    why_not = entry.cannot_act(params)
    if why_not is not None:
        return natural, f"{requested} is not supported because {why_not}", []
    return requested, None, []


def resolve_batches(cfg: LayoutConfig, dp: int) -> tuple[int, int]:
    """(micro batch, global batch): megatron's fields, else Oumi's per-device batch x accumulation x DP."""
    m = cfg.megatron
    micro = m.micro_batch_size or cfg.training.per_device_train_batch_size
    global_batch = m.global_batch_size or micro * cfg.training.gradient_accumulation_steps * dp
    return micro, global_batch


def resolve_layout(cfg: LayoutConfig, world_size: int | None = None, gpus_per_node: int | None = None,
                   shape: ModelShape | None = None) -> LayoutResolution:
    """The layout of ``cfg`` on ``world_size`` processes (default: ``default_world_size``), with every problem
    of the parallel sizes, the batch sizes, the schedule and ModuleQueue; with ``shape``, also whether the
    model splits over it (heads over TP, layers over PP x VPP, experts over EP)."""
    world = world_size if world_size is not None else default_world_size(cfg)
    r = LayoutResolution(None)
    if not isinstance(world, int) or world < 1:
        r.add("--world-size", f"must be a positive integer, got {world}.")
        return r
    _check_sizes(cfg.megatron, r)
    if r.problems:
        return r
    if shape is not None:
        _check_model_split(cfg.megatron, shape, r)
    dp = _data_parallel(cfg.megatron, world, r)
    if dp is None:
        return r
    _check_size_pairs(cfg.megatron, world, gpus_per_node, r)
    _check_sequence_split(cfg, r)
    batches = _check_batches(cfg, dp, r)
    schedule, why_not, problems = resolve_schedule(cfg.megatron)
    r.problems.extend(problems)
    if why_not is not None:
        r.warnings.append(f"megatron.pipeline_schedule {why_not}; using {schedule}.")
    if cfg.megatron.enable_module_queue:
        _check_module_queue(cfg.megatron, r)
    if batches is None:
        return r
    m, ng = cfg.megatron, cfg.grpo.num_generations
    r.layout = ParallelLayout(
        world_size=world,
        tensor_parallel=m.tensor_model_parallel_size,
        pipeline_parallel=m.pipeline_model_parallel_size,
        context_parallel=m.context_parallel_size,
        expert_parallel=m.expert_model_parallel_size,
        data_parallel=dp,
        virtual_pipeline=m.virtual_pipeline_model_parallel_size,
        sequence_parallel=m.sequence_parallel,
        micro_batch_size=batches[0],
        global_batch_size=batches[1],
        pipeline_schedule=schedule,
        num_generations=ng if isinstance(ng, int) and ng > 0 else 1,
        num_mini_batches=max(1, cfg.grpo.num_mini_batches),
        gpus_per_node=gpus_per_node,
        expert_tensor_parallel=m.expert_tensor_parallel_size,
    )
    return r


def engine_layout(params: MegatronParams, world_size: int | None = None) -> ParallelLayout:
    """The layout of ``params`` for callers that run the engine without a GRPO config (test workers, benchmarks,
    convert/export): ``resolve_layout`` with GRPO's batch rules neutral (one generation per prompt, one mini-batch),
    on ``world_size`` processes (default: ``default_world_size``). ``ValueError`` names every problem; the warnings
    (a schedule that falls back, ModuleQueue's reach) are logged, as validation reports them."""
    # One generation per prompt: completions never have to fill whole groups. No sequence length either (0 splits
    # over every CP): the engine pads what it is given, the 2 x CP rule is a GRPO config's.
    grpo = MegatronGrpoParams(num_generations=1, num_mini_batches=1, max_prompt_length=0, max_completion_length=0)
    # micro batch 1 unless megatron.micro_batch_size says otherwise (no Oumi per-device batch to fall back on)
    cfg = StandaloneConfig(megatron=params, grpo=grpo, training=TrainingSection(per_device_train_batch_size=1))
    resolution = resolve_layout(cfg, world_size)
    layout = resolution.require()
    for warning in resolution.warnings:
        logger.warning(warning)
    return layout


def _check_sizes(m: MegatronParams, r: LayoutResolution) -> None:
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        value = getattr(m, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            r.add(f"megatron.{name}", f"must be a positive integer, got {value!r}.")
    for name in ("virtual_pipeline_model_parallel_size", "micro_batch_size", "global_batch_size"):
        value = getattr(m, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            r.add(f"megatron.{name}", f"must be a positive integer, got {value!r}.")


def _data_parallel(m: MegatronParams, world: int, r: LayoutResolution) -> int | None:
    """DP = world / (TP x PP x CP), or None with the problem (EP must also divide a pipeline stage's ranks)."""
    sizes, mp = m.parallel_sizes, m.model_parallel_size
    if world % mp != 0:
        r.add("megatron.tensor_model_parallel_size",
              f"world_size ({world}) must be divisible by the product of all model parallel sizes ({mp}): "
              f"TP {sizes[0]} x PP {sizes[1]} x CP {sizes[2]}. Adjust the parallel sizes "
              f"so that their product divides {world} (or run on a multiple of {mp} GPUs).")
        return None
    ep, stage_ranks = m.expert_model_parallel_size, world // m.pipeline_model_parallel_size
    if stage_ranks % ep != 0:  # Megatron-Core's expert groups: EP x expert-DP ranks of one pipeline stage
        r.add("megatron.expert_model_parallel_size",
              f"{ep} must divide the ranks of a pipeline stage, TP x CP x DP = {stage_ranks} (experts are split over "
              f"them). Use one of {divisors(stage_ranks)}.")
        return None
    return world // mp


def _check_size_pairs(m: MegatronParams, world: int, gpus_per_node: int | None, r: LayoutResolution) -> None:
    """Sizes that need another: VPP needs PP, SP needs TP; node boundaries when the node size is known."""
    if m.virtual_pipeline_model_parallel_size is not None and m.pipeline_model_parallel_size <= 1:
        r.add("megatron.virtual_pipeline_model_parallel_size",
              "needs pipeline_model_parallel_size > 1 (it splits each pipeline rank's layers into chunks). "
              "Remove it or raise pipeline_model_parallel_size.")
    if m.sequence_parallel and m.tensor_model_parallel_size <= 1:
        r.add("megatron.sequence_parallel",
              "needs tensor_model_parallel_size > 1 (it shards activations over the TP group). "
              "Set sequence_parallel: False or raise tensor_model_parallel_size.")
    if gpus_per_node is None:
        return
    if gpus_per_node < 1:
        r.add("--gpus-per-node", f"must be a positive integer, got {gpus_per_node}.")
    elif world % gpus_per_node != 0:
        r.add("--gpus-per-node", f"world size {world} is not a whole number of nodes of {gpus_per_node} GPUs.")
    elif m.tensor_model_parallel_size > gpus_per_node:
        r.warnings.append(f"megatron.tensor_model_parallel_size {m.tensor_model_parallel_size} spans nodes of "
                          f"{gpus_per_node} GPUs: TP all-reduces every layer, keep it within a node (NVLink).")


def _check_sequence_split(cfg: LayoutConfig, r: LayoutResolution) -> None:
    """Context parallelism splits each sequence into 2 x CP chunks."""
    seq, cp = cfg.grpo.max_sequence_length, cfg.megatron.context_parallel_size
    if cp > 1 and seq % (2 * cp) != 0:
        fixed = seq + (2 * cp - seq % (2 * cp))
        r.add("grpo.max_completion_length",
              f"context parallelism splits each sequence into 2 x CP = {2 * cp} chunks, but "
              f"grpo.max_prompt_length + grpo.max_completion_length = {seq} is not divisible by {2 * cp}. "
              f"Set grpo.max_completion_length to {cfg.grpo.max_completion_length + fixed - seq} (total {fixed}).")


def _check_batches(cfg: LayoutConfig, dp: int, r: LayoutResolution) -> tuple[int, int] | None:
    """(micro, global) batch, or None when either cannot be resolved; divisibility by DP and by whole groups."""
    micro, global_batch = resolve_batches(cfg, dp)
    if not isinstance(micro, int) or micro < 1:
        r.add("megatron.micro_batch_size", f"resolves to {micro!r} (from training.per_device_train_batch_size); "
                                           "set megatron.micro_batch_size to a positive integer.")
        return None
    if not isinstance(global_batch, int) or global_batch < 1:
        r.add("megatron.global_batch_size", f"resolves to {global_batch!r} (micro_batch_size x training."
                                            "gradient_accumulation_steps x DP); set megatron.global_batch_size to a "
                                            "positive multiple of micro_batch_size x DP.")
        return None
    if global_batch % (micro * dp) != 0:
        r.add("megatron.global_batch_size",
              f"{global_batch} is not divisible by micro_batch_size x DP = {micro} x {dp} = {micro * dp}. "
              f"Use a multiple of {micro * dp} (e.g. {max(1, global_batch // (micro * dp)) * micro * dp}).")
    completions, ng = global_batch * cfg.grpo.num_mini_batches, cfg.grpo.num_generations
    if isinstance(ng, int) and ng >= 2 and completions % ng != 0:
        r.add("grpo.num_generations",
              f"completions per GRPO step (megatron.global_batch_size x grpo.num_mini_batches = "
              f"{completions}) must be a multiple of grpo.num_generations ({ng}) so that every prompt's "
              "group is complete. Change either.")
    elif isinstance(ng, int) and ng >= 1 and cfg.grpo.streaming_groups and (completions // ng) % dp:
        r.add("grpo.streaming_groups",
              f"each data-parallel rank streams whole groups, so the prompts of a step ({completions // ng}) must be a "
              f"multiple of the data-parallel size ({dp}). Change megatron.global_batch_size or grpo.num_generations, "
              "or streaming_groups: false.")
    return micro, global_batch


def _check_module_queue(m: MegatronParams, r: LayoutResolution) -> None:
    """ModuleQueue's rules (engine/parallel/module_queue.py): what it cannot run with is an error, where it acts a warning."""
    if m.ddp_config.overlap_param_gather:
        r.add("megatron.enable_module_queue",
              "does not run with ddp_config.overlap_param_gather: true (the parameter all-gather would write into the "
              "contiguous parameter buffer ModuleQueue detaches during the forward pass). Set overlap_param_gather: "
              "false, or enable_module_queue: false.")
    if m.transformer_config.cuda_graph_impl == "local":
        r.add("megatron.enable_module_queue",
              "does not run inside CUDA graphs (a graph replays fixed weight addresses; ModuleQueue frees and "
              "reallocates them). Set cuda_graph_impl: none, or enable_module_queue: false.")
    r.warnings.append(
        "megatron.enable_module_queue acts only where it can: on the last pipeline stage "
        f"(post_process=True{'; the only stage here' if m.pipeline_model_parallel_size == 1 else ''}) "
        "during training steps. Other stages build a plain GPTModel, and forward passes without gradients "
        "(logprobs, rollout generation) run with every weight on the GPU."
    )


def check_module_queue_chunks(config: LayoutConfig, found: Findings) -> None:
    """``megatron.module_queue_num_chunks`` (ModuleQueue's other rules need the layout: ``resolve_layout``)."""
    found.positive("megatron.module_queue_num_chunks", config.megatron.module_queue_num_chunks)


def _check_model_split(m: MegatronParams, shape: ModelShape, r: LayoutResolution) -> None:
    """The model splits over the layout: heads over TP, layers over PP x VPP, experts over EP; MoE under TP needs SP."""
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    if tp >= 1 and shape.num_attention_heads % tp != 0:
        r.add(
            "megatron.tensor_model_parallel_size",
            f"{tp} does not divide the model's {shape.num_attention_heads} attention heads. "
            f"Use a divisor of {shape.num_attention_heads}.",
        )
    if tp >= 1 and shape.num_key_value_heads % tp != 0:
        r.add(
            "megatron.tensor_model_parallel_size",
            f"{tp} does not divide the model's {shape.num_key_value_heads} key/value heads (GQA groups). "
            f"Use a divisor of {shape.num_key_value_heads}.",
        )
    vpp = m.virtual_pipeline_model_parallel_size or 1
    if pp >= 1 and vpp >= 1:
        t = m.transformer_config
        extra = int(t.account_for_embedding_in_pipeline_split) + int(t.account_for_loss_in_pipeline_split)
        slots = shape.num_layers + extra
        stages = pp * vpp
        counted = f"{shape.num_layers} layers" + (f" + {extra} (embedding/loss)" if extra else "")
        if slots % stages != 0:
            vpp_field = m.virtual_pipeline_model_parallel_size is not None
            field_name = (
                "megatron.virtual_pipeline_model_parallel_size" if vpp_field else "megatron.pipeline_model_parallel_size"
            )
            msg = f"{counted} = {slots} cannot be split evenly over PP {pp}" + (
                f" x VPP {vpp} = {stages} virtual stages" if vpp_field else " stages"
            )
            hints = []
            if vpp_field and slots % pp == 0:
                per_rank = slots // pp
                good = [d for d in range(1, per_rank + 1) if per_rank % d == 0 and d > 1]
                hints.append(
                    "virtual_pipeline_model_parallel_size is model chunks per pipeline rank (Megatron-Core's "
                    f"meaning), so it must divide the {per_rank} layers per rank: use one of {good or [1]}"
                )
            if not extra and (shape.num_layers + 2) % stages == 0:
                hints.append(
                    "or set megatron.transformer_config.account_for_embedding_in_pipeline_split and "
                    f"account_for_loss_in_pipeline_split: true ({shape.num_layers} + 2 = "
                    f"{shape.num_layers + 2} slots split evenly)"
                )
            if not hints:
                hints.append(f"use a pipeline size that divides {slots}")
            r.add(field_name, f"{msg}. Fix: {'; '.join(hints)}.")
    ep = m.expert_model_parallel_size
    if ep > 1 and not shape.is_moe:
        r.add(
            "megatron.expert_model_parallel_size",
            f"is {ep}, but {shape.model_type} is a dense model (no experts). Set expert_model_parallel_size: 1.",
        )
    elif ep > 1 and shape.num_experts % ep != 0:
        r.add(
            "megatron.expert_model_parallel_size",
            f"{ep} does not divide the model's {shape.num_experts} experts. Use a divisor of {shape.num_experts}.",
        )
    if shape.is_moe and tp > 1 and not m.sequence_parallel:
        r.add(
            "megatron.sequence_parallel",
            f"must be true for {shape.model_type} (MoE layers) with tensor_model_parallel_size {tp}: Megatron-Core's MoE "
            "layer refuses to train under TP without it. Set sequence_parallel: true.",
        )
