"""Validation of a MEGATRON_GRPO config: a list of field checks, plus the layout that engine/parallel/layout.py resolves.

Every rule appends to one report, so a user sees all problems at once. Each problem names the field
and says how to fix it. The parallel layout, batch sizes and pipeline schedule are resolved (and their
problems found) by ``layout.resolve_layout``; settings that cannot act in a given layout (ZB-H1 with PP=1,
ModuleQueue on non-last stages) fall back there with one warning, as the design documents say. Names a config
selects (schedules, losses, estimators, rollout backends) are checked against the live registries, after
``grpo.plugins`` are imported. ``oumi-megatron validate`` prints the report; training runs the same function
first, before any heavy work.
"""

from __future__ import annotations

import inspect
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from oumi.exceptions import OumiConfigError

from oumi_megatron.config.grpo_params import MAX_STALENESS, OFF_POLICY_CORRECTIONS, ON_REWARD_ERROR
from oumi_megatron.config.megatron_params import (
    ATTENTION_BACKENDS,
    CUDA_GRAPH_IMPLS,
    PACKED_ATTENTIONS,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    RECOMPUTE_MODULES,
    ROLLOUT_CUDA_GRAPHS,
    WEIGHT_SYNC_METHODS,
)
from oumi_megatron.config.problems import Problem
from oumi_megatron.data import HEAD_ROWS, DatasetHead, dataset_heads
from oumi_megatron.engine.parallel.layout import ParallelLayout, resolve_layout
from oumi_megatron.grpo.algorithm import KL_ESTIMATORS, LOSS_AGGREGATIONS
from oumi_megatron.model_shape import ModelShape, ModelShapeError, resolve_shape
from oumi_megatron.rollout.registry import own_gpu_engine_problem, resolve_rollout_mode
from oumi_megatron.utils.options import option_value

if TYPE_CHECKING:
    from oumi_megatron.config.grpo_params import MegatronGrpoParams
    from oumi_megatron.config.training_config import MegatronTrainingConfig

__all__ = ["MegatronConfigError", "Problem", "ValidationReport", "check_data", "reward_argument_problems", "validate_config"]


class MegatronConfigError(OumiConfigError):
    """A MEGATRON_GRPO config that cannot run; the message lists every problem."""

    def __init__(self, report: ValidationReport) -> None:
        self.report = report
        super().__init__(report.format_problems())


@dataclass
class ValidationReport:
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Settings taken over from Oumi's own fields (config/oumi_fields.py), for the log."""
    layout: ParallelLayout | None = None
    model_shape: ModelShape | None = None
    checked: list[str] = field(default_factory=list)
    """What the data checks read (``check_data``), one line per dataset, for the user."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def fields(self) -> list[str]:
        return [p.field for p in self.problems]

    def add(self, field_name: str, message: str) -> None:
        self.problems.append(Problem(field_name, message))

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def format_problems(self) -> str:
        n = len(self.problems)
        head = f"MEGATRON_GRPO config has {n} problem{'s' if n != 1 else ''}:"
        return "\n".join([head, *(f"  - {p}" for p in self.problems)])

    def raise_if_invalid(self) -> None:
        if self.problems:
            raise MegatronConfigError(self)

    def require_layout(self) -> ParallelLayout:
        """The resolved layout; raises ``MegatronConfigError`` listing the problems if there is none."""
        self.raise_if_invalid()
        if self.layout is None:  # every path that leaves it unresolved reports why; never a bare assert
            self.add("megatron", "the parallel layout could not be resolved from this config; check the parallel "
                                 "sizes and batch sizes (oumi-megatron validate -c CONFIG prints the details).")
            raise MegatronConfigError(self)
        return self.layout


def _fmt_choices(choices: tuple[str, ...]) -> str:
    return ", ".join(repr(c) for c in choices)


# --------------------------------------------------------------------------------------------------
# Rules that need only the config
# --------------------------------------------------------------------------------------------------
def _check_trainer_and_incompatible(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    if cfg.training.trainer_type.name != "MEGATRON_GRPO":
        r.add(
            "training.trainer_type",
            f"is {cfg.training.trainer_type.name}, but the config has megatron:/grpo: sections, "
            "which only MEGATRON_GRPO reads. Set training.trainer_type: MEGATRON_GRPO "
            "or remove the megatron: and grpo: sections.",
        )
    if cfg.fsdp.enable_fsdp:
        r.add(
            "fsdp.enable_fsdp",
            "FSDP cannot be combined with MEGATRON_GRPO (Megatron-Core does the sharding). "
            "Set fsdp.enable_fsdp: False and use megatron.ddp_config / tensor/pipeline parallelism.",
        )
    if cfg.deepspeed.enable_deepspeed:
        r.add(
            "deepspeed.enable_deepspeed",
            "DeepSpeed cannot be combined with MEGATRON_GRPO. Set deepspeed.enable_deepspeed: False; "
            "megatron.ddp_config.use_distributed_optimizer gives ZeRO-1 style optimizer sharding.",
        )
    if not (cfg.model.model_name or "").strip():
        r.add(
            "model.model_name",
            "is empty. Set it to a Hugging Face model name (e.g. meta-llama/Llama-3.1-8B-Instruct) "
            "or a local folder with config.json.",
        )


def _check_training_fields(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    t = cfg.training
    if t.max_steps == 0:
        r.add("training.max_steps", "is 0: nothing would be trained. Set it to the number of GRPO steps to run, "
                                    "or to -1 to run training.num_train_epochs passes over the data.")
    elif (t.max_steps is None or t.max_steps < 0) and not (t.num_train_epochs or 0) > 0:
        r.add("training.max_steps", f"is {t.max_steps} and training.num_train_epochs is {t.num_train_epochs}: set "
                                    "max_steps (GRPO steps) or a positive num_train_epochs.")
    if not isinstance(t.save_steps, int) or t.save_steps < 0:
        r.add("training.save_steps", f"must be >= 0 (0: save only at the end), got {t.save_steps!r}.")
    lr = t.learning_rate
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        r.add("training.learning_rate", f"must be a finite number >= 0, got {lr!r}. Typical for GRPO: 1e-7 to 1e-5.")
    elif lr == 0:
        r.warn("training.learning_rate is 0: the policy will not change.")
    if t.warmup_steps is not None and t.warmup_steps < 0:
        r.add("training.warmup_steps", f"must be >= 0, got {t.warmup_steps!r}.")
    if t.warmup_ratio is not None and not 0.0 <= t.warmup_ratio <= 1.0:
        r.add("training.warmup_ratio", f"must be in [0, 1], got {t.warmup_ratio!r}.")
    strategy = option_value(t.eval_strategy, "no")
    if strategy == "steps" and not (isinstance(t.eval_steps, (int, float)) and t.eval_steps > 0):
        r.add("training.eval_steps", f"must be > 0 with eval_strategy 'steps' (GRPO steps between evaluations, or a "
                                     f"fraction of max_steps below 1), got {t.eval_steps!r}.")
    if strategy != "no" and t.per_device_eval_batch_size < 1:
        r.add("training.per_device_eval_batch_size", f"must be >= 1 (eval prompts per generate call), got "
                                                     f"{t.per_device_eval_batch_size!r}.")
    _check_eval_metric_prefixes(cfg, r)
    _check_output_dir(t.output_dir, r)


def _check_eval_metric_prefixes(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    prefixes = list(cfg.grpo.eval_metric_prefixes)
    if not prefixes:
        return
    datasets = len(cfg.data.validation.datasets)
    if len(prefixes) != datasets:
        r.add("grpo.eval_metric_prefixes", f"has {len(prefixes)} entries and data.validation.datasets has {datasets}: "
                                           "give one prefix per validation dataset, in order "
                                           "(e.g. eval for the first, eval_unseen for the second).")
    for i, prefix in enumerate(prefixes):
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", prefix):
            r.add(f"grpo.eval_metric_prefixes[{i}]", f"{prefix!r} is not a metric prefix: use letters, digits and _ "
                                                     "(e.g. eval_unseen), starting with a letter.")


def _check_lora(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    """``training.use_peft`` with ``peft:`` (config/lora.py): its fields, and the layouts LoRA does not run under."""
    from oumi_megatron.config.lora import layout_problems, lora_settings

    lora, problems = lora_settings(cfg)
    r.problems.extend(problems)
    r.problems.extend(layout_problems(cfg))
    m = cfg.megatron
    if m.lora_sync not in ("adapter", "merged"):
        r.add("megatron.lora_sync", f"unknown value {m.lora_sync!r}. Use merged (rollouts decode the base with the "
                                    "adapters merged in) or adapter (the base beside the adapter: vLLM engines take "
                                    "the adapter alone at each sync, the embedded backend runs it in its forward).")
        return
    if lora is None or m.lora_sync != "adapter" or m.inference_backend == "megatron" or not m.enable_weight_sync:
        return  # the embedded backend decodes either way (engine.rollout_weights): nothing to sync
    from oumi_megatron.rollout.registry import resolve_rollout_mode
    from oumi_megatron.rollout.vllm_engine import VLLM_LORA_RANKS, vllm_lora_rank

    mode, _ = resolve_rollout_mode(m)
    if mode is None:
        return  # the backend's own problems are reported
    if not mode.adapter_sync:
        r.add("megatron.lora_sync", f"adapter is not built for {mode.name} engines (they take whole weights). Set "
                                    "megatron.lora_sync: merged, or use vLLM engines (colocated or separate).")
    elif m.weight_sync_method == "checkpoint":
        r.add("megatron.lora_sync", "adapter sends the adapter in memory, and weight_sync_method: checkpoint writes whole "
                                    "models to disk. Set weight_sync_method to nccl (GPUs) or gloo (CPU), or "
                                    "lora_sync: merged.")
    elif vllm_lora_rank(lora.rank) is None:
        r.add("peft.lora_r", f"{lora.rank} is above vLLM's largest LoRA rank ({VLLM_LORA_RANKS[-1]}), which "
                             "megatron.lora_sync: adapter needs. Lower it, or set lora_sync: merged.")


def _check_output_dir(output_dir: str, r: ValidationReport) -> None:
    """output_dir must be a folder we can create and write into (checked now, not after conversion)."""
    path = Path(output_dir or "").expanduser()
    if not str(output_dir or "").strip():
        r.add("training.output_dir", "is empty. Set it to a folder for checkpoints, metrics and the exported model.")
        return
    if path.exists() and not path.is_dir():
        r.add("training.output_dir", f"{path} exists and is not a folder. Choose another output_dir.")
        return
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        r.add("training.output_dir", f"cannot be created: {existing} is a file. Choose another output_dir.")
    elif not os.access(existing, os.W_OK | os.X_OK):
        r.add("training.output_dir", f"{existing} is not writable by this user, so {path} cannot be written. "
                                     "Choose a writable output_dir.")


def _check_positive(r: ValidationReport, name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or value < 1:
        r.add(name, f"must be a positive integer, got {value!r}.")


def _check_plugins(g: MegatronGrpoParams, r: ValidationReport) -> None:
    """Import grpo.plugins first: they register the datasets, reward functions and GRPO variants checked below."""
    from oumi_megatron.plugins import load_plugins

    for module in g.plugins or []:
        try:
            load_plugins([module])
        except Exception as e:  # noqa: BLE001 - any failure to import is the user's module to fix
            r.add("grpo.plugins", f"cannot import {module!r} ({type(e).__name__}: {e}). Name an importable module "
                                  "(on PYTHONPATH) that registers your functions.")


def _check_registered_variants(g: MegatronGrpoParams, r: ValidationReport) -> None:
    """policy_loss / advantage_estimator name registered functions (the plugins are imported); scale_rewards,
    clip_ratio_c."""
    from oumi_megatron.grpo.algorithm import scale_rewards_mode
    from oumi_megatron.grpo.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    for registry, value in ((POLICY_LOSSES, g.policy_loss), (ADVANTAGE_ESTIMATORS, g.advantage_estimator)):
        if value not in registry:
            r.add(registry.field, registry.unknown_message(value))
    try:
        scale_rewards_mode(g.scale_rewards)
    except ValueError as e:
        r.add("grpo.scale_rewards", str(e))
    if g.clip_ratio_c is not None and not g.clip_ratio_c > 1.0:
        r.add("grpo.clip_ratio_c", f"must be > 1 or null (off), got {g.clip_ratio_c!r}: it bounds the loss of "
                                   "negative-advantage tokens at -A x clip_ratio_c. verl's default: 3.0.")


def _check_megatron_fields(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    """The megatron: section, field by field (the parallel and batch sizes: engine/parallel/layout.py, where they are resolved)."""
    m = cfg.megatron
    _check_positive(r, "megatron.module_queue_num_chunks", m.module_queue_num_chunks)
    if m.ddp_config.average_in_collective:
        r.warn(
            "megatron.ddp_config.average_in_collective: True is not used: GRPO losses are normalized by the global "
            "token/sequence count, which Megatron-Core does by summing gradients in the collective and dividing "
            "once (averaging as well would divide twice). The gradient is the same average. Remove the setting."
        )
    if m.logprob_chunk_tokens is not None and m.logprob_chunk_tokens < 0:
        r.add("megatron.logprob_chunk_tokens",
              f"must be null (auto), 0 (off: full logits) or a positive token count, got {m.logprob_chunk_tokens}.")
    keep = m.checkpoint_config.keep_last_n_checkpoints
    if not isinstance(keep, int) or keep < 0:
        r.add("megatron.checkpoint_config.keep_last_n_checkpoints", f"must be >= 0 (0 keeps all), got {keep!r}.")
    _check_shard_size(m.hf_max_shard_size, r)
    _check_context_parallel(cfg, r)
    _check_rollout_fields(cfg, r)
    _check_optimizer_fields(cfg, r)
    _check_recompute_fields(cfg, r)
    _check_attention_and_graphs(cfg, r)


def _check_shard_size(size: str, r: ValidationReport) -> None:
    from oumi_megatron.utils.disk import parse_size

    try:
        ok = parse_size(size) > 0
    except (ValueError, TypeError):
        ok = False
    if not ok:
        r.add("megatron.hf_max_shard_size", f"must be a size such as 5GB, 500MB or a number of bytes > 0, got {size!r}.")


def _check_context_parallel(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    """What context parallelism runs with."""
    m = cfg.megatron
    # Context parallelism runs on the SDPA core attention with K/V all-gathered (engine/parallel/context_parallel.py):
    # training and logprob passes split sequences (padded or packed rows), generation runs whole ones.
    if isinstance(m.context_parallel_size, int) and m.context_parallel_size > 1:
        cp = m.context_parallel_size
        if m.transformer_config.attention_backend == "local":
            r.add("megatron.transformer_config.attention_backend",
                  f"local cannot run context_parallel_size {cp} (Megatron-Core's DotProductAttention asserts CP = 1). "
                  "Set attention_backend: auto or sdpa.")
        if m.inference_backend == "megatron":
            r.warn(f"megatron.context_parallel_size {cp} with the embedded megatron rollout backend: training and "
                   "logprob passes split sequences over CP ranks; generation (KV cache) runs whole sequences on each "
                   f"CP rank, the {cp} ranks of a replica generating the same rollouts. inference_backend: vllm "
                   "generates on its own engines.")


def _check_rollout_fields(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    """The rollout backend (live registry), weight sync and vLLM placement."""
    m = cfg.megatron
    _, problems = resolve_rollout_mode(m)  # backend, placement and the mode's own rules (rollout/registry.py)
    r.problems.extend(problems)
    if m.weight_sync_method not in WEIGHT_SYNC_METHODS:
        r.add(
            "megatron.weight_sync_method",
            f"unknown value {m.weight_sync_method!r}. Use one of {_fmt_choices(WEIGHT_SYNC_METHODS)}.",
        )
    graphs = m.rollout_cuda_graphs_choice
    if graphs not in ROLLOUT_CUDA_GRAPHS:
        r.add("megatron.rollout_cuda_graphs",
              f"unknown value {m.rollout_cuda_graphs!r}. Use one of {_fmt_choices(ROLLOUT_CUDA_GRAPHS)}.")
    elif graphs == "true" and m.inference_backend == "megatron" and m.pipeline_model_parallel_size > 1:
        r.add("megatron.rollout_cuda_graphs", "true cannot run with pipeline_model_parallel_size > 1: pipeline stages "
              "exchange activations every token, so decode steps run eagerly. Set it to auto.")
    if not (isinstance(m.rollout_cuda_graphs_kept, int) and m.rollout_cuda_graphs_kept >= 0):
        r.add("megatron.rollout_cuda_graphs_kept", f"must be an integer >= 0 (0: capture the decode step's graph in every "
              f"generation and free its KV cache after it), got {m.rollout_cuda_graphs_kept!r}.")
    if not m.weight_sync_bucket_mb > 0:
        r.add("megatron.weight_sync_bucket_mb", f"must be > 0, got {m.weight_sync_bucket_mb!r}. Typical: 256-1024.")
    if not m.vllm_kv_cache_gib >= 0.0:
        r.add("megatron.vllm_kv_cache_gib", f"must be >= 0 (0: sized from vllm_gpu_memory_utilization), got "
              f"{m.vllm_kv_cache_gib!r}.")
    if not 0.0 < m.vllm_gpu_memory_utilization <= 1.0:
        r.add("megatron.vllm_gpu_memory_utilization", f"must be in (0, 1], got {m.vllm_gpu_memory_utilization!r}.")
    if m.inference_backend == "vllm" and not m.enable_weight_sync:
        r.warn(
            "megatron.enable_weight_sync is False: vLLM keeps generating with the initial weights "
            "(rollouts use stale weights and GRPO is off-policy)."
        )


def _check_optimizer_fields(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    """Optimizer offload."""
    m = cfg.megatron
    frac = m.optimizer_config.optimizer_offload_fraction
    if not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
        r.add(
            "megatron.optimizer_config.optimizer_offload_fraction",
            f"must be in [0, 1], got {frac!r}. Use 1.0 to offload all optimizer state, 0.0 for none.",
        )
    elif frac > 0 and not m.optimizer_config.optimizer_cpu_offload:
        r.warn(
            "megatron.optimizer_config.optimizer_offload_fraction > 0 has no effect unless "
            "megatron.optimizer_config.optimizer_cpu_offload is True."
        )


def _check_recompute_fields(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    """Activation recompute."""
    t = cfg.megatron.transformer_config
    if t.recompute_granularity is not None and t.recompute_granularity not in RECOMPUTE_GRANULARITIES:
        r.add(
            "megatron.transformer_config.recompute_granularity",
            f"unknown value {t.recompute_granularity!r}. Use 'full', 'selective' or null (no recompute).",
        )
    if t.recompute_method is not None and t.recompute_method not in RECOMPUTE_METHODS:
        r.add(
            "megatron.transformer_config.recompute_method",
            f"unknown value {t.recompute_method!r}. Use 'uniform', 'block' or null.",
        )
    if t.recompute_granularity == "full" and t.recompute_method is None:
        r.add(
            "megatron.transformer_config.recompute_method",
            "full recompute needs a method. Set recompute_method: uniform (or block).",
        )
    bad_modules = [mod for mod in t.recompute_modules or [] if mod not in RECOMPUTE_MODULES]
    if bad_modules:
        r.add(
            "megatron.transformer_config.recompute_modules",
            f"unknown module(s) {bad_modules}. Choose from {_fmt_choices(RECOMPUTE_MODULES)}.",
        )
    _check_positive(
        r, "megatron.transformer_config.recompute_num_layers", t.recompute_num_layers, allow_none=True
    )


def _check_attention_and_graphs(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    """Core attention, packed attention and CUDA graphs."""
    m = cfg.megatron
    t = m.transformer_config
    if t.attention_backend not in ATTENTION_BACKENDS:
        r.add(
            "megatron.transformer_config.attention_backend",
            f"unknown value {t.attention_backend!r}. Choose from {_fmt_choices(ATTENTION_BACKENDS)}.",
        )
    if t.packed_attention not in PACKED_ATTENTIONS:
        r.add("megatron.transformer_config.packed_attention",
              f"unknown value {t.packed_attention!r}. Choose from {_fmt_choices(PACKED_ATTENTIONS)}.")
    if t.cuda_graph_impl not in CUDA_GRAPH_IMPLS:
        r.add("megatron.transformer_config.cuda_graph_impl",
              f"unknown value {t.cuda_graph_impl!r}. Choose from {_fmt_choices(CUDA_GRAPH_IMPLS)}.")
    elif t.cuda_graph_impl == "local":
        longest = cfg.grpo.max_prompt_length + cfg.grpo.max_completion_length
        if not t.cuda_graph_seq_length or t.cuda_graph_seq_length <= 0:
            r.add("megatron.transformer_config.cuda_graph_seq_length",
                  f"CUDA graphs have fixed shapes: set it to the longest prompt + completion ({longest}); "
                  "every microbatch is padded to it.")
        elif t.cuda_graph_seq_length < longest:
            r.add("megatron.transformer_config.cuda_graph_seq_length",
                  f"{t.cuda_graph_seq_length} is shorter than grpo.max_prompt_length + grpo.max_completion_length = {longest}. "
                  f"Set cuda_graph_seq_length: {longest}.")
        if m.enable_sequence_packing:
            r.add("megatron.enable_sequence_packing",
                  "packed rows (block-diagonal masks) are not supported with CUDA graphs. "
                  "Set enable_sequence_packing: False, or cuda_graph_impl: none.")
        if m.pipeline_model_parallel_size > 1:
            r.add("megatron.transformer_config.cuda_graph_impl",
                  "local CUDA graphs are tested with pipeline_model_parallel_size 1 only. Set cuda_graph_impl: none for PP > 1.")
        if t.recompute_granularity is not None:
            # Megatron-Core refuses full recompute under graphs and skips selective recompute while capturing
            r.add("megatron.transformer_config.recompute_granularity",
                  "activation recompute does not run inside CUDA graphs. Set recompute_granularity: null, or cuda_graph_impl: none.")

def _check_dapo_fields(g: MegatronGrpoParams, r: ValidationReport) -> None:
    """Dynamic sampling's round limit and the overlong punishment's buffer and factor."""
    _check_positive(r, "grpo.dynamic_sampling_max_rounds", g.dynamic_sampling_max_rounds)
    buffer, longest = g.overlong_buffer_length, g.max_completion_length
    if buffer is not None and (not isinstance(buffer, int) or isinstance(buffer, bool) or not 0 < buffer <= longest):
        r.add("grpo.overlong_buffer_length", f"must be an integer in [1, grpo.max_completion_length = {longest}] or "
                                             f"null (off), got {buffer!r}: the last this-many tokens before the limit "
                                             f"are penalised. DAPO: a fifth of the limit (here {max(longest // 5, 1)}).")
    if not isinstance(g.overlong_penalty_factor, (int, float)) or not g.overlong_penalty_factor >= 0:
        r.add("grpo.overlong_penalty_factor", f"must be >= 0, got {g.overlong_penalty_factor!r}: the most reward the "
                                              "overlong punishment takes. DAPO: 1.0.")


def _check_staleness(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    """``grpo.max_staleness``: asynchronous GRPO needs a rollout mode whose engines generate while the trainer trains."""
    g, m = cfg.grpo, cfg.megatron
    if not isinstance(g.max_staleness, int) or isinstance(g.max_staleness, bool) or not 0 <= g.max_staleness <= MAX_STALENESS:
        r.add("grpo.max_staleness", f"must be an integer from 0 (synchronous) to {MAX_STALENESS}, got {g.max_staleness!r}. "
                                    "Typical: 1 (one step off policy).")
        return
    if g.max_staleness == 0:
        return
    mode, _ = resolve_rollout_mode(m)
    if mode is not None and not mode.asynchronous:
        r.add("grpo.max_staleness", f"{g.max_staleness} (asynchronous GRPO) needs rollout engines that generate while "
                                    "the trainer trains: set megatron.inference_backend: vllm (rollout_placement: separate "
                                    "or ray) or sglang (rollout_placement: separate) (now "
                                    f"{m.inference_backend!r} / {m.rollout_placement!r}), or max_staleness: 0.")
    if m.weight_sync_method == "checkpoint":
        r.add("grpo.max_staleness", "asynchronous GRPO streams each new policy to the engines behind their generations in "
                                    "flight; megatron.weight_sync_method: checkpoint would rewrite the folder under them. "
                                    "Use nccl (GPUs) or gloo (CPU).")
    if not m.enable_weight_sync:
        r.add("grpo.max_staleness", "asynchronous GRPO bounds how old the engines' weights are, which needs "
                                    "megatron.enable_weight_sync: true.")
    if g.dynamic_sampling:
        r.add("grpo.dynamic_sampling", "is not built for asynchronous GRPO (grpo.max_staleness > 0): its extra rounds "
                                       "would wait for the engines. Set dynamic_sampling: false, or max_staleness: 0.")


def _check_environment(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    """``grpo.environment`` (the live registry, after ``grpo.plugins``) and its limits; what episodes do not run under."""
    g, m = cfg.grpo, cfg.megatron
    if g.environment is None:
        return
    from oumi_megatron.environments.registry import ENVIRONMENTS

    if g.environment not in ENVIRONMENTS:
        r.add("grpo.environment", ENVIRONMENTS.unknown_message(g.environment) + " Or leave it unset (single-turn).")
    for name in ("max_turns", "max_observation_tokens"):
        value = getattr(g, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            r.add(f"grpo.{name}", f"must be an integer >= 1, got {value!r}."
                                  + (" Typical: 2-8 turns (1: one tool-free answer)." if name == "max_turns" else " Typical: 256."))
    turn = g.max_turn_tokens
    if turn is not None and (not isinstance(turn, int) or isinstance(turn, bool) or not 0 < turn <= g.max_completion_length):
        r.add("grpo.max_turn_tokens", f"must be an integer in [1, grpo.max_completion_length = {g.max_completion_length}] "
                                      f"or null (a turn may use the whole budget), got {turn!r}.")
    timeout = g.environment_timeout_s
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        r.add("grpo.environment_timeout_s", f"must be > 0 seconds, got {timeout!r}. Typical: 60.")
    workers = g.environment_workers
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        r.add("grpo.environment_workers", f"must be an integer >= 0 (0: each turn answered in line; N: on N threads "
                                          f"in the background), got {workers!r}.")
    if g.max_staleness and m.rollout_placement == "ray":
        r.add("grpo.environment", "asynchronous multi-turn episodes (grpo.max_staleness > 0) are built for "
                                  "megatron.rollout_placement: separate, not yet for ray (its fleet queues single "
                                  "generations). Use rollout_placement: separate, or max_staleness: 0.")


def _check_sandbox(g: MegatronGrpoParams, r: ValidationReport) -> None:
    """``grpo.sandbox``: where model-written code runs (utils/sandbox.py)."""
    from oumi_megatron.utils.sandbox import ISOLATIONS, MAX_WORKERS

    s = g.sandbox
    if s.isolation not in ISOLATIONS:
        r.add("grpo.sandbox.isolation", f"unknown value {s.isolation!r}. Use one of {_fmt_choices(ISOLATIONS)} "
                                        "(limits_unsafe: resource limits only, the model's code can read this machine's "
                                        "files and reach the network).")
    if s.workers is not None and (not isinstance(s.workers, int) or isinstance(s.workers, bool)
                                  or not 1 <= s.workers <= MAX_WORKERS):
        r.add("grpo.sandbox.workers", f"must be an integer in [1, {MAX_WORKERS}] or null (max(environment_workers, "
                                      f"min(4, CPUs))), got {s.workers!r}.")
    for name in ("timeout_s", "cpu_s"):
        value = getattr(s, name)
        if (value is not None or name == "timeout_s") and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                                           or not value > 0):
            r.add(f"grpo.sandbox.{name}", f"must be > 0 seconds{' or null (= timeout_s)' if name == 'cpu_s' else ''}, "
                                          f"got {value!r}. Typical: 10.")
    for name in ("memory_mb", "max_processes", "max_output_bytes", "work_mb"):
        _check_positive(r, f"grpo.sandbox.{name}", getattr(s, name))


def _check_grpo_fields(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    g = cfg.grpo
    dump = g.rollout_dump_steps
    if not isinstance(dump, int) or isinstance(dump, bool) or dump < 0:
        r.add("grpo.rollout_dump_steps", f"must be an integer >= 0 (0: no dumps; N: every N-th step's samples to "
                                         f"output_dir/rollouts/), got {dump!r}.")
    if not isinstance(g.temperature, (int, float)) or not 0.0 < g.temperature <= 2.0:
        r.add("grpo.temperature", f"must be in (0, 2], got {g.temperature!r}. Typical: 0.6-1.0.")
    if not isinstance(g.num_generations, int) or g.num_generations < 2:
        r.add(
            "grpo.num_generations",
            f"must be at least 2, got {g.num_generations!r}: GRPO's advantage compares completions "
            "of the same prompt. Typical: 4-16.",
        )
    if not 0.0 < g.top_p <= 1.0:
        r.add("grpo.top_p", f"must be in (0, 1], got {g.top_p!r}. Use 1.0 to disable nucleus sampling.")
    if not g.epsilon > 0:
        r.add("grpo.epsilon", f"must be > 0, got {g.epsilon!r}. Typical: 0.2.")
    if g.epsilon_high is not None and not g.epsilon_high > 0:
        r.add("grpo.epsilon_high", f"must be > 0 or null (= epsilon), got {g.epsilon_high!r}. DAPO uses 0.28.")
    if g.tis_cap is not None and not g.tis_cap >= 1.0:
        r.add("grpo.tis_cap", f"must be >= 1 or null (off), got {g.tis_cap!r}: it caps p_trainer / p_rollout. Typical: 2.0.")
    if g.off_policy_correction is not None and g.off_policy_correction not in OFF_POLICY_CORRECTIONS:
        r.add("grpo.off_policy_correction", f"unknown value {g.off_policy_correction!r}. Use one of "
                                            f"{_fmt_choices(OFF_POLICY_CORRECTIONS)}, or leave it unset.")
    _check_staleness(cfg, r)
    _check_environment(cfg, r)
    _check_sandbox(g, r)
    if g.beta < 0:
        r.add("grpo.beta", f"must be >= 0, got {g.beta!r}. Use 0 to train without a KL penalty.")
    if g.kl_estimator not in KL_ESTIMATORS:
        r.add("grpo.kl_estimator", f"unknown value {g.kl_estimator!r}. Use one of {_fmt_choices(KL_ESTIMATORS)}.")
    if g.loss_aggregation not in LOSS_AGGREGATIONS:
        r.add(
            "grpo.loss_aggregation",
            f"unknown value {g.loss_aggregation!r}. Use one of {_fmt_choices(LOSS_AGGREGATIONS)}.",
        )
    if g.on_reward_error not in ON_REWARD_ERROR:
        r.add("grpo.on_reward_error", f"unknown value {g.on_reward_error!r}. Use 'raise' or 'skip'.")
    _check_registered_variants(g, r)
    for name in ("max_prompt_length", "max_completion_length", "ppo_epochs", "num_mini_batches"):
        _check_positive(r, f"grpo.{name}", getattr(g, name))
    _check_dapo_fields(g, r)

    if not g.reward_functions:
        r.add(
            "grpo.reward_functions",
            "is empty, and the training data has no default reward (gsm8k and countdown data get theirs "
            "automatically); GRPO needs a reward. Add at least one registered reward function, e.g.\n"
            "      grpo:\n        reward_functions:\n          - name: gsm8k",
        )
    registered: set[str] | None = None
    for i, rf in enumerate(g.reward_functions):
        if not rf.name:
            r.add(f"grpo.reward_functions[{i}].name", "is empty. Set it to a registered reward function name.")
            continue
        if not math.isfinite(rf.weight):
            r.add(f"grpo.reward_functions[{i}].weight", f"must be a finite number, got {rf.weight!r}.")
        if registered is None:
            registered = _registered_reward_functions()
        if rf.name not in registered:
            r.add(
                f"grpo.reward_functions[{i}].name",
                f"{rf.name!r} is not in Oumi's REWARD_FUNCTION registry. Known: {sorted(registered)}. "
                "Register your own with @register('name', RegistryType.REWARD_FUNCTION) in a module "
                "named in grpo.plugins (the CPU demo's char_class: oumi_megatron.examples.demo_task).",
            )


def _registered_reward_functions() -> set[str]:
    from oumi.core.registry import RegistryType

    from oumi_megatron.grpo.rewards import load_reward_registry

    return set(load_reward_registry().get_all(RegistryType.REWARD_FUNCTION))


# --------------------------------------------------------------------------------------------------
# Rules that need the model's shape (how it splits over the layout: engine/parallel/layout.py)
# --------------------------------------------------------------------------------------------------
def _check_model_shape(cfg: MegatronTrainingConfig, shape: ModelShape, r: ValidationReport) -> None:
    """What the model needs beyond the layout (engine/parallel/layout.py checks the split): its own code, its context length."""
    if shape.is_moe and getattr(cfg.training, "use_peft", False):
        r.add("training.use_peft", f"{shape.source} has mixture-of-experts layers, and LoRA on expert layers is not "
                                   "built or tested here (docs/lora.md). Use a dense model with LoRA, or full fine-tuning.")
    if shape.remote_code and not cfg.model.trust_remote_code:
        r.add("model.trust_remote_code", f"{shape.source} needs its own code to load (config.json has an auto_map), "
                                         "which is not run unless you allow it. If you trust it, set "
                                         "model.trust_remote_code: true.")
    seq, limit = cfg.grpo.max_sequence_length, shape.max_position_embeddings
    if isinstance(limit, int) and limit > 0 and isinstance(seq, int) and seq > limit:
        r.add(
            "grpo.max_completion_length",
            f"grpo.max_prompt_length + grpo.max_completion_length = {cfg.grpo.max_prompt_length} + "
            f"{cfg.grpo.max_completion_length} = {seq} exceeds the model's max_position_embeddings ({limit}). "
            f"Lower them so that they sum to at most {limit}.",
        )


def _check_own_gpu_engines(cfg: MegatronTrainingConfig, shape: ModelShape, r: ValidationReport) -> None:
    """Engines on GPUs of their own (separate, ray) hold the whole model: on a machine with GPUs, against this one's
    (``oumi-megatron plan --gpu-memory-gib`` checks it for any GPU)."""
    import torch

    if not torch.cuda.is_available():
        return
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    problem = own_gpu_engine_problem(cfg.megatron, shape, gpu_gib)
    if problem is not None:
        r.add("megatron.rollout_placement", problem)


def _check_megatron_bridge(r: ValidationReport, shape: ModelShape | None) -> None:
    from oumi_megatron.bridge_utils import check_megatron_bridge_available, import_megatron_bridge

    try:
        check_megatron_bridge_available()
    except ImportError as e:
        r.add("megatron-bridge", str(e))
        return
    if shape is not None and shape.architectures:
        supported = set(import_megatron_bridge().AutoBridge.list_supported_models())
        if not any(arch in supported for arch in shape.architectures):
            examples = sorted(a for a in supported if a.endswith("ForCausalLM"))[:8]
            r.add(
                "model.model_name",
                f"{shape.source} is a {', '.join(shape.architectures)} model, which Megatron-Bridge cannot "
                f"convert. Use a supported architecture, e.g. {', '.join(examples)} ...",
            )


def validate_config(
    config: MegatronTrainingConfig,
    world_size: int | None = None,
    gpus_per_node: int | None = None,
    model_config_path: str | None = None,
    model_shape: ModelShape | None = None,
    check_bridge: bool = True,
) -> ValidationReport:
    """Checks a MEGATRON_GRPO config and resolves its parallel layout.

    First takes over Oumi's own fields (training.reward_functions, training.grpo, ...; see
    ``config/oumi_fields.py``) into the megatron:/grpo: sections, once per config object.

    Args:
        config: the parsed config.
        world_size: number of processes (GPUs); default WORLD_SIZE or the model-parallel product.
        gpus_per_node: GPUs per node, to check node boundaries (optional).
        model_config_path: a config.json (or folder) to read the model's shape from instead of
            ``model.model_name`` (e.g. a local copy when the Hub can't be reached).
        model_shape: an already-read shape (skips reading config.json).
        check_bridge: also check that Megatron-Bridge imports.
    """
    from oumi_megatron.config.oumi_fields import adopt_oumi_fields

    r = ValidationReport()
    adoption = adopt_oumi_fields(config)
    r.notes.extend(adoption.notes)
    r.warnings.extend(adoption.warnings)
    for field_name, message in adoption.problems:
        r.add(field_name, message)
    if world_size is not None and world_size < 1:
        r.add("--world-size", f"must be a positive integer, got {world_size}.")
        return r
    _check_plugins(config.grpo, r)
    _check_lora(config, r)
    _check_trainer_and_incompatible(config, r)
    _check_training_fields(config, r)
    _check_megatron_fields(config, r)
    _check_grpo_fields(config, r)

    if model_shape is None and (model_config_path or (config.model.model_name or "").strip()):
        source = model_config_path or config.model.model_name
        try:
            if model_config_path:
                model_shape = ModelShape.from_file(model_config_path)
            else:
                resolved = resolve_shape(config.model.model_name, config.model.model_revision)
                model_shape = resolved.shape
                if resolved.note:
                    r.notes.append(f"model.model_name: {resolved.note}")
        except ModelShapeError as e:
            field_name = "--model-config" if model_config_path else "model.model_name"
            if e.unsupported_architecture:
                r.add(field_name, str(e))
                check_bridge = False  # said already, in the words that fit
            elif model_config_path or str(e).startswith("local model path"):
                r.add(field_name, f"cannot read the model's shape: {e}. Use a local folder with config.json, check the "
                                  f"name, or pass `--model-config PATH/config.json` with a copy of {source}'s config.")
            else:  # a Hub name: the message names --model-config and the shipped shapes
                r.add(field_name, str(e))
    resolution = resolve_layout(config, world_size, gpus_per_node, model_shape)
    r.layout = resolution.layout
    r.problems.extend(resolution.problems)
    r.warnings.extend(resolution.warnings)
    if model_shape is not None:
        r.model_shape = model_shape
        _check_model_shape(config, model_shape, r)
        _check_own_gpu_engines(config, model_shape, r)
    if check_bridge:
        _check_megatron_bridge(r, model_shape)
    return r


# --------------------------------------------------------------------------------------------------
# The data (oumi-megatron validate): the datasets' first rows, the rewards' arguments, the environment
# --------------------------------------------------------------------------------------------------
_REWARD_GIVES = frozenset({"completions", "prompts"})
"""What every TRL-style reward call passes besides the rows' columns (grpo/rewards.py)."""


def _columns(rows: list[dict], environment: bool) -> set[str]:
    """The keyword arguments a batch of these rows gives a TRL-style reward (grpo/rewards.py: the first row's columns
    but the prompt; ``env_info`` where episodes run an environment)."""
    columns = {k for k in rows[0] if k not in ("prompt", "completion")} if rows else set()
    return columns | ({"env_info"} if environment else set())


def reward_argument_problems(config: MegatronTrainingConfig, heads: list[DatasetHead]) -> list[Problem]:
    """Each reward function's keyword arguments against the rows it will be called with (the first rows of each
    dataset in ``heads``): a TRL-style function's required parameters are among the columns, ``completions``,
    ``prompts`` and its ``kwargs``, and without ``**kwargs`` it accepts every column; a verl-style one finds
    ``reward_model.ground_truth`` in the rows."""
    from oumi_megatron.grpo.rewards import _is_verl_style, _registry_function

    problems: list[Problem] = []
    for i, rf in enumerate(config.grpo.reward_functions):
        try:
            fn = _registry_function(rf.name)
        except KeyError:
            continue  # reported by _check_grpo_fields
        where_rf = f"grpo.reward_functions[{i}]"
        params = inspect.signature(fn).parameters
        for head in heads:
            if not head.rows:
                continue
            data = f"{head.where} ({head.name})"
            if _is_verl_style(fn):
                if not all(isinstance(r.get("reward_model"), dict) and "ground_truth" in r["reward_model"] for r in head.rows):
                    problems.append(Problem(where_rf, f"{rf.name!r} is a verl-style reward (solution_str, ground_truth): it "
                                            f"reads each row's reward_model.ground_truth, which the rows of {data} do not "
                                            "have. Return {'reward_model': {'ground_truth': ...}} from the dataset's "
                                            "transform, or use a TRL-style reward (completions, **columns)."))
                continue
            columns = _columns(head.rows, config.grpo.environment is not None)
            given = _REWARD_GIVES | columns | set(rf.kwargs)
            required = [n for n, p in params.items() if p.default is p.empty
                        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            missing = [n for n in required if n not in given]
            if missing:
                problems.append(Problem(where_rf, f"{rf.name!r} needs the keyword argument(s) {', '.join(map(repr, missing))}, "
                                        f"which the rows of {data} do not have (their columns after the dataset's "
                                        f"transform: {', '.join(sorted(columns)) or 'none'} besides 'prompt'; every call also "
                                        f"gets completions and prompts). Return {' and '.join(map(repr, missing))} from the "
                                        f"dataset's transform, or set it in {where_rf}.kwargs."))
            clash = sorted(set(rf.kwargs) & (columns | _REWARD_GIVES))
            if clash:
                problems.append(Problem(f"{where_rf}.kwargs", f"sets {', '.join(map(repr, clash))}, which every call already "
                                        f"passes from the rows of {data}: the call would get it twice. Rename the argument."))
            positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
            if positional:
                problems.append(Problem(where_rf, f"{rf.name!r} has positional-only parameter(s) {positional}; rewards are "
                                        "called with keyword arguments (completions=..., prompts=..., one per column)."))
            if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                unexpected = sorted(given - set(rf.kwargs) - set(params))
                if unexpected:
                    problems.append(Problem(where_rf, f"{rf.name!r} takes no **kwargs, and every call passes "
                                            f"{', '.join(map(repr, unexpected))} (from the rows of {data}), which it does "
                                            "not accept. Add **kwargs to its signature."))
    return problems


def _environment_problems(config: MegatronTrainingConfig, heads: list[DatasetHead], r: ValidationReport) -> None:
    """``grpo.environment``'s needs: an episode starts from each first row, and the model's chat template renders the
    environment's observations (where the tokenizer can be read here)."""
    from oumi_megatron.environments.registry import ENVIRONMENTS, build_environment, check_environment
    from oumi_megatron.errors import UserInputError

    g = config.grpo
    if g.environment is None or g.environment not in ENVIRONMENTS:
        return
    environment = build_environment(g.environment)
    for head in heads:
        for index, row in enumerate(head.rows):
            try:
                environment.start(row)
            except Exception as e:  # noqa: BLE001 - the environment's own failure on the user's row
                missing = f" (the rows have no {e} column: return it from the dataset's transform)" if isinstance(e, KeyError) else ""
                r.add("grpo.environment", f"{g.environment!r} cannot start an episode from row {index} of {head.where} "
                                          f"({head.name}): {type(e).__name__}: {e}{missing}.")
                break
    try:
        from oumi.builders import build_tokenizer

        tokenizer = build_tokenizer(config.model)
    except Exception as e:  # noqa: BLE001 - offline, gated: this check waits for training
        r.warn(f"grpo.environment: whether the chat template of {config.model.model_name} renders {g.environment!r}'s "
               f"observations was not checked: its tokenizer cannot be read here ({type(e).__name__}); training checks it.")
        return
    try:
        check_environment(g, tokenizer)
    except UserInputError as e:
        r.add("grpo.environment", str(e).removeprefix("grpo.environment: "))


def check_data(config: MegatronTrainingConfig, r: ValidationReport, rows: int = HEAD_ROWS) -> None:
    """``oumi-megatron validate``'s data checks, before any GPU is touched: every dataset of ``data.train`` and
    ``data.validation`` registered with Oumi and its path present, its first ``rows`` rows loaded and transformed
    into prompts; the reward functions' keyword arguments in those rows; the environment's needs. Each problem names
    the field and the fix; where the Hub cannot be reached, a warning says what was not checked."""
    if "grpo.plugins" in r.fields():  # the modules that register the datasets and rewards did not import
        r.warn("the data was not checked: it needs grpo.plugins to import first (see its problem above).")
        return
    heads: list[DatasetHead] = []
    for split in ("train", "validation"):
        if getattr(config.data, split).datasets:
            heads.extend(dataset_heads(config, split, rows))
    for head in heads:
        if head.problem is not None:
            r.problems.append(head.problem)
        if head.warning is not None:
            r.warn(head.warning)
        if head.rows:
            of = f" of {head.total:,}" if head.total is not None else ""
            columns = ", ".join(sorted(head.rows[0]))
            r.checked.append(f"{head.where} ({head.name}): the first {len(head.rows)}{of} rows give prompts; columns "
                             f"after its transform: {columns}")
    r.problems.extend(reward_argument_problems(config, heads))
    _environment_problems(config, [h for h in heads if h.where.startswith("data.train")], r)
