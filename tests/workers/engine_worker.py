"""Runs a few engine steps under one layout (torchrun or plain python) and records the results.

    python tests/workers/engine_worker.py CKPT OUT --tp 2 --pp 1 --vpp 0 --steps 2
    torchrun --nproc_per_node 2 tests/workers/engine_worker.py --jobs JOBS.json   # a list of such argument lists

Writes OUT/result.json (losses, grad norms, logprobs of a fixed batch) on global rank 0, and exports
the trained weights to OUT/hf. The data and the loss are the same for every layout, so results must
match the single-rank run.
"""

import argparse
import json
from pathlib import Path

import torch


def global_batch(step: int, n: int = 8, seq: int = 24, vocab: int = 300) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (n, seq), generator=g)


def token_mean_nll(logprobs: torch.Tensor, batch: dict) -> tuple:
    mask = batch["loss_mask"].float()
    loss_sum = -(logprobs * mask).sum()
    return loss_sum, mask.sum().to(torch.int), {"logprob_sum": (logprobs * mask).sum().detach()}


def masked_microbatches(step: int, per_microbatch: int) -> list[dict]:
    """The step's global batch with a 4-token "prompt" and the last position out of the loss, split into
    microbatches of ``per_microbatch`` rows (the schedule and ModuleQueue workers)."""
    ids = global_batch(step)
    mask = torch.ones_like(ids)
    mask[:, :4] = 0
    mask[:, -1] = 0
    return [{"input_ids": i, "loss_mask": m} for i, m in zip(ids.split(per_microbatch), mask.split(per_microbatch))]


def parameter_state(engine) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    """name -> (main_grad, value) of every parameter of this rank, copied."""
    from oumi_megatron.engine.wrappers import unwrap

    return {n: (p.main_grad.detach().clone(), p.detach().clone())
            for chunk in engine.model for n, p in unwrap(chunk).named_parameters()}


def on_policy_check(engine, out: Path) -> None:  # noqa: ANN001
    """The trainer's on-policy first update: the GRPO loss without ``old_logprobs``, in a train step with the entropy
    output. Records, next to the forward-only pass's entropy and logprobs of the same microbatches (same weights),
    what the train step's metrics say: the entropy sum, and the mismatch against "rollout" logprobs set to the
    forward-only ones plus a known offset per rank and microbatch (sums add, ``mismatch_abs_max`` is the max)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from oumi_megatron.config.grpo_params import MegatronGrpoParams
    from oumi_megatron.grpo.loss import make_grpo_loss_fn

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mbs = [{"input_ids": m["input_ids"], "completion_mask": m["loss_mask"]}
           for m in masked_microbatches(0, 2)]
    mbs = mbs[dp_rank * len(mbs) // dp:(dp_rank + 1) * len(mbs) // dp]
    old, entropy = engine.compute_logprobs_and_entropy(mbs)
    expected = {"entropy_sum": 0.0, "mismatch_abs_sum": 0.0, "mismatch_tokens": 0.0, "mismatch_abs_max": 0.0}
    for i, (mb, lp, ent) in enumerate(zip(mbs, old, entropy)):
        offset = 0.01 * (dp_rank + 1) * (i + 1)
        mask = mb["completion_mask"].float()
        mb["rollout_logprobs"] = lp + offset
        mb["advantages"] = torch.zeros(mb["input_ids"].shape[0])  # no gradient: the weights stay as they are
        expected["entropy_sum"] += float((ent * mask).sum())
        expected["mismatch_abs_sum"] += offset * float(mask.sum())
        expected["mismatch_tokens"] += float(mask.sum())
        expected["mismatch_abs_max"] = max(expected["mismatch_abs_max"], offset)
    totals = torch.tensor([expected[k] for k in ("entropy_sum", "mismatch_abs_sum", "mismatch_tokens")], dtype=torch.float64)
    dist.all_reduce(totals, group=ps.get_data_parallel_group())
    top = torch.tensor([expected["mismatch_abs_max"]], dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    grpo = MegatronGrpoParams(beta=0.0, tis_cap=None, loss_aggregation="token_mean", max_completion_length=24)
    r = engine.train_step(mbs, make_grpo_loss_fn(grpo), with_entropy=True)
    result = {"expected": {**dict(zip(("entropy_sum", "mismatch_abs_sum", "mismatch_tokens"), totals.tolist())),
                           "mismatch_abs_max": float(top)},
              "train_step": {k: r.metrics[k] for k in expected}, "ratio_sum": r.metrics["ratio_sum"],
              "completion_tokens": r.metrics["completion_tokens"]}
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()


def observation_mask_check(engine, out: Path) -> None:  # noqa: ANN001
    """Issue 46: a multi-turn episode's observation tokens get exactly no gradient. Two train steps (lr 0: the weights
    stay) through the real GRPO loss on batches that differ only in each row's last two tokens, an observation at the
    end of the episode, out of the loss (``completion_mask`` 0) like a mid-episode one (positions 10-13): their
    logprobs differ, nothing after them is scored, so every parameter's gradient must be the same. Records the largest
    difference and the largest gradient (a step that trained nothing would also 'match')."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from oumi_megatron.config.grpo_params import MegatronGrpoParams
    from oumi_megatron.grpo.loss import make_grpo_loss_fn

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    ids = global_batch(0)
    mask = torch.ones_like(ids)
    mask[:, :4] = 0  # the prompt
    mask[:, 10:14] = 0  # an observation mid-episode
    mask[:, -3:] = 0  # the final observation's two tokens (the targets of positions -3 and -2), and no target after
    changed = ids.clone()
    changed[:, -2:] = (ids[:, -2:] + 7) % 300
    loss_fn = make_grpo_loss_fn(MegatronGrpoParams(beta=0.0, tis_cap=None, max_completion_length=24))
    grads = []
    for batch in (ids, changed):
        local = batch.chunk(dp)[dp_rank], mask.chunk(dp)[dp_rank]
        mbs = [{"input_ids": i, "completion_mask": m, "advantages": torch.linspace(-1, 1, i.shape[0]),
                "rollout_logprobs": torch.zeros(i.shape, dtype=torch.float32)}
               for i, m in zip(local[0].split(2), local[1].split(2))]
        engine.train_step(mbs, loss_fn)
        grads.append({n: g for n, (g, _) in parameter_state(engine).items()})
    worst = max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0])
    largest = max(float(g.abs().max()) for g in grads[0].values())
    stats = torch.tensor([worst, largest], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps({"grad_max_abs_diff": stats[0].item(), "grad_max_abs": stats[1].item()}))
    dist.barrier()


EPISODE_PROMPTS = [[[5, 17, 42, 99, 7], [3, 250, 11]], [[8, 8, 8, 8, 120, 64, 1], [77, 31, 200, 9]]]


class _SetEnvironment:
    """Episodes that end differently per prompt set: set 0's first prompt ends after its first turn, its second after
    a long observation and a second turn (little room left); set 1's episodes get a short observation every turn and
    run to ``max_turns``. Under EP = 2 each rank runs one set, so rank 0's episodes end while rank 1's go on."""

    def start(self, row: dict) -> dict:
        return dict(row, turns=0)

    def step(self, state: dict, turn_text: str, turn_ids: list[int]):  # noqa: ANN201
        from oumi_megatron.environments.base import EpisodeEnd, Observation

        state["turns"] += 1
        if state["set"] == 1:
            return Observation("ok", role="tool")
        if state["prompt"] == 0 or state["turns"] == 2:
            return EpisodeEnd(info={"turns": state["turns"]})
        return Observation("the answer is a rather long sentence", role="tool")


def expert_parallel_episodes_check(engine, out: Path) -> None:  # noqa: ANN001
    """Multi-turn episodes on the embedded backend under EP: rank r (a replica) runs prompt set r, greedy; one rank
    runs both sets, also turn by turn (the reference). The expert peers must take every decode step together
    (rollout/decoding/episodes.py: the loop ends when every peer's episodes are over) although rank 0's episodes end
    first: otherwise rank 1 waits in an all-to-all for good. Records each set's episodes (tokens, masks, logprobs,
    turns)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.environments.runner import EnvironmentRunner
    from oumi_megatron.examples.tiny_models import build_byte_tokenizer
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend
    from oumi_megatron.rollout.sampling import SamplingParams

    tokenizer = build_byte_tokenizer()
    backend = MegatronRolloutBackend(engine, len(tokenizer), path="static")
    greedy = SamplingParams(max_new_tokens=70, pad_token_id=256, eos_token_id=258, greedy=True)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    sets = [dp_rank] if dp == len(EPISODE_PROMPTS) else list(range(len(EPISODE_PROMPTS)))
    class GenerateOnly:  # the same engine seen through generate alone: episodes turn by turn (rollout/turns.py)
        def generate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return backend.generate(*args, **kwargs)

    mine = {}
    # one rank: both sets, also turn by turn (the turn-synchronous reference; under EP its replicas' turn counts differ)
    engines = [("", backend)] + ([("reference", GenerateOnly())] if len(sets) > 1 else [])
    for tag, engine in engines:
        for s in sets:
            prompts = EPISODE_PROMPTS[s]
            episodes, _ = run_episodes(engine, tokenizer, EnvironmentRunner(_SetEnvironment(), 60.0), prompts,
                                       [{"set": s, "prompt": i} for i in range(len(prompts))], greedy, n=2, max_turns=3,
                                       max_turn_tokens=8)
            mine[f"{tag}{s}"] = {"ids": [r.completion_ids for r in episodes], "mask": [r.loss_mask for r in episodes],
                                 "logprobs": [r.logprobs for r in episodes], "turns": [r.turns for r in episodes]}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        merged = {str(k): v for part in gathered for k, v in part.items()}
        (out / "result.json").write_text(json.dumps({"sets": merged, "path": backend.path}))
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=0)
    p.add_argument("--cp", type=int, default=1, help="megatron.context_parallel_size")
    p.add_argument("--ep", type=int, default=1, help="megatron.expert_model_parallel_size (MoE checkpoints)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--distributed-optimizer", type=int, default=1)
    p.add_argument("--save-at", type=int, action="append", default=[], help="save a checkpoint after this step")
    p.add_argument("--resume", default="", help="checkpoint to resume from before training")
    p.add_argument("--no-export", action="store_true")
    p.add_argument("--hf-max-shard-size", default="5GB", help="megatron.hf_max_shard_size of the export")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background (GPU)")
    p.add_argument("--attention", default="auto", help="megatron.transformer_config.attention_backend")
    p.add_argument("--logprob-chunk", type=int, default=None, help="megatron.logprob_chunk_tokens")
    p.add_argument("--schedule", default="1f1b", help="megatron.pipeline_schedule")
    p.add_argument("--sequence-parallel", action="store_true", help="megatron.sequence_parallel: true (TP > 1)")
    p.add_argument("--grad-accum-fusion", action="store_true", help="transformer_config.gradient_accumulation_fusion: true")
    p.add_argument("--observation-mask-check", action="store_true",
                   help="only the zero-gradient check of out-of-loss observation tokens (lr 0, two train steps)")
    p.add_argument("--episodes-check", action="store_true",
                   help="only multi-turn episodes on the embedded backend, one prompt set per data-parallel rank")
    p.add_argument("--on-policy-check", action="store_true",
                   help="only the GRPO loss's on-policy first update against the forward-only pass (no training)")
    args = p.parse_args(argv)

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.kernels.attention import core_attention_name
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.state.conversion import save_hf

    params = MegatronParams(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp or None,
        context_parallel_size=args.cp,
        expert_model_parallel_size=args.ep,
    )
    params.ddp_config.use_distributed_optimizer = bool(args.distributed_optimizer)
    params.transformer_config.recompute_granularity = None
    params.transformer_config.attention_backend = args.attention
    params.logprob_chunk_tokens = args.logprob_chunk
    params.pipeline_schedule = args.schedule
    params.sequence_parallel = args.sequence_parallel
    if args.grad_accum_fusion:
        params.transformer_config.gradient_accumulation_fusion = True
    settings = OptimSettings(lr=0.0 if args.observation_mask_check else 1e-3, weight_decay=0.01, clip_grad=1.0,
                             total_steps=args.steps)
    bridge, engine = build_engine(args.ckpt, engine_layout(params), params, settings, dtype=torch.float32)

    if args.on_policy_check:
        on_policy_check(engine, Path(args.out))
        return
    if args.episodes_check:
        expert_parallel_episodes_check(engine, Path(args.out))
        return
    if args.observation_mask_check:
        observation_mask_check(engine, Path(args.out))
        return
    from oumi_megatron.engine.state.checkpointing import AsyncCheckpointWriter, load_checkpoint, save_checkpoint

    writer = AsyncCheckpointWriter() if args.async_save else None

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    results = {"loss": [], "grad_norm": [], "count": [], "schedule": [], "deferred_wgrad_ops": []}
    # the sequence length the first norm sees, in training and in forward-only passes (1/TP under sequence parallelism)
    from oumi_megatron.engine.wrappers import unwrap

    norm_rows: dict[str, set] = {"train": set(), "forward_only": set()}
    unwrap(engine.model[0]).decoder.layers[0].input_layernorm.register_forward_pre_hook(
        lambda _m, inputs: norm_rows["train" if torch.is_grad_enabled() else "forward_only"].add(inputs[0].shape[0]))
    first = 0
    if args.resume:
        first = load_checkpoint(engine, args.resume)["step"]
    for step in range(first, args.steps):
        ids = global_batch(step)
        mask = torch.ones_like(ids)
        mask[:, :4] = 0  # a "prompt" that is not trained on
        mask[:, -1] = 0  # no target after the last token
        mask[step::3, -6:-1] = 0  # some "padding"
        local = ids.chunk(dp)[dp_rank], mask.chunk(dp)[dp_rank]
        mbs = [{"input_ids": i, "loss_mask": m} for i, m in zip(local[0].split(args.mbs), local[1].split(args.mbs))]
        r = engine.train_step(mbs, token_mean_nll)
        results["loss"].append(r.loss)
        results["grad_norm"].append(r.grad_norm)
        results["count"].append(r.count)
        results["schedule"].append(r.schedule)
        results["deferred_wgrad_ops"].append(r.deferred_wgrad_ops)
        if step + 1 in args.save_at:
            save_checkpoint(engine, Path(args.out) / "checkpoints", step + 1, {"data_position": step + 1},
                            Path(args.ckpt) / "hf", async_writer=writer)
            if writer is not None:  # the model's and the optimizer's writes in flight, each with its results queue
                queues = [call.async_request.async_fn_args[2] for call in writer.queue.async_calls]
                results["async_writes"] = [len(queues), len({id(q) for q in queues})]
    if writer is not None:
        writer.close()
    probe = global_batch(99)[:4]
    lp = engine.compute_logprobs([{"input_ids": probe[:2]}, {"input_ids": probe[2:]}])
    results["logprobs"] = torch.cat(lp).tolist() if dp_rank == 0 else None
    # the generation path (embedded rollouts): last-position logits of the probe rows, no KV cache
    from oumi_megatron.rollout.decoding.generation_mode import last_token_logits

    seq = probe.shape[1]
    future = ~torch.ones(seq, seq, dtype=torch.bool).tril()
    last = last_token_logits(engine, probe, torch.arange(seq).expand_as(probe), future.expand(probe.shape[0], 1, seq, seq))
    results["last_token_logits"] = last.tolist() if dp_rank == 0 else None
    results["core_attention"] = core_attention_name(engine.model[0])
    mlp = unwrap(engine.model[0]).decoder.layers[0].mlp  # MoE: SequentialMLP experts on this rank
    results["local_experts"] = len(mlp.experts.local_experts) if hasattr(mlp, "experts") else 0
    results["norm_rows"] = {k: sorted(v) for k, v in norm_rows.items()}
    results["sequence_parallel_norm_weights"] = sum(bool(getattr(p, "sequence_parallel", False))
                                                    for c in engine.model for p in c.parameters())
    if not args.no_export:
        save_hf(bridge, engine.model, Path(args.ckpt) / "hf", Path(args.out) / "hf", args.hf_max_shard_size)
    if dist.get_rank() == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    import jobs

    jobs.run(main)
