"""Pipeline schedules by name (``megatron.pipeline_schedule``): what each one runs and which settings it needs.

Resolution happens once, in engine/parallel/layout.py (``resolve_schedule``): the requested name is checked against this live
registry and the entry's rules, and the name that runs travels in ``ParallelLayout`` to the engine, which only
looks its function up here, the way torchtitan resolves its pipeline schedule class. Adding a schedule is one
``SCHEDULES.add(name, PipelineSchedule(...))`` (here or in a ``grpo.plugins`` module). What the rest of the code
needs to know about a schedule (it defers weight gradients, it holds more activations) is a property of its entry,
read as ``SCHEDULES.get(name).<property>``, never a compare of its name.

- ``none``: PP = 1, Megatron-Core's ``forward_backward_no_pipelining``;
- ``1f1b`` (the default): Megatron-Core's ``forward_backward_pipelining_without_interleaving``; it stands for
  the layout's natural schedule, so PP = 1 runs ``none`` and a virtual pipeline runs ``interleaved``;
- ``interleaved``: Megatron-Core's ``forward_backward_pipelining_with_interleaving`` (virtual pipeline);
- ``zb_h1``: engine/parallel/zero_bubble.py (1F1B with the weight-gradient GEMMs deferred into the bubbles).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oumi_megatron.engine.parallel.zero_bubble import forward_backward_zb_h1, zb_h1_unsupported_reason
from oumi_megatron.utils.registry import Registry

if TYPE_CHECKING:
    from oumi_megatron.config.megatron_params import MegatronParams

ForwardBackward = Callable[..., Any]
"""Megatron-Core's forward-backward signature (``forward_step_func``, ``data_iterator``, ``model``, ...)."""


def _never(params: MegatronParams) -> None:
    return None


@dataclass(frozen=True)
class PipelineSchedule:
    load: Callable[[], ForwardBackward]
    """Returns the forward-backward function (imported lazily: Megatron-Core's schedules import CUDA bits)."""
    cannot_act: Callable[[MegatronParams], str | None] = _never
    """Why it cannot act in these settings; the run falls back to the layout's natural schedule, with a warning."""
    refuses: Callable[[MegatronParams], tuple[str, str] | None] = _never
    """(field, message) for settings it cannot run with at all: a config error."""
    natural: bool = False
    """True for the default name: it stands for the layout's natural schedule (none / 1f1b / interleaved)."""
    defers_weight_gradients: bool = False
    """It queues the linear layers' weight-gradient GEMMs (engine/parallel/zero_bubble.py): the model is built with
    the gradient accumulation path those GEMMs come from, and the step reports how many it deferred."""
    activation_factor: float = 1.0
    """Activation memory of a pipeline stage over 1F1B's for the same microbatches in flight (``oumi-megatron plan``)."""


def _no_pipelining() -> ForwardBackward:
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    return forward_backward_no_pipelining


def _one_f_one_b() -> ForwardBackward:
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    return forward_backward_pipelining_without_interleaving


def _interleaved() -> ForwardBackward:
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

    return forward_backward_pipelining_with_interleaving


def _none_refuses(params: MegatronParams) -> tuple[str, str] | None:
    if params.pipeline_model_parallel_size > 1:
        return ("megatron.pipeline_schedule", f"'none' runs no pipeline, but pipeline_model_parallel_size is "
                f"{params.pipeline_model_parallel_size}. Use 1f1b, interleaved or zb_h1.")
    return None


def _interleaved_refuses(params: MegatronParams) -> tuple[str, str] | None:
    if not params.virtual_pipeline_model_parallel_size:
        return ("megatron.pipeline_schedule", "'interleaved' needs megatron.virtual_pipeline_model_parallel_size "
                "(model chunks per pipeline rank, e.g. 2). Set it, or use pipeline_schedule: 1f1b.")
    return None


def _zb_h1_refuses(params: MegatronParams) -> tuple[str, str] | None:
    # ZB-H1 takes the weight-gradient GEMMs it defers from the gradient accumulation fusion path
    # (engine/kernels/fusions.py turns the fusion on under zb_h1); an explicit false cannot be honoured.
    if params.transformer_config.gradient_accumulation_fusion is False and zb_h1_unsupported_reason(params) is None:
        return ("megatron.transformer_config.gradient_accumulation_fusion",
                "zb_h1 defers the weight-gradient GEMMs of the linear layers, which it takes from the gradient "
                "accumulation fusion path. Set gradient_accumulation_fusion: null (zb_h1 turns it on), or pipeline_schedule: 1f1b.")
    return None


DEFAULT_SCHEDULE = "1f1b"

SCHEDULES: Registry[PipelineSchedule] = Registry(
    "pipeline schedule", "megatron.pipeline_schedule", "a new one is one SCHEDULES.add in engine/parallel/schedules.py")
SCHEDULES.add("none", PipelineSchedule(_no_pipelining, refuses=_none_refuses))
SCHEDULES.add(DEFAULT_SCHEDULE, PipelineSchedule(_one_f_one_b, natural=True))
SCHEDULES.add("interleaved", PipelineSchedule(_interleaved, refuses=_interleaved_refuses))
# activation_factor: the deferred weight-gradient inputs over 1F1B's activations (measured +8.0% PP=2, +9.4% PP=4)
SCHEDULES.add("zb_h1", PipelineSchedule(lambda: forward_backward_zb_h1, cannot_act=zb_h1_unsupported_reason,
                                        refuses=_zb_h1_refuses, defers_weight_gradients=True, activation_factor=1.10))


def natural_schedule(params: MegatronParams) -> str:
    """The schedule a layout runs by default: none without a pipeline, interleaved with a virtual pipeline."""
    if params.pipeline_model_parallel_size <= 1:
        return "none"
    return "interleaved" if params.virtual_pipeline_model_parallel_size else DEFAULT_SCHEDULE


def schedule_function(name: str) -> ForwardBackward:
    """The forward-backward function of a resolved schedule name."""
    return SCHEDULES.get(name).load()
