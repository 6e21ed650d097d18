"""What the sandbox for model-written code costs (utils/sandbox.py), on this machine's CPUs.

    .venv/bin/python scripts/bench_sandbox.py [--programs 400] [--workers 1 2 4] [--out result.json]

Measured, with the isolation ``auto`` picks here (``Sandbox.description``):
- start: seconds to start N servers (the pre-started interpreters);
- latency: one short program (``print(sum(range(100)))``) after another on one server, median and p95 of the
  caller's wall time per program (request, fork, limits, run, reaping, cleanup, reply);
- throughput: ``--programs`` short programs through ``run_many`` over N servers, programs per second;
- the baseline: the same program as a bare ``python -I -S -c`` subprocess (no isolation, no limits), one after another
  and two at a time; the overhead per program is the sandbox's latency minus the bare one's (negative: the
  pre-started interpreter saves more than the isolation costs);
- code_tests: a batch of HumanEval's canonical solutions scored by the ``code_tests`` reward (its own tests in the
  sandbox), completions per second.
Prints a markdown table (docs/benchmarks.md, "The sandbox for model-written code") and writes the numbers to --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import statistics
import subprocess
import time

PROGRAM = "print(sum(range(100)))"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def bare(n: int, threads: int) -> tuple[float, float]:
    """(median seconds per program one at a time, programs per second ``threads`` at a time) of ``python -I -S -c``."""
    from oumi_megatron.utils.sandbox import _interpreter

    cmd = [_interpreter(), "-I", "-S", "-c", PROGRAM]

    def one(_: int) -> float:
        started = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env={})
        return time.perf_counter() - started

    latency = statistics.median(one(i) for i in range(min(n, 100)))
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(n)))
    return latency, n / (time.perf_counter() - started)


def sandboxed(n: int, workers: int) -> dict[str, float]:
    from oumi_megatron.utils.sandbox import Sandbox

    started = time.perf_counter()
    with Sandbox("auto", workers=workers) as sandbox:
        start_s = time.perf_counter() - started
        for _ in range(10):
            sandbox.run(PROGRAM)  # warm
        times = []
        for _ in range(min(n, 200)):
            t = time.perf_counter()
            assert sandbox.run(PROGRAM).stdout == "4950\n"
            times.append(time.perf_counter() - t)
        started = time.perf_counter()
        results = sandbox.run_many([PROGRAM] * n)
        rate = n / (time.perf_counter() - started)
        assert all(getattr(r, "stdout", None) == "4950\n" for r in results)
        description = sandbox.description
    times.sort()
    return {"workers": workers, "start_s": start_s, "median_s": statistics.median(times),
            "p95_s": times[int(0.95 * (len(times) - 1))], "per_s": rate, "isolation": description}


def code_tests_rate(workers: int, completions: int = 164) -> float:
    from oumi_megatron.examples.code_task import humaneval_problems, humaneval_row
    from oumi_megatron.grpo.code_tests import code_tests
    from oumi_megatron.utils.sandbox import SandboxSettings, start_shared

    start_shared(SandboxSettings("auto", workers))
    problems = humaneval_problems()[:completions]
    rows = [humaneval_row(p) for p in problems]
    texts = [f"```python\n{p['prompt']}{p['canonical_solution']}```" for p in problems]
    started = time.perf_counter()
    out = code_tests(texts, [r["tests"] for r in rows], entry_point=[r["entry_point"] for r in rows],
                     code_prefix=[r["code_prefix"] for r in rows])
    took = time.perf_counter() - started
    assert out.rewards == [1.0] * len(rows)
    return len(rows) / took


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--programs", type=int, default=400)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--out", default=None)
    args = p.parse_args()

    rows = [sandboxed(args.programs, w) for w in args.workers]
    bare_latency, bare_rate = bare(args.programs, 2)
    tests_rate = code_tests_rate(2)
    result = {"date": datetime.date.today().isoformat(), "cpu": _cpu_name(), "cpus": os.cpu_count(),
              "kernel": platform.release(), "isolation": rows[0]["isolation"], "sandbox": rows,
              "bare_python_median_s": bare_latency, "bare_python_per_s_2_threads": bare_rate,
              "code_tests_humaneval_per_s_2_workers": tests_rate}
    print(f"{result['date']}, {result['cpus']} x {result['cpu']}, Linux {result['kernel']}, command: "
          f"`.venv/bin/python scripts/bench_sandbox.py --programs {args.programs} --workers "
          f"{' '.join(map(str, args.workers))}`; isolation: {result['isolation'].split(':')[0]}\n")
    print("| what | servers | start s | ms per program (median / p95, one at a time) | programs/s | overhead vs bare "
          "`python -c`, ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| sandbox, `{PROGRAM}` | {r['workers']} | {r['start_s']:.3f} | {1e3 * r['median_s']:.2f} / "
              f"{1e3 * r['p95_s']:.2f} | {r['per_s']:.0f} | {1e3 * (r['median_s'] - bare_latency):+.2f} |")
    print(f"| bare `python -I -S -c`, no isolation | 2 threads | - | {1e3 * bare_latency:.2f} | {bare_rate:.0f} | 0 |")
    print(f"| code_tests: HumanEval's canonical solutions, its tests | 2 | - | - | {tests_rate:.0f} completions/s | - |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
