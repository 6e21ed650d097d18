"""The reference policy of GRPO's KL term (``grpo.beta > 0``): the initial weights, without a second model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class ReferenceWeights:
    """The initial policy's parameters, kept on the CPU (no second model on the GPU). ``active()`` swaps them into
    the model for the reference logprobs, and the current ones back afterwards."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        self.params = [p for c in chunks for p in c.parameters()]
        self.initial = [p.detach().to("cpu", copy=True) for p in self.params]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        current = [p.detach().to("cpu", copy=True) for p in self.params]
        with torch.no_grad():
            for p, ref in zip(self.params, self.initial):
                p.copy_(ref)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, cur in zip(self.params, current):
                    p.copy_(cur)
