"""Where a run starts: a fresh output_dir, a checkpoint to resume from, or a run that is already there.

First, ``check_shared``: every rank must see one output_dir (a run across nodes writes each checkpoint, the converted
model and the export in parts, from the ranks that hold them). Then, decided before any heavy work (conversion,
engine), the same way on every rank (the checkpoint checks are collective once torch.distributed runs: each rank
verifies its own files, engine/state/checkpoint_manifest.py):

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
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oumi_megatron.engine.state.checkpoint_io import META_FILE
from oumi_megatron.engine.state.checkpointing import (
    STATE_FILE,
    CheckpointError,
    list_checkpoints,
    newest_valid_checkpoint,
    verify_checkpoint,
)
from oumi_megatron.engine.state.hf_weights import HF_ADAPTER, HF_MODEL
from oumi_megatron.errors import UserInputError
from oumi_megatron.utils.atomic import MEGATRON_CHECKPOINT, PRIVATE_DIR_MODE
from oumi_megatron.utils.disk import space_problem
from oumi_megatron.utils.ranks import first_failure, from_rank0, global_rank

if TYPE_CHECKING:
    from oumi_megatron.config.problems import Findings


class OutputDirInUseError(UserInputError):
    """output_dir holds an earlier run and the config does not say to resume it."""


class ResumeCheckpointError(UserInputError, CheckpointError):
    """The checkpoint named by training.resume_from_checkpoint cannot be resumed from."""


class OutputDirSpaceError(UserInputError):
    """output_dir's filesystem cannot hold what the run will write (found before conversion)."""


class OutputDirNotSharedError(UserInputError):
    """Some rank does not see the output_dir rank 0 writes to (node-local folders in a multi-node run)."""


def check_shared(output_dir: str | Path) -> None:
    """Collective: every rank sees a file rank 0 writes into ``output_dir`` (then removed), or every rank stops with an
    error naming training.output_dir and the fix. Nothing else is written before this check passes."""
    output_dir = Path(output_dir)
    name = from_rank0(f".oumi_megatron_shared_check_{uuid.uuid4().hex}")
    token = output_dir / name
    problem = None
    if global_rank() == 0:
        try:
            if not output_dir.exists():  # a run's folder holds prompts, completions and models: private to the user
                output_dir.mkdir(parents=True, mode=PRIVATE_DIR_MODE)
            token.write_text(name)
        except OSError as e:
            problem = f"training.output_dir: {output_dir} cannot be written ({type(e).__name__}: {e})"
    problem = first_failure(problem)  # also: rank 0 has written the file before anyone looks
    if problem is None:
        seen = token.is_file() and token.read_text() == name
        problem = first_failure(None if seen else (
            f"training.output_dir: {output_dir} is not one folder every rank shares: rank {global_rank()} "
            f"(host {socket.gethostname()}) does not see the file rank 0 wrote there ({name}). A run writes each "
            "checkpoint, the converted model and the HF export once, in parts, from the ranks that hold them, so every "
            "node must see the same folder: set training.output_dir to a path on a filesystem every node mounts at that "
            "path (NFS, Lustre, GPFS, ...)"))
    if global_rank() == 0:
        token.unlink(missing_ok=True)
    if problem is not None:
        raise OutputDirNotSharedError(problem)


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
    for folder in (HF_MODEL, HF_ADAPTER):
        if (output_dir / folder).exists():
            found.append(f"{folder}/")
    metrics = output_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    return found


def _step_of(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / STATE_FILE).read_text())["step"])


def plan_start(training: Any) -> StartPoint:
    """Read-only, the same answer on every rank (collective once torch.distributed is initialized: the checkpoint
    checks are split over the ranks). ``training`` is Oumi's ``training:`` section. A checkpoint it returns has been
    verified (``StartPoint.checkpoint``: load it with ``verified=True``)."""
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


def check_space(config: Any, shape: Any, start: StartPoint) -> None:
    """Collective: stops every rank, before the conversion, when output_dir's filesystem cannot hold what is still to be
    written: the converted model if it is not there, the checkpoints that will coexist beyond those on disk (at most
    the saves left), the final HF export (state_plan.py's sizes). ``shape``: the model's ModelShape (None: unknown,
    nothing to check)."""
    problem = None
    if global_rank() == 0 and shape is not None:
        from oumi_megatron.state_plan import CHECKPOINT_BYTES_PER_PARAM, model_params

        t, keep = config.training, config.megatron.checkpoint_config.keep_last_n_checkpoints
        out = Path(t.output_dir)
        weights = 2.0 * model_params(shape)
        need = 0.0 if (out / MEGATRON_CHECKPOINT / META_FILE).is_file() else weights
        if t.save_final_model and not (out / "hf_model").exists():
            need += weights
        saves = -(-max(t.max_steps - start.step, 0) // t.save_steps) if t.save_steps else 0
        saves += 1  # the final checkpoint
        existing = len(list_checkpoints(out / "checkpoints"))
        new = saves if keep <= 0 else min(saves, max(keep + 1 - existing, 1))
        need += new * CHECKPOINT_BYTES_PER_PARAM * model_params(shape)
        problem = space_problem(out, need, f"this run ({new} checkpoint(s) of ~{CHECKPOINT_BYTES_PER_PARAM:.0f} B per "
                                f"parameter beside the {existing} on disk, the converted model and the HF export)",
                                "free space there, lower megatron.checkpoint_config.keep_last_n_checkpoints (0 keeps all), "
                                "or set training.output_dir to a larger filesystem")
    problem = first_failure(problem)
    if problem is not None:
        raise OutputDirSpaceError(f"training.output_dir: {problem}")


def check_output_dir(config: Any, found: Findings) -> None:
    """``training.output_dir`` must be a folder this user can create and write into (checked before any work, not after
    the conversion)."""
    output_dir = config.training.output_dir
    path = Path(output_dir or "").expanduser()
    if not str(output_dir or "").strip():
        found.add("training.output_dir", "is empty. Set it to a folder for checkpoints, metrics and the exported model.")
        return
    if path.exists() and not path.is_dir():
        found.add("training.output_dir", f"{path} exists and is not a folder. Choose another output_dir.")
        return
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        found.add("training.output_dir", f"cannot be created: {existing} is a file. Choose another output_dir.")
    elif not os.access(existing, os.W_OK | os.X_OK):
        found.add("training.output_dir", f"{existing} is not writable by this user, so {path} cannot be written. "
                                         "Choose a writable output_dir.")
