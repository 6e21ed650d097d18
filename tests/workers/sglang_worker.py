"""A real SGLang engine receiving the Megatron policy's weights, checked against the trainer and the embedded backend
(one engine start per call): fp32 on the CPU (CI), bf16 on a GPU (tests/test_gpu.py, scripts/gpu_check.py).

    python tests/workers/sglang_worker.py CKPT HF_DIR OUT.json --placement colocated|separate [--pp 2] (torchrun for 2)
        [--dtype bfloat16 --rows 64 --new-tokens 32 --syncs 3]

1. Greedy completions (with an EOS that ends rows early) equal the embedded backend's, and the weight probe
   (``weight_sync/probe_max_diff``: the engine's logprobs of a fixed sequence against the trainer's) is ~0 at the start.
2. Sampled completions: the engine's logprobs of its own tokens equal the trainer's recomputed ones.
3. Two optimizer steps change the policy: the probe, before a sync, sees it (what a sync that did nothing leaves);
   after ``sync_weights`` the probe is ~0 again and the greedy completions equal the embedded backend's again
   (``--syncs K``: K such updates, a probe after each).
4. Multi-turn greedy episodes of a toy environment: SGLang's request chains (no turn barrier), SGLang turn by turn and
   the embedded backend give the same episodes.
"""

import argparse
import json
from pathlib import Path

import torch

PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 11], [8, 8, 8, 120, 64, 1], [77, 31, 200, 9, 14, 2, 150]]


def prompts(rows: int, vocab: int) -> list[list[int]]:
    """PROMPTS, then seeded random prompts of 3-24 tokens below ``vocab``, ``rows`` in all."""
    g = torch.Generator().manual_seed(1)
    extra = [torch.randint(0, vocab, (int(torch.randint(3, 25, (1,), generator=g)),), generator=g).tolist()
             for _ in range(max(rows - len(PROMPTS), 0))]
    return (PROMPTS + extra)[:rows]


def parity(rows: list[list[int]], ours: list[list[int]], theirs: list[list[int]], engine) -> dict:  # noqa: ANN001
    """How many rows of two greedy decodes (SGLang's, the embedded backend's) are equal; where the first unequal row
    first differs; and, for every unequal row, the trainer's logprob margin between the two tokens chosen at its first
    difference (embedded's minus SGLang's): a divergence within the engines' rounding noise is a near-tie, one beyond
    it a real difference."""
    unequal = [k for k, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    first, margins = None, []
    for k in unequal:
        a, b = ours[k], theirs[k]
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if first is None:
            first = {"row": k, "position": at, "sglang": a[at:at + 4], "embedded": b[at:at + 4]}
        if at < min(len(a), len(b)):  # not where one row merely ended earlier
            seqs = [torch.tensor([rows[k] + b[:at] + [token]]) for token in (b[at], a[at])]
            lps = [engine.compute_logprobs([{"input_ids": q}])[0][0, -2].float().item() for q in seqs]  # t: log p(t + 1)
            margins.append(lps[0] - lps[1])
    return {"rows": len(ours), "equal_rows": len(ours) - len(unequal), "first_divergence": first,
            "divergence_margins": margins}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("hf")
    p.add_argument("out")
    p.add_argument("--placement", default="colocated")
    p.add_argument("--pp", type=int, default=1, help="a replica of two pipeline stages (separate: its owner drives the engine)")
    p.add_argument("--dtype", default="float32", help="float32 (CPU) or bfloat16 (GPU)")
    p.add_argument("--rows", type=int, default=len(PROMPTS), help="greedy parity rows: PROMPTS, then random ones")
    p.add_argument("--new-tokens", type=int, default=12, help="greedy parity: tokens per row")
    p.add_argument("--syncs", type=int, default=1, help="updates of two optimizer steps, each followed by a sync")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)

    import torch.distributed as dist
    from transformers import AutoConfig, AutoTokenizer

    from oumi_megatron.config.grpo_params import MegatronGrpoParams
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.config.standalone import ModelSection, StandaloneConfig, TrainingSection
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.state.hf_weights import HFWeightExporter
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend
    from oumi_megatron.rollout.registry import RolloutContext, build_rollout_backend
    from oumi_megatron.rollout.sample import Sample
    from oumi_megatron.rollout.sampling import SamplingParams
    from oumi_megatron.trainer.batches import padded_layout

    params = MegatronParams(inference_backend="sglang", rollout_placement=args.placement, weight_sync_method="gloo",
                            weight_sync_bucket_mb=0.05, pipeline_model_parallel_size=args.pp)  # small buckets: many
    params.transformer_config.recompute_granularity = None
    bridge, engine = build_engine(args.ckpt, engine_layout(params), params, OptimSettings(lr=2e-2, total_steps=10),
                                  dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.hf)
    config = StandaloneConfig(model=ModelSection(model_name=args.hf, torch_dtype_str=args.dtype),
                              training=TrainingSection(seed=0), megatron=params,
                              grpo=MegatronGrpoParams(max_prompt_length=32, max_completion_length=128))
    backend = build_rollout_backend(RolloutContext(engine, config, tokenizer, dtype, Path(args.out).parent))
    # SGLang decodes over the model's whole vocabulary (the tiny models': 320 rows for 259 tokens); the embedded backend,
    # given the tokenizer's size, never picks a padding row: compare the two over the same rows
    embedded = MegatronRolloutBackend(engine, AutoConfig.from_pretrained(args.hf).vocab_size, path="static")
    weights = HFWeightExporter(bridge, engine.model, Path(args.ckpt) / "hf")
    result: dict = {"backend": type(backend).__name__, "dtype": args.dtype, "rollout_path": backend.decode_profile().path}
    rows = prompts(args.rows, min(len(tokenizer), 250))

    def greedy(name: str) -> None:
        """Both backends' greedy completions, with an EOS some rows reach early (the embedded backend's 4th token)."""
        probe = embedded.generate(rows[:1], SamplingParams(max_new_tokens=12, pad_token_id=256, greedy=True), 1)
        eos = probe[0][0].completion_ids[3]
        params = SamplingParams(max_new_tokens=args.new_tokens, pad_token_id=256, greedy=True, eos_token_id=eos)
        result[f"{name}_sglang"] = [g[0].completion_ids for g in backend.generate(rows, params, 1)]
        result[f"{name}_embedded"] = [g[0].completion_ids for g in embedded.generate(rows, params, 1)]
        result[f"{name}_parity"] = parity(rows, result[f"{name}_sglang"], result[f"{name}_embedded"], engine)

    def mismatch() -> float:
        """max |engine - trainer| logprob over sampled completions (2 per prompt)."""
        rollouts = [r for g in backend.generate(PROMPTS, SamplingParams(temperature=0.8, max_new_tokens=10,
                                                                      pad_token_id=256), 2) for r in g]
        batch = [Sample(r.prompt_ids, r.completion_ids, 0, logprobs=r.logprobs, trainable=True) for r in rollouts]
        layout = padded_layout(batch, 2, pad_id=256)
        worst, total, count = 0.0, 0.0, 0.0
        for mb, lp in zip(layout.microbatches, engine.compute_logprobs(layout.microbatches, 0.8)):
            mask = mb["completion_mask"].to(lp.device)
            diff = (mb["rollout_logprobs"].to(lp.device).float() - lp.float()).abs() * mask
            worst, total, count = max(worst, diff.max().item()), total + diff.sum().item(), count + mask.sum().item()
        result["sampled_rows"] = len(rollouts)
        result["sampled_logprob_mean_abs_diff"] = total / max(count, 1.0)
        return worst

    greedy("start")
    result["probe_start"] = backend.probe()
    result["sampled_logprob_max_abs_diff"] = mismatch()
    g = torch.Generator().manual_seed(0)
    result["probes_stale"], result["syncs"] = [], []
    for k in range(args.syncs):
        for _ in range(2):  # the policy moves
            ids = torch.randint(0, 250, (4, 16), generator=g)
            engine.train_step([{"input_ids": ids[:2]}, {"input_ids": ids[2:]}],
                              lambda lp, b: (-lp[:, :-1].sum(), torch.tensor(lp[:, :-1].numel()), {}))
        result["probes_stale"].append(backend.probe())
        backend.sleep()
        backend.wake()
        stats = backend.sync_weights(weights)
        result["syncs"].append({"method": stats.method, "tensors": stats.tensors, "bytes": stats.bytes,
                                "seconds": stats.seconds, "probe": stats.probe_max_diff})
        if k < args.syncs - 1:
            greedy(f"synced_{k + 1}")
    result["probe_stale"], result["sync"] = result["probes_stale"][0], result["syncs"][-1]
    greedy("synced")
    result["episodes"] = greedy_episodes(backend, embedded, tokenizer, weights)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    backend.close()
    dist.barrier()


def greedy_episodes(backend, embedded, tokenizer, weights) -> dict:  # noqa: ANN001
    """Greedy episodes of the example environment ``guess_number``: SGLang's request chains, SGLang turn by turn (each
    turn one generate of every going episode's history), SGLang in pieces of 4 tokens with the same weights synced
    again between every two (partial rollouts interrupted by a push that changes nothing) and the embedded backend;
    tokens, masks and turns."""
    import oumi_megatron.examples.guess_number_environment  # noqa: F401 - registers guess_number
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.environments.registry import build_environment
    from oumi_megatron.environments.runner import EnvironmentRunner
    from oumi_megatron.rollout.sampling import SamplingParams

    class GenerateOnly:  # SGLang seen through generate alone: turn by turn
        def generate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return backend.generate(*args, **kwargs)

    class PiecesSynced(GenerateOnly):
        calls = 0

        def generate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if self.calls:
                backend.sync_weights(weights)
            self.calls += 1
            return backend.generate(*args, **kwargs)

    greedy = SamplingParams(temperature=1.0, greedy=True, max_new_tokens=120, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=256)
    rows = [{"prompt": str(q), "extra_info": {"secret": 50}} for q in PROMPTS]
    out = {}
    for name, engine, chunk in (("sglang", backend, None), ("sglang_turn_by_turn", GenerateOnly(), None),
                                ("sglang_pieces_synced", PiecesSynced(), 4), ("embedded", embedded, None)):
        env = EnvironmentRunner(build_environment("guess_number"), timeout_s=30)
        samples, stats = run_episodes(engine, tokenizer, env, PROMPTS, rows, greedy, 1, max_turns=3,
                                      max_observation_tokens=16, max_turn_tokens=6, chunk=chunk)
        out[name] = {"tokens": [s.completion_ids for s in samples], "masks": [s.loss_mask for s in samples],
                     "turns": [s.turns for s in samples], "observation_tokens": stats.observation_tokens}
        if chunk:
            out["pieces_synced_calls"] = engine.calls
    return out


if __name__ == "__main__":
    main()
