"""Where a run starts: a fresh output_dir, a checkpoint to resume from, or a run that is already there.

Decided before any heavy work (conversion, engine), the same way on every rank:

* ``training.resume_from_checkpoint: PATH``: that checkpoint, which must be complete (else an error
  naming what is wrong with it).
* ``training.try_resume_from_last_checkpoint: true``: the newest complete checkpoint in
  ``output_dir/checkpoints``; damaged newer ones are named in a warning and skipped; none: step 0.
* neither, while ``output_dir`` already holds a run (checkpoints, ``hf_model/`` or metrics): an error.
  A previous run is never overwritten without an explicit choice: resume it, or pick another
  output_dir (or delete the old run's folders). The converted model (``megatron_checkpoint/``) is a
  cache, not a run, and is reused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oumi_megatron.engine.state.checkpointing import STATE_FILE, CheckpointError, newest_valid_checkpoint, verify_checkpoint
from oumi_megatron.errors import UserInputError


class OutputDirInUseError(UserInputError):
    """output_dir holds an earlier run and the config does not say to resume it."""


class ResumeCheckpointError(UserInputError, CheckpointError):
    """The checkpoint named by training.resume_from_checkpoint cannot be resumed from."""


@dataclass(frozen=True)
class StartPoint:
    checkpoint: Path | None
    """The checkpoint to resume from; None: start at step 0."""
    step: int
    """The GRPO step the checkpoint holds (0 for a fresh start)."""


def _previous_run(output_dir: Path) -> list[str]:
    found = []
    if any((output_dir / "checkpoints").glob("step_*")):  # complete or not: either is the old run's
        found.append("checkpoints/")
    if (output_dir / "hf_model").exists():
        found.append("hf_model/")
    metrics = output_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    return found


def _step_of(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / STATE_FILE).read_text())["step"])


def plan_start(training: Any) -> StartPoint:
    """Read-only, the same answer on every rank (called before torch.distributed starts). ``training`` is
    Oumi's ``training:`` section."""
    output_dir = Path(training.output_dir)
    if training.resume_from_checkpoint:
        checkpoint = Path(training.resume_from_checkpoint)
        problem = verify_checkpoint(checkpoint)
        if problem is not None:
            raise ResumeCheckpointError(
                f"training.resume_from_checkpoint: cannot resume from {checkpoint}: {problem}. Point it at a complete "
                "checkpoint (output_dir/checkpoints/step_XXXXXX), or use training.try_resume_from_last_checkpoint: "
                "true to take the newest complete one."
            )
        return StartPoint(checkpoint, _step_of(checkpoint))
    if training.try_resume_from_last_checkpoint:
        newest = newest_valid_checkpoint(output_dir / "checkpoints")
        return StartPoint(newest, _step_of(newest) if newest else 0)
    previous = _previous_run(output_dir)
    if previous:
        raise OutputDirInUseError(
            f"training.output_dir: {output_dir} already holds a run ({', '.join(previous)}), and starting over "
            "would overwrite it. To continue it, set training.try_resume_from_last_checkpoint: true; to start a "
            "new run, choose another training.output_dir (or delete those folders first)."
        )
    return StartPoint(None, 0)
