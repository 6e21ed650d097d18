"""Third-party start-up chatter that tells a user nothing, silenced in the command-line entry points (not in tests, not
in training logs, where a stack's warnings may matter)."""

from __future__ import annotations

import logging
import warnings

QUIET_LOGGERS = ("torchao", "torch.utils.cpp_extension")
"""torchao's "Skipping import of cpp extensions ..." (its kernels do not match this torch; nothing here uses them) and
torch's "No CUDA runtime is found, using CUDA_HOME" on CPU machines."""
QUIET_WARNINGS = ("Transformer Engine and Apex are not installed", "MimoModelConfig is experimental")
"""Megatron-Core's: this project runs without TransformerEngine by design (docs/engine.md); an unused model class."""


def quiet_third_party() -> None:
    """Before the heavy imports: those loggers at ERROR, those warnings ignored."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for text in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{text}.*")
