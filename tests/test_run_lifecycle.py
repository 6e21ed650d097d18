"""A run's life through `oumi train` (issue 10): a used output_dir is never overwritten, a damaged latest
checkpoint falls back to the previous complete one, metrics hold each step once after a resume, bad data
stops the run before conversion, a reward function that fails on everything stops the run, and Oumi's
VERL_GRPO gsm8k example, migrated by the guide's steps, runs as meant.

Every run copies one converted checkpoint (the `finished` fixture's) so no test converts again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import REPO, is_loopback, run_cli, run_cli_watching_listeners
from oumi_megatron.engine.state.checkpointing import verify_checkpoint

pytestmark = pytest.mark.slow
CONFIG = str(REPO / "configs" / "tiny_cpu_grpo.yaml")


def _train(out: Path, model: Path, *overrides: str, config: str = CONFIG, env: dict | None = None):  # noqa: ANN202
    return run_cli(["oumi", "train", "-c", config, "--model.model_name", str(model), "--training.output_dir", str(out),
                    *overrides], env=env)


def _ok(proc) -> None:  # noqa: ANN001
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]


def _failed(proc, *texts: str) -> str:  # noqa: ANN001
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    for t in texts:
        assert t in text, text[-3000:]
    return text


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _fresh(tmp: Path, finished: Path) -> Path:
    """A new output_dir holding only the converted model (a cache, not a run)."""
    out = tmp / "run"
    shutil.copytree(finished / "megatron_checkpoint", out / "megatron_checkpoint")
    return out


LISTENING: set[str] = set()
"""What the `finished` run's processes listened on (tests/conftest.py ``run_cli_watching_listeners``)."""


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("lifecycle") / "finished"
    proc, listening = run_cli_watching_listeners(["oumi", "train", "-c", CONFIG, "--model.model_name", str(tiny_model_dir),
                                                  "--training.output_dir", str(out), "--training.max_steps", "4",
                                                  "--training.save_steps", "2"])
    _ok(proc)
    LISTENING.update(listening)
    return out


def test_a_one_process_run_listens_on_the_loopback_only(finished: Path) -> None:
    """During a whole one-process CPU run (conversion, 4 steps, checkpoints, the export) no socket of its processes
    listens beyond the loopback interface: its store is in memory and its gloo connections stay on `lo`. Before,
    torch's TCPStore listened on every interface (`*:port`)."""
    assert LISTENING, "the run's listening sockets were not seen (gloo always opens one)"
    assert all(is_loopback(a) for a in LISTENING), sorted(LISTENING)


def _plan(out: Path, **training):  # noqa: ANN003, ANN202
    """The start decision `oumi train` makes before converting (trainer/run_dir.py), in this process."""
    from types import SimpleNamespace

    from oumi_megatron.trainer.run_dir import plan_start

    base = {"output_dir": str(out), "resume_from_checkpoint": None, "try_resume_from_last_checkpoint": False}
    return plan_start(SimpleNamespace(**{**base, **training}))


def test_a_finished_output_dir_is_never_overwritten(finished: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    from oumi_megatron.errors import UserInputError
    from oumi_megatron.trainer.run_dir import OutputDirInUseError

    before = _digest(finished)
    with pytest.raises(OutputDirInUseError) as e:
        _plan(finished)
    for text in ("already holds a run (checkpoints/, hf_model/, metrics.jsonl)",
                 "set training.try_resume_from_last_checkpoint: true", "choose another training.output_dir"):
        assert text in str(e.value)
    assert isinstance(e.value, UserInputError)  # `oumi train` prints it without a traceback and exits 1
    assert _plan(_fresh(tmp_path, finished)).checkpoint is None  # the conversion cache alone is not a run
    assert _plan(finished, try_resume_from_last_checkpoint=True).step == 4
    # resuming a finished run: nothing to train, and nothing rewritten (hf_model, checkpoints, metrics)
    proc = _train(finished, tiny_model_dir, "--training.max_steps", "4", "--training.try_resume_from_last_checkpoint",
                  "true")
    _ok(proc)
    assert "Nothing to train" in proc.stdout + proc.stderr
    assert _digest(finished) == before


def test_damaged_latest_checkpoint_falls_back_and_metrics_hold_each_step_once(finished: Path, tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    run = tmp_path / "crashed"
    shutil.copytree(finished, run)
    step4 = run / "checkpoints" / "step_000004"
    assert (step4 / "rank_00000.json").is_file() and not list(step4.glob("*.pt"))  # no pickle of ours
    shard = max((p for p in (step4 / "model").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a truncated tensor file

    # named explicitly: refused, naming the file (was EOFError with no path)
    from oumi_megatron.trainer.run_dir import ResumeCheckpointError

    with pytest.raises(ResumeCheckpointError, match=rf"cannot resume from {step4}: .*{shard.name} has \d+ bytes"):
        _plan(run, resume_from_checkpoint=str(step4))

    # the newest complete one: step 2, with a warning naming the damaged one
    proc = _train(run, tiny_model_dir, "--training.max_steps", "6", "--training.save_steps", "2",
                  "--training.try_resume_from_last_checkpoint", "true")
    _ok(proc)
    text = proc.stdout + proc.stderr
    assert f"Checkpoint {step4} is damaged" in text and "Resumed from" in text and "step_000002" in text
    assert "dropped 2 row(s) of steps after 2" in text  # metrics.jsonl held steps 3, 4 of the first run
    # the damaged step 4 was replaced when training reached step 4 again; step 2 pruned (keep 2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000004", "step_000006"]
    assert verify_checkpoint(run / "checkpoints" / "step_000004") is None
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    first = {r["step"]: r for r in _metrics(finished)}
    for r in rows[2:4]:  # resume is exact: steps 3, 4 again equal the first run's
        assert (r["reward/mean"], r["loss"]) == (first[r["step"]]["reward/mean"], first[r["step"]]["loss"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3, 4, 5, 6]


def test_bad_data_stops_before_conversion(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "Only digits.", "target": "digits"}\n{"prompt": "x", "target": \n')
    out = tmp_path / "run"
    proc = _train(out, tiny_model_dir, "--data.train.datasets[0].dataset_path", str(data))
    _failed(proc, f"{data} line 2 is not valid JSON")
    assert not (out / "megatron_checkpoint").exists()  # reported before the model was converted
    assert "Traceback" not in proc.stdout + proc.stderr  # one message, as for Oumi's own config errors


def test_a_reward_that_fails_on_everything_stops_the_run(finished: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    module = tmp_path / "failing_reward.py"
    module.write_text(
        "from oumi.core.registry import RegistryType, register\n\n\n"
        "@register('test_always_fails', RegistryType.REWARD_FUNCTION)\n"
        "def always_fails(completions, **kwargs):\n"
        "    raise ConnectionError('reward server unreachable')\n"
    )
    deps = tmp_path / "deps.txt"
    deps.write_text(f"{module}\n")
    out = _fresh(tmp_path, finished)
    cfg = yaml.safe_load(Path(CONFIG).read_text())
    cfg["grpo"].update(reward_functions=[{"name": "test_always_fails"}], on_reward_error="skip")
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = _train(out, tiny_model_dir, "--training.max_steps", "20", config=str(config),
                  env={"OUMI_EXTRA_DEPS_FILE": str(deps)})
    _failed(proc, "every sample's reward was skipped (grpo.on_reward_error: skip) in 3 GRPO steps in a row",
            "reward server unreachable")
    assert not (out / "checkpoints").exists()  # nothing trained, nothing saved


def test_migrated_verl_gsm8k_example_runs_as_meant(finished: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Oumi's VERL_GRPO gsm8k example after the Migration Guide's steps, shrunk to the CPU (tiny model, 8 local
    gsm8k-format problems, 1 epoch, small verl batch sizes): rewards from training.reward_functions, vLLM
    rollouts from training.grpo.use_vllm, epochs -> steps, KL from verl's use_kl_loss, full recompute from
    enable_gradient_checkpointing, W&B (offline) beside TensorBoard, held-out eval from data.validation + eval_steps."""
    from test_oumi_fields import verl_gsm8k_migrated

    problems = [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (3, 3), (4, 4), (9, 1)]
    data = tmp_path / "gsm8k_train.jsonl"
    data.write_text("".join(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many apples does he "
                                                    "have?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n"
                            for a, b in problems))
    cfg = verl_gsm8k_migrated()
    cfg["model"].update(model_name=str(tiny_model_dir), torch_dtype_str="float32")
    for split in ("train", "validation"):
        cfg["data"][split]["datasets"][0]["dataset_path"] = str(data)
    out = _fresh(tmp_path, finished)
    cfg["training"].update(num_train_epochs=1, output_dir=str(out))
    verl = cfg["training"]["verl_config_overrides"]
    verl["data"].update(train_batch_size=4, max_prompt_length=128, max_response_length=16)
    verl["actor_rollout_ref"]["actor"].update(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4)
    verl["actor_rollout_ref"]["rollout"]["n"] = 4
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))

    proc = run_cli(["oumi", "train", "-c", str(config)], env={"WANDB_MODE": "offline"})
    _ok(proc)
    text = proc.stdout + proc.stderr
    for note in ("grpo.reward_functions = ['gsm8k'] (from training.reward_functions)",
                 "megatron.inference_backend = 'vllm' (from training.grpo.use_vllm)",
                 "grpo.beta = 0.001", "megatron.transformer_config.recompute_granularity = 'full'",
                 "training.max_steps = 2: 1 epoch(s) of 8 prompts at 4 prompts per GRPO step",
                 "algorithm.kl_ctrl.kl_coef",
                 "longer than grpo.max_prompt_length (128 tokens"):
        assert note in text, note
    rows = _metrics(out)
    # data.validation + eval_steps 10: evaluated (greedy, by vLLM) at step 0 and at the end (max_steps 2)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2] and rows[0]["eval/samples"] == 8
    assert "eval at step 2" in text
    rows = rows[1:]
    assert all("reward/gsm8k" in r for r in rows)
    assert rows[-1]["weight_sync/bytes"] > 0  # the vLLM engine got the weights of step 1 before step 2
    assert all(r["prompt/truncated_fraction"] == 1.0 for r in rows)
    assert rows[-1]["mismatch/max_abs_diff"] < 1e-3  # vLLM's logprobs are the trainer's (fp32)
    assert (out / "hf_model" / "config.json").is_file() and [p.name for p in (out / "checkpoints").iterdir()]
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))


def test_quick_start_yaml_runs_on_the_cpu(finished: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The design document's Quick Start YAML as shipped (configs/quickstart_70b_grpo.yaml: `gsm8k` data, no
    reward function), shrunk to the CPU by overrides of the model, layout, data file and step count only:
    the dataset resolves to Oumi's openai/gsm8k and its gsm8k reward scores the completions."""
    data = tmp_path / "gsm8k_train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {a}?", "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}"})
                            + "\n" for a in range(1, 9)))
    out = _fresh(tmp_path, finished)
    proc = _train(out, tiny_model_dir, "--model.torch_dtype_str", "float32", "--megatron.tensor_model_parallel_size", "1",
                  "--megatron.pipeline_model_parallel_size", "1", "--megatron.inference_backend", "megatron",
                  "--data.train.datasets[0].dataset_path", str(data), "--training.max_steps", "2",
                  "--grpo.max_completion_length", "16", "--grpo.max_prompt_length", "128",
                  config=str(REPO / "configs" / "quickstart_70b_grpo.yaml"))
    _ok(proc)
    text = proc.stdout + proc.stderr
    assert "data.train.datasets[0].dataset_name = 'openai/gsm8k'" in text
    assert "grpo.reward_functions = ['gsm8k'] (no reward function configured" in text
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and all("reward/gsm8k" in r for r in rows)
