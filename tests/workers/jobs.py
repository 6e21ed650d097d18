"""``--jobs FILE``: several runs of one worker in one torchrun world, one after another (one start-up for all).

FILE holds a JSON list of argument lists; each goes through the worker's ``main(argv)`` in turn (the engine, and
Megatron-Core's process groups with it, are built anew for each). Without ``--jobs`` the worker runs once on its
command line."""

import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path


def run(main: Callable[[list[str] | None], None]) -> None:
    if sys.argv[1:2] != ["--jobs"]:
        main(None)
        return
    for argv in json.loads(Path(sys.argv[2]).read_text()):
        main(argv)
        gc.collect()  # the previous run's engine goes before the next is built
