"""Training checkpoints for resume: model, optimizer, LR schedule, RNG states, step and data position.

Layout of ``output_dir/checkpoints/step_000012/``:

* ``model/``: weights as a Megatron-Core distributed checkpoint (also what ``export`` reads);
* ``optimizer/``: the optimizer state as a distributed checkpoint;
* ``hf/``: config and tokenizer files (so a checkpoint exports on its own);
* ``rank_XXXXX.pt``: per-rank RNG states and the LR scheduler;
* ``trainer_state.json``: step, data position and whatever the trainer adds; written last.

Each checkpoint is written into ``.step_000012.partial`` and renamed when complete (see
``utils/atomic.py``), so ``latest_checkpoint`` never sees a partial one; only the newest
``keep_last`` are kept.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from oumi_megatron.engine.checkpoint_io import (
    load_model,
    load_strategy,
    model_sharded_state_dict,
    save_model,
    save_strategy,
)
from oumi_megatron.utils import atomic

STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"
# Megatron-Core's default distributed-optimizer sharding cannot be saved without TE/apex
# ("ShardedTensor.flattened_range is not supported"); fully_reshardable works everywhere.
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _fully_parallel(engine: Any) -> bool:
    return bool(engine.params.checkpoint_config.use_fully_parallel_strategy)


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` (ascending by step); partial ones are never listed."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m and child.is_dir() and (child / STATE_FILE).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1][1] if ckpts else None


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    from megatron.core import tensor_parallel

    state["megatron_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def _torch_adams(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's (possibly chained) optimizer."""
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [sub.optimizer for sub in subs if isinstance(getattr(sub, "optimizer", None), torch.optim.Optimizer)]


def _materialize_adam_state(optimizer: Any) -> None:
    """Without TE/apex Megatron-Core falls back to torch Adam, whose ``DistributedOptimizer.state_dict``
    asserts that every parameter has a ``step`` (false before the first step, e.g. when building the
    template to load into). Give never-stepped parameters the state torch Adam would create."""
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for p in group["params"]:
                state = adam.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


@contextlib.contextmanager
def _skip_missing_step_on_load(optimizer: Any) -> Iterator[None]:
    """torch Adam keeps ``step`` as a tensor in each parameter's state, but the fully-reshardable
    checkpoint holds only the param/exp_avg/exp_avg_sq tensors, so Megatron-Core's
    ``_set_main_param_and_optimizer_states`` raises KeyError('step'). ``step`` is restored from the
    param groups instead (see ``_unshare_adam_steps``); mark it as absent for the duration of the load."""
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    patched = []
    for sub in subs:
        original = getattr(sub, "_set_main_param_and_optimizer_states", None)
        if original is None:
            continue
        sub._set_main_param_and_optimizer_states = lambda p, t, _o=original: _o(p, {"step": None, **t})
        patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states  # back to the class method


def _unshare_adam_steps(optimizer: Any) -> None:
    """Megatron-Core's load gives every parameter the *same* ``step`` tensor; torch Adam increments it
    in place once per parameter, which would corrupt bias correction after resume. Copy it per param."""
    for adam in _torch_adams(optimizer):
        for state in adam.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].detach().clone()


class AsyncCheckpointWriter:
    """Background checkpoint writes (``checkpoint_config.use_async_checkpoint``).

    Megatron-Core stages the tensors to host memory when the save is scheduled, so training goes on
    while a background process writes them; the checkpoint is committed (renamed into place, pruned)
    by a finalize step once every rank's write has finished. ``poll`` finalizes finished writes,
    ``wait`` blocks until all are done (before the next save and at the end of training).
    """

    def __init__(self) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue()

    def schedule(self, request: Any) -> None:
        self.queue.schedule_async_request(request)

    def poll(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True)

    def close(self) -> None:
        self.wait()
        self.queue.close()


def save_checkpoint(
    engine: Any,
    root: str | Path,
    step: int,
    trainer_state: dict[str, Any],
    hf_artifacts: str | Path,
    keep_last: int = 2,
    async_writer: AsyncCheckpointWriter | None = None,
) -> Path:
    """Collective. Writes ``root/step_XXXXXX`` atomically, then prunes to the newest ``keep_last``.

    With ``async_writer`` the tensor files are written in the background and the checkpoint appears
    (is committed) only when they are complete; until then it stays ``.step_XXXXXX.partial``.
    """
    from megatron.core import dist_checkpointing

    final = Path(root) / step_dir_name(step)
    if async_writer is not None:
        async_writer.wait()  # one checkpoint in flight at a time
    tmp = atomic.begin(final)
    if _rank() == 0:
        (tmp / "model").mkdir()
        (tmp / "optimizer").mkdir()
        shutil.copytree(hf_artifacts, tmp / "hf")
    if dist.is_initialized():
        dist.barrier()
    fully_parallel = _fully_parallel(engine)
    optim_sd = engine.optimizer.sharded_state_dict(
        model_sharded_state_dict(engine.model), is_loading=False, metadata=_OPTIM_METADATA
    )
    # torch.save of RNG / scheduler is small and synchronous; the tensors may go in the background.
    torch.save(
        {"rng": _rng_state(), "scheduler": engine.scheduler.state_dict(), "engine_step": engine.step_count},
        tmp / f"rank_{_rank():05d}.pt",
    )
    background = async_writer is not None
    requests = [
        dist_checkpointing.save(
            sd, str(tmp / sub), sharded_strategy=save_strategy(fully_parallel),
            async_sharded_save=background, async_strategy="mcore",
        )
        for sub, sd in (("model", model_sharded_state_dict(engine.model)), ("optimizer", {"optimizer": optim_sd}))
    ]

    def commit() -> None:
        if dist.is_initialized():
            dist.barrier()
        if _rank() == 0:  # written last: its presence marks a complete checkpoint
            (tmp / STATE_FILE).write_text(json.dumps({"step": step, **trainer_state}, indent=2))
        atomic.commit(final)
        if _rank() == 0 and keep_last > 0:
            for _, old in list_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()

    if background:
        requests[0].add_finalize_fn(lambda: None)
        async_writer.schedule(requests[0])
        requests[1].add_finalize_fn(commit)
        async_writer.schedule(requests[1])
    else:
        commit()
    return final


def load_checkpoint(engine: Any, checkpoint: str | Path) -> dict[str, Any]:
    """Collective. Restores model, optimizer, scheduler and RNG; returns the trainer state."""
    from megatron.core import dist_checkpointing

    checkpoint = Path(checkpoint)
    fully_parallel = _fully_parallel(engine)
    load_model(engine.model, checkpoint / "model", fully_parallel)
    _materialize_adam_state(engine.optimizer)
    optim_sd = engine.optimizer.sharded_state_dict(
        model_sharded_state_dict(engine.model), is_loading=True, metadata=_OPTIM_METADATA
    )
    loaded = dist_checkpointing.load(
        {"optimizer": optim_sd}, str(checkpoint / "optimizer"), sharded_strategy=load_strategy(checkpoint / "optimizer", fully_parallel)
    )
    with _skip_missing_step_on_load(engine.optimizer):
        engine.optimizer.load_state_dict(loaded["optimizer"])
    _unshare_adam_steps(engine.optimizer)
    local = torch.load(checkpoint / f"rank_{_rank():05d}.pt", weights_only=False)
    engine.scheduler.load_state_dict(local["scheduler"])
    engine.step_count = local["engine_step"]
    _set_rng_state(local["rng"])
    return json.loads((checkpoint / STATE_FILE).read_text())
