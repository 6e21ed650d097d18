"""The GRPO loop end to end through `oumi train` (1 rank; DP=2 on 2 gloo ranks, the MoE with EP=2), and resume.

The task (oumi_megatron/examples/demo_task.py) rewards the fraction of completion characters in the class the
prompt asks for; a random tiny model starts near 0.15. Thresholds are below what the runs reach
(seen: +0.31 after 60 steps on one rank, +0.30 on two, +0.31 for the MoE with EP=2), so they fail only if
learning breaks.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, free_port, run_cli

pytestmark = pytest.mark.slow
CONFIG = str(REPO / "configs" / "tiny_cpu_grpo.yaml")


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _rise(rows: list[dict], k: int = 10) -> float:
    r = [row["reward/mean"] for row in rows]
    return sum(r[-k:]) / k - sum(r[:k]) / k


def _train(out: Path, tiny_model_dir: Path, *overrides: str, nproc: int = 1) -> str:
    args = ["-m", "oumi", "train", "-c", CONFIG, "--model.model_name", str(tiny_model_dir),
            "--training.output_dir", str(out), *overrides]
    cmd = ["python", *args] if nproc == 1 else ["torchrun", "--nproc_per_node", str(nproc), "--master-port", str(free_port()), *args]
    proc = run_cli(cmd)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc.stdout + proc.stderr


def test_single_rank_run_learns_and_writes_the_output_layout(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "run"
    _train(out, tiny_model_dir, "--training.max_steps", "60", "--grpo.rollout_dump_steps", "30")  # seen +0.31 (2026-11-27)
    rows = _metrics(out)
    # grpo.rollout_dump_steps: steps 30 and 60, every sample of the one DP rank, its tokens and how it scored
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == ["step_000030_rank_00000.jsonl", "step_000060_rank_00000.jsonl"]
    dumped = [json.loads(line) for line in (out / "rollouts" / "step_000060_rank_00000.jsonl").read_text().splitlines()]
    assert len(dumped) == 32 and all(d["loss_mask"] is None and d["turns"] == 1 for d in dumped)  # 4 prompts x 8
    assert all(len(d["logprobs"]) == len(d["completion_ids"]) <= 16 and d["text"] for d in dumped)
    assert sum(d["reward"] for d in dumped) / 32 == pytest.approx(rows[-1]["reward/mean"], abs=1e-6)
    assert [r["step"] for r in rows] == list(range(1, 61))
    assert _rise(rows) >= 0.2, [round(r["reward/mean"], 3) for r in rows]
    for key in ("reward/char_class", "advantage/std", "kl", "clip_fraction", "completion_length/mean",
                "completion_length/truncated_fraction", "tokens_per_s", "rollout/tokens_per_s", "rollout/decode_ms_per_step",
                "time/rollout_s", "time/train_s", "grad_norm", "entropy",
                "batch/padding_fraction", "perf/step_s", "perf/train_tokens_per_s", "perf/peak_host_memory_gib"):
        assert key in rows[-1], key
    # the step profile (trainer/step_profile.py): the rollout phase's parts lie within it and the host's share is the
    # rest of it after the decoder's loops
    parts = ("prompts", "generate", "detokenize", "reward", "score_gather")
    for r in rows:
        t = {k[len("time/"):-len("_s")]: v for k, v in r.items() if k.startswith("time/")}
        assert 0 < t["prefill"] + t["graph_capture"] <= t["decode"] <= t["generate"], t
        assert sum(t[p] for p in parts) <= t["rollout"] + 1e-6, t
        assert t["rollout_host"] == pytest.approx(t["rollout"] - t["decode"], abs=1e-9) and t["batch_build"] > 0, t
        assert 0 < t["train_forward_backward"] and 0 < t["train_optimizer"], t
        assert t["train_forward_backward"] + t["train_optimizer"] <= t["train"], t
    # the embedded backend samples from the trainer's own weights (fp32): its logprobs (KV cache) equal
    # the trainer's recomputed ones up to rounding
    assert max(r["mismatch/max_abs_diff"] for r in rows) < 1e-4 and rows[-1]["mismatch/token_mult_prob_error"] < 1.0001
    assert (out / "megatron_checkpoint" / "oumi_megatron.json").is_file()
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step_000050", "step_000060"]
    assert (out / "plots" / "reward_mean.png").stat().st_size > 1000
    assert any((out / "tensorboard").iterdir())

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "hf_model")
    model = AutoModelForCausalLM.from_pretrained(out / "hf_model")
    ids = tok.apply_chat_template([{"role": "user", "content": "Reply with digits only."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    gen = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids.shape[1] and torch.isfinite(model(ids).logits).all()


def test_single_rank_run_learns_with_every_new_grpo_option_on(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The demo with issue 17's options at once (scripts/demo_variants.py EVERY_OPTION): two epochs over each batch
    with GSPO's sequence-level ratio at the paper's clip ranges and the dual clip, batch-level reward scaling,
    dynamic sampling, DAPO's overlong punishment and truncated-completion masking. Seen (2026-11-27): the task's
    reward 0.166 -> 0.507, 41 groups dropped in 78 rounds, completions cut at the limit 68% -> 1% of them."""
    sys.path.insert(0, str(REPO / "scripts"))  # the options are defined once, in the script that documents them
    from demo_variants import EVERY_OPTION

    out = tmp_path / "every_option"
    _train(out, tiny_model_dir, "--training.max_steps", "60", "--training.save_steps", "0", "--training.save_final_model",
           "false", "--training.include_performance_metrics", "false", *EVERY_OPTION)
    rows = _metrics(out)
    task = [r["reward/char_class"] for r in rows]  # the task's reward, without the overlong punishment
    assert len(rows) == 60 and sum(task[-10:]) / 10 - sum(task[:10]) / 10 >= 0.2, [round(x, 3) for x in task]
    assert sum(r["dynamic_sampling/groups_dropped"] for r in rows) > 0, "dynamic sampling never dropped a group"
    assert sum(r["dynamic_sampling/rounds"] for r in rows) > 60  # ... and refilled from further prompts
    truncated = [r["completion_length/truncated_fraction"] for r in rows]
    assert sum(truncated[-10:]) / 10 < 0.5 * sum(truncated[:10]) / 10, truncated  # the overlong punishment works
    assert rows[0]["reward/overlong_penalty"] < 0 and rows[0]["batch/untrained_samples"] > 0  # masked: cut completions
    assert max(r["clip_fraction"] for r in rows) > 0.5  # GSPO's 3e-4 / 4e-4 clip ranges bind on the second epoch


def test_resume_mid_training_continues_exactly(tmp_path: Path, tiny_model_dir: Path) -> None:
    full = tmp_path / "full"
    _train(full, tiny_model_dir, "--training.max_steps", "4", "--training.save_steps", "2")
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "megatron_checkpoint", resumed / "megatron_checkpoint")
    _train(resumed, tiny_model_dir, "--training.max_steps", "4", "--training.save_steps", "2",
           "--training.resume_from_checkpoint", str(full / "checkpoints" / "step_000002"))
    a, b = _metrics(full), _metrics(resumed)
    assert [r["step"] for r in b] == [3, 4]
    for key in ("reward/mean", "loss", "grad_norm", "completion_length/mean"):
        assert [r[key] for r in b] == [r[key] for r in a[2:]], key


def test_two_rank_data_parallel_packed_moe_run_learns(tmp_path: Path, tiny_moe_dir: Path) -> None:
    """The tiny Qwen3-MoE with expert parallelism: EP=2 inside DP=2 (each rank holds 2 of the 4 experts of
    every layer; tokens reach them by all-to-all). Each rank generates (embedded backend: expert peers stop
    generating together) and trains on its half of the completions, in packed microbatches. Seen +0.31 in 60 steps."""
    out = tmp_path / "dp2"
    text = _train(out, tiny_moe_dir, "--training.max_steps", "60", "--training.save_steps", "0",
                  "--training.save_final_model", "false", "--megatron.enable_sequence_packing", "true",
                  "--megatron.expert_model_parallel_size", "2", "--training.include_performance_metrics", "false", nproc=2)
    assert "TP 1 x PP 1 x CP 1 x DP 2 = world size 2" in text and "expert parallel: EP 2" in text, text[-3000:]
    rows = _metrics(out)
    assert len(rows) == 60
    assert not any(k.startswith("perf/") for k in rows[0])  # training.include_performance_metrics: false
    assert _rise(rows) >= 0.2, [round(r["reward/mean"], 3) for r in rows]
    # packing: fewer tokens processed than the real ones padded to the longest sequence would need
    assert all(r["batch/processed_tokens"] >= r["batch/real_tokens"] for r in rows)
    assert sum(r["batch/padding_fraction"] for r in rows) / len(rows) < 0.25, [r["batch/padding_fraction"] for r in rows]
    # this task's sequences are nearly all the same length, so packing saves little here (the
    # parity test in test_engine.py shows 25% saved on mixed lengths), but it never costs tokens
    assert all(r["batch/tokens_saved_fraction"] >= 0.0 for r in rows), [r["batch/tokens_saved_fraction"] for r in rows]
    # entropy of the sampling distribution falls as the policy concentrates on one character class
    assert rows[-1]["entropy"] < rows[0]["entropy"], (rows[0]["entropy"], rows[-1]["entropy"])


def test_a_dp_share_reaches_the_backend_as_prompt_groups() -> None:
    """Each DP rank asks generate for distinct prompts and n completions each (trainer/collection.py): whole
    GRPO groups when its share holds whole groups, else the largest equal runs that stay within one prompt."""
    from oumi_megatron.trainer.collection import share_as_groups

    assert share_as_groups(0, 32, 8) == ([0, 1, 2, 3], 8)  # one rank: every prompt once, n = num_generations
    assert share_as_groups(16, 16, 8) == ([2, 3], 8)  # DP 2: rank 1's two whole groups
    assert share_as_groups(6, 2, 8) == ([0], 2)  # DP 4 over one prompt: a quarter of its group each
    assert share_as_groups(6, 6, 4) == ([1, 2, 2], 2)  # shares that split groups: runs within one prompt
    for first, count, g in ((0, 32, 8), (16, 16, 8), (6, 2, 8), (6, 6, 4), (12, 12, 8)):
        prompts, n = share_as_groups(first, count, g)
        assert [p for p in prompts for _ in range(n)] == [i // g for i in range(first, first + count)]


PHASED_BACKEND = '''
"""A rollout backend that behaves like a colocated vLLM engine on GPU: it drops its weights at every sleep and refuses to
generate until they are pushed again; it logs every call, one per line, to PHASE_LOG."""
import os

from oumi_megatron.rollout.base import EngineSleep, WeightSyncStats
from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend
from oumi_megatron.rollout.registry import register_rollout_backend


class Phased:
    def __init__(self, ctx):
        self.inner = MegatronRolloutBackend(ctx.engine, vocab_size=len(ctx.tokenizer), seed=ctx.config.training.seed)
        self.fresh = True

    def log(self, what):
        with open(os.environ["PHASE_LOG"], "a") as f:
            f.write(what + "\\n")

    def generate(self, prompts, params, n, seed=None):
        if not self.fresh:
            raise RuntimeError("generate without weights: the trainer did not sync after sleep")
        self.log("generate")
        return self.inner.generate(prompts, params, n, seed)

    def sync_weights(self, weights):
        tensors = sum(1 for _ in weights())  # the real export, as an engine would receive it
        self.fresh = True
        self.log("sync")
        return WeightSyncStats("phased", tensors, 0, 0.0)

    def wake(self):
        self.log("wake")
        return 0.0

    def sleep(self):
        self.fresh = False
        self.log("sleep")
        return EngineSleep(0.0, weights_dropped=True)

    def engine_metrics(self):
        return {}

    def decode_profile(self):
        return self.inner.decode_profile()

    def close(self):
        self.log("close")


register_rollout_backend("phased")(Phased)
'''


def test_the_trainer_brackets_generation_with_wake_and_sleep_and_syncs_after_dropped_weights(tmp_path: Path,
                                                                                            tiny_model_dir: Path) -> None:
    """A backend that drops its weights when it sleeps (colocated vLLM on GPU) gets, from `oumi train`: wake before each
    generation phase, sleep after each step's rollouts (before the logprob and training passes), a weight sync before
    any generation that follows a sleep, and none where the engine still holds the current weights (the first step,
    the step after an evaluation). Evaluations (steps 0, 2, 3) leave it awake."""
    from conftest import base_config_dict, write_yaml

    (tmp_path / "phased_backend.py").write_text(PHASED_BACKEND)
    log = tmp_path / "phases.log"
    out = tmp_path / "run"
    cfg = base_config_dict(
        tiny_model_dir,
        data={"train": {"datasets": [{"dataset_name": "oumi-megatron/char-class",
                                      "dataset_path": str(REPO / "data/char_class_train.jsonl")}]},
              "validation": {"datasets": [{"dataset_name": "oumi-megatron/char-class",
                                           "dataset_path": str(REPO / "data/char_class_train.jsonl"), "sample_count": 4}]}},
        training={"trainer_type": "MEGATRON_GRPO", "max_steps": 3, "output_dir": str(out), "eval_strategy": "steps",
                  "eval_steps": 2, "per_device_eval_batch_size": 4, "learning_rate": 1e-3, "save_steps": 0},
        megatron={"micro_batch_size": 2, "global_batch_size": 8, "inference_backend": "phased"},
        grpo={"plugins": ["oumi_megatron.examples.demo_task", "phased_backend"], "num_generations": 4,
              "max_prompt_length": 64, "max_completion_length": 4, "reward_functions": [{"name": "char_class"}]},
    )
    proc = run_cli(["oumi", "train", "-c", str(write_yaml(tmp_path / "cfg.yaml", cfg))],
                   env={"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
                        "PHASE_LOG": str(log)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    calls = log.read_text().split()
    phases = [c for i, c in enumerate(calls) if i == 0 or c != calls[i - 1]]  # an eval's several generate calls as one
    assert phases == ["wake", "generate",  # eval at step 0: the engine holds the starting weights
                      "wake", "generate", "sleep",  # step 1: no sync needed yet
                      "wake", "sync", "generate", "sleep",  # step 2: the weights were dropped at step 1's sleep
                      "wake", "sync", "generate",  # eval at step 2, left awake
                      "wake", "generate", "sleep",  # step 3: still holds step 2's weights
                      "wake", "sync", "generate",  # eval at step 3 (the end)
                      "close"], calls


def test_lora_run_learns_resumes_exactly_and_checkpoints_the_adapters_alone(tmp_path: Path) -> None:
    """training.use_peft (docs/lora.md) on the demo: r 16 on every linear layer with the KL term on (the reference is the
    base: the adapters switched off). The tiny model is built with init_std 0.2: at transformers' 0.02 its tied output
    layer, which LoRA leaves frozen, caps every logit near 1 and no adapter can move its choices. Seen (2026-12-05, this
    model, lr 3e-3, 60 steps): full fine-tuning +0.83, LoRA +0.72 (without the KL term; with it, as here, +0.47).
    The checkpoints hold the adapters and their optimizer state
    alone, name the base, and a resume continues step for step; ADAPTER_AND_BASE_MODEL writes the adapter and the
    unchanged base."""
    from oumi_megatron.engine.peft import is_adapter
    from oumi_megatron.examples.tiny_models import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", arch="qwen2", init_std=0.2)
    lora = ("--training.use_peft", "true", "--peft.lora_r", "16", "--peft.lora_alpha", "32", "--grpo.beta", "0.04",
            "--peft.peft_save_mode", "ADAPTER_AND_BASE_MODEL", "--training.include_performance_metrics", "false")
    out = tmp_path / "lora"
    text = _train(out, model, "--training.max_steps", "60", "--training.save_steps", "30", *lora)
    assert "trainable parameters" in text, text[-3000:]
    rows = _metrics(out)
    assert _rise(rows) >= 0.4, [round(r["reward/mean"], 3) for r in rows]
    assert max(r["kl"] for r in rows) > 0  # the adapters move the policy away from the base, its reference
    step = out / "checkpoints" / "step_000030"
    # the bound: a checkpoint's bytes within 3x the adapters' (fp32) and Adam's two moments' (the model's
    # fp32 weights alone would be 742,656 B; a full fine-tuning checkpoint of it takes 3.3 MB)
    adapters = 57_344  # r 16 x (in + out) over QKV, output, fc1 and fc2 of 4 layers
    assert f"({adapters:,} trainable parameters on this rank)" in text
    saved_bytes = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
    assert saved_bytes <= 3 * (4 * adapters + 8 * adapters), saved_bytes
    meta = json.loads((step / "oumi_megatron.json").read_text())
    assert meta["lora"]["rank"] == 16 and meta["base"]["checkpoint"] == str(out / "megatron_checkpoint")
    from torch.distributed.checkpoint import FileSystemReader

    saved = [k for k in FileSystemReader(str(step / "model")).read_metadata().state_dict_metadata
             if k.startswith(("decoder.", "embedding.", "output_layer."))]  # the weights (not common_state/)
    assert saved and all(is_adapter(k) for k in saved), [k for k in saved if not is_adapter(k)][:5]
    assert (out / "hf_adapter" / "adapter_config.json").is_file() and (out / "hf_model" / "config.json").is_file()
    # oumi-megatron export on the last checkpoint: the base from the converted checkpoint its meta names, the adapters
    # from the checkpoint; the run's own final export, tensor for tensor
    exported = tmp_path / "exported"
    proc = run_cli(["oumi-megatron", "export", "--checkpoint", str(out / "checkpoints" / "step_000060"), "--out",
                    str(exported), "--peft-save-mode", "adapter_only"])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    from safetensors.torch import load_file

    mine, theirs = (load_file(d / "hf_adapter" / "adapter_model.safetensors") for d in (exported, out))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert not (exported / "hf_model").exists()

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(out / "megatron_checkpoint", resumed / "megatron_checkpoint")
    _train(resumed, model, "--training.max_steps", "32", "--training.save_steps", "0", "--training.save_final_model",
           "false", "--training.resume_from_checkpoint", str(step), *lora)
    again = _metrics(resumed)
    assert [r["step"] for r in again] == [31, 32]
    for key in ("reward/mean", "loss", "grad_norm", "kl"):
        assert [r[key] for r in again] == [r[key] for r in rows[30:32]], key
