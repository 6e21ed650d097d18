"""Each rank's TP shards (engine/state/tp_shards.py) against the gathered whole-model export.

    torchrun --nproc-per-node 4 tests/workers/tp_shards_worker.py OUT.json --arch llama --gqa --tp 2 --pp 2

The model is a randomly initialized tiny one of ``--arch`` (examples/tiny_models.py; ``--gqa``: 4 query heads sharing
2 key/value heads): both sides are exports of the same parameters, so no checkpoint is needed.

Every rank takes ``HFWeightExporter.tp_shards`` with vLLM's vocabulary rows for its TP rank (padded to 64, TP equal
ranges), all-gathers the shards over its TP group and rebuilds each HF tensor (concatenated along the one dimension where
a shard differs from the whole, or whole where it does not); OUT.json gets, per rank, the largest |rebuilt - whole|, the
names each side lacks and the bytes of its shards against the whole model's.
"""

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--arch", default="llama")
    p.add_argument("--gqa", action="store_true")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    args = p.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine_from_hf_config
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.state.hf_weights import HFWeightExporter
    from oumi_megatron.examples.tiny_models import tiny_config

    params = MegatronParams(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    params.transformer_config.recompute_granularity = None
    config = tiny_config(args.arch, gqa=args.gqa)
    config.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[args.arch]]  # what AutoBridge reads
    torch.manual_seed(0)  # every rank initializes its shards of the same model
    bridge, engine = build_engine_from_hf_config(config, engine_layout(params), params,
                                                 OptimSettings(lr=1e-3, total_steps=1), dtype=torch.float32)
    weights = HFWeightExporter(bridge, engine.model)
    whole = {n: t.clone() for n, t in weights()}
    vocab = next(t.shape[0] for n, t in whole.items() if n.endswith("embed_tokens.weight"))
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    per = -(-vocab // 64) * 64 // tp  # vLLM: the vocabulary padded to 64, equal ranges per TP rank
    rows = (rank * per, min((rank + 1) * per, vocab))
    result: dict = {"unsupported": weights.tp_shards_unsupported()}
    shards = {n: t.clone() for n, t in weights.tp_shards(rows)}
    worst = 0.0
    for name, shard in shards.items():
        parts = [torch.empty(0)] * tp
        dist.all_gather_object(parts, shard, group=ps.get_tensor_model_parallel_group())
        full = whole[name]
        dims = [d for d in range(full.ndim) if shard.shape[d] != full.shape[d]]
        rebuilt = shard if not dims and all(torch.equal(x, shard) for x in parts) else torch.cat(parts, dim=dims[0] if dims else 0)
        if rebuilt.shape != full.shape:
            worst = float("inf")
            continue
        worst = max(worst, (rebuilt - full).abs().max().item())
    result.update(
        worst=worst, missing=sorted(set(whole) - set(shards)), extra=sorted(set(shards) - set(whole)),
        shard_bytes=sum(t.numel() * t.element_size() for t in shards.values()),
        model_bytes=sum(t.numel() * t.element_size() for t in whole.values()),
        lm_head_bytes=sum(t.numel() * t.element_size() for n, t in whole.items() if n == "lm_head.weight"),
    )
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(every))
    dist.barrier()


if __name__ == "__main__":
    main()
