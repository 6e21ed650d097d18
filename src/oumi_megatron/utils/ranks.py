"""This process's global rank, for "rank 0 only" work (logs, files, plots)."""

from __future__ import annotations

import os

import torch.distributed as dist


def global_rank() -> int:
    """torch.distributed's rank once initialized; before that torchrun's ``RANK`` (the resume plan and the
    output-folder checks run before the process group exists); 0 in a plain single process."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
