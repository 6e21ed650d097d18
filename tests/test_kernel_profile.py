"""bench_common.kernel_profile / kernel_table: the per-step kernel tables of the benchmarks (here the CPU's aten ops)."""

from __future__ import annotations

import sys

import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
from bench_common import kernel_profile, kernel_table  # noqa: E402


def test_kernel_profile_counts_calls_and_time_per_step() -> None:
    x = torch.randn(256, 256)
    steps = 4

    def run() -> None:
        for _ in range(steps):
            torch.tanh_(x @ x)

    profiled = kernel_profile(run, per=lambda: steps)
    assert profiled["device"] == "cpu ops" and profiled["steps"] == steps
    by_name = {r["name"]: r for r in profiled["rows"]}
    assert by_name["aten::mm"]["calls_per_step"] == 1.0
    assert by_name["aten::tanh_"]["calls_per_step"] == 1.0
    assert by_name["aten::mm"]["us_per_step"] > 0
    # the rows are heaviest first, their shares of the total under 1, the totals at least the rows'
    times = [r["us_per_step"] for r in profiled["rows"]]
    assert times == sorted(times, reverse=True)
    # each share is rounded to 4 decimals: their sum may pass 1 by half a unit of that place per row
    assert 0 < sum(r["share"] for r in profiled["rows"]) <= 1.0 + 0.5e-4 * len(profiled["rows"])
    assert profiled["kernels_per_step"] >= 2 and profiled["us_per_step"] >= max(times)

    table = kernel_table(profiled, step_ms=10.0, title="cpu: ")
    assert table.startswith(f"cpu: {profiled['kernels_per_step']:g} aten op (CPU)s a step")
    gap = 10.0 - profiled["us_per_step"] / 1e3
    assert f"(gaps: {gap:.3f} ms)" in table
    assert "| aten::mm | 1 |" in table
