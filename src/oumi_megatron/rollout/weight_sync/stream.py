"""The NCCL / gloo stream: the policy's weights to engines outside the trainer's processes, HF-named tensors in packed
buckets, over a process group of their own. Both ends use it: the trainer's senders (senders.py) and the engine's
receiver (vllm_stream.py, in vLLM's worker processes). Torch only (no vLLM import), so both stay light.

Source: the engine's exporter (engine/state/hf_weights.py ``HFWeightExporter``, handed to the rollout backend's
``sync_weights`` by the trainer) yields ``(hf_name, tensor)``: each pipeline stage its own tensors
(``stage_tensors``), of which each sender takes a share (``share_of``; senders.py says who sends).
Buckets: consecutive tensors packed into one contiguous byte buffer of about ``bucket_bytes`` (fewer, larger
messages). Wire format, over a group of one sender (rank 0) and the engine's workers (ranks 1..), self-describing so
the receiver needs nothing up front: ``int64[2] = (len(meta), len(buffer))`` (``(0, 0)`` ends the stream),
``uint8[len(meta)]`` = JSON list of ``[name, dtype, shape, offset]``, then the buffer. An engine fed by several senders
receives from all their groups at once (``receive_all``).
"""

from __future__ import annotations

import collections
import json
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from oumi_megatron.utils.net import bound_store, gloo_options, route_address

_ALIGN = 64  # byte alignment of each tensor inside a bucket


@dataclass
class Bucket:
    meta: list[list[Any]]
    """``[name, dtype, shape, offset]`` per tensor."""
    buffer: torch.Tensor
    """uint8, all tensors' bytes."""

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, dtype, shape, offset in self.meta:
            dt = getattr(torch, dtype)
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
            out.append((name, self.buffer[offset : offset + n].view(dt).view(shape)))
        return out


def _meta_entry(name: str, t: torch.Tensor, offset: int) -> list[Any]:
    """One tensor's entry in a bucket's ``meta`` (the wire format above)."""
    return [name, str(t.dtype).removeprefix("torch."), list(t.shape), offset]


def pack(pairs: list[tuple[str, torch.Tensor]], device: torch.device | None = None) -> Bucket:
    meta, offset = [], 0
    for name, t in pairs:
        meta.append(_meta_entry(name, t, offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    buffer = torch.empty(offset, dtype=torch.uint8, device=device or pairs[0][1].device)
    for (_, t), (_, _, _, o) in zip(pairs, meta):
        n = t.numel() * t.element_size()
        buffer[o : o + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
    return Bucket(meta, buffer)


def buckets(pairs: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Consecutive tensors packed into buckets of about ``bucket_bytes``. A tensor of ``bucket_bytes``
    or more travels alone, as a view of its own bytes: no packing copy (a ~1B model's sync on 2 x H100:
    18-23 ms with the copy, 14-15 ms without; within the noise on another host, docs/benchmarks.md)."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in pairs:
        nbytes = t.numel() * t.element_size()
        if nbytes >= bucket_bytes and t.is_contiguous():
            if pending:
                yield pack(pending)
                pending, size = [], 0
            yield Bucket([_meta_entry(name, t, 0)], t.detach().view(-1).view(torch.uint8))
            continue
        pending.append((name, t))
        size += nbytes
        if size >= bucket_bytes:
            yield pack(pending)
            pending, size = [], 0
    if pending:
        yield pack(pending)


def share_of(pairs: Iterable[tuple[str, torch.Tensor]], share: int, shares: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The pairs that sender ``share`` of ``shares`` sends, out of a stream every one of them iterates to the end (the
    export is collective): each tensor goes to the sender with the fewest bytes so far (ties: the lowest index). The
    senders see the same stream, so they make the same choices without talking; each ends with about 1/``shares`` of
    the bytes (at most one tensor more)."""
    loads = [0] * shares
    for name, t in pairs:
        k = min(range(shares), key=loads.__getitem__)
        loads[k] += t.numel() * t.element_size()
        if k == share:
            yield name, t


class Counted:
    """Passes buckets through, counting their tensors and bytes."""

    def __init__(self, source: Iterable[Bucket]) -> None:
        self.source, self.tensors, self.bytes = source, 0, 0

    def __iter__(self) -> Iterator[Bucket]:
        for bucket in self.source:
            self.tensors += len(bucket.meta)
            self.bytes += bucket.buffer.numel()
            yield bucket


class TimedPairs:
    """Passes ``(name, tensor)`` pairs through, counting them and their bytes and timing the source alone
    (the exporter's share of a sync whose consumer, the engine's loader, pulls the pairs lazily)."""

    def __init__(self, source: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.source, self.tensors, self.bytes, self.seconds = source, 0, 0, 0.0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        it = iter(self.source)
        while True:
            start = time.perf_counter()
            pair = next(it, None)
            self.seconds += time.perf_counter() - start
            if pair is None:
                return
            self.tensors += 1
            self.bytes += pair[1].numel() * pair[1].element_size()
            yield pair


class WeightSyncGroup:
    """A process group of its own, beside the training group: rank 0 is the trainer's sending rank, ranks 1.. the
    engines (one for a separate engine process; every engine of a Ray fleet). Its own TCPStore (rank 0 hosts it;
    ``host`` is its address as the engines reach it), not registered with torch.distributed, so
    the training world is untouched. Every member listens on the interface that leads to ``host`` only: the store's
    master on ``host`` itself, each member's gloo connections on its own address towards it (loopback when the engines
    share the node)."""

    def __init__(self, host: str, port: int, rank: int, backend: str = "gloo", timeout_s: float = 3600.0,
                 device: torch.device | None = None, world_size: int = 2) -> None:
        """``device``: NCCL's GPU (default: the current one). ``timeout_s``: how long a broadcast waits for the other
        members (an asynchronous push's sender may start before the engine's update session opens, behind a generation
        in flight)."""
        timeout = timedelta(seconds=timeout_s)
        self.store, self._listener = bound_store(host, port, world_size, rank == 0, timeout)
        prefix = dist.PrefixStore("oumi_megatron_weight_sync", self.store)
        self.group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(prefix, rank, world_size, gloo_options(route_address(host, port), timeout))
        elif backend == "nccl":
            if device is not None:
                torch.cuda.set_device(device)
            # options has a default in the binding; torch's stub makes it required
            self.group = dist.ProcessGroupNCCL(prefix, rank, world_size)  # type: ignore[call-arg]
        else:
            raise ValueError(f"unknown weight-sync backend {backend!r}")
        self.rank = rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        """Give the group up (a restarted engine joins a new one): an NCCL communicator is aborted, so a broadcast stuck
        on a dead peer returns with an error instead of waiting out the timeout."""
        abort = getattr(self.group, "abort", None)
        if self.device.type == "cuda" and abort is not None:
            try:
                abort()
            except Exception:  # noqa: BLE001 - giving up a group that already failed
                pass

    def synchronize(self) -> None:
        """Wait for the group's GPU work (NCCL runs on its own stream); nothing to wait for with gloo."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.broadcast_async(tensor, src).wait()
        return tensor

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Started, not waited for: keep ``tensor`` alive until ``.wait()`` (the group holds a reference too)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        # the backends' broadcast binding is missing from torch's stub (Backend declares no collectives)
        return self.group.broadcast([tensor], opts)  # type: ignore[union-attr]


@dataclass
class SendStats:
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    broadcast_seconds: float = 0.0
    """Host time inside broadcast calls (gloo: the transfer; NCCL: only the enqueue, it is asynchronous)."""


def _finished(work: Any, cuda: bool) -> None:
    """Until ``work`` is done. NCCL's ``wait`` only orders the current stream after it and returns at once: the CPU
    would run ahead, packing bucket after bucket into fresh GPU memory (the caching allocator does not reuse a buffer
    a collective still reads), up to the whole model while the receiver lags. Polling its completion bounds that."""
    work.wait()
    if cuda:
        while not work.is_completed():
            time.sleep(1e-4)


def send(group: WeightSyncGroup, pairs: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, max_in_flight: int = 2) -> SendStats:
    """Trainer side: stream every bucket, then the end marker. Up to ``max_in_flight`` buckets are on
    the wire while the next one is exported and packed (with NCCL the broadcasts run on their own
    stream); older ones are waited for, so at most that many bucket buffers exist at once."""
    stats = SendStats()
    start = time.perf_counter()
    cuda = group.device.type == "cuda"
    # (works, the tensors they send): a bucket's buffer may be the model's own tensor (see ``buckets``),
    # kept referenced here until its broadcast is done
    in_flight: collections.deque[tuple[list[Any], tuple[torch.Tensor, ...]]] = collections.deque()
    counted = Counted(buckets(((n, t.to(group.device)) for n, t in pairs), bucket_bytes))
    for bucket in counted:
        while len(in_flight) >= max_in_flight:
            for work in in_flight.popleft()[0]:
                _finished(work, cuda)
        meta = torch.frombuffer(bytearray(json.dumps(bucket.meta).encode()), dtype=torch.uint8).to(group.device)
        header = torch.tensor([meta.numel(), bucket.buffer.numel()], dtype=torch.int64, device=group.device)
        t0 = time.perf_counter()
        tensors = (header, meta, bucket.buffer)
        in_flight.append(([group.broadcast_async(t) for t in tensors], tensors))
        stats.broadcast_seconds += time.perf_counter() - t0
    end = torch.zeros(2, dtype=torch.int64, device=group.device)
    in_flight.append(([group.broadcast_async(end)], (end,)))
    for works, _ in in_flight:
        for work in works:
            _finished(work, cuda)
    stats.tensors, stats.bytes = counted.tensors, counted.bytes
    stats.seconds = time.perf_counter() - start
    return stats


def receive(group: WeightSyncGroup, permits: threading.Semaphore | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Engine side: the tensors of each bucket until the end marker (a fresh buffer per bucket: the
    receiver may keep views into it). ``permits``: taken before each bucket's buffer is allocated, after its header
    (whoever consumes the bucket gives it back; see ``receive_all``)."""
    while True:
        header = group.broadcast(torch.zeros(2, dtype=torch.int64, device=group.device))
        meta_len, buf_len = (int(x) for x in header.tolist())
        if meta_len == 0:
            return
        if permits is not None:
            permits.acquire()
        meta = group.broadcast(torch.empty(meta_len, dtype=torch.uint8, device=group.device))
        buffer = group.broadcast(torch.empty(buf_len, dtype=torch.uint8, device=group.device))
        yield Bucket(json.loads(bytes(meta.cpu().tolist()).decode()), buffer).tensors()


MAX_BUFFERED = 4
"""Buckets an engine fed by several senders holds at once, received or being received (about 1 GiB at the default
``weight_sync_bucket_mb``): enough to keep one link busy, bounded however many senders there are."""


def receive_all(groups: list[WeightSyncGroup], max_buffered: int = MAX_BUFFERED) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Engine side, several senders (one group each): every group's buckets, as they arrive, until each has sent its end
    marker. A thread per group receives; the caller loads one bucket at a time. At most ``max_buffered`` buckets exist
    at once: a receiver takes a permit after a bucket's header, so a sender whose bucket waits for a permit has posted
    nothing it still has to export, and the permits' holders complete without any sender's further help (a permit
    taken before the header could wait on a sender stuck in the export's collective with one that waits for a permit).
    A receiver's error ends the stream with it."""
    if len(groups) == 1:
        yield from receive(groups[0])
        return
    arrived: queue.Queue[tuple[str, Any]] = queue.Queue()
    permits = threading.Semaphore(max_buffered)

    def run(group: WeightSyncGroup) -> None:
        try:
            if group.device.type == "cuda":
                torch.cuda.set_device(group.device)
            for bucket in receive(group, permits):
                arrived.put(("bucket", bucket))
            arrived.put(("end", None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            arrived.put(("error", e))

    for i, group in enumerate(groups):
        threading.Thread(target=run, args=(group,), daemon=True, name=f"oumi-megatron-weight-receive-{i}").start()
    remaining = len(groups)
    while remaining:
        kind, value = arrived.get()
        if kind == "end":
            remaining -= 1
        elif kind == "error":
            raise RuntimeError(f"receiving the weights from one of {len(groups)} senders failed: {value!r}") from value
        else:
            yield value
            permits.release()  # the caller has loaded it


def in_threads(fn: Any, groups: list[WeightSyncGroup], *args: Any) -> list[Any]:
    """``fn(group, *args)`` for every group at once, a thread each (a probe of several senders' links); the results in
    order, the first error raised."""
    results: list[Any] = [None] * len(groups)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            if groups[i].device.type == "cuda":
                torch.cuda.set_device(groups[i].device)
            results[i] = fn(groups[i], *args)
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


RAW_PROBE_BYTES = {"cuda": 256 * 2**20, "cpu": 32 * 2**20}
"""The buffer a raw-bandwidth probe broadcasts: large enough for a link's peak (NCCL), small on CPU (gloo, CI)."""
RAW_PROBE_REPEATS = 3


def send_raw(group: WeightSyncGroup, nbytes: int, repeats: int = RAW_PROBE_REPEATS) -> float:
    """Trainer side of the raw-bandwidth probe: one warm-up broadcast of ``nbytes``, then ``repeats`` timed ones, over
    the same group and GPUs the weights take. The receivers call ``receive_raw`` meanwhile. Returns GB/s: what the
    weight sync's ``weight_sync/fraction_of_raw`` compares against."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
    group.broadcast(buffer)
    group.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        group.broadcast(buffer)
    group.synchronize()
    return nbytes * repeats / max(time.perf_counter() - start, 1e-9) / 1e9


def receive_raw(group: WeightSyncGroup, nbytes: int, repeats: int = RAW_PROBE_REPEATS) -> None:
    """Engine side of ``send_raw``."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
    for _ in range(repeats + 1):
        group.broadcast(buffer)
    group.synchronize()
