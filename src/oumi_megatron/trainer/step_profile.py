"""Where a GRPO step's time goes, in every step's metrics (``time/*``), not only in a profiler run.

The rollout phase (``time/rollout_s``) splits into:
- ``time/prompts_s``: reading the step's rows and rendering them with the chat template (host);
- ``time/generate_s``: the backend's calls (episodes: with the environment's turns);
  - ``time/decode_s``: of it, the embedded decoder's prefill and decode loops (the device's share, measured up to
    the tokens' copy to the host), with ``time/prefill_s`` and ``time/graph_capture_s`` (its eager first step and
    the capture of the decode step's CUDA graph) parts of it; other backends report none, so their engine call
    counts as the device's share;
- ``time/detokenize_s``: the completions' and prompts' text (prompts once per distinct prompt);
- ``time/reward_s``: the reward functions (the replica's first rank; the others wait in its broadcast);
- ``time/score_gather_s``: the round's scores gathered over DP (the overlong penalty with them);
- ``time/rollout_host_s``: the rollout phase less the device's share: everything a faster decoder would not remove.
The update splits into ``time/batch_build_s`` (advantages, microbatch layouts), ``time/logprob_s`` and
``time/train_s`` (with ``time/train_forward_backward_s`` and ``time/train_optimizer_s`` parts of it). Device work
is timed where its results reach the host, so no phase hides another's queued kernels.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator


class StepProfile:
    """Seconds per named phase, summed over a step (dynamic sampling runs several rounds)."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def metrics(self) -> dict[str, float]:
        """``time/<phase>_s`` for every phase timed."""
        return {f"time/{name}_s": s for name, s in self.seconds.items()}


def rollout_host_seconds(rollout_s: float, phases: dict[str, float]) -> float:
    """The rollout phase outside the device's generation: ``time/rollout_s`` less the decoder's loops where the
    backend reports them, else less its whole generate calls (an engine in another process: vLLM)."""
    device = phases.get("time/decode_s", phases.get("time/generate_s", 0.0))
    return max(rollout_s - device, 0.0)
