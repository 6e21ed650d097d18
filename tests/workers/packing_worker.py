"""Packed vs padded microbatches on one engine: logprobs, entropy, loss, gradients.

    python tests/workers/packing_worker.py CKPT OUT.json [--pp 2 | --tp 2 --sequence-parallel, under torchrun]

For variable-length sequences (different prompt and completion lengths) it builds both layouts of
trainer/batches.py, compares per-sequence logprobs and entropies, and for each loss aggregation runs
one train_step per layout with lr = 0 (the weights stay put) and compares the loss and every
parameter's gradient. Writes the worst differences and the token counts of both layouts.
"""

import argparse
import json
from pathlib import Path

import torch


def sequences(n: int = 8, vocab: int = 250) -> tuple[list[list[int]], list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    prompt_lens = torch.randint(3, 12, (n,), generator=g).tolist()
    completion_lens = torch.randint(1, 28, (n,), generator=g).tolist()
    ids = [torch.randint(0, vocab, (p + c,), generator=g).tolist() for p, c in zip(prompt_lens, completion_lens)]
    advantages = torch.randn(n, generator=g)
    return ids, prompt_lens, advantages


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--cp", type=int, default=1, help="megatron.context_parallel_size")
    p.add_argument("--ep", type=int, default=1, help="megatron.expert_model_parallel_size (an MoE checkpoint; DP = 2 around it)")
    p.add_argument("--mbs", type=int, default=2)
    args = p.parse_args(argv)

    import torch.distributed as dist

    from oumi_megatron.config.grpo_params import MegatronGrpoParams
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.grpo.loss import make_grpo_loss_fn
    from oumi_megatron.rollout.sample import Sample
    from oumi_megatron.trainer.batches import packed_layout, padded_layout

    params = MegatronParams(pipeline_model_parallel_size=args.pp, tensor_model_parallel_size=args.tp,
                            sequence_parallel=args.sequence_parallel, context_parallel_size=args.cp,
                            expert_model_parallel_size=args.ep)
    params.transformer_config.recompute_granularity = None
    if args.cp > 1 or args.ep > 1:  # DP x CP = 2 ranks: the distributed optimizer would leave each rank only its shard of the reduced grads
        params.ddp_config.use_distributed_optimizer = False
    # lr = 0: train_step computes the real gradients but leaves the weights as they are
    settings = OptimSettings(lr=0.0, weight_decay=0.0, clip_grad=0.0, total_steps=10)
    _, engine = build_engine(args.ckpt, engine_layout(params), params, settings, dtype=torch.float32)
    ids, prompt_lens, advantages = sequences()
    trainable = torch.ones(len(ids), dtype=torch.bool)
    trainable[3] = False  # a skipped sample: kept in the batch, not trained on
    batch = [Sample(t[:p], t[p:], i, advantage=float(a), trainable=bool(tr))
             for i, (t, p, a, tr) in enumerate(zip(ids, prompt_lens, advantages, trainable, strict=True))]
    layouts = {"padded": padded_layout(batch, args.mbs, pad_id=0), "packed": packed_layout(batch, args.mbs, pad_id=0)}

    per_seq = {}
    g = torch.Generator().manual_seed(3)
    offsets = [0.3 * torch.randn(len(t), generator=g) for t in ids]  # old policy != current: clipping is exercised
    for name, layout in layouts.items():
        lp, ent = engine.compute_logprobs_and_entropy(layout.microbatches, temperature=0.9)
        per_seq[name] = (layout.per_sequence(lp), layout.per_sequence(ent))
        for mb, t in zip(layout.microbatches, lp):
            mb["old_logprobs"] = t.clone()
        for i, (m, r, s, n) in enumerate(layout.placements):
            layout.microbatches[m]["old_logprobs"][r, s : s + n] += offsets[i]

    def completion_part(values: list[torch.Tensor]) -> list[torch.Tensor]:
        return [v[p - 1 : len(t) - 1] for v, p, t in zip(values, prompt_lens, ids)]

    result = {
        "tokens": {k: {"real": v.real_tokens, "processed": v.processed_tokens, "microbatches": len(v.microbatches)}
                   for k, v in layouts.items()},
        "logprobs_max_abs_diff": max((a - b).abs().max().item() for a, b in zip(
            completion_part(per_seq["padded"][0]), completion_part(per_seq["packed"][0]))),
        "entropy_max_abs_diff": max((a - b).abs().max().item() for a, b in zip(
            completion_part(per_seq["padded"][1]), completion_part(per_seq["packed"][1]))),
        "entropy_mean": torch.cat(completion_part(per_seq["padded"][1])).mean().item(),
        "aggregations": {},
    }
    for mode in ("token_mean", "seq_mean", "seq_mean_token_sum_norm"):
        grpo = MegatronGrpoParams(epsilon=0.2, epsilon_high=0.28, beta=0.0, kl_estimator="k3", loss_aggregation=mode,
                                  tis_cap=None, max_completion_length=32)
        loss_fn = make_grpo_loss_fn(grpo)
        runs = {}
        for name, layout in layouts.items():
            step = engine.train_step(layout.microbatches, loss_fn, temperature=0.9)
            grads = [p.main_grad.detach().clone() for c in engine.model for p in c.parameters()]
            runs[name] = (step, grads)
        (a, ga), (b, gb) = runs["padded"], runs["packed"]
        worst = torch.tensor([max((x - y).abs().max().item() for x, y in zip(ga, gb)), max(g.abs().max().item() for g in ga)])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank's parameters (TP shards, PP stages)
        result["aggregations"][mode] = {
            "loss": [a.loss, b.loss],
            "count": [a.count, b.count],
            "clipped_tokens": [a.metrics["clipped_tokens"], b.metrics["clipped_tokens"]],
            "grad_max_abs_diff": worst[0].item(),
            "grad_max_abs": worst[1].item(),
        }
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.barrier()


if __name__ == "__main__":
    import jobs

    jobs.run(main)
