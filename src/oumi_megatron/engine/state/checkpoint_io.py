"""Saving and loading model chunks as Megatron-Core distributed checkpoints.

``dist_checkpointing`` stores every tensor under a global key with its shard offsets, so a checkpoint
saved under one TP/PP/VPP layout loads under any other. Each rank writes and reads only its own shards, and the
host memory either costs above the state it saves or fills is one tensor at a time (scripts/bench_scale_laws.py):

* **save**: Megatron-Core's synchronous save runs its asynchronous writer, which clones every tensor that is a view of
  a larger storage before writing any (under DDP every parameter is a view of one buffer: a whole copy of the
  weights, and of fp32 master weights); ``streaming_save_strategy`` writes the same files through torch's own
  ``FileSystemWriter``, which copies one tensor at a time (a file per tensor, in pageable host memory: see there);
* **load**: Megatron-Core loads each SwiGLU ``linear_fc1`` weight in place through two views of it, then concatenates
  the views into a copy of the weight, for every layer before any is used (+55% of the weights at Llama-70B's
  shape); the views already hold the weight, so ``_merge_in_place`` returns the parameter itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from oumi_megatron.engine.peft import is_adapter
from oumi_megatron.engine.wrappers import unwrap
from oumi_megatron.utils.parent_watch import exit_with_parent

META_FILE = "oumi_megatron.json"
"""Beside a checkpoint's model (a converted one, engine/state/conversion.py, or a training one, checkpointing.py): where
it came from and how it was saved."""


def read_meta(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """A checkpoint's ``META_FILE``; None where it has none."""
    path = Path(checkpoint_dir) / META_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def model_sharded_state_dict(chunks: list[torch.nn.Module], adapters_only: bool = False) -> dict[str, Any]:
    """Each chunk's sharded state dict; ``adapters_only``: its LoRA adapters' entries alone (a LoRA run's checkpoint:
    the frozen base is the converted checkpoint, engine/peft.py)."""
    def of(chunk: torch.nn.Module) -> dict[str, Any]:
        sd = unwrap(chunk).sharded_state_dict()
        return {k: v for k, v in sd.items() if is_adapter(k)} if adapters_only else sd

    if len(chunks) == 1:
        return {"model": of(chunks[0])}
    return {f"model{i}": of(c) for i, c in enumerate(chunks)}


def _dp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def streaming_save_strategy() -> Any:
    """Megatron-Core's ``torch_dist`` format, written through torch's synchronous ``FileSystemWriter`` (see the module
    docstring): the same files, the same metadata, one tensor copied at a time."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class StreamingTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                                 self.keep_only_main_replica)
            # A GPU tensor is copied to host memory to be written, and the copy must go once it is. Two of the writer's
            # defaults keep it (seen on an H200 with the 70B-wide slice's 50 GiB checkpoint: 19.8 GiB of host memory
            # above the trainer's, 11.7 with the first fixed): its copy-ahead path takes pinned blocks from CUDA's caching
            # host allocator, which keeps every freed block (per_thread_copy_ahead=0: plain blocking copies); and it
            # holds every tensor of a file until the file is done (for its safetensors output), so one file per rank
            # holds the rank's state (single_file_per_rank=False: a file per tensor, torch's own option).
            writer = FileSystemWriter(checkpoint_dir, single_file_per_rank=False, thread_count=self.thread_count,
                                      per_thread_copy_ahead=0)
            dcp_save(mcore_to_pyt_state_dict(sharded_state_dict, False), storage_writer=writer,
                     planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                              flatten_state_dict=False, flatten_sharded_tensors=False))

    return StreamingTorchDistSaveStrategy("torch_dist", 1)


def save_strategy(fully_parallel: bool, background: bool = False) -> Any:
    """The save strategy: streaming (above) for synchronous saves, Megatron-Core's default for background ones (it stages
    the rank's state in host memory so training can go on); with ``fully_parallel``, DP replicas split the writing."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = get_default_save_sharded_strategy() if background else streaming_save_strategy()
    return FullyParallelSaveStrategyWrapper(strategy, _dp_group()) if fully_parallel else strategy


def own_write_results_queue() -> None:
    """Before each background save: a results queue of its own for the write that follows.

    Megatron-Core's background writer (``FileSystemWriterAsync``) hands every write one process-wide results queue
    (``filesystem_async._results_queue``), and each write's finalize step takes whichever result comes first. A training
    checkpoint has two writes in flight together (the model's and the optimizer's, each in a forked process): when the
    optimizer's finished first, the model's metadata recorded the optimizer's file offsets, and the checkpoint failed
    to load ("invalid load key", "Unsupported operand"; 9 of 50 under load in scripts/stress_async_checkpoint.py, none
    with this). A queue per write keeps each result with its write. A forked manager starts in ~40 ms, no interpreter
    started; it stops when the write's finalize step drops the queue, or when the trainer is gone (killed with
    SIGKILL, which drops nothing: utils/parent_watch.py)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start(initializer=exit_with_parent)
    filesystem_async._results_queue = manager.Queue()


def load_strategy(directory: str | Path, fully_parallel: bool) -> Any:
    """Megatron-Core's default load strategy; with ``fully_parallel``, DP replicas split the reading. Every load
    passes here: torch's readers are made safe first (engine/state/safe_reads.py)."""
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    from oumi_megatron.engine.state import safe_reads

    safe_reads.install()

    strategy = get_default_load_sharded_strategy(str(directory))
    return FullyParallelLoadStrategyWrapper(strategy, _dp_group()) if fully_parallel else strategy


def save_model(chunks: list[torch.nn.Module], directory: str | Path, fully_parallel: bool = False,
               adapters_only: bool = False) -> None:
    """Collective: every rank writes its shards into ``directory`` (which must exist and be empty); ``adapters_only``:
    the LoRA adapters alone."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(model_sharded_state_dict(chunks, adapters_only), str(directory),
                            sharded_strategy=save_strategy(fully_parallel))


def _merge_in_place(sharded: Any) -> Any:
    """``sharded`` with each factory that merges by concatenating (the SwiGLU ``linear_fc1`` weights) returning the
    tensor it was built from when its loaded pieces tile that tensor in order (views filled in place by the load: their
    concatenation is the tensor as it stands); other factories, and pieces that do not tile, keep Megatron-Core's
    merge."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.transformer.utils import cat_with_oom_fallback

    for factory in nested_values(sharded):
        if not (isinstance(factory, ShardedTensorFactory) and factory.merge_fn is cat_with_oom_fallback):
            continue

        def merge(pieces: Any, _data: torch.Tensor = factory.data) -> Any:
            return _data if _tile(pieces, _data) else cat_with_oom_fallback(pieces)

        factory.merge_fn = merge
    return sharded


def _tile(pieces: Any, data: torch.Tensor) -> bool:
    """Whether ``torch.cat(pieces)`` is ``data`` itself: contiguous views that cover ``data`` (contiguous) from its
    start, in order, with its trailing shape."""
    if not (isinstance(pieces, list) and pieces and data.is_contiguous()
            and all(isinstance(p, torch.Tensor) and p.shape[1:] == data.shape[1:] for p in pieces)):
        return False
    offset = data.data_ptr()
    for piece in pieces:
        if not piece.is_contiguous() or piece.data_ptr() != offset:
            return False
        offset += piece.numel() * piece.element_size()
    return offset == data.data_ptr() + data.numel() * data.element_size() and sum(p.shape[0] for p in pieces) == data.shape[0]


def load_model(chunks: list[torch.nn.Module], directory: str | Path, fully_parallel: bool = False,
               adapters_only: bool = False) -> None:
    """Collective: fills ``chunks`` (any layout) from a checkpoint saved under any layout; ``adapters_only``: their LoRA
    adapters alone, from a LoRA run's checkpoint (every adapter must be there; the base stays as it is)."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(
        _merge_in_place(model_sharded_state_dict(chunks, adapters_only)), str(directory),
        sharded_strategy=load_strategy(directory, fully_parallel),
    )
    for key, chunk in zip(["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))], chunks):
        result = unwrap(chunk).load_state_dict(loaded[key], strict=not adapters_only)
        if adapters_only:
            wrong = [k for k in result.missing_keys if is_adapter(k)] + list(result.unexpected_keys)
            if wrong:
                raise RuntimeError(f"{directory}: the LoRA adapters do not match this model's: {wrong[:4]}")
