"""Sequence parallelism switched off for forward-only passes (logprobs, generation), as Megatron-Core's own inference
does (the flags ``set_model_to_sequence_parallel`` sets); training keeps it on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from oumi_megatron.engine.wrappers import unwrap


def _sequence_parallel_flags(model: torch.nn.Module) -> tuple[str, ...]:
    """The module attributes that switch sequence parallelism (Megatron-Core's, as ``set_model_to_sequence_parallel``
    sets them, and LoRA adapters' ``disable_sequence_parallel_comm``: True is off)."""
    embeddings = () if getattr(model, "position_embedding_type", None) == "learned_absolute" else ("reduce_scatter_embeddings",)
    return ("sequence_parallel", "scatter_to_sequence_parallel", *embeddings, "disable_sequence_parallel_comm")


@contextlib.contextmanager
def sequence_parallel_off(chunks: list[torch.nn.Module], config: Any) -> Iterator[None]:
    """The model ``chunks`` (``config``: their Megatron-Core config) without sequence parallelism for the block. Each
    flag gets back the value it had, not True: a LoRA adapter's own linear layers are built without sequence parallelism
    and gather their input themselves (``disable_sequence_parallel_comm``, switched off here with the rest), and
    Megatron-Core's helper would turn them on. Its cache of modules by ``id(model)`` is not used either: a later model
    can take a freed one's id."""
    if not config.sequence_parallel:
        yield
        return
    models = [unwrap(chunk) for chunk in chunks]
    flags = [(m, attr, getattr(m, attr)) for model in models for m in model.modules()
             for attr in _sequence_parallel_flags(model) if hasattr(m, attr)]
    for m, attr, _ in flags:
        setattr(m, attr, attr == "disable_sequence_parallel_comm")
    configs = {id(model.config): model.config for model in models}
    for c in configs.values():
        c.sequence_parallel = False
    try:
        yield
    finally:
        for m, attr, value in flags:
            setattr(m, attr, value)
        for c in configs.values():
            c.sequence_parallel = True
