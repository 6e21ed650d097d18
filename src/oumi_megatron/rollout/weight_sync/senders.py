"""Who sends the policy's weights to engines outside the trainer's processes (``rollout_placement: separate`` and
``ray``), and how their links open.

Every rank of a model replica with context-parallel rank 0 sends. Each pipeline stage exports its own tensors
(``PolicyWeights.stage_tensors``: gathered over TP / EP, nothing crosses stages) and each of the stage's TP ranks
sends a share of them (stream.share_of) over a group of its own with the engine's workers, which receive from
every group at once (stream.receive_all). Per push a sender holds and sends ~model / (TP x PP), an asynchronous
push's host snapshot included, and the senders run at the same time: at 70B on TP8 x PP2, 16 senders of ~8.8 GB
each instead of rank 0 sending 141 GB. The cost is one communicator per sender on every engine worker.

``StreamSync`` is the trainer's side of the stream for a separate engine process (rollout/vllm_backend.py): a sync the
trainer waits for, or a push (push.py) queued behind the engine's generations. The Ray fleet (rollout/ray_fleet.py)
opens the same links to every engine of its fleet and pushes through push.py itself (it restarts engines that die).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.parallel.distributed import node_address
from oumi_megatron.rollout.base import WeightSyncStats
from oumi_megatron.rollout.weight_sync import stream
from oumi_megatron.rollout.weight_sync.push import WeightPusher
from oumi_megatron.utils.net import free_port

if TYPE_CHECKING:
    from oumi_megatron.rollout.base import PolicyWeights


@dataclass(frozen=True)
class SenderRole:
    """This rank's part in feeding one set of engines."""

    ranks: list[int]
    """The senders' global ranks, by pipeline stage, then tensor-parallel rank: group i of an engine is ranks[i]'s."""
    index: int | None
    """This rank's position in ``ranks``; None: it does not send."""
    share: int
    """Which share of its stage's tensors it sends: its tensor-parallel rank."""
    shares: int
    """How many senders split its stage's tensors: the tensor-parallel size."""

    @property
    def sends(self) -> bool:
        return self.index is not None

    def pairs(self, stage_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """This sender's share of its stage's tensors. Every rank iterates its stage's export to the end (it is
        collective); a rank that does not send yields nothing."""
        if not self.sends:
            for _ in stage_tensors:
                pass
            return
        yield from stream.share_of(stage_tensors, self.share, self.shares)


def sender_role(group: Any, ranks: list[int]) -> SenderRole:
    """Collective over ``group`` (the replica's gloo group, its global ``ranks``): who sends, and which share."""
    from megatron.core import parallel_state as ps

    me = (dist.get_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
          ps.get_context_parallel_rank())
    every: list[Any] = [None] * len(ranks)
    dist.all_gather_object(every, me, group=group)
    senders = [rank for rank, _, _, cp in sorted(every, key=lambda r: (r[1], r[2])) if cp == 0]
    index = senders.index(me[0]) if me[0] in senders else None
    return SenderRole(senders, index, me[2], ps.get_tensor_model_parallel_world_size())


def open_links(role: SenderRole, group: Any, owner: int, backend: str, receivers: int,
               join_engines: Callable[[list[tuple[str, int]]], Callable[[], None]] | None) -> stream.WeightSyncGroup | None:
    """Collective over ``group``: every sender opens its group (rank 0 of it, hosting its store on this node), of
    ``1 + receivers`` members. ``join_engines`` runs on ``owner``, the rank that talks to the engines: it asks them to
    join the senders' groups, in order (addresses as ``[(host, port), ...]``), and returns what waits until they have.
    This rank's group, None if it does not send."""
    address = (node_address(), free_port()) if role.sends else None
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (dist.get_rank(), address), group=group)
    by_rank = dict(every)
    joined = join_engines([by_rank[r] for r in role.ranks]) if dist.get_rank() == owner and join_engines else None
    link = None
    if address is not None:
        link = stream.WeightSyncGroup(address[0], address[1], rank=0, backend=backend, world_size=1 + receivers)
    if joined is not None:
        joined()
    return link


def probe_raw(link: stream.WeightSyncGroup | None, group: Any, owner: int,
              start_receivers: Callable[[int], Callable[[], None]] | None) -> float | None:
    """Collective over ``group``: every sender broadcasts a plain buffer over its link at once, the engines receiving
    every link meanwhile (``start_receivers(nbytes)`` on ``owner`` starts them and returns what waits for them). The
    senders' GB/s summed, on ``owner`` (None elsewhere): what a push's bandwidth is compared with."""
    nbytes = stream.RAW_PROBE_BYTES["cuda" if link is not None and link.device.type == "cuda" else "cpu"]
    received = start_receivers(nbytes) if dist.get_rank() == owner and start_receivers else None
    gbps = stream.send_raw(link, nbytes) if link is not None else 0.0
    if received is not None:
        received()
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, gbps, group=group)
    return float(sum(every)) if dist.get_rank() == owner else None


def replica_stats(group: Any, mine: WeightSyncStats) -> WeightSyncStats:
    """Collective over ``group``: the replica's push from each rank's own ``mine``: tensors and bytes summed over the
    senders, the largest sender's bytes, how many sent something; the seconds stay this rank's."""
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (mine.tensors, mine.bytes), group=group)
    return dataclasses.replace(mine, tensors=sum(t for t, _ in every), bytes=sum(b for _, b in every),
                               senders=sum(1 for _, b in every if b > 0), sender_bytes=max(b for _, b in every))


class StreamSync:
    """The stream to one engine outside the trainer's processes, on every rank of its replica: each sender's share of
    its stage's export over its own link (``open``), the engine receiving from all of them at once.

    ``group``: the replica's gloo group; ``role``: this rank's (``sender_role``); ``open_session(version)``: on the rank
    that talks to the engine (None elsewhere), queues the engine's update session behind its generations in flight and
    returns futures of its opening and of its end (``version``: the policy version it receives; None in the
    synchronous loop); ``wait_for(future, what)``: a future's result, a ``WeightSyncError`` naming ``what`` if none
    comes."""

    def __init__(self, method: str, bucket_bytes: int, group: Any, role: SenderRole,
                 open_session: Callable[[int | None], tuple[Future, Future]] | None,
                 wait_for: Callable[[Future, str], Any]) -> None:
        self.method, self.bucket_bytes, self.group, self.role = method, bucket_bytes, group, role
        self.open_session, self.wait_for = open_session, wait_for
        self.link: stream.WeightSyncGroup | None = None
        """This rank's group with the engine, if it sends."""
        self.raw_gbps: float | None = None
        """The owner: the senders' plain broadcast bandwidth to the engine, summed (measured once, at start)."""
        self.pusher = WeightPusher(method)

    def open(self, owner: int, receivers: int, join_engines: Callable[[list[tuple[str, int]]], Callable[[], None]],
             start_receivers: Callable[[int], Callable[[], None]]) -> None:
        """Collective over the replica: the links (``open_links``), then their plain broadcast bandwidth, what
        ``weight_sync/fraction_of_raw`` compares the weight pushes with (``probe_raw``)."""
        self.link = open_links(self.role, self.group, owner, self.method, receivers=receivers, join_engines=join_engines)
        self.raw_gbps = probe_raw(self.link, self.group, owner, start_receivers)

    def sync(self, weights: PolicyWeights) -> WeightSyncStats:
        """Every sender streams its share of its stage's export to the engine process, which receives from all of them
        meanwhile; the owner opens the engine's session first and waits for it to end."""
        share = self.role.pairs(weights.stage_tensors())
        done = None
        if self.open_session is not None:
            opened, done = self.open_session(None)
            self.wait_for(opened, "receive_update (opening the session)")
        if self.link is not None:
            sent = stream.send(self.link, share, self.bucket_bytes)
            tensors, nbytes = sent.tensors, sent.bytes
        else:
            tensors, nbytes = sum(1 for _ in share), 0  # takes part in the collective export
        if done is not None:
            self.wait_for(done, "receive_update")
        return replica_stats(self.group, WeightSyncStats(self.method, tensors, nbytes, 0.0))

    def push(self, weights: PolicyWeights, version: int) -> WeightSyncStats:
        """Collective over the replica: every sender exports its share of the policy now, as a snapshot it keeps, and
        the owner queues the update behind the engine's generations in flight; a background thread on each sender
        streams its snapshot once the engine opens the update session (push.py), so the trainer does not wait for the
        generation in flight."""
        share = self.role.pairs(weights.stage_tensors())
        if self.link is None:
            self.pusher.wait()
            start = time.perf_counter()
            n = sum(1 for _ in share)  # take part in the collective export
            return replica_stats(self.group, WeightSyncStats(self.method, n, 0, time.perf_counter() - start))

        def open_sessions() -> tuple[list[Future], list[Future]]:
            if self.open_session is None:
                return [], []
            opened, done = self.open_session(version)
            return [opened], [done]

        return replica_stats(self.group, self.pusher.push(share, self.link, self.bucket_bytes, open_sessions,
                                                          self.wait_for))

    def wait(self) -> float | None:
        """Wait for this sender's push in flight; the seconds its transfer took (None: none was in flight)."""
        return self.pusher.wait()

    def close(self) -> None:
        self.pusher.close()
