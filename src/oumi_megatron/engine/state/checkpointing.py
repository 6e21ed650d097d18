"""Training checkpoints for resume: model, optimizer, LR schedule, RNG states, step and data position.

Layout of ``output_dir/checkpoints/step_000012/``:

* ``model/``: weights as a Megatron-Core distributed checkpoint (also what ``export`` reads); under LoRA the adapters
  alone, the frozen base being the converted checkpoint ``oumi_megatron.json`` names with its source's fingerprint;
* ``optimizer/``: the optimizer state as a distributed checkpoint;
* ``hf/``: config and tokenizer files (so a checkpoint exports on its own);
* ``rank_XXXXX.json``: per-rank RNG states and the LR scheduler, as plain JSON (no pickle: a crafted
  checkpoint must not run code when it is loaded);
* ``oumi_megatron.json``: the dtype and the layout that saved, and the optimizer state's form (read before loading);
* ``manifest_rank_XXXXX.json`` / ``manifest.json``: each rank's files / the shared ones, with sizes (and the SHA-256
  of the small ones), to detect truncation (checkpoint_manifest.py: written and verified per rank);
* ``trainer_state.json``: step, data position and whatever the trainer adds; written last.

Each rank writes and reads only its own shards of the model and of the optimizer state (the distributed optimizer's
``dp_reshardable`` form: no gather; ``checkpoint_config.optimizer_fully_reshardable`` trades that for a form any layout
resumes from), so a save costs a rank host memory for one tensor at a time above its state (checkpoint_io.py).

Each checkpoint is written into ``.step_000012.partial`` and renamed when complete (see
``utils/atomic.py``), so ``latest_checkpoint`` never sees a partial one; only the newest
``keep_last`` up to the step just saved are kept. ``newest_valid_checkpoint`` checks checkpoints
against their manifest, newest first, so a damaged latest checkpoint falls back to the previous
complete one (with a warning naming the bad file).

Trust: Megatron-Core's distributed-checkpoint metadata (``.metadata``, ``common.pt``) is pickled by
torch, so load checkpoints only from a source you trust.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist

from oumi_megatron.engine.optimizer import kernel_choice, restore_kernel_choice, torch_optimizers
from oumi_megatron.engine.state.checkpoint_io import (
    META_FILE,
    load_model,
    load_strategy,
    model_sharded_state_dict,
    own_write_results_queue,
    read_meta,
    save_strategy,
)
from oumi_megatron.engine.state.checkpoint_manifest import (
    STATE_FILE,
    verify_checkpoint,
    write_manifest,
    write_rank_manifest,
)
from oumi_megatron.utils import atomic
from oumi_megatron.utils.disk import space_problem
from oumi_megatron.utils.progress import EVERY_S, Progress
from oumi_megatron.utils.ranks import first_failure, global_rank

if TYPE_CHECKING:
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig
    from oumi_megatron.engine.engine import MegatronEngine

STEP_DIR = re.compile(r"^step_(\d+)$")
logger = logging.getLogger("oumi")
OPTIMIZER_FORMATS: dict[str, dict[str, Any]] = {
    # Each rank's own buckets of fp32 master weights and Adam moments, as they are (no gather, no copy); loads under
    # another data-parallel size, not another TP / PP / VPP / CP / EP (Megatron-Core's default for the distributed
    # optimizer, and Megatron-LM's). Megatron-Core 0.19's default, fully_sharded_model_space, cannot be saved without
    # TE/apex ("ShardedTensor.flattened_range is not supported").
    "dp_reshardable": {"distrib_optim_sharding_type": "dp_reshardable"},
    # The whole state gathered into data-parallel rank 0's host memory, in a form any layout loads. The memory-efficient
    # form gathers over gloo into DP rank 0 alone; the other sends through GPU buffers the size of a gradient bucket x
    # DP (with DP = 1 one bucket holds the whole model: 17 GiB more on the GPU for a 4.5B model, which ran out of memory
    # on an H200) and gives every DP rank a host copy of the whole state.
    "fully_reshardable": {"distrib_optim_sharding_type": "fully_reshardable",
                          "distrib_optim_fully_reshardable_mem_efficient": True},
    # The plain (non-distributed) optimizer: its state per parameter, sharded like the parameters (any layout).
    "model_space": {},
}
_RESUMABLE_ONLY_AS_SAVED = (  # (layout key, the field that sets it) a dp_reshardable optimizer state does not reshard
    ("tensor_model_parallel_size", "megatron.tensor_model_parallel_size"),
    ("pipeline_model_parallel_size", "megatron.pipeline_model_parallel_size"),
    ("virtual_pipeline_model_parallel_size", "megatron.virtual_pipeline_model_parallel_size"),
    ("context_parallel_size", "megatron.context_parallel_size"),
    ("expert_model_parallel_size", "megatron.expert_model_parallel_size"),
    ("expert_tensor_parallel_size", "megatron.expert_model_parallel_size (expert TP)"),
    ("ddp_bucket_size", "megatron.ddp_config.overlap_grad_reduce (the gradient buckets the shards are cut from)"),
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded (missing, incomplete or damaged); the message names it."""


class CheckpointSpaceError(CheckpointError):
    """Not enough free space for the next checkpoint (found before anything is written)."""


def _fully_parallel(engine: MegatronEngine) -> bool:
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


def check_checkpoints(config: MegatronTrainingConfig, found: Findings) -> None:
    """``megatron.checkpoint_config.keep_last_n_checkpoints``: the newest checkpoints a save keeps (0: all)."""
    keep = config.megatron.checkpoint_config.keep_last_n_checkpoints
    if not isinstance(keep, int) or keep < 0:
        found.add("megatron.checkpoint_config.keep_last_n_checkpoints", f"must be >= 0 (0 keeps all), got {keep!r}.")


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1][1] if ckpts else None


def _tensor_json(t: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(t.dtype).replace("torch.", ""), "data": t.cpu().flatten().tolist()}


def _tensor_from_json(d: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(d["data"], dtype=getattr(torch, d["dtype"]))


def _rng_state() -> dict[str, Any]:
    """RNG states as JSON-able values (lists of ints), restored exactly by ``_set_rng_state``."""
    from megatron.core import tensor_parallel

    version, words, gauss = random.getstate()
    # the legacy tuple: numpy's global RandomState is an MT19937 (the dict form is for other bit generators)
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    kind, keys, pos, has_gauss, cached = legacy
    state: dict[str, Any] = {
        "python": [version, list(words), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _tensor_json(torch.get_rng_state()),
        "megatron_tracker": {k: _tensor_json(v.get_state() if isinstance(v, torch.Generator) else v)
                             for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = _tensor_json(torch.cuda.get_rng_state())
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_tensor_from_json(state["torch"]))
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(_tensor_from_json(state["cuda"]))
    tracker = tensor_parallel.get_cuda_rng_tracker()
    current = tracker.get_states()
    states = {}
    for name, value in state["megatron_tracker"].items():
        saved = _tensor_from_json(value)
        if isinstance(current.get(name), torch.Generator):
            # the graph-safe tracker (CUDA graphs) holds generators that captured graphs refer to: set in place
            current[name].set_state(saved)
            states[name] = current[name]
        else:
            states[name] = saved
    tracker.set_states(states)


def _rank_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / f"rank_{rank:05d}.json"


def _read_rank_state(checkpoint: Path, rank: int) -> dict[str, Any]:
    path = _rank_file(checkpoint, rank)
    if not path.is_file() and (checkpoint / f"rank_{rank:05d}.pt").is_file():
        raise CheckpointError(
            f"{checkpoint} was written by an older oumi-megatron (rank_{rank:05d}.pt, a pickle, which is not loaded "
            "because unpickling can run code). Resume from a checkpoint written by this version."
        )
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}).") from e


def newest_valid_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under ``root`` that passes ``verify_checkpoint`` (collective when torch.distributed is
    initialized: every rank checks its share of each candidate), warning about each damaged newer one. Read-only: a
    damaged checkpoint stays where it is (never pruned in favour of older ones, see ``save_checkpoint``) and is
    replaced when training reaches its step again."""
    for _, path in reversed(list_checkpoints(root)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        if global_rank() == 0:
            logger.warning(f"Checkpoint {path} is damaged: {problem}. Resuming from the previous complete checkpoint "
                           "instead; the damaged one is replaced when training reaches its step.")
    return None


def _adam_step_device(group: dict[str, Any], param: torch.Tensor) -> torch.device | str:
    """Where torch Adam keeps a parameter's ``step``: on its device for the fused / capturable kernels,
    on the CPU otherwise."""
    return param.device if group.get("fused") or group.get("capturable") else "cpu"


def _materialize_adam_state(optimizer: Any) -> None:
    """Without TE/apex Megatron-Core falls back to torch Adam, whose ``DistributedOptimizer.state_dict``
    asserts that every parameter has a ``step`` (false before the first step, e.g. when building the
    template to load into). Give never-stepped parameters the state torch Adam would create."""
    for adam in torch_optimizers(optimizer):
        for group in adam.param_groups:
            for p in group["params"]:
                state = adam.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=_adam_step_device(group, p))
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


@contextlib.contextmanager
def _skip_missing_step_on_load(optimizer: Any) -> Iterator[None]:
    """torch Adam keeps ``step`` as a tensor in each parameter's state. The fully-reshardable checkpoint holds only the
    param/exp_avg/exp_avg_sq tensors, so Megatron-Core's ``_set_main_param_and_optimizer_states`` raises
    KeyError('step'); the dp_reshardable one hands it the template's own ``step`` (zero before the load, copied into the
    one step tensor every parameter shares: bias correction restarted). ``step`` is restored from the param groups
    instead (see ``_unshare_adam_steps``); mark it as absent for the duration of the load."""
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    patched = []
    for sub in subs:
        original = getattr(sub, "_set_main_param_and_optimizer_states", None)
        if original is None:
            continue
        sub._set_main_param_and_optimizer_states = lambda p, t, _o=original: _o(p, {**t, "step": None})
        patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states  # back to the class method


def _unshare_adam_steps(optimizer: Any) -> None:
    """Megatron-Core's load gives every parameter the *same* ``step`` tensor; torch Adam increments it
    in place once per parameter, which would corrupt bias correction after resume. Copy it per param;
    torch's fused Adam wants it as fp32 on the parameter's device, its other paths on the CPU."""
    for adam in torch_optimizers(optimizer):
        for group in adam.param_groups:
            for p in group["params"]:
                step = adam.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    adam.state[p]["step"] = step.detach().to(_adam_step_device(group, p), torch.float32, copy=True)


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


def _layout(engine: MegatronEngine) -> dict[str, Any]:
    """The parallel layout this rank's shards were cut by (what a dp_reshardable optimizer state needs again)."""
    from megatron.core import parallel_state as ps

    ddp = getattr(engine.model[0], "ddp_config", None)
    return {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
        "use_distributed_optimizer": bool(engine.params.ddp_config.use_distributed_optimizer),
        "ddp_bucket_size": getattr(ddp, "bucket_size", None),
    }


def optimizer_format(engine: MegatronEngine) -> str:
    """How this engine saves its optimizer state (a key of OPTIMIZER_FORMATS)."""
    if not engine.params.ddp_config.use_distributed_optimizer:
        return "model_space"
    return "fully_reshardable" if engine.params.checkpoint_config.optimizer_fully_reshardable else "dp_reshardable"


def _meta(engine: MegatronEngine) -> dict[str, Any]:
    dtype = next(p for c in engine.model for p in c.parameters()).dtype
    meta = {"dtype": str(dtype).replace("torch.", ""), "layout": _layout(engine), "optimizer_format": optimizer_format(engine)}
    if engine.lora is not None:  # the model/ folder holds the adapters; the base is the converted checkpoint it names
        from oumi_megatron.engine.state.conversion import base_identity

        meta["lora"] = engine.lora.as_json()
        meta["base"] = base_identity(engine.base_dir)
    return meta


def _lora_problem(saved: dict[str, Any], engine: MegatronEngine) -> str | None:
    """Why a checkpoint's adapters (or full weights) do not fit this engine's LoRA (or full fine-tuning)."""
    saved_lora = saved.get("lora")
    mine = engine.lora.as_json() if engine.lora is not None else None
    if saved_lora is None and mine is None:
        return None
    if saved_lora is None or mine is None:
        have, want = ("full weights", "LoRA adapters") if saved_lora is None else ("LoRA adapters", "full weights")
        return (f"it holds {have} and this run trains {want} (training.use_peft). Resume with the setting that saved "
                "it, or start a new run from its export")
    keys = ("rank", "alpha", "targets", "canonical")
    differ = [k for k in keys if saved_lora.get(k) != mine.get(k)]
    if differ:
        return (f"its LoRA adapters differ from this run's in {differ} ({[saved_lora.get(k) for k in differ]} vs "
                f"{[mine.get(k) for k in differ]}: peft.lora_r, lora_alpha, lora_target_modules). Resume with the peft: "
                "settings that saved it")
    from oumi_megatron.engine.state.conversion import base_identity

    now = base_identity(engine.base_dir)
    base = saved.get("base") or {}
    if any(base.get(k) != now.get(k) for k in ("config_sha256", "weight_files")):
        return (f"its adapters were trained on the base {base.get('source')} ({base.get('checkpoint')}), and this run's "
                f"base {now.get('source')} ({now.get('checkpoint')}) has other weights. Resume with model.model_name set "
                "to the model that trained them")
    return None


def read_checkpoint_meta(checkpoint: str | Path) -> dict[str, Any]:
    """The checkpoint's ``META_FILE``; checkpoints of earlier versions have none: their optimizer state is fully
    reshardable and their dtype unknown."""
    meta = read_meta(checkpoint)
    return {"optimizer_format": "fully_reshardable"} if meta is None else meta


def resume_problem(saved: dict[str, Any], engine: MegatronEngine) -> str | None:
    """Why this engine cannot take the optimizer state a checkpoint with ``saved`` meta holds, naming the setting and
    the fix; None if it can."""
    lora = _lora_problem(saved, engine)
    if lora is not None:
        return lora
    if "layout" not in saved:
        return None  # an earlier version's checkpoint: fully reshardable
    now = _layout(engine)
    if saved["layout"]["use_distributed_optimizer"] != now["use_distributed_optimizer"]:
        return (f"it was saved with megatron.ddp_config.use_distributed_optimizer = "
                f"{saved['layout']['use_distributed_optimizer']} and this run has {now['use_distributed_optimizer']}: the "
                "two keep different optimizer states. Resume with the setting that saved it")
    if saved.get("optimizer_format") != "dp_reshardable":
        return None  # fully reshardable, or the plain optimizer's per-parameter state: any layout
    for key, field in _RESUMABLE_ONLY_AS_SAVED:
        if saved["layout"].get(key) != now[key]:
            return (f"its optimizer state was saved per rank under {field} = {saved['layout'].get(key)}, and this run has "
                    f"{now[key]}; a per-rank optimizer state (megatron.checkpoint_config.optimizer_fully_reshardable: false) "
                    "loads under another data-parallel size only. Resume with the layout that saved it, or save with "
                    "optimizer_fully_reshardable: true to change the layout (it gathers the whole optimizer state into "
                    "data-parallel rank 0's host memory), or start a new run from its weights (oumi-megatron export)")
    return None


def checkpoint_bytes(engine: MegatronEngine) -> float:
    """Collective: the bytes a checkpoint of this engine takes on disk (every rank's share of the weights and of the
    optimizer state: fp32 master weights and two moments, 12 B per parameter; DP x CP replicas write one copy). Under
    LoRA, the adapters' alone."""
    from megatron.core import parallel_state as ps

    local = sum(p.numel() * (p.element_size() + 12) for c in engine.model for p in c.parameters()
                if engine.peft is None or p.requires_grad)
    mine = torch.tensor([local / (ps.get_data_parallel_world_size(with_context_parallel=True))], dtype=torch.float64,
                        device=engine.device)
    if dist.is_initialized():
        dist.all_reduce(mine)
    return float(mine.item())


def _require_space(engine: MegatronEngine, root: Path, step: int, keep_last: int) -> float:
    """Stops before writing anything when ``root``'s filesystem cannot take one more checkpoint (decided on rank 0,
    raised on every rank); the checkpoint's bytes otherwise."""
    need = checkpoint_bytes(engine)
    problem = None
    if global_rank() == 0:
        kept = f"the {keep_last} newest are kept until it is complete" if keep_last else "every checkpoint is kept"
        problem = space_problem(root, need, f"checkpoint step {step} ({kept})",
                                "free space there, lower megatron.checkpoint_config.keep_last_n_checkpoints, or set "
                                "training.output_dir to a larger filesystem")
    problem = first_failure(problem)
    if problem is not None:
        raise CheckpointSpaceError(problem)
    return need


def save_checkpoint(
    engine: MegatronEngine,
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
    need = _require_space(engine, Path(root), step, keep_last)
    background = async_writer is not None
    progress = Progress(f"Saving checkpoint step {step} to {final}" + (" in the background" if background else ""),
                        watch=atomic.partial_path(final), expected=need, every=None if background else EVERY_S)
    progress.__enter__()  # left in commit(), which a background save runs when its files are written
    try:
        tmp = atomic.begin(final)
        if global_rank() == 0:
            (tmp / "model").mkdir()
            (tmp / "optimizer").mkdir()
            shutil.copytree(hf_artifacts, tmp / "hf", symlinks=True)  # links copied as links, never followed
            (tmp / META_FILE).write_text(json.dumps(_meta(engine), indent=2))
        if dist.is_initialized():
            dist.barrier()
        fully_parallel = _fully_parallel(engine)
        optim_sd = engine.optimizer.sharded_state_dict(
            model_sharded_state_dict(engine.model), is_loading=False, metadata=OPTIMIZER_FORMATS[optimizer_format(engine)]
        )
        # The RNG / scheduler state is small and written now; the tensors may go in the background.
        _rank_file(tmp, global_rank()).write_text(
            json.dumps({"rng": _rng_state(), "scheduler": engine.scheduler.state_dict(), "engine_step": engine.step_count})
        )
        requests = []
        for sub, sd in (("model", model_sharded_state_dict(engine.model, adapters_only=engine.peft is not None)),
                        ("optimizer", {"optimizer": optim_sd})):
            if background:
                own_write_results_queue()  # the two writes run together: each keeps its own results
            requests.append(dist_checkpointing.save(
                sd, str(tmp / sub), sharded_strategy=save_strategy(fully_parallel, background=background),
                async_sharded_save=background, async_strategy="mcore",
            ))

        def commit() -> None:
            write_rank_manifest(tmp, global_rank())  # this rank's files, written (every rank at once)
            if dist.is_initialized():
                dist.barrier()
            if global_rank() == 0:
                write_manifest(tmp, dist.get_world_size() if dist.is_initialized() else 1)
                # written last: its presence marks a complete checkpoint
                (tmp / STATE_FILE).write_text(json.dumps({"step": step, **trainer_state}, indent=2))
            atomic.commit(final)
            progress.result = final
            progress.__exit__(None, None, None)
            if global_rank() == 0 and keep_last > 0:
                # only checkpoints up to this step: newer ones (of a run resumed from an earlier step) are replaced
                # when training reaches their step, never pruned in favour of an older lineage
                for _, old in [c for c in list_checkpoints(root) if c[0] <= step][:-keep_last]:
                    shutil.rmtree(old, ignore_errors=True)
            if dist.is_initialized():
                dist.barrier()

        if async_writer is not None:  # background
            requests[0].add_finalize_fn(lambda: None)
            async_writer.schedule(requests[0])
            requests[1].add_finalize_fn(commit)
            async_writer.schedule(requests[1])
        else:
            commit()
    except BaseException as e:  # the lines in between stop; the partial folder is replaced by the next save
        progress.__exit__(type(e), e, e.__traceback__)
        raise
    return final


def load_checkpoint(engine: MegatronEngine, checkpoint: str | Path, verified: bool = False) -> dict[str, Any]:
    """Collective. Restores model, optimizer, scheduler and RNG; returns the trainer state. A missing, incomplete or
    damaged checkpoint, or one this layout cannot take, raises ``CheckpointError`` naming it, before any tensor is read
    (``verified``: the caller checked the files already, trainer/run_dir.py)."""
    checkpoint = Path(checkpoint)
    problem = None if verified else verify_checkpoint(checkpoint)
    if problem is None:
        problem = resume_problem(read_checkpoint_meta(checkpoint), engine)
    if problem is not None:
        raise CheckpointError(f"cannot resume from {checkpoint}: {problem}.")
    local = _read_rank_state(checkpoint, global_rank())
    try:
        with Progress(f"Loading checkpoint {checkpoint}", reads=checkpoint):
            _load_tensors(engine, checkpoint)
    except Exception as e:  # noqa: BLE001 - torch / dist_checkpointing errors do not name the checkpoint
        raise CheckpointError(f"cannot resume from {checkpoint}: {type(e).__name__}: {e}") from e
    engine.scheduler.load_state_dict(local["scheduler"])
    engine.step_count = local["engine_step"]
    _set_rng_state(local["rng"])
    return json.loads((checkpoint / STATE_FILE).read_text())


def _load_tensors(engine: MegatronEngine, checkpoint: Path) -> None:
    from megatron.core import dist_checkpointing

    fully_parallel = _fully_parallel(engine)
    load_model(engine.model, checkpoint / "model", fully_parallel, adapters_only=engine.peft is not None)
    _materialize_adam_state(engine.optimizer)
    form = OPTIMIZER_FORMATS[read_checkpoint_meta(checkpoint)["optimizer_format"]]  # the form it was saved in
    optim_sd = engine.optimizer.sharded_state_dict(model_sharded_state_dict(engine.model), is_loading=True, metadata=form)
    loaded = dist_checkpointing.load(
        {"optimizer": optim_sd}, str(checkpoint / "optimizer"), sharded_strategy=load_strategy(checkpoint / "optimizer", fully_parallel)
    )
    kernels = kernel_choice(engine.optimizer)
    # no_grad: the dp_reshardable load copies into the master weights, leaves that require grad (fp32 training: views
    # of the model's parameters), outside Megatron-Core's own no_grad
    with _skip_missing_step_on_load(engine.optimizer), torch.no_grad():
        engine.optimizer.load_state_dict(loaded["optimizer"])
    restore_kernel_choice(engine.optimizer, kernels)
    _unshare_adam_steps(engine.optimizer)
