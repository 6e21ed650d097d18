"""Helper processes that end with the process that started them.

A trainer killed with SIGKILL (out of memory, a lost node, ``kill -9``) closes nothing: a separate vLLM engine blocked
in a weight update with it, or a checkpoint writer's results manager, would live on, holding host memory or a GPU in
the way of the resumed run. ``exit_with_parent`` in such a process ends it once its parent is gone: the kernel's
parent-death signal where Linux has it (it needs no Python thread: it fires even while a C call holds the GIL), and a
watch thread everywhere."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


def exit_with_parent(poll_s: float = 1.0) -> None:
    """End this process when its parent process ends (call it first thing in the child)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:  # SIGKILL to this process when the thread that started it ends (the parent's main thread, here)
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it ended before the signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="oumi-megatron-parent-watch").start()
