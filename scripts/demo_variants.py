"""The CPU demo (configs/tiny_cpu_grpo.yaml) with each GRPO variant on, one `oumi train` run each.

    python scripts/demo_variants.py [--steps 60] [--only NAME ...]    # ~1 min a run on 2 CPU cores

Same seed, data and hyper-parameters for every run; only the variant's grpo: fields change. Reports the demo
task's reward (reward/char_class: the overlong punishment is not part of it) over the first and the last 10
steps, and what the variant's own metrics say, into docs/grpo_variants.md (with the date, machine and command).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

EVERY_OPTION = ["--grpo.ppo_epochs", "2", "--grpo.policy_loss", "gspo", "--grpo.epsilon", "3e-4", "--grpo.epsilon_high", "4e-4",
                "--grpo.clip_ratio_c", "3.0", "--grpo.scale_rewards", "batch", "--grpo.dynamic_sampling", "true",
                "--grpo.overlong_buffer_length", "4", "--grpo.mask_truncated_completions", "true"]
"""ppo_epochs 2 (so GSPO's ratio and the dual clip act), GSPO with the paper's clip ranges, batch scaling, dual clip,
dynamic sampling, overlong shaping and truncated-completion masking."""

VARIANTS: dict[str, list[str]] = {
    "baseline (grpo loss, group scaling)": [],
    "policy_loss: gspo": ["--grpo.policy_loss", "gspo"],  # one on-policy update: the same gradient as grpo's
    "ppo_epochs: 2 (grpo loss)": ["--grpo.ppo_epochs", "2"],  # the reference for the two off-policy rows below
    "ppo_epochs: 2, policy_loss: gspo (epsilon 3e-4 / 4e-4)": ["--grpo.ppo_epochs", "2", "--grpo.policy_loss", "gspo",
                                                             "--grpo.epsilon", "3e-4", "--grpo.epsilon_high", "4e-4"],
    "ppo_epochs: 2, clip_ratio_c: 3 (dual clip)": ["--grpo.ppo_epochs", "2", "--grpo.clip_ratio_c", "3.0"],
    "scale_rewards: batch": ["--grpo.scale_rewards", "batch"],
    "scale_rewards: none (Dr. GRPO)": ["--grpo.scale_rewards", "none"],
    "advantage_estimator: rloo": ["--grpo.advantage_estimator", "rloo"],
    "dynamic_sampling": ["--grpo.dynamic_sampling", "true"],
    # the demo's reward is dense: groups of equal rewards appear only once completions are all of one class
    "baseline, 150 steps (the demo's length)": ["--training.max_steps", "150"],
    "dynamic_sampling, 150 steps": ["--grpo.dynamic_sampling", "true", "--training.max_steps", "150"],
    "overlong_buffer_length: 4": ["--grpo.overlong_buffer_length", "4"],
    # nearly every completion of the demo runs to max_completion_length, so masking them leaves little to train on
    "mask_truncated_completions": ["--grpo.mask_truncated_completions", "true"],
    "overlong_buffer_length: 4 + mask_truncated_completions": ["--grpo.overlong_buffer_length", "4",
                                                               "--grpo.mask_truncated_completions", "true"],
    "every option at once (tests/test_grpo_trainer.py)": EVERY_OPTION,
}


def cpu_name() -> str:
    """The CPU's model name and the cores this process may use (for the results' header)."""
    import os

    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        name = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                     if line.startswith("model name")), name)
    return f"{name}, {len(os.sched_getaffinity(0))} cores"


def mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def run(name: str, overrides: list[str], model: Path, steps: int, work: Path) -> dict:
    out = work / f"run{list(VARIANTS).index(name)}"
    cmd = [sys.executable, "-m", "oumi", "train", "-c", str(REPO / "configs" / "tiny_cpu_grpo.yaml"),
           "--model.model_name", str(model), "--training.output_dir", str(out), "--training.max_steps", str(steps),
           "--training.save_steps", "0", "--training.save_final_model", "false", *overrides]  # a variant's max_steps wins
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: oumi train failed\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    task = [r["reward/char_class"] for r in rows]
    return {
        "name": name, "steps": len(rows), "seconds": time.perf_counter() - start, "first10": mean(task[:10]), "last10": mean(task[-10:]),
        "length_last10": mean([r["completion_length/mean"] for r in rows[-10:]]),
        "truncated_first10": mean([r["completion_length/truncated_fraction"] for r in rows[:10]]),
        "truncated_last10": mean([r["completion_length/truncated_fraction"] for r in rows[-10:]]),
        "rounds": sum(r.get("dynamic_sampling/rounds", 1) for r in rows),
        "clip_fraction": mean([r.get("clip_fraction", 0.0) for r in rows]),
        "dropped": sum(r.get("dynamic_sampling/groups_dropped", 0) for r in rows),
        "skipped_updates": sum(r.get("update_skipped", 0) for r in rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--only", nargs="*", help="variant names (prefixes) to run")
    p.add_argument("--out", default=str(REPO / "docs" / "grpo_variants.md"))
    args = p.parse_args()
    names = [n for n in VARIANTS if not args.only or any(n.startswith(o) for o in args.only)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = work / "tiny_qwen2"
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", str(model)], check=True,
                       capture_output=True)
        results = []
        for name in names:
            results.append(run(name, VARIANTS[name], model, args.steps, work))
            r = results[-1]
            print(f"{name}: reward/char_class {r['first10']:.3f} -> {r['last10']:.3f} ({r['seconds']:.0f} s)", flush=True)
    lines = [
        "# GRPO variants on the CPU demo",
        "",
        f"`python scripts/demo_variants.py --steps {args.steps}` on {cpu_name()}, {datetime.date.today().isoformat()}: "
        "configs/tiny_cpu_grpo.yaml "
        "(the tiny random Qwen2, 4 prompts x 8 completions a step, seed 42) with one variant's `grpo:` fields changed. "
        "Reward = `reward/char_class` (the task's reward, without the overlong punishment), mean over the first and the "
        "last 10 steps (a variant may run longer: its steps column).",
        "",
        "| variant | steps | reward first 10 | reward last 10 | rise | truncated first -> last 10 | length last 10 | "
        "rounds / groups dropped | clip fraction | updates skipped | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(f"| {r['name']} | {r['steps']} | {r['first10']:.3f} | {r['last10']:.3f} | {r['last10'] - r['first10']:+.3f} | "
                     f"{r['truncated_first10']:.2f} -> {r['truncated_last10']:.2f} | {r['length_last10']:.1f} | "
                     f"{r['rounds']} / {r['dropped']} | {r['clip_fraction']:.4f} | {r['skipped_updates']} | "
                     f"{r['seconds']:.0f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
