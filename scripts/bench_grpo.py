"""Whole GRPO runs, this project against TRL, same task and settings, one GPU, one call (issue 31, in progress).

    python scripts/bench_grpo.py --model HF_DIR --rows ROWS_DIR --steps 20 --out DIR [--paths embedded,vllm,trl,trl_vllm]

Rows (each in its own process, one after another):
- ``embedded``: this project, configs/smollm2_arithmetic_gpu.yaml's settings, the embedded backend
  (tests/workers/real_model_worker.py --no-eval: the same trainer as ``oumi train``);
- ``vllm``: the same with ``megatron.inference_backend: vllm`` (colocated, sleep/wake, in-memory weight sync);
- ``trl``: TRL's GRPOTrainer with HF ``generate`` rollouts (scripts/bench_grpo_trl.py, the settings written there);
- ``trl_vllm``: TRL with ``use_vllm=True, vllm_mode="colocate"``.

Per row: tokens/s/GPU (prompt + completion tokens of the step's batch over the step time, NeMo-RL's definition;
step 1, the warm-up, left out), step time and its split, peak memory, reward at the first and last 10 steps.
``--prompts/--generations/--max-new-tokens`` shrink the run (CPU smoke tests).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "smollm2_arithmetic_gpu.yaml"


def ours_config(out: Path, steps: int, backend: str, prompts: int, generations: int, new_tokens: int) -> Path:
    """configs/smollm2_arithmetic_gpu.yaml for a throughput run: ``steps`` steps, no checkpoints until the end."""
    raw = yaml.safe_load(CONFIG.read_text())
    completions = prompts * generations
    raw["training"].update(max_steps=steps, save_steps=0)
    raw["megatron"].update(inference_backend=backend, global_batch_size=completions // 2, micro_batch_size=completions // 4)
    raw["grpo"].update(num_generations=generations, max_completion_length=new_tokens)
    path = out / f"{backend}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_ours(args: argparse.Namespace, out: Path, backend: str) -> dict[str, Any]:
    work = out / f"ours_{backend}"
    cfg = ours_config(out, args.steps, backend, args.prompts, args.generations, args.max_new_tokens)
    cmd = [sys.executable, str(REPO / "tests" / "workers" / "real_model_worker.py"), str(cfg), str(work), "--rows", args.rows,
           "--model", args.model, "--no-eval"]
    _run(cmd, out / f"ours_{backend}.log")
    train = json.loads((work / "result.json").read_text())["train"]
    steady = train[1:] if len(train) > 1 else train
    step_s = [t["perf/step_s"] or (t["time/rollout_s"] + t["time/logprob_s"] + t["time/train_s"]) for t in steady]
    rewards = [t["reward/mean"] for t in train]
    return {
        "name": f"oumi-megatron ({backend})",
        "tokens_per_s_per_gpu": sum(t["batch/real_tokens"] for t in steady) / sum(step_s),
        "step_s": sum(step_s) / len(step_s),
        "rollout_s": _mean(steady, "time/rollout_s"), "logprob_s": _mean(steady, "time/logprob_s"),
        "train_s": _mean(steady, "time/train_s"), "sync_s": _mean(steady, "time/sync_s"),
        "peak_gib": max((t["perf/peak_gpu_memory_gib"] or 0) for t in train),
        "reward_first10": sum(rewards[:10]) / len(rewards[:10]), "reward_last10": sum(rewards[-10:]) / len(rewards[-10:]),
        "steps": len(train),
    }


def run_trl(args: argparse.Namespace, out: Path, vllm: bool) -> dict[str, Any]:
    name = "trl_vllm" if vllm else "trl"
    result = out / f"{name}.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_grpo_trl.py"), "--model", args.model, "--rows", args.rows,
           "--steps", str(args.steps), "--out", str(result), "--prompts", str(args.prompts), "--generations",
           str(args.generations), "--max-new-tokens", str(args.max_new_tokens), *(["--vllm"] if vllm else [])]
    _run(cmd, out / f"{name}.log")
    r = json.loads(result.read_text())
    steady = slice(1, None) if len(r["step_s"]) > 1 else slice(None)
    gen = r["generation_s"][steady]
    return {
        "name": f"TRL {r['trl']} ({'vLLM colocate' if vllm else 'HF generate'})",
        "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
        "step_s": sum(r["step_s"][steady]) / len(r["step_s"][steady]),
        "rollout_s": sum(gen) / max(len(gen), 1),
        "peak_gib": r["peak_gib"], "reward_first10": r["reward_first10"], "reward_last10": r["reward_last10"],
        "steps": r["grpo_steps"],
    }


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _run(cmd: list[str], log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} failed ({proc.returncode}); its log: {log}\n" + log.read_text()[-3000:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--rows", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True)
    p.add_argument("--paths", default="embedded,trl")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for path in args.paths.split(","):
        if path in ("embedded", "vllm"):
            rows.append(run_ours(args, out, "megatron" if path == "embedded" else "vllm"))
        elif path in ("trl", "trl_vllm"):
            rows.append(run_trl(args, out, vllm=path == "trl_vllm"))
        else:
            raise SystemExit(f"--paths: embedded, vllm, trl or trl_vllm, not {path!r}")
    (out / "result.json").write_text(json.dumps(rows, indent=1))
    print(f"\n| {args.steps} GRPO steps, {args.prompts} x {args.generations} | tokens/s/GPU | step s | rollout s | peak GiB "
          "| reward first 10 -> last 10 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] else "-"
        print(f"| {r['name']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {peak} | "
              f"{r['reward_first10']:.3f} -> {r['reward_last10']:.3f} |")


if __name__ == "__main__":
    main()
