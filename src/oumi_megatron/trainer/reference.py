"""The reference policy of GRPO's KL term (``grpo.beta > 0``): the initial weights, without a second model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from oumi_megatron.engine.engine import MegatronEngine


class ReferencePolicy(Protocol):
    def active(self) -> contextlib.AbstractContextManager[None]:
        """While the block runs, the model computes with the reference policy's weights."""
        ...


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


class AdaptersOff:
    """Under LoRA the initial policy is the frozen base: the same model with its adapters switched off (verl, ROLL
    and TRL do the same), no copy of any weight."""

    def __init__(self, engine: MegatronEngine) -> None:
        self.engine = engine

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        from oumi_megatron.engine.peft import adapters_off

        with adapters_off(self.engine.peft, self.engine.model):
            yield


def reference_policy(engine: MegatronEngine) -> ReferencePolicy:
    """The reference policy of ``engine``: its base with the adapters off under LoRA, else its initial weights."""
    return AdaptersOff(engine) if engine.peft is not None else ReferenceWeights(engine.model)
