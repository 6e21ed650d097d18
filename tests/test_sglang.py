"""SGLang rollouts with the real engine (sglang 0.5.17 on the CPU, in CI): greedy parity with the embedded backend,
logprobs, the weight probe before and after a sync, multi-turn episodes, and GRPO.

tests/workers/sglang_worker.py, one engine start per test: the engine's greedy completions (an EOS ending rows early)
equal the embedded backend's before and after a sync; its logprobs of its own samples equal the trainer's (fp32);
``weight_sync/probe_max_diff`` is ~0 at the start, clearly off after two optimizer steps without a sync (what a sync
that did nothing leaves) and ~0 after the sync; greedy episodes of a toy environment are the same as request chains
(no turn barrier), turn by turn and on the embedded backend.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, VENV_BIN, free_port, run_cli

pytestmark = pytest.mark.slow
PY = str(VENV_BIN / "python")
TORCHRUN = str(VENV_BIN / "torchrun")
WORKER = str(REPO / "tests" / "workers" / "sglang_worker.py")
EQUAL = 1e-5  # fp32 on the CPU; seen 4.8e-7
STALE = 0.05  # seen 0.47


def _check(proc) -> None:  # noqa: ANN001
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("sglang") / "megatron_checkpoint"
    _check(run_cli(["oumi-megatron", "convert", "--hf", str(tiny_model_dir), "--out", str(out), "--dtype", "float32"]))
    return out


def _run(converted: Path, tiny_model_dir: Path, placement: str, nproc: int = 1, *extra: str) -> dict:
    out = converted.parent / f"{placement}_{nproc}.json"
    worker = [WORKER, str(converted), str(tiny_model_dir), str(out), "--placement", placement, *extra]
    cmd = [PY, *worker] if nproc == 1 else [TORCHRUN, "--nproc_per_node", str(nproc), "--master-port", str(free_port()), *worker]
    _check(run_cli(cmd))
    return json.loads(out.read_text())


def _assert_follows_the_policy(r: dict) -> None:
    assert r["start_sglang"] == r["start_embedded"] and r["synced_sglang"] == r["synced_embedded"], r
    assert any(len(ids) < 12 for ids in r["start_embedded"])  # the EOS ended some rows early, on both
    assert r["probe_start"] <= EQUAL and r["sync"]["probe"] <= EQUAL, r
    assert r["probe_stale"] > STALE, r  # the probe can tell a missing sync
    assert r["sampled_logprob_max_abs_diff"] <= EQUAL and r["sampled_rows"] == 8, r
    assert r["sync"]["tensors"] >= 30 and r["sync"]["bytes"] > 0, r["sync"]
    episodes = r["episodes"]
    calls = episodes.pop("pieces_synced_calls")
    assert calls >= 2 * max(episodes["sglang"]["turns"])  # each turn in two pieces or more, a sync between every two
    # ... and a push of unchanged weights between pieces changes no token (partial rollouts, greedy)
    assert episodes["sglang"] == episodes["sglang_turn_by_turn"] == episodes["sglang_pieces_synced"] == episodes["embedded"]
    assert max(episodes["sglang"]["turns"]) >= 2 and episodes["sglang"]["observation_tokens"] > 0


def test_a_colocated_engine_follows_the_policy_and_runs_episodes(converted: Path, tiny_model_dir: Path) -> None:
    """One rank with its own engine: the HF tensors handed over in memory (update_weights_from_tensor)."""
    r = _run(converted, tiny_model_dir, "colocated")
    assert r["backend"] == "ColocatedSglangBackend" and r["sync"]["method"] == "in_memory"
    _assert_follows_the_policy(r)


def test_a_separate_engine_follows_a_two_stage_replica(converted: Path, tiny_model_dir: Path) -> None:
    """A replica of two pipeline stages and one engine of its own: the owner (stage 0's rank) sends the whole model over
    the weight-update group (gloo, flattened buckets) and its rollouts reach the other stage by broadcast."""
    r = _run(converted, tiny_model_dir, "separate", 2, "--pp", "2")
    assert r["backend"] == "SeparateSglangBackend" and r["sync"]["method"] == "gloo"
    _assert_follows_the_policy(r)


def test_grpo_with_sglang_rollouts_learns(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The demo task with `inference_backend: sglang` (a colocated engine) learns like the embedded backend, and the
    probe after every sync says the engine generates with the policy that just trained (fp32)."""
    out = tmp_path / "sglang_run"
    _check(run_cli([PY, "-m", "oumi", "train", "-c", str(REPO / "configs" / "tiny_cpu_grpo.yaml"),
                    "--model.model_name", str(tiny_model_dir), "--training.output_dir", str(out),
                    "--training.max_steps", "40", "--training.save_steps", "0", "--training.save_final_model", "false",
                    "--megatron.inference_backend", "sglang"]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward/mean"] for r in rows]
    assert len(rows) == 40
    assert sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.15, [round(x, 3) for x in rewards]
    assert all(r["weight_sync/probe_max_diff"] <= EQUAL for r in rows[1:]), [r.get("weight_sync/probe_max_diff") for r in rows]
    assert "weight_sync/probe_max_diff" not in rows[0]  # step 1 starts from the engine's own weights: no sync
    assert max(r["mismatch/max_abs_diff"] for r in rows) <= 1e-4


ASYNC = ("--megatron.inference_backend", "sglang", "--megatron.rollout_placement", "separate",
         "--megatron.weight_sync_method", "gloo", "--grpo.max_staleness", "1", "--grpo.off_policy_correction", "tis",
         "--training.save_final_model", "false", "--training.save_steps", "0")


def _train(out: Path, tiny_model_dir: Path, config: str, *overrides: str) -> list[dict]:
    _check(run_cli([PY, "-m", "oumi", "train", "-c", str(REPO / "configs" / config), "--model.model_name",
                    str(tiny_model_dir), "--training.output_dir", str(out), *overrides]))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_asynchronous_grpo_one_step_off_policy_on_a_separate_engine(tmp_path: Path, tiny_model_dir: Path) -> None:
    """grpo.max_staleness: 1 on a separate SGLang engine: generations and pushes queue on the engine's thread while the
    trainer trains, so every batch after the first is exactly one policy version old; after each push the engine's
    logprobs of the probe sequence equal the trainer's at the push; multi-turn episodes run whole on that thread too
    (the guess_number example)."""
    rows = _train(tmp_path / "async", tiny_model_dir, "tiny_cpu_grpo.yaml", *ASYNC, "--training.max_steps", "8")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["rollout/staleness_max"] for r in rows] == [0.0] + [1.0] * 7
    assert [r["rollout/policy_version"] for r in rows] == [0.0] + [float(s - 2) for s in range(2, 9)]
    assert all("tis/mean_weight" in r and r["weight_sync/bytes"] > 0 for r in rows[1:])
    probes = [r["weight_sync/probe_max_diff"] for r in rows[2:]]  # each push's probe, reported at the next push
    assert probes and max(probes) <= EQUAL, probes
    assert max(r["mismatch/mean_abs_diff"] for r in rows[1:]) > 1e-3  # one version old: the engine's logprobs differ
    episodes = _train(tmp_path / "async_episodes", tiny_model_dir, "tiny_cpu_grpo_guess_number.yaml", *ASYNC,
                      "--training.max_steps", "4")
    assert [r["rollout/staleness_max"] for r in episodes] == [0.0] + [1.0] * 3
    assert all(r["env/turns_max"] >= 2 and r["env/failed_episodes"] == 0 for r in episodes)
    # partial rollouts and streaming groups: the episodes' pieces are queued on the engine's thread one by one, so a
    # push lands between two, and each step trains on the first groups that finish
    streamed = _train(tmp_path / "streamed", tiny_model_dir, "tiny_cpu_grpo_guess_number.yaml", *ASYNC,
                      "--grpo.partial_rollouts", "true", "--grpo.streaming_groups", "true", "--training.max_steps", "3")
    assert [r["step"] for r in streamed] == [1, 2, 3]
    assert all(r["rollout/staleness_max"] <= 1.0 and r["env/failed_episodes"] == 0 for r in streamed), streamed
    assert streamed[0]["rollout/groups_carried_over"] > 0 and max(r["env/turns_max"] for r in streamed) >= 2
