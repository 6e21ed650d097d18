"""The embedded rollout backend with and without its KV cache, under one layout.

    python tests/workers/generation_worker.py CKPT OUT.json [--hf HF_DIR] [--tp 2 | --pp 2 --vpp 2] (torchrun for 2)

Left-padded prompts of different lengths. Records (rank 0):
- the max abs difference of last-token logits, KV cache vs re-running the prefix, over greedy steps;
- greedy tokens with the cache (to compare across layouts and with transformers' generate, --hf);
- sampled completions (same seed) with and without the cache, with an EOS that ends some rows early;
- the static-cache path (rollout/decoding/) against Megatron-Core's schedule path: greedy tokens of 64
  prompts of mixed lengths with an EOS, their logprobs, a sampled run twice with one seed, and a GRPO-style
  batch (16 prompts x 4 completions) whose groups share one prefill against one prefill per row;
- stop tokens (``SamplingParams.stop_token_ids``) on both paths: the greedy runs cut at each row's first EOS or stop.
"""

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 11], [8, 8, 8, 8, 8, 8, 8, 8, 120, 64, 1], [77, 31, 200, 9, 14, 2, 150]]
NEW_TOKENS = 12


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--hf", default="")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=0)
    args = p.parse_args(argv)

    import torch.distributed as dist

    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.rollout.decoding.generation_mode import last_token_logits, new_kv_cache
    from oumi_megatron.rollout.decoding.padding import left_padded_batch
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend
    from oumi_megatron.rollout.sampling import SamplingParams

    params = MegatronParams(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                            virtual_pipeline_model_parallel_size=args.vpp or None)
    params.transformer_config.recompute_granularity = None
    _, engine = build_engine(args.ckpt, engine_layout(params), params, OptimSettings(), dtype=torch.float32)
    vocab = 259

    # Logits, step by step: cache vs whole prefix, greedy
    ids, positions, mask = left_padded_batch(PROMPTS, pad_id=256)
    lengths = torch.tensor([len(q) for q in PROMPTS])
    pads = ids.shape[1] - lengths  # every row grows by one real token per step: its padding stays the same
    cache = new_kv_cache(len(PROMPTS), ids.shape[1] + NEW_TOKENS)
    cached = last_token_logits(engine, ids, positions, mask, cache)
    worst = 0.0
    greedy = []
    for step in range(NEW_TOKENS):
        full = last_token_logits(engine, ids, positions, mask)
        worst = max(worst, (full - cached).abs().max().item())
        nxt = cached[:, :vocab].argmax(-1).cpu()
        greedy.append(nxt)
        ids, positions, mask = left_padded_batch([row[pad:].tolist() + [t] for row, pad, t in zip(ids, pads.tolist(), nxt.tolist())], 256)
        if step < NEW_TOKENS - 1:
            decode_mask = mask[:, :, -1:, :]  # the newest token's row: its prefix, without the padding
            cached = last_token_logits(engine, ids[:, -1:], positions[:, -1:], decode_mask, cache)
    greedy_tokens = torch.stack(greedy, 1)

    # Sampling through the backend, same seed, with and without the cache
    probe = MegatronRolloutBackend(engine, vocab, seed=1, path="recompute")
    first = probe.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, pad_token_id=256), 2)
    eos = first[0][0].completion_ids[3]  # a token row 0 samples at step 4 (same seed below): rows end early
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, pad_token_id=256, eos_token_id=eos)
    runs = {}
    for kv in (False, True):
        backend = MegatronRolloutBackend(engine, vocab, seed=1, path="schedule" if kv else "recompute")
        runs[kv] = [r.completion_ids for group in backend.generate(PROMPTS, sampling, 2) for r in group]
    static = static_path_checks(engine, vocab)

    result = {
        "logits_max_abs_diff": worst,
        "greedy_tokens": greedy_tokens.tolist(),
        "sampled_no_cache": runs[False],
        "sampled_kv_cache": runs[True],
        "rows_ended_early": sum(1 for c in runs[True] if c and c[-1] == eos and len(c) < NEW_TOKENS),
        **static,
    }
    if args.hf and dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.hf, torch_dtype=torch.float32)
        hf_tokens = []
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=256, suppress_tokens=list(range(vocab, model.config.vocab_size)))
            hf_tokens.append(out[0, len(prompt):].tolist())
        result["hf_greedy_tokens"] = hf_tokens
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()


def static_path_checks(engine, vocab: int) -> dict:  # noqa: ANN001
    """The static-cache decoder against the schedule path, greedy with an EOS, and its own reproducibility."""
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend
    from oumi_megatron.rollout.sampling import SamplingParams

    rng = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (int(torch.randint(1, 14, (1,), generator=rng)),), generator=rng).tolist()
               for _ in range(64)]
    new = 16
    schedule = MegatronRolloutBackend(engine, vocab, path="schedule")
    static = MegatronRolloutBackend(engine, vocab, path="static")
    probe = schedule.generate(prompts, SamplingParams(max_new_tokens=new, pad_token_id=256, greedy=True), 1)
    # an EOS that some rows produce early: the most common token at step 3 of the probe
    eos = int(torch.tensor([g[0].completion_ids[2] for g in probe]).mode().values)
    greedy = SamplingParams(max_new_tokens=new, pad_token_id=256, greedy=True, eos_token_id=eos)
    ref = [g[0] for g in schedule.generate(prompts, greedy, 1)]
    got = [g[0] for g in static.generate(prompts, greedy, 1)]
    # GRPO shape: 16 prompts x 4 completions, the groups sharing their prompt's prefill, vs one prefill per row
    sampled = SamplingParams(max_new_tokens=new, pad_token_id=256, eos_token_id=eos, temperature=0.9, top_p=0.95)
    grouped = [[r.completion_ids for r in g] for g in static.generate(prompts[:16], greedy, 4)]
    per_row = [[g[0].completion_ids for g in static.generate([p for p in prompts[:16] for _ in range(4)], greedy, 1)][i * 4:(i + 1) * 4]
               for i in range(16)]
    draws, capture_s = [], []
    for _ in range(2):  # on CUDA the second replays the graph the first captured and kept (rollout_cuda_graphs_kept)
        draws.append([[r.completion_ids for r in g] for g in static.generate(prompts[:16], sampled, 4, seed=11)])
        capture_s.append(static.last_stats.capture_s if static.last_stats else -1.0)
    fresh = MegatronRolloutBackend(engine, vocab, path="static", cuda_graphs_kept=0)  # captures in every call
    fresh_draws = [[r.completion_ids for r in g] for g in fresh.generate(prompts[:16], sampled, 4, seed=11)]
    # other prompts of the same shape: the kept prefill and decode graphs replayed on the refilled buffers (on CUDA)
    other = [[r.completion_ids for r in g] for g in static.generate(prompts[16:32], sampled, 4, seed=12)]
    other_capture_s = static.last_stats.capture_s if static.last_stats else -1.0
    other_fresh = [[r.completion_ids for r in g] for g in fresh.generate(prompts[16:32], sampled, 4, seed=12)]
    continued = episode_checks(static, schedule, prompts[:8], eos)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:  # the runner's replica group is a real run's, not here
        continued.update(background_checks(static, prompts[:8], eos))
    # stop tokens (an environment's stop_strings) end rows as EOS does: the runs cut at each row's first end token
    ends_at_5 = [g[0].completion_ids[4] for g in probe if eos not in g[0].completion_ids[:5]]
    stop = int(torch.tensor([t for t in ends_at_5 if t != eos]).mode().values)
    stopping = replace(greedy, stop_token_ids=(stop,))
    stopped = {name: [g[0] for g in backend.generate(prompts, stopping, 1)] for name, backend in
               (("static", static), ("schedule", schedule))}

    def cut(ids: list[int]) -> list[int]:
        end = next((i for i, t in enumerate(ids) if t in (eos, stop)), None)
        return ids if end is None else ids[:end + 1]

    if torch.cuda.is_available():  # 150 tokens: a graph over the whole cache against eager steps over the slots written
        long = SamplingParams(max_new_tokens=150, pad_token_id=256, greedy=True)
        eager = MegatronRolloutBackend(engine, vocab, path="static", cuda_graphs="false")
        by_path = {name: [g[0] for g in backend.generate(prompts[:16], long, 1)] for name, backend in
                   (("graphs", static), ("eager", eager))}
        continued["long_graphs_tokens_equal"] = ([r.completion_ids for r in by_path["graphs"]]
                                                 == [r.completion_ids for r in by_path["eager"]])
        continued["long_graphs_logprob_max_abs_diff"] = max(abs(a - b) for x, y in zip(by_path["graphs"], by_path["eager"])
                                                            for a, b in zip(x.logprobs, y.logprobs))
    return {
        **continued,
        "stop_tokens_cut_static": [r.completion_ids for r in stopped["static"]] == [cut(r.completion_ids) for r in got],
        "stop_tokens_cut_schedule": [r.completion_ids for r in stopped["schedule"]] == [cut(r.completion_ids) for r in ref],
        "stop_tokens_rows": sum(1 for r in stopped["static"] if r.finished and r.completion_ids[-1] == stop),
        "static_path": static.path,
        "static_decoder": static.last_stats.path if static.last_stats else None,  # graphs or eager steps, and why
        "static_greedy_tokens": [r.completion_ids for r in got],
        "schedule_greedy_tokens": [r.completion_ids for r in ref],
        "static_rows_ended_early": sum(1 for r in got if r.finished and len(r.completion_ids) < new),
        "static_logprob_max_abs_diff": max(abs(a - b) for x, y in zip(got, ref) for a, b in zip(x.logprobs, y.logprobs)),
        "static_grouped_tokens": grouped,
        "static_per_row_tokens": per_row,
        "static_sampled_runs": draws,
        "static_sampled_capture_s": capture_s,
        "static_sampled_fresh_capture": fresh_draws,
        "static_other_prompts_equal_fresh": other == other_fresh,
        "static_other_prompts_capture_s": other_capture_s,
        "static_sampled_distinct_in_groups": sum(len({tuple(c) for c in g}) for g in draws[0]),
        "static_stats_tokens": static.last_stats.tokens if static.last_stats else -1,
    }


class ScriptedTurns:
    """A TurnHandler (rollout/base.py) whose answers depend only on the row, its turn count and its tokens so far:
    rows end at different turns (some at their first), observations of 1-3 ids, rooms of 5-8 tokens within a budget, so
    the same greedy episodes come out of any backend that runs them faithfully."""

    def __init__(self, rows: int, budget: int) -> None:
        self.budget, self.ids, self.mask = budget, [[] for _ in range(rows)], [[] for _ in range(rows)]
        self.turns = [0] * rows
        self.background = False

    def turns_ended(self, ends):  # noqa: ANN001, ANN201
        from oumi_megatron.rollout.base import NextTurn

        out = []
        for end in ends:
            r = end.row
            self.ids[r] += end.ids
            self.mask[r] += [1] * len(end.ids)
            self.turns[r] += 1
            block = [100 + r % 7, 101, 102 + self.turns[r]][: 1 + (r + self.turns[r]) % 3]
            left = self.budget - len(self.ids[r]) - len(block)
            if (r + self.turns[r]) % 5 == 0 or self.turns[r] >= 3 or left < 2:
                out.append(None)
                continue
            self.ids[r] += block
            self.mask[r] += [0] * len(block)
            out.append(NextTurn(block, min(left, 5 + r % 4)))
        return out

    def answered(self, wait):  # noqa: ANN001, ANN201 - every turn is answered at once
        return []


def episode_checks(static, schedule, prompts: list[list[int]], eos: int,  # noqa: ANN001
                   references: tuple[str, ...] = ("forced", "reference_static", "reference_schedule")) -> dict:
    """Multi-turn episodes without a turn barrier (rollout/decoding/episodes.py): 8 prompts x 2 rows, up to three
    turns, observations appended in one forward per look while other rows decode, against the same decoder feeding
    them as forced tokens (one decode step per token, the path before appends) and the turn-synchronous reference
    (rollout/turns.py: each turn a ``generate`` of every going row's whole history) on the static path and on the
    schedule path (greedy): the same episodes (ids, masks, turns); logprobs against each other and against the
    trainer's recomputation of the whole sequences (``compute_logprobs``); the decode steps and append forwards.
    ``references``: those of the three to run (each costs a batch of episodes)."""
    from oumi_megatron.rollout.decoding.episodes import episode_check_every
    from oumi_megatron.rollout.sampling import SamplingParams
    from oumi_megatron.rollout.turns import turn_by_turn

    greedy = SamplingParams(max_new_tokens=6, pad_token_id=256, greedy=True, eos_token_id=eos)
    budget = 30

    def forced(h):  # noqa: ANN001, ANN202
        static.episode_observations = "forced"
        try:
            return static.run_episodes(prompts, greedy, 2, h, budget, 3)
        finally:
            static.episode_observations = "appended"

    runs = {}
    paths = {"appended": lambda h: static.run_episodes(prompts, greedy, 2, h, budget, 3), "forced": forced,
             "reference_static": lambda h: turn_by_turn(static, prompts, greedy, 2, h),
             "reference_schedule": lambda h: turn_by_turn(schedule, prompts, greedy, 2, h)}
    for name, go in ((name, paths[name]) for name in ("appended", *references)):
        handler = Recorder(ScriptedTurns(len(prompts) * 2, budget))
        engine = go(handler)
        stats = static.last_stats
        runs[name] = {"ids": handler.inner.ids, "mask": handler.inner.mask, "turns": handler.inner.turns,
                      "logprobs": handler.logprobs, "decode_steps": engine.decode_steps,
                      "append_forwards": engine.append_forwards, "path": stats.path, "capture_s": stats.capture_s,
                      "stats_append_forwards": stats.append_forwards, "stats_decode_steps": stats.decode_steps}
    native = runs["appended"]
    worst = max(abs(a - b) for ref in references for x, y in zip(native["logprobs"], runs[ref]["logprobs"])
                for a, b in zip(x, y))
    # sampled episodes (temperature 0.8): other tokens than greedy, their logprobs as the trainer recomputes them too
    sampled = Recorder(ScriptedTurns(len(prompts) * 2, budget))
    static.run_episodes(prompts, replace(greedy, greedy=False, temperature=0.8), 2, sampled, budget, 3, seed=5)
    return {"episodes_same_tokens": [native[key] == runs[r][key] for r in references for key in ("ids", "mask", "turns")],
            "episodes_turns": native["turns"], "episodes_logprob_max_abs_diff": worst,
            "episodes_trainer_logprob_max_abs_diff": trainer_gap(static.engine, prompts, native),
            "episodes_sampled_trainer_logprob_max_abs_diff": trainer_gap(
                static.engine, prompts, {"ids": sampled.inner.ids, "mask": sampled.inner.mask,
                                         "logprobs": sampled.logprobs}, temperature=0.8),
            "episodes_sampled_differ": sampled.inner.ids != native["ids"],
            "episodes_observation_tokens": sum(m.count(0) for m in native["mask"]),
            "episodes_decode_steps": native["decode_steps"], "episodes_append_forwards": native["append_forwards"],
            "episodes_stats_agree": native["stats_append_forwards"] == native["append_forwards"]
                                    and native["stats_decode_steps"] == native["decode_steps"],
            "episodes_forced_decode_steps": runs.get("forced", {}).get("decode_steps"),
            "episodes_forced_append_forwards": runs.get("forced", {}).get("append_forwards"),
            "episodes_critical_path": max(len(ids) for ids in native["ids"]),
            # the fewest decode steps with appends: a row's sampled tokens less one per turn (the prefill or an append
            # samples each turn's first)
            "episodes_policy_path": max(sum(m) - t for m, t in zip(native["mask"], native["turns"], strict=True)),
            "episodes_path": native["path"], "episodes_forced_path": runs.get("forced", {}).get("path"),
            "episodes_capture_s": native["capture_s"],
            "episodes_check_every": episode_check_every(static.engine.device)}


def trainer_gap(engine, prompts: list[list[int]], run: dict, temperature: float = 1.0) -> float:  # noqa: ANN001
    """The largest difference between ``run``'s episode logprobs (``n`` = 2 rows per prompt) and the trainer's
    (``compute_logprobs``) of the same whole sequences at the policy's tokens (one microbatch per row)."""
    rows = [torch.tensor([prompts[k // 2] + ids]) for k, ids in enumerate(run["ids"])]
    recomputed = engine.compute_logprobs([{"input_ids": row} for row in rows], temperature=temperature)
    worst = 0.0
    for k, (mask, logprobs) in enumerate(zip(run["mask"], run["logprobs"], strict=True)):
        start = len(prompts[k // 2])
        at = [start + i - 1 for i, m in enumerate(mask) if m]  # logprobs[t]: of token t + 1
        assert len(at) == len(logprobs), (k, len(at), len(logprobs))
        worst = max([worst, *(abs(recomputed[k][0, t].item() - lp) for t, lp in zip(at, logprobs))])
    return worst


class Gated:
    """An environment whose first answer to episode 0 comes only once another episode has taken its second turn: a
    decoder that waited for that answer before going on would never get there (the call then fails at its deadline)."""

    def __init__(self, gated: bool, delay: float = 0.0) -> None:
        import threading

        self.gated, self.delay, self.release = gated, delay, threading.Event()

    def start(self, row: dict) -> dict:
        return {"k": row["k"], "turns": 0}

    def step(self, state: dict, turn_text: str, turn_ids: list[int]):  # noqa: ANN201
        from oumi_megatron.environments.base import EpisodeEnd, Observation

        state["turns"] += 1
        if state["k"] != 0 and state["turns"] == 2:
            self.release.set()
        if state["k"] == 0 and state["turns"] == 1 and self.gated:
            self.release.wait(60)
        if state["k"] == 0 and state["turns"] == 1:
            time.sleep(self.delay)  # every other episode is over long before: episode 0 takes its turns after theirs
        return EpisodeEnd() if state["turns"] >= 3 else Observation(f"result {state['k']}")


def background_checks(static, prompts: list[list[int]], eos: int) -> dict:  # noqa: ANN001
    """grpo.environment_workers on the decoder without a barrier: greedy episodes whose environment answers episode 0's
    first turn only after another episode took its second turn, answered in the background, equal those of an
    environment that answers at once, in line; none failed (in line, the gated call would hold every row until its
    deadline); nor do those of an environment that answers episode 0's first turn after every other episode is over
    (a row that waits takes no cache slot)."""
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.environments.runner import EnvironmentRunner
    from oumi_megatron.examples.tiny_models import build_byte_tokenizer
    from oumi_megatron.rollout.sampling import SamplingParams

    tokenizer = build_byte_tokenizer()
    greedy = SamplingParams(max_new_tokens=60, pad_token_id=256, greedy=True, eos_token_id=eos)
    out = {}
    for name, gated, workers, delay in (("in_line", False, 0, 0.0), ("background", True, 2, 0.0), ("late", False, 2, 3.0)):
        env = Gated(gated, delay)
        samples, _ = run_episodes(static, tokenizer, EnvironmentRunner(env, 20.0, workers=workers), prompts,
                                  [{"k": k} for k in range(len(prompts))], greedy, 1, max_turns=3, max_turn_tokens=6)
        out[name] = {"ids": [r.completion_ids for r in samples], "turns": [r.turns for r in samples],
                     "failed": {k: r.failure for k, r in enumerate(samples) if r.failed}}
    return {"background_same_episodes": out["background"]["ids"] == out["in_line"]["ids"],
            "late_same_episodes": out["late"]["ids"] == out["in_line"]["ids"], "late_failed": list(out["late"]["failed"]),
            "background_turns": out["background"]["turns"], "background_failed": list(out["background"]["failed"])}


class Recorder:
    """A TurnHandler that keeps each row's sampled logprobs in order and passes the turns on."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.logprobs = inner, [[] for _ in inner.ids]
        self.background = inner.background

    def turns_ended(self, ends):  # noqa: ANN001, ANN201
        for end in ends:
            self.logprobs[end.row] += end.logprobs
        return self.inner.turns_ended(ends)

    def answered(self, wait):  # noqa: ANN001, ANN201
        return self.inner.answered(wait)


if __name__ == "__main__":
    import jobs

    jobs.run(main)
