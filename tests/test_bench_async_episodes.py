"""scripts/bench_async_episodes.py's pure parts: the heavy-tailed latency draw (deterministic, slow in the stated
proportion), its environment's episodes (1 to 6 turns, the environment's own end and score), and the tool-time bounds
read back from the environment's call log."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest

from conftest import REPO
from oumi_megatron.environments.base import EpisodeEnd, Observation

sys.path.insert(0, str(REPO / "scripts"))  # the benchmark's plugin and script live there
from bench_async_episodes import parse_extra_row, tool_calls  # noqa: E402
from heavy_tail_env import HeavyTailTools, Latency, heavy_tail_score, row_key  # noqa: E402


def test_the_draws_are_deterministic_and_heavy_tailed_in_the_stated_proportion() -> None:
    law = Latency(fast_s=0.05, slow_s=3.0, slow_one_in=20, seed=0)
    draws = [law.seconds(f"row {r}", copy, call) for r in range(1000) for copy in range(4) for call in range(5)]
    assert draws == [Latency(seed=0).seconds(f"row {r}", copy, call)  # the same law from the same seed: the same calls
                     for r in range(1000) for copy in range(4) for call in range(5)]
    assert set(draws) == {0.05, 3.0}
    assert 0.045 < draws.count(3.0) / len(draws) < 0.055  # 1 in 20 (20,000 draws: +-3.4 standard deviations)
    assert draws != [Latency(seed=1).seconds(f"row {r}", c, k) for r in range(1000) for c in range(4) for k in range(5)]
    calls = collections.Counter(law.tool_calls(f"row {r}") for r in range(3000))
    assert set(calls) == set(range(6)) and min(calls.values()) > 0.13 * 3000  # 0..5 calls: 1..6 turns, about uniform
    assert Latency.from_env(law.as_env()) == law


def test_an_episode_takes_its_row_s_calls_plus_one_turns_and_is_scored_by_the_environment() -> None:
    env = HeavyTailTools(Latency(fast_s=0.0, slow_s=0.0))
    row = {"prompt": [{"role": "user", "content": "Only digits, please (x)."}], "target": "digits"}
    k = env.latency.tool_calls(row_key(row))
    state = env.start(row)
    answers = [env.step(state, "12ab" if turn % 2 else "1234", []) for turn in range(k + 1)]
    assert all(isinstance(a, Observation) and a.role == "tool" for a in answers[:-1])
    end = answers[-1]
    assert isinstance(end, EpisodeEnd) and end.info["tool_calls"] == k
    assert end.info["score"] == pytest.approx(sum(1.0 if t % 2 == 0 else 0.5 for t in range(k + 1)) / (k + 1))
    assert env.start(row)["copy"] == 1  # a second episode of the row draws its own calls
    assert heavy_tail_score(["a", "b"], env_info=[end.info, {}]) == [end.info["score"], 0.0]


def test_the_bounds_read_back_from_the_call_log(tmp_path: Path) -> None:
    """Two batches of two episodes: a batch without a turn barrier waits for its slowest episode's calls in sequence,
    with one for each turn's slowest call."""
    log = tmp_path / "calls.jsonl"
    starts = [{"start": i, "key": f"r{i // 2}", "copy": i % 2} for i in range(4)]
    calls = [("r0", 0, 0, 3.0), ("r0", 0, 1, 0.1), ("r0", 1, 0, 0.1), ("r0", 1, 1, 3.0),  # batch 0: two episodes
             ("r1", 0, 0, 0.1), ("r1", 1, 0, 0.1), ("r1", 1, 1, 0.1)]                    # batch 1
    records = starts + [{"key": k, "copy": c, "call": n, "s": s, "slow": s == 3.0} for k, c, n, s in calls]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    got = tool_calls(log, per_step=2)
    assert (got["episodes"], got["tool_calls"], got["slow_calls"]) == (4, 7, 2)
    assert got["no_barrier_s"] == pytest.approx(3.1 + 0.2)  # batch 0: max(3.1, 3.1); batch 1: max(0.1, 0.2)
    assert got["turn_barrier_s"] == pytest.approx(3.0 + 3.0 + 0.1 + 0.1)


def test_an_extra_row_is_a_name_and_its_overrides() -> None:
    assert parse_extra_row("streaming:grpo.streaming_groups=true,grpo.max_staleness=2") == (
        "streaming", ["grpo.streaming_groups=true", "grpo.max_staleness=2"])
    for bad in ("streaming", "async:grpo.x=1", "x:grpo.y"):
        with pytest.raises(SystemExit):
            parse_extra_row(bad)
