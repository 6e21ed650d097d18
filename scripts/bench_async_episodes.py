"""Asynchronous multi-turn GRPO against synchronous under heavy-tailed tool latency, on CPU, one call.

    python scripts/bench_async_episodes.py --out DIR [--steps 16] [--paths sync,async,async_partial]
        [--extra-row NAME:grpo.some_field=true,grpo.other=3 ...]

Every row is a whole GRPO run (scripts/run_grpo.py: the trainer ``oumi train`` runs) of the same number of steps on
the tiny CPU model (scripts/make_tiny_model.py's, built into ``--model`` where it is missing) with a separate vLLM CPU
engine (``megatron.inference_backend: vllm``, ``rollout_placement: separate``, ``weight_sync_method: gloo``), the demo's
prompts, and the ``heavy_tail_tools`` environment of scripts/heavy_tail_env.py (a ``grpo.plugins`` module: episodes of
1 to 6 turns, each tool call sleeping ``--fast-s`` or, 1 call in ``--slow-one-in``, ``--slow-s``, drawn from
``--seed``; answered on ``grpo.environment_workers`` threads). Rows, one process each, one after another:
- ``sync``: ``grpo.max_staleness: 0``, the synchronous loop;
- ``async``: ``max_staleness: 1``, ``off_policy_correction`` ``--correction`` (tis);
- ``async_partial``: the same with ``grpo.partial_rollouts: true`` (turns in 32-token pieces);
- each ``--extra-row NAME:KEY=VALUE,KEY=VALUE``: the ``async`` row's settings plus these overrides (each value read
  as YAML; ``grpo.max_staleness=0`` makes it a synchronous one), for a feature that is not a row yet.

Per row, from the run's metrics.jsonl: the training loop's wall seconds (the sum of ``perf/step_s``: each step from
its start to its metrics, the wait for its batch included), trained tokens (the policy's, loss mask 1:
``completion_length/mean`` less ``env/observation_tokens_per_episode``, times the episodes) per wall second,
``rollout/staleness_max`` (max), ``rollout/staleness_mean``, ``rollout/multi_version_fraction`` and
``async/trainer_idle_fraction`` (means), the reward's first-5 and last-5 step means, ``env/turns_mean``, and the time
the rollout waited for the tools with nothing else to run (``env/time_s``); the ratios are against ``sync`` of the
same call. Each row also records the CPU seconds other processes took while it ran (/proc/stat less this process
tree's: on 2 cores a run beside it slows the engine and the trainer) and the load average before and after. The
environment logs every tool call (DIR/episodes_ROW.calls.jsonl), from which each row's tool calls and slow ones are
counted (the same calls in every row that starts the same episodes: the draws depend on the data order only) and two
bounds of the batches' tool time are computed: with no turn barrier (each batch waits for its slowest episode's calls
in sequence) and with one (each turn of a batch waits for its slowest call); a row whose episode starts are not its
batches in order (one that starts more episodes than it trains on) gets none. Writes DIR/bench_async_episodes.json
(rewritten after every row) and prints the table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import yaml

from bench_common import REPO, apply_settings, fmt, print_report, run_rows, run_worker
from heavy_tail_env import ENVIRONMENT, REWARD, Latency

PATHS = ("sync", "async", "async_partial")
BASE_CONFIG = REPO / "configs" / "tiny_cpu_grpo.yaml"
DEMO_ROWS = REPO / "data" / "char_class_train.jsonl"
MAX_TURNS = 6
MAX_OBSERVATION_TOKENS = 32


def parse_extra_row(text: str) -> tuple[str, list[str]]:
    """``NAME:KEY=VALUE,KEY=VALUE`` -> (NAME, ["KEY=VALUE", ...]); each KEY a dotted config field."""
    name, sep, settings = text.partition(":")
    pairs = [s.strip() for s in settings.split(",") if s.strip()]
    if not sep or not name or name in PATHS or not pairs or any("=" not in p for p in pairs):
        raise SystemExit(f"--extra-row: NAME:KEY=VALUE[,KEY=VALUE...] with a new NAME (not {', '.join(PATHS)}), got {text!r}")
    return name, pairs


def episodes_per_step(args: argparse.Namespace) -> int:
    return args.prompts * args.generations


def completion_budget(turn_tokens: int) -> int:
    """``grpo.max_completion_length``: room for every turn of the longest episode and each observation (its template
    tokens and the end-of-turn token closing a turn cut at ``max_turn_tokens`` included), with a margin, so no episode is
    cut by the budget and every one ends where the environment ends it."""
    return MAX_TURNS * turn_tokens + (MAX_TURNS - 1) * (MAX_OBSERVATION_TOKENS + 1) + 8


def row_settings(args: argparse.Namespace, path: str) -> list[str]:
    """The overrides that make ``path`` (a row of PATHS or an --extra-row) out of the common config."""
    asynchronous = ["grpo.max_staleness=1", f"grpo.off_policy_correction={args.correction}"]
    if path == "sync":
        return ["grpo.max_staleness=0"]
    if path == "async":
        return asynchronous
    if path == "async_partial":
        return [*asynchronous, "grpo.partial_rollouts=true"]
    return asynchronous + dict(args.extra_rows)[path]


def row_config(out: Path, args: argparse.Namespace, path: str) -> Path:
    """configs/tiny_cpu_grpo.yaml with the heavy-tailed environment, the separate vLLM engine and the row's settings,
    written as episodes_PATH.yaml."""
    raw = yaml.safe_load(BASE_CONFIG.read_text())
    episodes = episodes_per_step(args)
    raw["training"].update(max_steps=args.steps, save_steps=0, include_performance_metrics=True, save_final_model=False)
    raw["megatron"].update(inference_backend="vllm", rollout_placement="separate", weight_sync_method="gloo",
                           global_batch_size=episodes, micro_batch_size=min(8, episodes))
    raw["grpo"].update(
        plugins=["heavy_tail_env"], environment=ENVIRONMENT, max_turns=MAX_TURNS, max_turn_tokens=args.turn_tokens,
        max_observation_tokens=MAX_OBSERVATION_TOKENS, environment_workers=episodes,  # every call of a batch at once
        environment_timeout_s=max(30.0, 4 * args.slow_s), num_generations=args.generations,
        max_completion_length=completion_budget(args.turn_tokens), reward_functions=[{"name": REWARD}],
        log_completions=False)
    apply_settings(raw, row_settings(args, path))
    cfg = out / f"episodes_{path}.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    return cfg


def tool_calls(log: Path, per_step: int) -> dict[str, Any]:
    """What the environment's call log says of a run: its tool calls and slow ones, and the tool time its batches
    cannot go below, summed over the batches (a batch: ``per_step`` episode starts in a row). ``no_barrier_s``: each
    batch's slowest episode, its calls one after another; ``turn_barrier_s``: each batch's turns one after another,
    each as long as its slowest call."""
    batch_of: dict[tuple[str, int], int] = {}
    episode_s: dict[tuple[str, int], float] = collections.defaultdict(float)
    turn_s: dict[tuple[int, int], float] = collections.defaultdict(float)
    calls = 0
    slowest = 0.0
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    for r in records:
        if "start" in r:
            batch_of[(r["key"], r["copy"])] = r["start"] // per_step
    for r in records:
        if "call" in r:
            episode = (r["key"], r["copy"])
            calls += 1
            slowest = max(slowest, r["s"])
            episode_s[episode] += r["s"]
            turn = (batch_of[episode], r["call"])
            turn_s[turn] = max(turn_s[turn], r["s"])
    slow = sum(1 for r in records if r.get("slow"))
    by_batch: dict[int, float] = collections.defaultdict(float)
    for episode, seconds in episode_s.items():
        by_batch[batch_of[episode]] = max(by_batch[batch_of[episode]], seconds)
    return {"episodes": len(batch_of), "tool_calls": calls, "slow_calls": slow, "slowest_call_s": slowest,
            "no_barrier_s": sum(by_batch.values()), "turn_barrier_s": sum(turn_s.values())}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(metrics: list[dict[str, Any]], episodes: int) -> dict[str, Any]:
    """A run's row of the table from its metrics.jsonl rows (one per step)."""

    def column(key: str) -> list[float]:
        return [float(m[key]) for m in metrics if m.get(key) is not None]

    loop_s = sum(column("perf/step_s"))
    policy_tokens = sum((m["completion_length/mean"] - m.get("env/observation_tokens_per_episode", 0.0)) * episodes
                        for m in metrics)
    rewards = column("reward/mean")
    return {
        "steps": len(metrics), "loop_s": loop_s, "policy_tokens": policy_tokens,
        "policy_tokens_per_s": policy_tokens / max(loop_s, 1e-9), "step_s": loop_s / max(len(metrics), 1),
        "untrained_samples": sum(column("batch/untrained_samples")),
        "staleness_max": max(column("rollout/staleness_max"), default=None),
        "staleness_mean": _mean(column("rollout/staleness_mean")),
        "multi_version_fraction": _mean(column("rollout/multi_version_fraction")),
        "trainer_idle_fraction": _mean(column("async/trainer_idle_fraction")),
        "rollout_wait_s": _mean(column("time/rollout_wait_s")),
        "rollout_s": _mean(column("time/rollout_s")), "train_s": _mean(column("time/train_s")),
        "tool_wait_s": _mean(column("env/time_s")), "turns_mean": _mean(column("env/turns_mean")),
        "turns_max": max(column("env/turns_max"), default=None),
        "failed_episodes": sum(column("env/failed_episodes")),
        "reward_first5": _mean(rewards[:5]), "reward_last5": _mean(rewards[-5:]), "reward_per_step": rewards,
        "step_s_per_step": column("perf/step_s"),
    }


def busy_cpu_s() -> float | None:
    """The CPU seconds every process of the machine has used since boot (/proc/stat), None where it cannot be read."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """The CPU seconds of this process and of its children that ended (each row's run, its engine process included)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_row(args: argparse.Namespace, out: Path, path: str) -> dict[str, Any]:
    cfg = row_config(out, args, path)
    log = out / f"episodes_{path}.calls.jsonl"
    log.unlink(missing_ok=True)
    os.environ["HEAVY_TAIL_CALLS_LOG"] = str(log)
    work = out / f"episodes_{path}"
    load_before, busy_before, own_before = os.getloadavg(), busy_cpu_s(), own_cpu_s()
    result, _, _ = run_worker(work, cfg, args, ["--no-eval", "--converted", str(out / "episodes_converted")])
    busy_after, own = busy_cpu_s(), own_cpu_s() - own_before
    # what other processes took of the machine's cores while the row ran (2 cores: a run beside it slows the engine)
    others = busy_after - busy_before - own if busy_after is not None and busy_before is not None else None
    metrics = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary, calls = summarize(metrics, episodes_per_step(args)), tool_calls(log, episodes_per_step(args))
    if calls["episodes"] != summary["steps"] * episodes_per_step(args):
        # a row that starts more episodes than it trains (or fewer): its starts are not its batches, in order
        calls.update(no_barrier_s=None, turn_barrier_s=None)
    return {"name": path, "card": result["card"], "settings": row_settings(args, path), **summary, **calls,
            "run_seconds": result.get("train_seconds"), "own_cpu_s": own, "others_cpu_s": others,
            # the machine's load average (1, 5, 15 min) before and after the row: another process on the cores shows here
            "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()]}


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The markdown table of docs/benchmarks.md, each row against ``sync``'s: its speed-up in loop time (sync's loop
    seconds over the row's) and in policy tokens per second (the row's over sync's)."""
    base = next((r for r in rows if r["name"] == "sync"), None)
    lines = [f"| {args.steps} steps of {args.prompts} x {args.generations} episodes | loop s | speed-up | policy tokens/s "
             "| x sync | step s | tool wait s/step | trainer idle | staleness max / mean | multi-version | turns "
             "| tool calls (slow) | reward first 5 -> last 5 | other processes' CPU s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        speed = f"{base['loop_s'] / r['loop_s']:.2f}x" if base else "-"
        tokens = f"{r['policy_tokens_per_s'] / base['policy_tokens_per_s']:.2f}x" if base else "-"
        lines.append(
            f"| {r['name']} | {r['loop_s']:.1f} | {speed} | {r['policy_tokens_per_s']:,.0f} | {tokens} | {r['step_s']:.2f} "
            f"| {fmt(r['tool_wait_s'])} | {fmt(r['trainer_idle_fraction'])} "
            f"| {fmt(r['staleness_max'], '.0f')} / {fmt(r['staleness_mean'])} | {fmt(r['multi_version_fraction'])} "
            f"| {fmt(r['turns_mean'])} | {r['tool_calls']} ({r['slow_calls']}) "
            f"| {fmt(r['reward_first5'], '.3f')} -> {fmt(r['reward_last5'], '.3f')} | {fmt(r.get('others_cpu_s'), '.0f')} |")
    bounds = "; ".join(f"{r['name']}: {fmt(r['no_barrier_s'], '.1f')} s / {fmt(r['turn_barrier_s'], '.1f')} s" for r in rows)
    return "\n".join(lines) + (f"\n\nTool time the batches cannot go below, summed over the steps (no turn barrier / a "
                               f"barrier at every turn): {bounds}" if rows else "")


def ensure_inputs(args: argparse.Namespace, out: Path) -> None:
    """The tiny model (built where missing) and the demo's rows as the trainer reads them (--rows)."""
    from oumi_megatron.examples.demo_task import char_class_row
    from oumi_megatron.examples.tiny_models import build_tiny_model

    model = Path(args.model)
    if not (model / "config.json").is_file():
        build_tiny_model(model)
    rows = out / "rows"
    rows.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(char_class_row(json.loads(line))) for line in DEMO_ROWS.read_text().splitlines() if line.strip()]
    (rows / "train.rows.jsonl").write_text("\n".join(lines) + "\n")
    args.rows = str(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="work folders, the call logs and bench_async_episodes.json")
    p.add_argument("--model", default=str(REPO / "output" / "tiny_qwen2"), help="the tiny model (built here if missing)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=40, help="grpo.max_turn_tokens (over 32: a turn is 2 pieces "
                   "under partial rollouts)")
    p.add_argument("--fast-s", type=float, default=Latency.fast_s, help="most tool calls' latency")
    p.add_argument("--slow-s", type=float, default=Latency.slow_s, help="the slow calls' latency")
    p.add_argument("--slow-one-in", type=int, default=Latency.slow_one_in, help="1 call in this many is slow")
    p.add_argument("--seed", type=int, default=Latency.seed, help="draws which calls are slow and each row's calls")
    p.add_argument("--correction", default="tis", choices=("tis", "seq_mask_tis", "icepop"),
                   help="grpo.off_policy_correction of the asynchronous rows")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--extra-row", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="one more row: the async row's settings plus these overrides (repeatable)")
    args = p.parse_args()
    args.extra_rows = [parse_extra_row(text) for text in args.extra_row]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ensure_inputs(args, out)
    latency = Latency(fast_s=args.fast_s, slow_s=args.slow_s, slow_one_in=args.slow_one_in, seed=args.seed)
    os.environ.update(latency.as_env())
    here = str(Path(__file__).resolve().parent)  # grpo.plugins imports heavy_tail_env from here
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    names = [n for n in args.paths.split(",") if n] + [name for name, _ in args.extra_rows]
    rows, failed = run_rows(",".join(names), (*PATHS, *(name for name, _ in args.extra_rows)),
                            lambda path: run_row(args, out, path), out / "bench_async_episodes.json")
    text = table(rows, args)
    argv = ["DIR" if a == args.out else a for a in sys.argv[1:]]  # the command, without this machine's folder
    result = {"rows": rows, "failed": failed, "latency": latency.__dict__, "args": argv, "table": text}
    (out / "bench_async_episodes.json").write_text(json.dumps(result, indent=1))
    print_report(f"cpu ({os.cpu_count()} cores), `python scripts/bench_async_episodes.py {' '.join(sys.argv[1:])}`",
                 text, failed)


if __name__ == "__main__":
    main()
