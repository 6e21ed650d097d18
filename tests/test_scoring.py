"""Rewards scored once (trainer/scoring.py): each sample by exactly one rank, its replica's first; a failure anywhere
stops every rank with the same error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, VENV_BIN, free_port, run_cli


def _torchrun(n: int, *args: str) -> list[str]:
    return [str(VENV_BIN / "torchrun"), "--nproc_per_node", str(n), "--master-port", str(free_port()), *args]


@pytest.mark.parametrize("tp", [2, 1], ids=["one_replica", "two_replicas"])
def test_one_rank_a_replica_scores_and_every_rank_gets_its_scores(tmp_path: Path, tp: int) -> None:
    """TP 2 (one replica of 2 ranks): rank 0 alone calls the reward function and rank 1 receives rank 0's values
    (each rank's function adds rank / 10: rank 1's would differ); TP 1 (two replicas): each rank scores its own.
    A reward that raises on one scoring rank alone (rank 0 of the one replica, rank 1 of the second) gives both ranks
    the same error, naming the function and the cause, instead of leaving the other waiting in a collective (the call
    would time out)."""
    proc = run_cli(_torchrun(2, str(REPO / "tests" / "workers" / "scoring_worker.py"), str(tmp_path), "--tp", str(tp)),
                   timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    if tp == 2:
        assert [r["calls"] for r in ranks] == [[3], []] and [r["samples_scored"] for r in ranks] == [3, 0]
        assert ranks[0]["totals"] == ranks[1]["totals"] == [1.0, 2.0, 3.0] and ranks[1]["replica"] == [0, 1]
    else:
        assert [r["calls"] for r in ranks] == [[3], [3]]
        assert ranks[0]["totals"] == [1.0, 2.0, 3.0] and ranks[1]["totals"] == [1.1, 2.1, 3.1]
    assert all(r["empty"] == 0 for r in ranks)
    errors = {r["error"] for r in ranks}
    assert len(errors) == 1 and None not in errors, errors
    (error,) = errors
    assert "'judge'" in error and "RuntimeError: judge unreachable" in error and "on_reward_error" in error


def test_each_sample_is_scored_once_at_tp2_pp2(tmp_path: Path) -> None:
    """The GRPO loop on TP 2 x PP 2 (4 gloo ranks, one replica): the reward function is called once per completion
    in all (2 steps x 32 completions), all on rank 0; scoring on every rank called it 4 times per sample."""
    log = tmp_path / "calls"
    proc = run_cli(_torchrun(4, str(REPO / "tests" / "workers" / "grpo_loop_worker.py"), str(tmp_path / "work"),
                             "--steps", "2", "--tp", "2", "--pp", "2", "--reward-log", str(log)), timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    calls = [json.loads((log / f"rank{r}.json").read_text()) for r in range(4)]
    assert [sum(c) for c in calls] == [2 * 32, 0, 0, 0], calls
