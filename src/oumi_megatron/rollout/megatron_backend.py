"""The embedded rollout backend: batched sampling from the policy's own Megatron-Core model.

No copy of the weights and no extra process: generation calls the same model chunks the optimizer
updates, so it works under every TP/PP/VPP/CP/EP layout (every rank of a model replica takes part; tokens
are drawn from a generator seeded identically on each of them, so all agree). Prompts are left-padded and
masked. Three paths (``path``):

- ``static`` (default): rollout/decoding/, a static KV cache with the decode position on the device, each
  distinct prompt prefilled once, sampling and bookkeeping on the device, decode steps replayed as a CUDA
  graph where they can be (``megatron.rollout_cuda_graphs``). Models it does not cover (decoding/policy_stages.py
  ``unsupported_reason``) take ``schedule``, and the log says why.
- ``schedule``: each token through Megatron-Core's forward-only pipeline schedule with its
  ``StaticInferenceContext`` (the prompt once, then the newest token against the cached keys/values); the
  logits and tokens visit the host every token. The reference the static path is tested against.
- ``recompute``: the whole prefix again for every token, no cache (the reference of the cache itself).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from oumi_megatron.rollout.base import DecodeProfile, EngineSleep, EpisodeRun, PolicyWeights, Rollout, TurnHandler, WeightSyncStats
from oumi_megatron.rollout.decoding.decoder import GenerationStats, StaticCacheDecoder, generated_tokens
from oumi_megatron.rollout.decoding.episodes import run_episodes as decode_episodes
from oumi_megatron.rollout.decoding.generation_mode import forward_peers_done, last_token_logits, new_kv_cache
from oumi_megatron.rollout.decoding.padding import left_pad, positions_and_mask
from oumi_megatron.rollout.sampling import SamplingParams, end_token_tensor, first_end, pick_tokens
from oumi_megatron.rollout.turns import turn_by_turn

if TYPE_CHECKING:
    from oumi_megatron.engine.engine import MegatronEngine

logger = logging.getLogger("oumi")

PATHS = ("static", "schedule", "recompute")


class MegatronRolloutBackend:
    """Generate with ``engine.model``; ``vocab_size`` is the tokenizer's (Megatron may pad the vocab)."""

    def __init__(self, engine: MegatronEngine, vocab_size: int, seed: int = 0, path: str = "static",
                 cuda_graphs: str = "auto", cuda_graphs_kept: int = 1, decode_kernels: str = "auto") -> None:
        if path not in PATHS:
            raise ValueError(f"MegatronRolloutBackend: path must be one of {PATHS}, got {path!r}")
        self.engine = engine
        self.vocab_size = vocab_size
        # on the model's device: the draw happens where the logits are, the same on every rank for a seed
        self.generator = torch.Generator(device=engine.device).manual_seed(seed)
        self.decoder: StaticCacheDecoder | None = None
        self.decoder_unsupported: str | None = None
        """What of the model the static-cache decoder does not cover, when it fell back to the schedule path."""
        if path == "static":
            decoder = StaticCacheDecoder(engine, vocab_size, cuda_graphs, graphs_kept=cuda_graphs_kept,
                                         decode_kernels=decode_kernels)
            self.decoder_unsupported = decoder.stages.unsupported_reason()
            if self.decoder_unsupported is None:
                self.decoder = decoder
            else:
                path = "schedule"
                logger.info("rollout: Megatron-Core's schedule path (the static-cache decoder does not cover %s)",
                            self.decoder_unsupported)
        self.path = path
        if self.decoder is not None:
            logger.info("rollout: %s", self.decoder.path)
        self.episode_observations = "appended"
        """How the static path's episodes write observations into the cache (decoding/episodes.py ``OBSERVATIONS``): one
        append forward per look, or ``forced`` (one decode step per token: the reference the tests and the benchmark
        compare with)."""
        self._last_stats: GenerationStats | None = None
        self._merged = False  # inside ``_rollout_weights``
        self.decoder_seconds = {"decode": 0.0, "prefill": 0.0, "graph_capture": 0.0}
        """Seconds since start, over every call: the decoder's prefill and decode loops (``decode``), and of them the
        prefills and the CUDA-graph captures (the step profile's ``time/<key>_s``: the collector reads their growth)."""

    @property
    def last_stats(self) -> GenerationStats | None:
        """The last ``generate`` call's (or episode turn's) path, tokens, prefill and decode times (the trainer logs them)."""
        return self._last_stats

    @last_stats.setter
    def last_stats(self, stats: GenerationStats | None) -> None:
        self._last_stats = stats
        if stats is not None:
            for key, seconds in (("decode", stats.prefill_s + stats.decode_s), ("prefill", stats.prefill_s),
                                 ("graph_capture", stats.capture_s)):
                self.decoder_seconds[key] += seconds

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        """``n`` completions per prompt, grouped per prompt. One sequence per batch row: each prompt takes
        ``n`` adjacent rows (the draw depends on the rows, so the same prompts, n and seed give the same rollouts)."""
        if seed is not None:
            self.generator.manual_seed(seed)
        rows = len(prompts) * n
        if params.max_new_tokens == 0 or rows == 0:
            tokens, logprobs = torch.zeros(rows, 0, dtype=torch.long), torch.zeros(rows, 0)
        elif self.decoder is not None:
            with self._rollout_weights():
                tokens, logprobs, self.last_stats = self.decoder.generate(prompts, n, params, self.generator)
        else:
            started = time.perf_counter()
            with self._rollout_weights():
                tokens, logprobs = self._generate_per_token([p for p in prompts for _ in range(n)], params)
            self.last_stats = GenerationStats(path=self.path, tokens=generated_tokens(tokens, params), prefill_s=0.0,
                                              decode_steps=tokens.shape[1], decode_s=time.perf_counter() - started)
        out = _rollouts(tokens, logprobs, [prompts[i // n] for i in range(rows)], params)
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def run_episodes(self, prompts: list[list[int]], params: SamplingParams, n: int, turns: TurnHandler, budget: int,
                     max_turns: int, seed: int | None = None) -> EpisodeRun:
        """Multi-turn episodes without a turn barrier on the static cache (decoding/episodes.py): each row takes its
        next turn as soon as its observation is ready, the observation written into the cache in one forward. One-turn
        episodes are a plain ``generate``; the ``schedule`` and ``recompute`` paths take turn by turn (rollout/turns.py:
        each later turn's history, observation included, runs in the prompt's one forward)."""
        if self.decoder is None or max_turns <= 1 or params.max_new_tokens == 0 or not prompts:
            with self._rollout_weights():  # once for every turn's generate
                run = turn_by_turn(self, prompts, params, n, turns, seed)
            run.decode_steps = self.last_stats.decode_steps + 1 if self.last_stats is not None and max_turns <= 1 else 0
            return run
        if seed is not None:
            self.generator.manual_seed(seed)
        with self._rollout_weights():
            run, self.last_stats = decode_episodes(self.decoder, prompts, n, params, self.generator, turns, budget,
                                                   self.episode_observations)
        return run

    @contextlib.contextmanager
    def _rollout_weights(self) -> Iterator[None]:
        """The weights a rollout decodes from: under LoRA with ``megatron.lora_sync: merged`` the adapters folded into
        the base for the block (engine/peft.py ``adapters_merged``: one GEMM a projection, the base restored
        bit-exactly after), otherwise the model as it is. Reentrant (a turn-by-turn rollout nests generations);
        collective over TP."""
        engine = self.engine
        if engine.peft is None or engine.params.lora_sync != "merged" or self._merged:
            yield
            return
        from oumi_megatron.engine.peft import adapters_merged

        self._merged = True
        try:
            with adapters_merged(engine.peft, engine.model):
                yield
        finally:
            self._merged = False

    def _generate_per_token(self, expanded: list[list[int]], params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``schedule`` and ``recompute`` paths: tokens [rows, T] and their logprobs, on the host."""
        ids, real = left_pad(expanded, params.pad_token_id)
        finished = torch.zeros(len(expanded), dtype=torch.bool)
        ends = end_token_tensor(params)
        new_tokens: list[torch.Tensor] = []
        new_logprobs: list[torch.Tensor] = []
        cache = new_kv_cache(len(expanded), ids.shape[1] + params.max_new_tokens) if self.path == "schedule" else None
        for step in range(params.max_new_tokens):
            if cache is not None and step > 0:  # only the newest token, against the cached ones
                ids_in, positions, mask = ids[:, -1:], (real.long().sum(-1, keepdim=True) - 1).clamp(min=0), (~real)[:, None, None, :]
            else:
                ids_in, (positions, mask) = ids, positions_and_mask(real)
            full = last_token_logits(self.engine, ids_in, positions, mask, cache)
            nxt, logprob = pick_tokens(full, params, self.vocab_size, self.generator)
            nxt, logprob = nxt.cpu(), logprob.cpu()
            nxt = torch.where(finished, torch.full_like(nxt, params.pad_token_id), nxt)
            new_tokens.append(nxt)
            new_logprobs.append(logprob)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            real = torch.cat([real, ~finished[:, None]], dim=1)
            if ends is not None:
                finished |= torch.isin(nxt, ends)
            if forward_peers_done(self.engine, bool(finished.all())):  # under EP, when every expert peer is done too
                break
        return torch.stack(new_tokens, dim=1), torch.stack(new_logprobs, dim=1)

    def sync_weights(self, weights: PolicyWeights) -> WeightSyncStats | None:
        """Nothing to sync: generation reads the weights the optimizer just updated."""
        return None

    def wake(self) -> float:
        """The policy's own weights: nothing sleeps."""
        return 0.0

    def sleep(self) -> EngineSleep:
        return EngineSleep()

    def engine_metrics(self) -> dict[str, float]:
        return {}  # the policy generates itself: no link, no engine to restart

    def decode_profile(self) -> DecodeProfile:
        last = self.last_stats
        return DecodeProfile(dict(self.decoder_seconds), None if last is None else last.decode_ms_per_step,
                             self.path if last is None else last.path)

    def close(self) -> None:
        pass


def _rollouts(tokens: torch.Tensor, logprobs: torch.Tensor, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
    """One ``Rollout`` per row of ``tokens`` [rows, T]: its tokens up to and including its first EOS (or stop token)."""
    out = []
    for i, prompt in enumerate(prompts):
        toks = tokens[i].tolist()
        end = first_end(toks, params)
        done = end is not None
        if end is not None:
            toks = toks[: end + 1]
        out.append(Rollout(prompt_ids=list(prompt), completion_ids=toks, finished=done,
                           logprobs=logprobs[i, : len(toks)].tolist()))
    return out
