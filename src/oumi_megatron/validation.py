"""Validation of a MEGATRON_GRPO config against a world size and the model's shape.

Every rule appends to one report, so a user sees all problems at once. Each problem names the field
and says how to fix it. Settings that cannot act in a given layout (ZB-H1 with PP=1, ModuleQueue on
non-last stages) fall back with one warning, as the design documents say. ``oumi-megatron validate``
prints the report; training runs the same function first, before any heavy work.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oumi.exceptions import OumiConfigError

from oumi_megatron.config.grpo_params import ON_REWARD_ERROR
from oumi_megatron.config.megatron_params import (
    ATTENTION_BACKENDS,
    CUDA_GRAPH_IMPLS,
    INFERENCE_BACKENDS,
    PACKED_ATTENTIONS,
    PIPELINE_SCHEDULES,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    RECOMPUTE_MODULES,
    ROLLOUT_PLACEMENTS,
    WEIGHT_SYNC_METHODS,
)
from oumi_megatron.engine.parallel.schedules import resolve_schedule
from oumi_megatron.grpo.algorithm import KL_ESTIMATORS, LOSS_AGGREGATIONS
from oumi_megatron.layout import ParallelLayout
from oumi_megatron.model_shape import ModelShape, ModelShapeError

if TYPE_CHECKING:
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.config.training_config import MegatronTrainingConfig


class MegatronConfigError(OumiConfigError):
    """A MEGATRON_GRPO config that cannot run; the message lists every problem."""

    def __init__(self, report: ValidationReport) -> None:
        self.report = report
        super().__init__(report.format_problems())


@dataclass(frozen=True)
class Problem:
    field: str
    """Dotted config path (``megatron.tensor_model_parallel_size``) or CLI flag (``--world-size``)."""
    message: str
    """What is wrong and how to fix it."""

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass
class ValidationReport:
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Settings taken over from Oumi's own fields (config/oumi_fields.py), for the log."""
    layout: ParallelLayout | None = None
    model_shape: ModelShape | None = None

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


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (the sizes a parallel dimension over ``n`` ranks may take)."""
    return [d for d in range(1, n + 1) if n % d == 0]


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
    strategy = str(getattr(t.eval_strategy, "value", t.eval_strategy) or "no")
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
                                           "give one prefix per validation dataset, in order (e.g. eval for the first, eval_unseen for the second).")
    for i, prefix in enumerate(prefixes):
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", prefix):
            r.add(f"grpo.eval_metric_prefixes[{i}]", f"{prefix!r} is not a metric prefix: use letters, digits and _ "
                                                     "(e.g. eval_unseen), starting with a letter.")


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


def _check_plugins(g: Any, r: ValidationReport) -> None:
    """Import grpo.plugins first: they register the datasets, reward functions and GRPO variants checked below."""
    from oumi_megatron.plugins import load_plugins

    for module in g.plugins or []:
        try:
            load_plugins([module])
        except Exception as e:  # noqa: BLE001 - any failure to import is the user's module to fix
            r.add("grpo.plugins", f"cannot import {module!r} ({type(e).__name__}: {e}). Name an importable module "
                                  "(on PYTHONPATH) that registers your functions.")


def _check_registered_variants(g: Any, r: ValidationReport) -> None:
    """policy_loss / advantage_estimator name registered functions (the plugins are imported); scale_rewards,
    clip_ratio_c."""
    from oumi_megatron.grpo.algorithm import scale_rewards_mode
    from oumi_megatron.grpo.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    for field_name, table, value in (("grpo.policy_loss", POLICY_LOSSES, g.policy_loss),
                                     ("grpo.advantage_estimator", ADVANTAGE_ESTIMATORS, g.advantage_estimator)):
        if value not in table:
            r.add(field_name, f"unknown value {value!r}. Registered: {_fmt_choices(tuple(sorted(table)))} "
                              "(your own: a module in grpo.plugins, docs/grpo.md).")
    try:
        scale_rewards_mode(g.scale_rewards)
    except ValueError as e:
        r.add("grpo.scale_rewards", str(e))
    if g.clip_ratio_c is not None and not g.clip_ratio_c > 1.0:
        r.add("grpo.clip_ratio_c", f"must be > 1 or null (off), got {g.clip_ratio_c!r}: it bounds the loss of "
                                   "negative-advantage tokens at -A x clip_ratio_c. verl's default: 3.0.")


def _check_megatron_fields(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    m = cfg.megatron
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "module_queue_num_chunks",
    ):
        _check_positive(r, f"megatron.{name}", getattr(m, name))
    for name in ("virtual_pipeline_model_parallel_size", "micro_batch_size", "global_batch_size"):
        _check_positive(r, f"megatron.{name}", getattr(m, name), allow_none=True)

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
    if m.ddp_config.average_in_collective:
        r.warn(
            "megatron.ddp_config.average_in_collective: True is not used: GRPO losses are normalized by the global "
            "token/sequence count, which Megatron-Core does by summing gradients in the collective and dividing "
            "once (averaging as well would divide twice). The gradient is the same average. Remove the setting."
        )

    if m.inference_backend not in INFERENCE_BACKENDS:
        hint = " (sglang rollouts are not implemented in oumi-megatron)" if m.inference_backend == "sglang" else ""
        r.add(
            "megatron.inference_backend",
            f"unknown value {m.inference_backend!r}{hint}. Use one of {_fmt_choices(INFERENCE_BACKENDS)}.",
        )
    if m.weight_sync_method not in WEIGHT_SYNC_METHODS:
        r.add(
            "megatron.weight_sync_method",
            f"unknown value {m.weight_sync_method!r}. Use one of {_fmt_choices(WEIGHT_SYNC_METHODS)}.",
        )
    if m.rollout_placement not in ROLLOUT_PLACEMENTS:
        r.add(
            "megatron.rollout_placement",
            f"unknown value {m.rollout_placement!r}. Use one of {_fmt_choices(ROLLOUT_PLACEMENTS)}.",
        )
    if not m.weight_sync_bucket_mb > 0:
        r.add("megatron.weight_sync_bucket_mb", f"must be > 0, got {m.weight_sync_bucket_mb!r}. Typical: 256-1024.")
    if not 0.0 < m.vllm_gpu_memory_utilization <= 1.0:
        r.add("megatron.vllm_gpu_memory_utilization", f"must be in (0, 1], got {m.vllm_gpu_memory_utilization!r}.")
    if m.pipeline_schedule not in PIPELINE_SCHEDULES:
        r.add(
            "megatron.pipeline_schedule",
            f"unknown value {m.pipeline_schedule!r}. Use one of {_fmt_choices(PIPELINE_SCHEDULES)}.",
        )
    if m.inference_backend == "vllm" and not m.enable_weight_sync:
        r.warn(
            "megatron.enable_weight_sync is False: vLLM keeps generating with the initial weights "
            "(rollouts use stale weights and GRPO is off-policy)."
        )

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

    t = m.transformer_config
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
                  f"CUDA graphs have fixed shapes: set it to the longest prompt + completion ({longest}); every microbatch is padded to it.")
        elif t.cuda_graph_seq_length < longest:
            r.add("megatron.transformer_config.cuda_graph_seq_length",
                  f"{t.cuda_graph_seq_length} is shorter than grpo.max_prompt_length + grpo.max_completion_length = {longest}. "
                  f"Set cuda_graph_seq_length: {longest}.")
        if m.enable_sequence_packing:
            r.add("megatron.enable_sequence_packing",
                  "packed rows (block-diagonal masks) are not supported with CUDA graphs. Set enable_sequence_packing: False, or cuda_graph_impl: none.")
        if m.pipeline_model_parallel_size > 1:
            r.add("megatron.transformer_config.cuda_graph_impl",
                  "local CUDA graphs are tested with pipeline_model_parallel_size 1 only. Set cuda_graph_impl: none for PP > 1.")
        if t.recompute_granularity is not None:
            # Megatron-Core refuses full recompute under graphs and skips selective recompute while capturing
            r.add("megatron.transformer_config.recompute_granularity",
                  "activation recompute does not run inside CUDA graphs. Set recompute_granularity: null, or cuda_graph_impl: none.")
    if m.logprob_chunk_tokens is not None and m.logprob_chunk_tokens < 0:
        r.add("megatron.logprob_chunk_tokens",
              f"must be null (auto), 0 (off: full logits) or a positive token count, got {m.logprob_chunk_tokens}.")
    bad_modules = [mod for mod in t.recompute_modules or [] if mod not in RECOMPUTE_MODULES]
    if bad_modules:
        r.add(
            "megatron.transformer_config.recompute_modules",
            f"unknown module(s) {bad_modules}. Choose from {_fmt_choices(RECOMPUTE_MODULES)}.",
        )
    _check_positive(
        r, "megatron.transformer_config.recompute_num_layers", t.recompute_num_layers, allow_none=True
    )
    keep = m.checkpoint_config.keep_last_n_checkpoints
    if not isinstance(keep, int) or keep < 0:
        r.add("megatron.checkpoint_config.keep_last_n_checkpoints", f"must be >= 0 (0 keeps all), got {keep!r}.")


def _check_dapo_fields(g: Any, r: ValidationReport) -> None:
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


def _check_grpo_fields(cfg: MegatronTrainingConfig, r: ValidationReport) -> None:
    g = cfg.grpo
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
    import oumi.datasets.grpo.rewards  # noqa: F401 - registers Oumi's reward functions
    from oumi.core.registry import REGISTRY, RegistryType

    return set(REGISTRY.get_all(RegistryType.REWARD_FUNCTION))


# --------------------------------------------------------------------------------------------------
# Rules that need the world size and the model's shape
# --------------------------------------------------------------------------------------------------
def _resolve_batches(
    cfg: MegatronTrainingConfig, dp: int
) -> tuple[int, int]:
    m = cfg.megatron
    micro = m.micro_batch_size or cfg.training.per_device_train_batch_size
    global_batch = m.global_batch_size or micro * cfg.training.gradient_accumulation_steps * dp
    return micro, global_batch


def _check_module_queue(m: MegatronParams, r: ValidationReport) -> None:
    """ModuleQueue's rules (engine/parallel/module_queue.py): what it cannot run with is an error, where it acts a warning."""
    t = m.transformer_config
    if m.ddp_config.overlap_param_gather:
        r.add("megatron.enable_module_queue",
              "does not run with ddp_config.overlap_param_gather: true (the parameter all-gather would write into the "
              "contiguous parameter buffer ModuleQueue detaches during the forward pass). Set overlap_param_gather: "
              "false, or enable_module_queue: false.")
    if t.cuda_graph_impl == "local":
        r.add("megatron.enable_module_queue",
              "does not run inside CUDA graphs (a graph replays fixed weight addresses; ModuleQueue frees and "
              "reallocates them). Set cuda_graph_impl: none, or enable_module_queue: false.")
    r.warn(
        "megatron.enable_module_queue acts only where it can: on the last pipeline stage "
        f"(post_process=True{'; the only stage here' if m.pipeline_model_parallel_size == 1 else ''}) "
        "during training steps. Other stages build a plain GPTModel, and forward passes without gradients "
        "(logprobs, rollout generation) run with every weight on the GPU."
    )


def _resolve_schedule(cfg: MegatronTrainingConfig, r: ValidationReport) -> str:
    m = cfg.megatron
    if m.pipeline_schedule == "interleaved" and not m.virtual_pipeline_model_parallel_size:
        r.add(
            "megatron.pipeline_schedule",
            "'interleaved' needs megatron.virtual_pipeline_model_parallel_size (model chunks per "
            "pipeline rank, e.g. 2). Set it, or use pipeline_schedule: 1f1b.",
        )
    schedule, why_not = resolve_schedule(m)  # the engine runs what this returns (engine/parallel/schedules.py)
    if why_not is not None:
        r.warn(f"megatron.pipeline_schedule {why_not}; using {schedule}.")
    if schedule == "zb_h1" and m.transformer_config.gradient_accumulation_fusion is False:
        r.add("megatron.transformer_config.gradient_accumulation_fusion",
              "zb_h1 defers the weight-gradient GEMMs of the linear layers, which it takes from the gradient "
              "accumulation fusion path. Set gradient_accumulation_fusion: null (zb_h1 turns it on), or pipeline_schedule: 1f1b.")
    return schedule


def _check_layout(
    cfg: MegatronTrainingConfig, world_size: int, gpus_per_node: int | None, r: ValidationReport
) -> ParallelLayout | None:
    m = cfg.megatron
    sizes = m.parallel_sizes
    if any(not isinstance(s, int) or s < 1 for s in sizes):
        return None  # already reported
    mp = m.model_parallel_size
    if world_size % mp != 0:
        r.add(
            "megatron.tensor_model_parallel_size",
            f"world_size ({world_size}) must be divisible by the product of all model parallel sizes ({mp}): "
            f"TP {sizes[0]} x PP {sizes[1]} x CP {sizes[2]}. Adjust the parallel sizes "
            f"so that their product divides {world_size} (or run on a multiple of {mp} GPUs).",
        )
        return None
    dp = world_size // mp
    ep, stage_ranks = m.expert_model_parallel_size, world_size // m.pipeline_model_parallel_size
    if stage_ranks % ep != 0:  # Megatron-Core's expert groups: EP x expert-DP ranks of one pipeline stage
        r.add(
            "megatron.expert_model_parallel_size",
            f"{ep} must divide the ranks of a pipeline stage, TP x CP x DP = {stage_ranks} (experts are split over "
            f"them). Use one of {divisors(stage_ranks)}.",
        )
        return None
    vpp = m.virtual_pipeline_model_parallel_size

    if vpp is not None and m.pipeline_model_parallel_size <= 1:
        r.add(
            "megatron.virtual_pipeline_model_parallel_size",
            "needs pipeline_model_parallel_size > 1 (it splits each pipeline rank's layers into chunks). "
            "Remove it or raise pipeline_model_parallel_size.",
        )
    if m.sequence_parallel and m.tensor_model_parallel_size <= 1:
        r.add(
            "megatron.sequence_parallel",
            "needs tensor_model_parallel_size > 1 (it shards activations over the TP group). "
            "Set sequence_parallel: False or raise tensor_model_parallel_size.",
        )
    if gpus_per_node is not None:
        if gpus_per_node < 1:
            r.add("--gpus-per-node", f"must be a positive integer, got {gpus_per_node}.")
        elif world_size % gpus_per_node != 0:
            r.add(
                "--gpus-per-node",
                f"world size {world_size} is not a whole number of nodes of {gpus_per_node} GPUs.",
            )
        elif m.tensor_model_parallel_size > gpus_per_node:
            r.warn(
                f"megatron.tensor_model_parallel_size {m.tensor_model_parallel_size} spans nodes of "
                f"{gpus_per_node} GPUs: TP all-reduces every layer, keep it within a node (NVLink)."
            )

    seq = cfg.grpo.max_sequence_length
    cp = m.context_parallel_size
    if cp > 1 and seq % (2 * cp) != 0:
        fixed = seq + (2 * cp - seq % (2 * cp))
        r.add(
            "grpo.max_completion_length",
            f"context parallelism splits each sequence into 2 x CP = {2 * cp} chunks, but "
            f"grpo.max_prompt_length + grpo.max_completion_length = {seq} is not divisible by {2 * cp}. "
            f"Set grpo.max_completion_length to {cfg.grpo.max_completion_length + fixed - seq} "
            f"(total {fixed}).",
        )

    micro, global_batch = _resolve_batches(cfg, dp)
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
        r.add(
            "megatron.global_batch_size",
            f"{global_batch} is not divisible by micro_batch_size x DP = {micro} x {dp} = {micro * dp}. "
            f"Use a multiple of {micro * dp} (e.g. {max(1, global_batch // (micro * dp)) * micro * dp}).",
        )
    completions = global_batch * cfg.grpo.num_mini_batches
    ng = cfg.grpo.num_generations
    if isinstance(ng, int) and ng >= 2 and completions % ng != 0:
        r.add(
            "grpo.num_generations",
            f"completions per GRPO step (megatron.global_batch_size x grpo.num_mini_batches = "
            f"{completions}) must be a multiple of grpo.num_generations ({ng}) so that every prompt's "
            "group is complete. Change either.",
        )

    schedule = _resolve_schedule(cfg, r)
    if m.enable_module_queue:
        _check_module_queue(m, r)
    return ParallelLayout(
        world_size=world_size,
        tensor_parallel=m.tensor_model_parallel_size,
        pipeline_parallel=m.pipeline_model_parallel_size,
        context_parallel=cp,
        expert_parallel=m.expert_model_parallel_size,
        data_parallel=dp,
        virtual_pipeline=vpp,
        sequence_parallel=m.sequence_parallel,
        micro_batch_size=micro,
        global_batch_size=global_batch,
        pipeline_schedule=schedule,
        num_generations=ng if isinstance(ng, int) and ng > 0 else 1,
        num_mini_batches=max(1, cfg.grpo.num_mini_batches),
        gpus_per_node=gpus_per_node,
    )


def _check_model_shape(cfg: MegatronTrainingConfig, shape: ModelShape, r: ValidationReport) -> None:
    m = cfg.megatron
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
            r.add(
                "model.model_name",
                f"{shape.source} is a {', '.join(shape.architectures)} model, which Megatron-Bridge cannot "
                f"convert. Use a supported architecture, e.g. {', '.join(sorted(a for a in supported if a.endswith('ForCausalLM'))[:8])} ...",
            )


def default_world_size(cfg: MegatronTrainingConfig) -> int:
    """WORLD_SIZE under torchrun; otherwise the smallest world the layout fits: PP x lcm(TP x CP, EP)
    (DP = 1 unless EP needs more ranks per stage)."""
    env = os.environ.get("WORLD_SIZE")
    if env:
        return int(env)
    tp, pp, cp, ep = (s if isinstance(s, int) and s > 0 else 1 for s in cfg.megatron.parallel_sizes)
    return pp * math.lcm(tp * cp, ep)


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
    world = world_size if world_size is not None else default_world_size(config)
    if world < 1:
        r.add("--world-size", f"must be a positive integer, got {world}.")
        return r
    _check_plugins(config.grpo, r)
    _check_trainer_and_incompatible(config, r)
    _check_training_fields(config, r)
    _check_megatron_fields(config, r)
    _check_grpo_fields(config, r)
    r.layout = _check_layout(config, world, gpus_per_node, r)

    if model_shape is None and (model_config_path or (config.model.model_name or "").strip()):
        source = model_config_path or config.model.model_name
        try:
            if model_config_path:
                model_shape = ModelShape.from_file(model_config_path)
            else:
                model_shape = ModelShape.resolve(config.model.model_name, config.model.model_revision)
        except ModelShapeError as e:
            field_name = "--model-config" if model_config_path else "model.model_name"
            if e.unsupported_architecture:
                r.add(field_name, str(e))
                check_bridge = False  # said already, in the words that fit
            else:
                r.add(
                    field_name,
                    f"cannot read the model's shape: {e}. Use a local folder with config.json, check the "
                    f"name, or (offline) pass `--model-config PATH/config.json` with a copy of {source}'s config.",
                )
    if model_shape is not None:
        r.model_shape = model_shape
        _check_model_shape(config, model_shape, r)
    if check_bridge:
        _check_megatron_bridge(r, model_shape)
    return r
