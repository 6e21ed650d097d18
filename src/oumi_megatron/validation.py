"""Validation of a MEGATRON_GRPO config: every feature's checks, in one order, into one report.

Each feature checks its own fields in its own module (``check_*(config, found)``: docs/architecture.md lists who checks
what); this module only orders the checks and collects what they find, so a user sees every problem at once, each
naming its field and the fix. The parallel layout, batch sizes and pipeline schedule are resolved (and their problems
found) by ``layout.resolve_layout``. Names a config selects (schedules, losses, estimators, rollout backends,
environments) are checked against the live registries, after ``grpo.plugins`` are imported. ``oumi-megatron validate``
prints the report; training runs the same function first, before any heavy work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from oumi.exceptions import OumiConfigError

from oumi_megatron.bridge_utils import check_megatron_bridge
from oumi_megatron.config.grpo_params import check_rollout_dump_steps, check_sandbox
from oumi_megatron.config.lora import check_lora
from oumi_megatron.config.problems import Findings, Problem
from oumi_megatron.config.training_config import check_oumi_sections
from oumi_megatron.data import HEAD_ROWS, DatasetHead, dataset_heads
from oumi_megatron.engine.builder import check_ddp
from oumi_megatron.engine.kernels.attention import check_attention
from oumi_megatron.engine.kernels.chunked_logprobs import check_logprob_chunks
from oumi_megatron.engine.kernels.cuda_graphs import check_cuda_graph_fields
from oumi_megatron.engine.model import check_recompute
from oumi_megatron.engine.optimizer import check_optimizer
from oumi_megatron.engine.parallel.context_parallel import check_context_parallel
from oumi_megatron.engine.parallel.layout import ParallelLayout, check_module_queue_chunks, resolve_layout
from oumi_megatron.engine.peft import check_lora_on_model
from oumi_megatron.engine.state.checkpointing import check_checkpoints
from oumi_megatron.engine.state.hf_writer import check_shard_size
from oumi_megatron.environments.registry import check_environment_data, check_environment_settings
from oumi_megatron.grpo.algorithm import check_loss_and_updates, check_sampling_and_clipping
from oumi_megatron.grpo.rewards import check_reward_functions, reward_argument_problems
from oumi_megatron.model_shape import ModelShape, check_model_needs, read_config_shape
from oumi_megatron.plugins import check_plugins
from oumi_megatron.rollout.registry import check_lora_sync, check_own_gpu_engines, check_rollout
from oumi_megatron.trainer.async_rollouts import check_staleness
from oumi_megatron.trainer.evaluation import check_evaluation
from oumi_megatron.trainer.run_dir import check_output_dir

if TYPE_CHECKING:
    from oumi_megatron.config.training_config import MegatronTrainingConfig

__all__ = ["MegatronConfigError", "Problem", "ValidationReport", "check_data", "validate_config"]

ConfigCheck = Callable[["MegatronTrainingConfig", Findings], None]
ShapeCheck = Callable[["MegatronTrainingConfig", ModelShape, Findings], None]

CONFIG_CHECKS: tuple[ConfigCheck, ...] = (
    check_plugins,  # first: they register what the checks below look up
    check_lora, check_lora_sync,
    check_oumi_sections, check_evaluation, check_output_dir,
    # the megatron: section
    check_module_queue_chunks, check_ddp, check_logprob_chunks, check_checkpoints, check_shard_size,
    check_context_parallel, check_rollout, check_optimizer, check_recompute, check_attention, check_cuda_graph_fields,
    # the grpo: section
    check_rollout_dump_steps, check_sampling_and_clipping, check_staleness, check_environment_settings, check_sandbox,
    check_loss_and_updates, check_reward_functions,
)
"""The checks that need the config alone, in the order their problems are reported."""

SHAPE_CHECKS: tuple[ShapeCheck, ...] = (check_lora_on_model, check_model_needs, check_own_gpu_engines)
"""The checks that need the model's shape, after the layout's."""


class MegatronConfigError(OumiConfigError):
    """A MEGATRON_GRPO config that cannot run; the message lists every problem."""

    def __init__(self, report: ValidationReport) -> None:
        self.report = report
        super().__init__(report.format_problems())


@dataclass
class ValidationReport(Findings):
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
        check_bridge: also check that Megatron-Bridge imports and converts the model.
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
    for check in CONFIG_CHECKS:
        check(config, r)
    if model_shape is None and (model_config_path or (config.model.model_name or "").strip()):
        model_shape, unsupported = read_config_shape(config, model_config_path, r, r.notes)
        check_bridge = check_bridge and not unsupported  # said already, in the words that fit
    resolution = resolve_layout(config, world_size, gpus_per_node, model_shape)
    r.layout = resolution.layout
    r.problems.extend(resolution.problems)
    r.warnings.extend(resolution.warnings)
    if model_shape is not None:
        r.model_shape = model_shape
        for shape_check in SHAPE_CHECKS:
            shape_check(config, model_shape, r)
    if check_bridge:
        check_megatron_bridge(model_shape, r)
    return r


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
    check_environment_data(config, [h for h in heads if h.where.startswith("data.train")], r)
