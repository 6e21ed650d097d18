"""The push schedule for asynchronous engines (``grpo.max_staleness`` > 0): every sender (senders.py) exports its share
of the policy at once, keeps a snapshot, and a background thread streams it to the engines once they have opened
their update sessions, which they do after the generations queued before the update. One push at a time. Used by the
separate engine process (senders.py ``StreamSync``) and the Ray fleet (rollout/ray_fleet.py).

The snapshot lives in host memory (pinned where the tensors are on a GPU), copied tensor by tensor as the exporter
yields them: a GPU copy of the whole model (141 GB at 70B) does not fit beside training. Above training the GPU then
holds the exporter's tensor in hand and, while sending, the buckets in flight (stream.send: two, on a stream
of the sender's own); each sender's host holds its share (~model / (TP x PP)) until the push ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from oumi_megatron.rollout.base import WeightSyncStats
from oumi_megatron.rollout.weight_sync import stream
from oumi_megatron.rollout.weight_sync.base import WeightSyncError


def host_snapshot(pairs: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """A copy of every (name, tensor) in host memory, one tensor at a time: pinned for GPU tensors (copied back at
    the link's speed when sent), plain for CPU ones. The copies share nothing with the exporter's tensors, which the
    next optimizer step changes."""
    out, cuda = [], False
    for name, t in pairs:
        if t.is_cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t.detach(), non_blocking=True)
            cuda = True
        else:
            host = t.detach().clone()
        out.append((name, host))
    if cuda:
        torch.cuda.current_stream().synchronize()  # the copies are complete before the exporter's tensors change
    return out


class WeightPusher:
    def __init__(self, method: str) -> None:
        self.method = method
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oumi-megatron-weight-push")
        self.pushing: Future | None = None

    def push(self, share: Iterable[tuple[str, torch.Tensor]], group: stream.WeightSyncGroup, bucket_bytes: int,
             open_sessions: Callable[[], tuple[list[Future], list[Future]]], wait: Callable[[Future, str], Any]) -> WeightSyncStats:
        """A sender's part of a push: waits for its previous push, exports its ``share`` now into a host snapshot (the
        next optimizer step changes the parameters the exporter yields views of), asks the engines for their sessions
        (``open_sessions`` queues them: futures that resolve when each is open, and when each is done; the rank that
        talks to the engines returns them, the other senders none, their broadcasts waiting for the engines) and streams
        the snapshot from the background thread once every session is open. The stats' seconds are the trainer's."""
        self.wait()
        start = time.perf_counter()
        pairs = stream.TimedPairs(share)
        snapshot = host_snapshot(pairs)
        group.synchronize()
        opened, done = open_sessions()

        def send() -> float:
            if group.device.type == "cuda":
                torch.cuda.set_device(group.device)
                # the copies back to the GPU on a stream of their own: on the default stream they would queue
                # behind the training step's kernels
                torch.cuda.set_stream(torch.cuda.Stream(group.device))
            for future in opened:
                wait(future, "receive_update (opening the session)")
            began = time.perf_counter()
            stream.send(group, snapshot, bucket_bytes)
            for future in done:
                wait(future, "receive_update")
            return time.perf_counter() - began

        self.pushing = self.sender.submit(send)
        return WeightSyncStats(self.method, pairs.tensors, pairs.bytes, time.perf_counter() - start,
                               export_seconds=pairs.seconds)

    def wait(self) -> float | None:
        """Wait for the push in flight; the seconds its transfer took (None: none was in flight). A failed push
        raises: the engines would otherwise generate with weights they never got."""
        if self.pushing is None:
            return None
        pushing, self.pushing = self.pushing, None
        try:
            return float(pushing.result())
        except WeightSyncError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure means stale weights: stop with the cause
            raise WeightSyncError(f"weight push ({self.method}) failed: {e}") from e

    def close(self) -> None:
        if self.pushing is not None:
            try:
                self.wait()
            except WeightSyncError:  # closing anyway
                pass
        self.sender.shutdown(wait=False)
