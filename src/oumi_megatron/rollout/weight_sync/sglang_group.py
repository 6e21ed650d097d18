"""A separate SGLang engine's update group (``inference_backend: sglang``, ``rollout_placement: separate``): the
replica's owner and the engine's scheduler in a process group of their own (NCCL on GPU, gloo on CPU), over which the
whole model travels in flattened buckets into SGLang's ``update_weights_from_distributed``. Synchronously (``sync``:
every rank iterates the export, the owner sends), or queued on the engine's thread behind its generations in flight
(``push``, asynchronous GRPO: the owner keeps a host copy, the engine's thread loads it, flushes the prefix cache, sets
the engine's policy version and takes the probe).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oumi_megatron.rollout.base import WeightSyncStats
from oumi_megatron.rollout.weight_sync.base import WeightSyncError
from oumi_megatron.rollout.weight_sync.probe import policy_logprobs, probe_sequence
from oumi_megatron.rollout.weight_sync.stream import TimedPairs
from oumi_megatron.utils.net import LOOPBACK, listening_socket

if TYPE_CHECKING:
    from oumi_megatron.rollout.base import PolicyWeights

UPDATE_GROUP = "oumi_megatron_sglang_weights"
UPDATE_GROUP_TIMEOUT = timedelta(minutes=30)
"""How long the update group's members wait for each other (SGLang's default for its groups)."""
ENGINE_THREAD = "oumi-megatron-sglang"
"""The name prefix of the backend's engine thread (``thread_name_prefix``): a bucket sent from it broadcasts beside it."""


class SglangUpdateGroup:
    """The update group, on every rank of the replica (every rank iterates the export; the owner alone sends).
    ``method``: ``nccl`` or ``gloo``; ``trainer_engine``: the MegatronEngine (a push's probe reference), with a
    tokenizer of ``vocab``."""

    def __init__(self, method: str, bucket_bytes: int, is_owner: bool, trainer_engine: Any, vocab: int) -> None:
        self.method, self.bucket_bytes, self.is_owner = method, bucket_bytes, is_owner
        self.trainer_engine, self.vocab = trainer_engine, vocab
        self.engine: Any = None
        self.thread: ThreadPoolExecutor | None = None
        self.group: Any = None
        self.version = 0
        """The policy version of the weights the engine holds (0: those it started from)."""
        self.pushed: Future | None = None
        self.pushed_probe: float | None = None
        """The last asynchronous push's probe (its engine's logprobs against the trainer's at the push)."""

    def open(self, engine: Any, thread: ThreadPoolExecutor) -> None:
        """The owner (rank 0) and the engine's scheduler rank (1) in a process group of their own (SGLang's rendezvous:
        the engine joins from its ``init_weights_update_group`` while the owner joins here). ``engine``: the owner's
        ``sglang.Engine``, driven from ``thread`` (the backend's engine thread, where every call on it runs in order)."""
        from sglang.srt.utils.common import init_custom_process_group

        self.engine, self.thread = engine, thread
        # the group's store is ours, listening on the loopback alone (the engine is on this node; SGLang's own
        # rendezvous would listen on every interface), on a port held from the start (no race for it)
        listener = listening_socket(LOOPBACK, 0)
        port = listener.getsockname()[1]
        backend = "nccl" if self.method == "nccl" else "gloo"
        joined = self.thread.submit(self.engine.init_weights_update_group, LOOPBACK, port, 1, 2, UPDATE_GROUP, backend)
        store = dist.TCPStore(LOOPBACK, port, world_size=2, is_master=True, timeout=UPDATE_GROUP_TIMEOUT,
                              wait_for_workers=True, master_listen_fd=listener.fileno())
        group = init_custom_process_group(backend=backend, store=dist.PrefixStore(UPDATE_GROUP, store), world_size=2,
                                          rank=0, group_name=UPDATE_GROUP, timeout=UPDATE_GROUP_TIMEOUT)
        self._update_store = (store, listener)  # both live as long as the group
        ok, message = joined.result()
        if not ok:
            raise WeightSyncError(f"the SGLang engine did not join the weight-update group: {message}")
        self.group = group

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """The owner: one flattened bucket to the engine (its ``update_weights_from_distributed`` on the engine's thread
        while this thread broadcasts; called from the engine's thread, the broadcast goes on a helper thread)."""
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        device = torch.device("cuda", torch.cuda.current_device()) if self.method == "nccl" else torch.device("cpu")
        flat = FlattenedTensorBucket(named_tensors=[(n, t.to(device)) for n, t in bucket]).get_flattened_tensor()
        names, dtypes = [n for n, _ in bucket], [str(t.dtype).removeprefix("torch.") for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]

        def receive() -> Any:
            return self.engine.update_weights_from_distributed(names, dtypes, shapes, UPDATE_GROUP, flush_cache=False,
                                                               load_format="flattened_bucket")

        on_engine_thread = threading.current_thread().name.startswith(ENGINE_THREAD)
        if on_engine_thread:  # an asynchronous push: the engine's call here, the broadcast beside it
            sender = threading.Thread(target=dist.broadcast, args=(flat, 0, self.group), daemon=True)
            sender.start()
            ok, message = receive()
            sender.join()
        else:
            assert self.thread is not None
            answer = self.thread.submit(receive)
            dist.broadcast(flat, src=0, group=self.group)
            ok, message = answer.result()
        if not ok:
            raise WeightSyncError(f"SGLang refused the weights: {message}")

    def buckets(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Consecutive tensors in buckets of at least ``bucket_bytes`` (the last one: what is left)."""
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in pairs:
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def sync(self, weights: PolicyWeights) -> WeightSyncStats:
        """Every rank iterates the whole model (the exporter's gathers are collective); the owner streams it to the
        engine in flattened buckets, then flushes its prefix cache."""
        pairs = TimedPairs(weights())
        for bucket in self.buckets(pairs):
            if self.is_owner:
                self.send_bucket(bucket)
        if self.is_owner:
            assert self.thread is not None
            self.thread.submit(self.engine.flush_cache).result()  # prefixes cached under the old weights must not be reused
        return WeightSyncStats(self.method, pairs.tensors, pairs.bytes if self.is_owner else 0, 0.0,
                               export_seconds=pairs.seconds)

    def push(self, weights: PolicyWeights, version: int) -> WeightSyncStats:
        """Collective over the training ranks: the whole policy (``version``) read now (every rank iterates it; the
        owner keeps a host copy) and queued for the engine behind the generations in flight; the trainer's logprobs of
        a fixed sequence go with it for the probe the engine's thread runs after the update."""
        started = time.perf_counter()
        pairs = TimedPairs(weights())
        snapshot = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in pairs] if self.is_owner else []
        sequence = probe_sequence(self.vocab)
        reference = policy_logprobs(self.trainer_engine, sequence)
        stats = WeightSyncStats(self.method, pairs.tensors, pairs.bytes if self.is_owner else 0,
                                time.perf_counter() - started, export_seconds=pairs.seconds,
                                probe_max_diff=self.pushed_probe)
        if self.is_owner:
            assert self.thread is not None
            self.pushed = self.thread.submit(self._apply_push, snapshot, version, sequence, reference)
        return stats

    def _apply_push(self, snapshot: list[tuple[str, torch.Tensor]], version: int, sequence: list[int],
                    reference: torch.Tensor) -> float:
        """On the engine's thread: the snapshot into the engine, the cache flushed, the version set, the probe taken;
        the seconds the update took."""
        started = time.perf_counter()
        for bucket in self.buckets(snapshot):
            self.send_bucket(bucket)
        self.engine.flush_cache()
        self.version = version
        seconds = time.perf_counter() - started
        out = self.engine.generate(input_ids=[sequence], sampling_params={"temperature": 1.0, "max_new_tokens": 1},
                                   return_logprob=True, logprob_start_len=0)
        theirs = torch.tensor([float(lp) for lp, _, _ in out[0]["meta_info"]["input_token_logprobs"][1:]])
        self.pushed_probe = float((theirs - reference).abs().max())
        return seconds

    def wait(self) -> float | None:
        """Wait for the push in flight; the seconds its update took (None: none in flight, or not the owner)."""
        if self.pushed is None:
            return None
        seconds = self.pushed.result()
        self.pushed = None
        return seconds
