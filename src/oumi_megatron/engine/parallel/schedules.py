"""Pipeline schedules by name: the one place that maps ``megatron.pipeline_schedule`` to the function that runs.

Validation resolves the requested schedule against the layout once (``resolve_schedule``: ZB-H1 falls
back where it cannot run, and says why) and the resolved name travels in ``ParallelLayout`` to the
engine, which looks the function up here (``schedule_function``), the way torchtitan resolves its
pipeline schedule class. Adding a schedule is one entry in ``SCHEDULES``.

- ``none``: PP = 1, Megatron-Core's ``forward_backward_no_pipelining``;
- ``1f1b``: Megatron-Core's ``forward_backward_pipelining_without_interleaving``;
- ``interleaved``: Megatron-Core's ``forward_backward_pipelining_with_interleaving`` (virtual pipeline);
- ``zb_h1``: engine/parallel/zero_bubble.py (1F1B with the weight-gradient GEMMs deferred into the bubbles).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from oumi_megatron.engine.parallel.zero_bubble import forward_backward_zb_h1, zb_h1_unsupported_reason


def _no_pipelining() -> Callable:
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    return forward_backward_no_pipelining


def _one_f_one_b() -> Callable:
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    return forward_backward_pipelining_without_interleaving


def _interleaved() -> Callable:
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

    return forward_backward_pipelining_with_interleaving


SCHEDULES: dict[str, Callable[[], Callable]] = {
    "none": _no_pipelining,
    "1f1b": _one_f_one_b,
    "interleaved": _interleaved,
    "zb_h1": lambda: forward_backward_zb_h1,
}


def schedule_function(name: str) -> Callable:
    """The forward-backward function of a resolved schedule name."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; registered: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]()


def resolve_schedule(params: Any) -> tuple[str, str | None]:  # MegatronParams
    """(schedule that runs, why it is not the requested one or None) for ``megatron.pipeline_schedule``."""
    pp, vpp = params.pipeline_model_parallel_size, params.virtual_pipeline_model_parallel_size
    default = "none" if pp <= 1 else ("interleaved" if vpp else "1f1b")
    if params.pipeline_schedule == "zb_h1":
        reason = zb_h1_unsupported_reason(params)
        return ("zb_h1", None) if reason is None else (default, f"zb_h1 is not supported because {reason}")
    return default, None
