"""The decode step's attention kernel alone against SDPA, on one GPU: each tuning's time a call, from CUDA graphs.

    python scripts/bench_decode_attention.py --shape qwen2.5-1.5b --out result.json

engine/kernels/decode_attention.py reads each row's cache slots up to the one it writes; a decode step's CUDA graph
runs SDPA over every slot under a mask (``megatron.rollout_decode_kernels: false``). Cases ``ROWS:SLOTS:REACHED``
(bf16, random values, every reached slot valid): the rows, the cache's slots, and the slots each row has reached.
For each case: SDPA over every slot with the additive mask (what the torch path runs), SDPA over the reached slots
alone (no mask; a floor for a kernel that reads what it needs), and the kernel under every tuning of
``--products`` x ``--chunks`` (``SPLIT_SLOTS``) x ``--blocks`` (``BLOCK_S``) x ``--warps`` x ``--stages``: microseconds a call
(CUDA graph of 20 calls, replayed), the fraction of the HBM roofline over the bytes of keys and values reached, and
the largest difference from SDPA's output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from typing import Any

import torch

import bench_common

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"qwen2.5-1.5b": (12, 2, 128), "qwen2.5-7b": (28, 4, 128), "smollm2-135m": (9, 3, 64)}
"""(query heads, key/value heads, head dim) of the benchmark's model shapes."""


def graph_us(fn: Any, calls: int = 20, replays: int = 10) -> float:
    """Microseconds a call of ``fn``, ``calls`` of them captured in one CUDA graph (no launch gaps, as a decode step);
    without CUDA (a dry run under TRITON_INTERPRET=1) the wall time of one call."""
    if not torch.cuda.is_available():
        started = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - started)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(stop) / (replays * calls)


def run_case(rows: int, slots: int, reached: int, shape: tuple[int, int, int], tunings: list[dict[str, Any]],
             bandwidth: float | None) -> dict[str, Any]:
    from oumi_megatron.engine.kernels import decode_attention as da
    from oumi_megatron.engine.kernels.attention import sdpa

    heads, groups, dim = shape
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(1, rows, heads, dim, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    keys, values = (torch.randn(rows, groups, slots, dim, device=DEVICE, dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))
    valid = torch.zeros(rows, slots, dtype=torch.bool, device=DEVICE)
    valid[:, :reached] = True
    last = torch.full((rows,), reached - 1, dtype=torch.long, device=DEVICE)
    bias = torch.zeros(rows, 1, 1, slots, device=DEVICE, dtype=torch.bfloat16).masked_fill(~valid[:, None, None], float("-inf"))
    scale = dim ** -0.5
    q4 = q[0].unsqueeze(2)  # [rows, heads, 1, dim]

    def sdpa_all() -> torch.Tensor:
        return sdpa(q4, keys, values, attn_mask=bias, scale=scale, enable_gqa=True)

    def sdpa_reached() -> torch.Tensor:
        return sdpa(q4, keys[:, :, :reached], values[:, :, :reached], scale=scale, enable_gqa=True)

    reference = sdpa_all().reshape(1, rows, heads * dim).float()
    read = rows * groups * reached * dim * 2 * keys.element_size()  # keys and values reached

    def roofline(us: float) -> float | None:
        return None if bandwidth is None else read / bandwidth / (us * 1e-6)

    out: dict[str, Any] = {"rows": rows, "slots": slots, "reached": reached, "bytes": read,
                           "sdpa_all_us": graph_us(sdpa_all), "sdpa_reached_us": graph_us(sdpa_reached), "kernel": []}
    saved = {k: getattr(da, k) for k in ("NARROW_PRODUCTS", "SPLIT_SLOTS", "BLOCK_S", "NUM_WARPS", "NUM_STAGES")}
    try:
        for t in tunings:
            for k, v in t.items():
                setattr(da, k, v)
            def kernel() -> torch.Tensor:
                return da.decode_attention(q, keys, values, valid, last, scale)
            diff = (kernel().float() - reference).abs().max().item()
            us = graph_us(kernel)
            out["kernel"].append({**t, "us": us, "roofline": roofline(us), "max_diff": diff})
    finally:
        for k, v in saved.items():
            setattr(da, k, v)
    out["sdpa_all_roofline"] = roofline(out["sdpa_all_us"])
    out["sdpa_reached_roofline"] = roofline(out["sdpa_reached_us"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    p.add_argument("--cases", default="128:192:100,128:192:192,32:192:100,256:320:300,128:1024:900")
    p.add_argument("--products", default="narrow,tf32")
    p.add_argument("--chunks", default="32,64,128,256")
    p.add_argument("--blocks", default="32,64")
    p.add_argument("--warps", default="2,4")
    p.add_argument("--stages", default="2")
    p.add_argument("--top", type=int, default=10, help="the fastest tunings printed per case (--out: all)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("bench_decode_attention times the compiled kernel on a CUDA GPU (a CPU dry run: TRITON_INTERPRET=1)")
    tunings = [{"NARROW_PRODUCTS": prod == "narrow", "SPLIT_SLOTS": int(c), "BLOCK_S": int(b), "NUM_WARPS": int(w),
                "NUM_STAGES": int(st)}
               for prod, c, b, w, st in itertools.product(args.products.split(","), args.chunks.split(","),
                                                          args.blocks.split(","), args.warps.split(","),
                                                          args.stages.split(","))]
    card = bench_common.card_name() if torch.cuda.is_available() else "cpu (Triton's interpreter: a dry run)"
    bandwidth = bench_common.hbm_bandwidth(card) if torch.cuda.is_available() else None
    results = []
    for case in args.cases.split(","):
        rows, slots, reached = (int(x) for x in case.split(":"))
        r = run_case(rows, slots, reached, SHAPES[args.shape], tunings, bandwidth)
        results.append(r)
        best = min(r["kernel"], key=lambda k: k["us"])
        print(f"\n{args.shape}, {rows} rows, {reached} of {slots} slots reached ({r['bytes'] / 1e6:.1f} MB of keys and "
              f"values): SDPA every slot {r['sdpa_all_us']:.1f} us, SDPA reached slots {r['sdpa_reached_us']:.1f} us")
        print("| products | SPLIT_SLOTS | BLOCK_S | warps | stages | us | roofline | vs SDPA every slot | max diff |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for k in sorted(r["kernel"], key=lambda k: k["us"])[:args.top]:
            mark = " (best)" if k is best else ""
            roof = "-" if k["roofline"] is None else f"{k['roofline']:.2f}"
            tuning = f"{'bf16' if k['NARROW_PRODUCTS'] else 'tf32'} | {k['SPLIT_SLOTS']} | {k['BLOCK_S']} | {k['NUM_WARPS']}"
            print(f"| {tuning} | {k['NUM_STAGES']} | {k['us']:.1f}{mark} | {roof} | {r['sdpa_all_us'] / k['us']:.2f}x | "
                  f"{k['max_diff']:.3g} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"card": card, "date": time.strftime("%Y-%m-%d"), "shape": args.shape, "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
