"""Progress of the long operations (checkpoint save and load, HF export, conversion: minutes per rank at 70B): a line
when one starts, one every ``every`` seconds while it runs (the time so far and, where it writes a folder, the bytes
there against the size expected), and one when it ends, with its time and rate. Logged by global rank 0 (the other
ranks do their share of the same operation at the same time, into the same folders).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from types import TracebackType

from oumi_megatron.utils.disk import folder_bytes, human_bytes
from oumi_megatron.utils.ranks import global_rank

EVERY_S = 30.0
"""Seconds between the lines of an operation in progress."""


class Progress:
    """``with Progress("Saving checkpoint step 50 to DIR", watch=tmp, expected=n) as p: ...; p.result = DIR``."""

    def __init__(self, what: str, watch: str | Path | None = None, expected: float | None = None,
                 reads: str | Path | None = None, every: float | None = EVERY_S, logger: logging.Logger | None = None,
                 enabled: bool | None = None) -> None:
        """``watch``: the folder it writes (its bytes are read every ``every`` seconds; None: no lines in between);
        ``expected``: the bytes it will write; ``reads``: the folder it reads (its size said at the start);
        ``enabled``: whether this process logs (default: global rank 0)."""
        self.what, self.expected, self.every = what, expected, every
        self.watch, self.reads = (Path(watch) if watch else None), (Path(reads) if reads else None)
        self.result: Path | None = None
        """The folder the operation ended with (an atomic write's, renamed from ``watch``), measured at the end."""
        self.logger = logger or logging.getLogger("oumi")  # Oumi's logger where Oumi runs, plain logging elsewhere
        self.enabled = global_rank() == 0 if enabled is None else enabled
        self.started = 0.0
        self._read_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _beat(self) -> None:
        assert self.every is not None
        while not self._stop.wait(self.every):
            so_far = ""
            if self.watch is not None:
                of = f" of ~{human_bytes(self.expected)}" if self.expected else ""
                so_far = f", {human_bytes(folder_bytes(self.watch))}{of} written"
            self.logger.info(f"{self.what}: {time.perf_counter() - self.started:.0f} s so far{so_far}")

    def __enter__(self) -> Progress:
        self.started = time.perf_counter()
        if not self.enabled:
            return self
        size = ""
        if self.reads is not None:
            self._read_bytes = folder_bytes(self.reads)
            size = f" ({human_bytes(self._read_bytes)} to read)"
        elif self.expected:
            size = f" (~{human_bytes(self.expected)})"
        self.logger.info(f"{self.what}{size} ...")
        if self.every is not None:
            self._thread = threading.Thread(target=self._beat, name="oumi-megatron-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self.enabled:
            return
        seconds = time.perf_counter() - self.started
        if kind is not None:
            self.logger.info(f"{self.what}: stopped after {seconds:.1f} s ({kind.__name__})")
            return
        folder = self.result if self.result is not None else self.watch
        size = folder_bytes(folder) if folder is not None and folder.exists() else self._read_bytes
        rate = f", {human_bytes(size / seconds)}/s" if size and seconds > 0 else ""
        self.logger.info(f"{self.what}: done in {seconds:.1f} s" + (f" ({human_bytes(size)}{rate})" if size else ""))
