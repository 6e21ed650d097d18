"""kill -9 of an asynchronous GRPO run at five points, then a resume: is every prompt trained once, every step logged once?

    .venv/bin/python scripts/stress_async_resume.py [--points push,episode,checkpoint,train,between_steps]
                                                   [--steps 8] [--save-steps 2] [--kill-pass 3] [--out result.json]
                                                   [--placement separate|ray]

Each point runs the guess_number example (multi-turn episodes on the tiny CPU model) with asynchronous GRPO on a
separate vLLM engine: ``grpo.max_staleness: 1``, ``partial_rollouts`` and ``streaming_groups`` (steps train groups out of
data order), background checkpoint writes every ``--save-steps`` steps, and every step's samples dumped
(``grpo.rollout_dump_steps: 1``). ``OUMI_MEGATRON_KILL_AT=POINT:N`` (utils/faults.py) sends the trainer SIGKILL the N-th
time it passes the point: during a weight push, mid-episode (a piece of open turns), during a background checkpoint
write, inside a step's update, or between two steps. The same command then resumes from the newest valid checkpoint to
``--steps``. A point passes when the killed run died of SIGKILL, the resumed run ended well, the metrics log holds
steps 1 .. ``--steps`` once each, the dumps of those steps (each resumed step's dump replaces the killed run's) hold
``--steps`` x 4 distinct prompts, none trained twice (the data's prompts are distinct), and no Ray head or engine
actor of the killed run is left 5 s after it died.
``--placement ray``: the same on a fleet of two engines (Ray actors of a local head the trainer starts), whose
episodes run as one job per step (no ``streaming_groups``). Prints a line per point and a summary; writes the numbers
to ``--out`` (docs/benchmarks.md, "kill -9 of asynchronous GRPO").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
POINTS = ("push", "episode", "checkpoint", "train", "between_steps")
PASSES = {"push": 3, "episode": 45, "checkpoint": 3, "train": 3, "between_steps": 3}
"""Which pass of each point is killed: a step or two after the first checkpoint (the stream passes its point ~10-20
times a step)."""
FLEET_EPISODE_PASS = 8
"""The fleet's episode jobs pass the episode point a few times a step (a piece of every open turn at once)."""
PROMPTS_PER_STEP = 4  # configs/tiny_cpu_grpo_guess_number.yaml: 32 episodes a step, 8 per prompt


def _train(out: Path, model: Path, steps: int, save_steps: int, kill: str | None, placement: str) -> tuple[int, str]:
    """The run's exit status and the end of its log (a file: a killed trainer's children must not hold a pipe open)."""
    cmd = [sys.executable, "-m", "oumi", "train", "-c", str(REPO / "configs" / "tiny_cpu_grpo_guess_number.yaml"),
           "--model.model_name", str(model), "--training.output_dir", str(out), "--training.max_steps", str(steps),
           "--training.save_steps", str(save_steps), "--training.save_final_model", "false",
           "--training.try_resume_from_last_checkpoint", "true",
           "--megatron.inference_backend", "vllm", "--megatron.rollout_placement", placement,
           "--megatron.weight_sync_method", "gloo", "--megatron.checkpoint_config.use_async_checkpoint", "true",
           "--grpo.max_staleness", "1", "--grpo.off_policy_correction", "tis", "--grpo.partial_rollouts", "true",
           "--grpo.streaming_groups", str(placement == "separate").lower(), "--grpo.environment_workers", "2",
           "--grpo.rollout_dump_steps", "1"]
    if placement == "ray":
        cmd += ["--megatron.rollout_engines", "2"]
    env = {**os.environ, "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("OUMI_MEGATRON_KILL_AT", None)
    if kill:
        env["OUMI_MEGATRON_KILL_AT"] = kill
    log = out.parent / f"{out.name}_{'killed' if kill else 'resumed'}.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1800).returncode
    return rc, log.read_text()[-3000:]


def _check(out: Path, steps: int) -> dict[str, Any]:
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    prompts: collections.Counter[str] = collections.Counter()
    for step in range(1, steps + 1):
        dumped = out / "rollouts" / f"step_{step:06d}_rank_00000.jsonl"
        if dumped.is_file():
            prompts.update({json.loads(line)["prompt"] for line in dumped.read_text().splitlines() if line.strip()})
    twice = sorted(p for p, n in prompts.items() if n > 1)
    return {"steps_logged": logged, "steps_once": logged == list(range(1, steps + 1)), "prompts": len(prompts),
            "prompts_twice": len(twice), "prompts_ok": len(prompts) == steps * PROMPTS_PER_STEP and not twice}


def _ray_processes() -> list[str]:
    """A killed run's Ray head (GCS, raylet) and engine actors (what holds GPUs) left on this machine. Ray's dashboard
    and runtime-env agents are not counted: they end on their own ~1.5 min after their raylet, holding no GPU."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [line[:120] for line in out if ("EngineActor" in line or "gcs_server" in line or "raylet/raylet" in line)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default=",".join(POINTS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--kill-pass", type=int, default=None, help="kill at every point's N-th pass (default: PASSES)")
    p.add_argument("--model", default=str(REPO / "output" / "tiny_qwen2"))
    p.add_argument("--out", default=None)
    p.add_argument("--placement", default="separate", choices=("separate", "ray"))
    args = p.parse_args()
    model = Path(args.model)
    if not (model / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", str(model), "--arch", "qwen2"],
                       check=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="stress_async_resume_") as tmp:  # the runs and their logs
        for point in args.points.split(","):
            out = Path(tmp) / point
            started = time.perf_counter()
            passes = args.kill_pass or (FLEET_EPISODE_PASS if (args.placement, point) == ("ray", "episode") else PASSES[point])
            killed_rc, _ = _train(out, model, args.steps, args.save_steps, f"{point}:{passes}", args.placement)
            died = killed_rc == -signal.SIGKILL
            before = len((out / "metrics.jsonl").read_text().splitlines()) if (out / "metrics.jsonl").exists() else 0
            time.sleep(5)  # a local Ray head's processes end a moment after their driver
            left = _ray_processes()  # the killed run's, in the resumed run's way
            resumed_rc, resumed_log = _train(out, model, args.steps, args.save_steps, None, args.placement)
            row = {"point": point, "killed_by_sigkill": died, "steps_logged_before_kill": before,
                   "resumed_rc": resumed_rc, **_check(out, args.steps), "ray_processes_left": len(left),
                   "seconds": time.perf_counter() - started}
            row["passed"] = died and resumed_rc == 0 and row["steps_once"] and row["prompts_ok"] and not left
            if left:
                row["left"] = left[:10]
            if resumed_rc != 0:
                row["error"] = resumed_log[-2000:]
            rows.append(row)
            print(f"{point}: killed by SIGKILL {died} after {before} logged steps; resumed rc {resumed_rc}; "
                  f"steps once {row['steps_once']}; {row['prompts']} prompts, {row['prompts_twice']} twice -> "
                  f"{'PASS' if row['passed'] else 'FAIL'} ({row['seconds']:.0f} s)", flush=True)
    summary = {"points": rows, "passed": sum(r["passed"] for r in rows), "of": len(rows), "steps": args.steps,
               "save_steps": args.save_steps, "kill_pass": args.kill_pass or PASSES, "placement": args.placement}
    print(f"{summary['passed']} of {summary['of']} points resumed with every prompt trained once")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    sys.exit(0 if summary["passed"] == summary["of"] else 1)


if __name__ == "__main__":
    main()
