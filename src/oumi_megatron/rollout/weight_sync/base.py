"""The interface every transport offers its backend: ``sync`` for the synchronous loop, and for engines that generate
while the trainer trains (asynchronous GRPO) ``push`` and ``wait``. A backend builds one transport at start and calls
it from its ``sync_weights`` (through ``synced``), ``push_weights`` and ``wait_pushed`` (rollout/base.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from oumi_megatron.rollout.base import PolicyWeights, WeightSyncStats


class WeightSyncError(RuntimeError):
    """The rollout engine did not take the new weights; training stops rather than use stale ones."""


class WeightSync(Protocol):
    """One way the policy's weights reach a backend's engines."""

    def sync(self, weights: PolicyWeights) -> WeightSyncStats:
        """Collective over the training ranks: the engines hold ``weights`` when it returns."""
        ...


@runtime_checkable
class WeightPush(WeightSync, Protocol):
    """A transport to engines that generate while the trainer trains: a push is queued behind their generations in
    flight and the trainer does not wait for it."""

    def push(self, weights: PolicyWeights, version: int) -> WeightSyncStats:
        """Collective over the training ranks: ``weights`` (policy version ``version``) read now and queued for the
        engines; returns without waiting for them."""
        ...

    def wait(self) -> float | None:
        """Wait for the push in flight; the seconds its transfer took (None: none was in flight)."""
        ...


def synced(transport: WeightSync, weights: PolicyWeights, what: str) -> WeightSyncStats:
    """``transport.sync(weights)``, its ``seconds`` measured here; any failure is a ``WeightSyncError`` naming ``what``
    (the engines may hold stale weights: training stops with the cause)."""
    start = time.perf_counter()
    try:
        stats = transport.sync(weights)
    except WeightSyncError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure means stale weights: stop with the cause
        raise WeightSyncError(f"weight sync ({what}) failed: {e}") from e
    stats.seconds = time.perf_counter() - start
    return stats
