"""The embedded rollout backend: batched sampling from the policy's own Megatron-Core model.

No copy of the weights and no extra process: generation calls the same model chunks the optimizer
updates, through Megatron-Core's forward-only schedule, so it works under every TP/PP/VPP layout
(every rank of a model replica takes part; tokens are drawn from a generator seeded identically on
each of them, so all agree). Prompts are left-padded and masked.

KV cache: a Megatron-Core ``StaticInferenceContext`` per batch. The prompt is run once (prefill),
then each step runs only the new token against the cached keys/values, with a [b, 1, 1, S] mask that
hides each row's left padding (and the pad tokens of rows that already ended). Rotary positions are
the cache slots, so a left-padded row is shifted by a constant, which RoPE (relative) ignores.
``kv_cache=False`` re-runs the whole prefix per token (the reference the tests compare against).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from oumi_megatron.rollout.base import PolicyWeights, Rollout, WeightSyncStats
from oumi_megatron.rollout.sampling import SamplingParams, sample

if TYPE_CHECKING:
    from oumi_megatron.engine.engine import MegatronEngine


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, L] left-padded with ``pad_id``, and where the real tokens are (pad may be a real token too)."""
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    real = torch.zeros((len(prompts), length), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, length - len(p):] = torch.tensor(p, dtype=torch.long)
        real[i, length - len(p):] = True
    return ids, real


def left_padded_batch(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, L], position ids (0 at each row's first real token) and a [B, 1, L, L] mask
    (True = may not attend) combining causality with the left padding."""
    ids, real = _left_pad(prompts, pad_id)
    return ids, *_positions_and_mask(real)


def _positions_and_mask(real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions = (real.long().cumsum(dim=-1) - 1).clamp(min=0)
    length = real.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = causal[None] & real[:, None, :]
    # a padding row attends to itself only (its output is never used), so softmax has no empty row
    allowed |= torch.eye(length, dtype=torch.bool)[None] & ~real[:, :, None]
    return positions, ~allowed[:, None]


class MegatronRolloutBackend:
    """Generate with ``engine.model``; ``vocab_size`` is the tokenizer's (Megatron may pad the vocab)."""

    def __init__(self, engine: MegatronEngine, vocab_size: int, seed: int = 0, kv_cache: bool = True) -> None:
        self.engine = engine
        self.vocab_size = vocab_size
        # on the model's device: sampling reads the logits where they are (a [rows, vocab] copy to the
        # host per token, and a host multinomial over it, cost 2/3 of the rollout time on an H200)
        self.generator = torch.Generator(device=engine.device).manual_seed(seed)
        self.kv_cache = kv_cache

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        """``n`` completions per prompt, grouped per prompt. One sequence per batch row: each prompt takes
        ``n`` adjacent rows (the draw depends on the rows, so the same prompts, n and seed give the same rollouts)."""
        if seed is not None:
            self.generator.manual_seed(seed)
        expanded = [p for p in prompts for _ in range(n)]
        ids, real = _left_pad(expanded, params.pad_token_id)
        finished = torch.zeros(len(expanded), dtype=torch.bool)
        new_tokens: list[torch.Tensor] = []
        new_logprobs: list[torch.Tensor] = []
        cache = self.engine.new_kv_cache(len(expanded), ids.shape[1] + params.max_new_tokens) if self.kv_cache else None
        for step in range(params.max_new_tokens):
            if cache is not None and step > 0:  # only the newest token, against the cached ones
                ids_in, positions, mask = ids[:, -1:], (real.long().sum(-1, keepdim=True) - 1).clamp(min=0), (~real)[:, None, None, :]
            else:
                ids_in, (positions, mask) = ids, _positions_and_mask(real)
            full = self.engine.last_token_logits(ids_in, positions, mask, cache)
            nxt = sample(full[:, : self.vocab_size], params, self.generator)
            logprob = torch.log_softmax(full.float() / params.temperature, dim=-1).gather(1, nxt[:, None])[:, 0]
            nxt, logprob = nxt.cpu(), logprob.cpu()
            nxt = torch.where(finished, torch.full_like(nxt, params.pad_token_id), nxt)
            new_tokens.append(nxt)
            new_logprobs.append(logprob)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            real = torch.cat([real, ~finished[:, None]], dim=1)
            if params.eos_token_id is not None:
                finished |= nxt == params.eos_token_id
            if self.engine.forward_peers_done(bool(finished.all())):  # under EP, when every expert peer is done too
                break
        generated = torch.stack(new_tokens, dim=1) if new_tokens else torch.zeros(len(expanded), 0, dtype=torch.long)
        logprobs = torch.stack(new_logprobs, dim=1) if new_logprobs else torch.zeros(len(expanded), 0)
        out = []
        for i, p in enumerate(expanded):
            toks = generated[i].tolist()
            done = params.eos_token_id is not None and params.eos_token_id in toks
            if done:
                toks = toks[: toks.index(params.eos_token_id) + 1]
            out.append(Rollout(prompt_ids=list(p), completion_ids=toks, finished=done, logprobs=logprobs[i, : len(toks)].tolist()))
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]

    def sync_weights(self, weights: PolicyWeights) -> WeightSyncStats | None:
        """Nothing to sync: generation reads the weights the optimizer just updated."""
        return None

    def close(self) -> None:
        pass
