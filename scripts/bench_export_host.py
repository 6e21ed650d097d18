"""Host time of one weight export (Megatron-Bridge ``export_hf_weights`` through ``HFWeightExporter``).

    python scripts/bench_export_host.py [--layers 16] [--bridge-as-is]

On a model this small the tensors are tiny, so what is measured is the per-tensor Python work that
also paces the GPU weight sync (docs/benchmarks.md: the export is host-bound there). CPU, one process,
a 16-layer tiny Llama = 147 HF tensors, the count of scripts/bench_weight_sync.py's 0.89B model.
``--bridge-as-is`` turns off ``_strip_each_config_once`` (Bridge strips its config per fused tensor).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--bridge-as-is", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from oumi_megatron.engine.parallel.distributed import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import torch

    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine_from_hf_config
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.state import hf_weights
    from oumi_megatron.examples.tiny_models import tiny_config

    if args.bridge_as_is:
        hf_weights._strip_each_config_once = contextlib.nullcontext
    cfg = tiny_config("llama", num_layers=args.layers)
    cfg.architectures = ["LlamaForCausalLM"]
    bridge, engine = build_engine_from_hf_config(
        cfg, engine_layout(params := MegatronParams()), params, OptimSettings(), dtype=torch.float32)
    export = hf_weights.HFWeightExporter(bridge, engine.model)
    tensors = sum(1 for _ in export())  # builds and caches the conversion plan
    times = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        sum(1 for _ in export())
        times.append(time.perf_counter() - t0)
    mode = "Bridge as is" if args.bridge_as_is else "config stripped once"
    print(f"| {mode} | {args.layers} | {tensors} | {1e3 * statistics.median(times):.1f} ms | {1e3 * min(times):.1f} ms |")


if __name__ == "__main__":
    main()
