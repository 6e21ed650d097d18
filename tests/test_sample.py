"""``Sample`` (rollout/sample.py), the one record from the rollout driver to the microbatches: its invariants, the
driver's samples (synchronous and asynchronous single-turn alike), and a rollout dump of them read back."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from oumi_megatron.examples.tiny_models import build_byte_tokenizer
from oumi_megatron.rollout.base import Rollout, TaggedRollouts
from oumi_megatron.rollout.sample import Sample, SampleStatus
from oumi_megatron.rollout.sampling import SamplingParams

EOS = 258


def test_a_sample_s_per_token_fields_cover_its_completion_and_its_status_its_failure() -> None:
    good = Sample([1, 2], [3, 4, 5], 0, logprobs=[-0.1] * 3, loss_mask=[1, 0, 1])
    good.check()
    assert good.versions == [] and good.token_ids == [1, 2, 3, 4, 5] and good.length == 5
    good.stamp(7)
    assert good.versions == [7, 7, 7]
    good.check()
    with pytest.raises(ValueError, match="loss_mask has 2 entries for 3 completion tokens"):
        Sample([1], [3, 4, 5], 0, loss_mask=[1, 0]).check()
    with pytest.raises(ValueError, match="versions has 1 entries"):
        Sample([1], [3, 4], 0, versions=[0]).check()
    with pytest.raises(ValueError, match="a failed sample with failure None"):
        Sample([1], [3], 0, SampleStatus.FAILED).check()
    with pytest.raises(ValueError, match="a finished sample with failure 'boom'"):
        Sample([1], [3], 0, failure="boom").check()


def test_a_sample_s_score_is_its_reward_and_penalty_and_zero_without_a_reward() -> None:
    scored = Sample([1], [2], 0, reward=0.75, overlong_penalty=-0.25)
    assert scored.valid and scored.score == 0.5
    skipped = Sample([1], [2], 0, reward=None, overlong_penalty=0.0)
    assert not skipped.valid and skipped.score == 0.0
    assert not Sample([1], [2], 0, SampleStatus.TRUNCATED).finished and Sample([1], [2], 0).finished


class _Engine:
    """Generates a fixed completion per prompt (cut at the sampling's budget), synchronously or as a submission the
    trainer collects later (rollout/base.py ``AsyncRolloutBackend``): the same tokens either way."""

    def __init__(self) -> None:
        self.queued: list[list[list[Rollout]]] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        out = []
        for p in prompts:
            ids = ([p[0] + 10] * 3 + [EOS])[:params.max_new_tokens]
            out.append([Rollout(list(p), ids, ids[-1] == EOS, [-0.5] * len(ids)) for _ in range(n)])
        return out

    def submit(self, prompts: list[list[int]], params: SamplingParams, n: int) -> None:
        self.queued.append(self.generate(prompts, params, n))

    def collect(self) -> TaggedRollouts:
        return TaggedRollouts(self.queued.pop(0), version=3, engine_seconds=0.0)

    def decode_profile(self) -> None:
        return None


@pytest.mark.parametrize("budget", [10, 2])
def test_asynchronous_single_turn_samples_are_the_driver_s_episodes(budget: int) -> None:
    """A single-turn submission collected later goes through the same episodes' bookkeeping as a generation now: the
    same samples (groups, status, logprobs), stamped with the version the engine reports."""
    from oumi_megatron.environments.driver import EpisodeTools, RolloutDriver

    grpo = SimpleNamespace(max_turns=1, max_observation_tokens=None, max_turn_tokens=None)
    engine = _Engine()
    driver = RolloutDriver(engine, grpo, EpisodeTools(build_byte_tokenizer(), None))  # type: ignore[arg-type]
    params = SamplingParams(max_new_tokens=budget, eos_token_id=EOS)
    prompts, rows, groups = [[1, 2], [5]], [{"id": 0}, {"id": 1}], [4, 9]
    now, now_stats = driver.run(prompts, rows, params, 2, groups=groups, version=2)
    driver.submit(engine, prompts, rows, params, 2, groups=groups)  # type: ignore[arg-type]
    later, later_stats, tagged = driver.collect(engine)  # type: ignore[arg-type]
    assert [s.group for s in now] == [4, 4, 9, 9] and tagged.version == 3
    assert {s.versions[0] for s in now} == {2} and {s.versions[0] for s in later} == {3}
    for s in (*now, *later):
        s.versions = []
    assert later == now and later_stats == now_stats
    expected = SampleStatus.FINISHED if budget == 10 else SampleStatus.TRUNCATED
    assert all(s.status is expected and s.loss_mask is None and s.env_info is None and s.turns == 1 for s in now)


def test_a_dump_is_the_samples_as_json_lines(tmp_path: Path) -> None:
    from oumi_megatron.trainer.rollout_dump import RolloutDump, read_dump

    tok = build_byte_tokenizer()
    hi = tok("Hi", add_special_tokens=False)["input_ids"]
    failed = Sample([1], hi, 3, SampleStatus.FAILED, [-0.1, -0.2], [1, 0], versions=[5, 5], failure="timed out",
                    turns=2, tool_calls=1, env_info={"code": object()}, round=1, rewards={"f": 0.5})
    dump = RolloutDump(tmp_path, every=1, writes=True)
    dump.add(0, tok, [failed])
    (line,) = read_dump(dump.write(0, 0))  # type: ignore[arg-type]
    assert line["status"] == "failed" and line["failure"] == "timed out" and not line["finished"]
    assert (line["group"], line["round"], line["versions"], line["turns"], line["tool_calls"]) == (3, 1, [5, 5], 2, 1)
    assert line["reward"] is None and line["rewards"] == {"f": 0.5} and line["text"] == "Hi"
    assert line["env_info"]["code"].startswith("<object object")  # what JSON cannot hold, as its text
    assert "advantage" not in line and "trainable" not in line  # not known when the dump is taken


def test_staleness_counts_each_policy_token_by_the_version_that_sampled_it() -> None:
    """Asynchronous GRPO's staleness metrics read each sample's per-token versions: the trainer at step 5; a sample
    whose first turn came from version 3 and second from version 4 (its observation tokens, version 3's, not counted),
    one wholly of version 5, one of version 4. Token-weighted mean (2 x 2 + 1 x 1 + 0 x 2 + 1 x 3) / 8, the oldest token 2
    versions behind, one sample of three spans two versions."""
    import torch

    from oumi_megatron.trainer.async_rollouts import staleness_metrics

    spanning = Sample([1], [10, 11, 12, 13, 14], 0, loss_mask=[1, 1, 0, 0, 1], versions=[3, 3, 3, 3, 4])
    fresh = Sample([1], [10, 11], 0, versions=[5, 5])
    one_behind = Sample([1], [10, 11, 12], 0, versions=[4, 4, 4])
    m = staleness_metrics([spanning, fresh, one_behind], 5, torch.device("cpu"))
    assert m["rollout/staleness_mean"] == pytest.approx((2 * 2 + 1 + 0 * 2 + 1 * 3) / 8)
    assert m["rollout/staleness_max"] == 2.0
    assert m["rollout/multi_version_fraction"] == pytest.approx(1 / 3)


def test_streaming_groups_resume_from_the_oldest_untrained_group_and_pass_over_the_trained_ones() -> None:
    """grpo.streaming_groups trains groups out of data order: the checkpoint keeps the oldest position not trained and
    the trained ones after it (and those still to pass over from an earlier resume); a resumed collector reads every
    untrained position once, in order, and none of the trained ones."""
    import torch

    from oumi_megatron.trainer.async_rollouts import StreamingRollouts
    from oumi_megatron.trainer.collection import RolloutCollector, StreamedGroup

    collector = RolloutCollector.__new__(RolloutCollector)  # the data-order state alone
    collector.dataset, collector.order = [{"i": i} for i in range(100)], list(range(100))
    collector.data_position, collector.skip_positions = 24, {25, 27}  # read up to 23; two to pass over from before
    stream = StreamingRollouts.__new__(StreamingRollouts)
    stream.collector, stream.device = collector, torch.device("cpu")
    stream.groups = {p: StreamedGroup(p, [1], {"i": p}, False) for p in (13, 15, 21)}  # in flight, not trained
    state = stream.resume_state()
    assert state == {"data_position": 13, "skip_positions": [14, 16, 17, 18, 19, 20, 22, 23, 25, 27]}
    assert stream.data_position == 13

    resumed = RolloutCollector.__new__(RolloutCollector)
    resumed.dataset, resumed.order = collector.dataset, collector.order
    resumed.data_position, resumed.skip_positions = state["data_position"], set(state["skip_positions"])
    rows, positions = resumed._next_rows(5)
    assert positions == [13, 15, 21, 24, 26] and [r["i"] for r in rows] == positions
    assert resumed._next_rows(2)[1] == [28, 29] and not resumed.skip_positions


def test_kill_point_sends_sigkill_at_the_named_pass_and_does_nothing_unset() -> None:
    """utils/faults.py (the resume stress test's kill -9): the N-th pass of the named point kills the process with
    SIGKILL, no earlier pass and no other point does; without OUMI_MEGATRON_KILL_AT nothing happens."""
    import os
    import signal
    import subprocess
    import sys

    code = ("from oumi_megatron.utils.faults import kill_point\n"
            "for i in range(1, 5):\n    kill_point('push'); kill_point('train'); print(i, flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "OUMI_MEGATRON_KILL_AT"}
    killed = subprocess.run([sys.executable, "-c", code], env={**env, "OUMI_MEGATRON_KILL_AT": "train:3"},
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL and killed.stdout.split() == ["1", "2"]
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and plain.stdout.split() == ["1", "2", "3", "4"]


_ENGINE_LIKE = ("import multiprocessing as mp, pathlib, sys, time\n"
                "def child(ready):\n"
                "    from oumi_megatron.utils.parent_watch import exit_with_parent\n"
                "    exit_with_parent(poll_s=0.1)\n"
                "    pathlib.Path(ready).touch()\n"
                "    time.sleep(120)\n"
                "if __name__ == '__main__':\n"
                "    p = mp.get_context('spawn').Process(target=child, args=(sys.argv[1],), daemon=True); p.start()\n"
                "    print(p.pid, flush=True); time.sleep(120)\n")
_RESULTS_MANAGER = ("import multiprocessing as mp, pathlib, sys, time\n"
                    "from oumi_megatron.engine.state.checkpoint_io import own_write_results_queue\n"
                    "own_write_results_queue()\n"
                    "(manager,) = mp.active_children()\n"
                    "pathlib.Path(sys.argv[1]).touch(); print(manager.pid, flush=True); time.sleep(120)\n")


@pytest.mark.parametrize("child", ["engine", "checkpoint_results_manager"])
def test_a_helper_process_ends_with_the_trainer_that_started_it(tmp_path, child: str) -> None:  # noqa: ANN001
    """utils/parent_watch.py: a separate engine's process (spawned) and a background checkpoint write's results manager
    (forked) end once their trainer is gone (killed with SIGKILL, which closes nothing), so neither holds a GPU or
    host memory in the way of the resumed run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    ready = tmp_path / "watching"
    script = tmp_path / "trainer.py"
    script.write_text(_ENGINE_LIKE if child == "engine" else _RESULTS_MANAGER)
    trainer = subprocess.Popen([sys.executable, str(script), str(ready)], stdout=subprocess.PIPE, text=True)
    helper = int(trainer.stdout.readline())
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline:  # the helper imported and watches
        time.sleep(0.1)
    assert ready.exists()
    os.kill(helper, 0)  # alive while the trainer is
    trainer.send_signal(signal.SIGKILL)
    trainer.wait(timeout=30)
    deadline = time.monotonic() + 30
    status = Path(f"/proc/{helper}/status")
    while time.monotonic() < deadline:
        try:  # gone, or a zombie no one reaps yet (re-parented to a PID 1 that may not reap): ended either way
            if "State:\tZ" in status.read_text():
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.2)
    else:
        os.kill(helper, signal.SIGKILL)
        raise AssertionError(f"the {child} process outlived its trainer by 30 s")


def test_the_mismatch_splits_by_staleness_over_the_tokens_an_older_policy_sampled() -> None:
    """Asynchronous GRPO's mismatch by staleness: each microbatch's stale_mask marks the completion tokens a policy
    older than the trainer's sampled (a sample whose turns span two versions has both kinds), logprob_mismatch sums
    those tokens apart, and the step's metrics give the mean |diff| over stale and over current tokens."""
    import torch

    from oumi_megatron.grpo.algorithm import logprob_mismatch
    from oumi_megatron.rollout.sample import Sample
    from oumi_megatron.trainer.batches import mark_stale, packed_layout
    from oumi_megatron.trainer.step_metrics import mismatch_by_staleness

    a = Sample([1, 2], [3, 4, 5], 0, logprobs=[-1.0, -1.0, -1.0], versions=[4, 4, 5], trainable=True)
    b = Sample([1], [6, 7], 1, logprobs=[-2.0, -2.0], versions=[5, 5], trainable=True)
    layout = packed_layout([a, b], 1, pad_id=0, capacity=8)  # one row holds both
    mark_stale(layout, [a, b], 5)
    mb = layout.microbatches[0]
    assert mb["stale_mask"].sum() == 2 and mb["stale_mask"][0].tolist()[1:3] == [1.0, 1.0]  # a's first two tokens
    trainer = torch.zeros_like(mb["rollout_logprobs"])  # the trainer's logprobs: 0 everywhere
    m = logprob_mismatch(mb["rollout_logprobs"], trainer, mb["completion_mask"], mb["stale_mask"])
    assert (m["tokens"], m["stale_tokens"], m["stale_abs_diff_sum"], m["abs_diff_sum"]) == (5, 2, 2.0, 7.0)
    out = mismatch_by_staleness({"mm_tokens": 5.0, "mm_abs": 7.0, "mm_stale_tokens": 2.0, "mm_stale_abs": 2.0})
    assert out == {"mismatch/mean_abs_diff_stale": 1.0, "mismatch/mean_abs_diff_current": 5.0 / 3}
