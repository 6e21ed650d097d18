"""Long operations say what they do while they do it (utils/progress.py: checkpoint save and load, HF export,
conversion), and sizes read in the unit that fits (utils/disk.py ``human_bytes``: a 3.6 MB checkpoint is not
"~0.0 GiB"). The operations' own lines are checked in a real run: tests/test_two_nodes.py."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from oumi_megatron.utils.disk import folder_bytes, human_bytes, space_problem
from oumi_megatron.utils.progress import Progress


def test_sizes_read_in_the_unit_that_fits() -> None:
    assert [human_bytes(n) for n in (0, 512, 3.6e6, 12.1 * 2**30, 3 * 2**40, 5 * 2**50)] == [
        "0 B", "512 B", "3.4 MiB", "12.1 GiB", "3.0 TiB", "5120.0 TiB"]


def test_a_disk_message_says_megabytes_for_a_small_checkpoint(tmp_path: Path) -> None:
    import shutil

    free = shutil.disk_usage(tmp_path).free
    message = space_problem(tmp_path, free + 3.6e6, "checkpoint step 2", "free space there")
    assert message is not None and "checkpoint step 2 needs ~" in message and "~0.0 GiB" not in message
    assert space_problem(tmp_path, 3.6e6, "checkpoint step 2", "free space there") is None


def test_a_long_operation_logs_its_start_its_progress_and_its_end(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = tmp_path / ".out.partial"
    target.mkdir()

    def write() -> None:
        for i in range(6):
            (target / f"shard_{i}").write_bytes(b"x" * 2**20)
            time.sleep(0.05)

    with caplog.at_level(logging.INFO, logger="oumi"):
        with Progress("Saving checkpoint step 2 to out", watch=target, expected=6 * 2**20, every=0.1, enabled=True) as p:
            writer = threading.Thread(target=write)
            writer.start()
            writer.join()
            final = tmp_path / "out"
            target.rename(final)
            p.result = final
    lines = [r.getMessage() for r in caplog.records if r.name == "oumi"]
    assert lines[0] == "Saving checkpoint step 2 to out (~6.0 MiB) ..."
    beats = [line for line in lines[1:-1] if " s so far, " in line]
    assert beats and all(line.endswith(" of ~6.0 MiB written") for line in beats), lines
    assert lines[-1].startswith("Saving checkpoint step 2 to out: done in ") and " (6.0 MiB, " in lines[-1], lines
    assert folder_bytes(final) == 6 * 2**20


def test_a_failed_operation_says_it_stopped_and_other_ranks_stay_quiet(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="oumi"):
        with pytest.raises(ValueError), Progress("Loading checkpoint c", every=None, enabled=True):
            raise ValueError("damaged")
        with Progress("Loading checkpoint c", every=None, enabled=False):
            pass
    lines = [r.getMessage() for r in caplog.records if r.name == "oumi"]
    assert lines[0] == "Loading checkpoint c ..." and lines[1].startswith("Loading checkpoint c: stopped after ")
    assert lines[1].endswith(" s (ValueError)") and len(lines) == 2
