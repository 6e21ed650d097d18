"""Token sampling from logits: temperature, nucleus (top-p), greedy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    eos_token_id: int | None = None
    pad_token_id: int = 0
    greedy: bool = False
    """Take the most likely token (for tests and evaluation); GRPO samples."""
    stop_token_ids: tuple[int, ...] = ()
    """More tokens that end a row, as EOS does (kept, like EOS): an environment's ``stop_strings`` (a multi-turn
    episode's turn ends there and the environment answers inside the assistant's message)."""

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Every token that ends a row: EOS, then the stop tokens."""
        return (*(() if self.eos_token_id is None else (self.eos_token_id,)), *self.stop_token_ids)


def sampling_for(grpo: Any, tokenizer: Any, greedy: bool = False) -> SamplingParams:
    """A run's sampling (``grpo``: its MegatronGrpoParams): training's temperature and top-p, or greedy (evaluation);
    ``max_completion_length`` new tokens; the tokenizer's EOS ends a row, its pad token (else EOS) pads."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if greedy:
        return SamplingParams(temperature=1.0, max_new_tokens=grpo.max_completion_length,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=pad, greedy=True)
    return SamplingParams(temperature=grpo.temperature, top_p=grpo.top_p, max_new_tokens=grpo.max_completion_length,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)


def end_token_tensor(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """``params.end_ids`` as a tensor on ``device`` (what a row's tokens are compared with); None when nothing ends a row."""
    return torch.tensor(params.end_ids, dtype=torch.long, device=device) if params.end_ids else None


def first_end(ids: list[int], params: SamplingParams) -> int | None:
    """The index of the first token of ``ids`` that ends a row (``params.end_ids``), or None."""
    ends = set(params.end_ids)
    return next((i for i, t in enumerate(ids) if t in ends), None)


def pick_tokens(logits: torch.Tensor, params: SamplingParams, vocab_size: int,
                generator: torch.Generator | None = None, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [B, V >= vocab_size] (any float dtype; columns past ``vocab_size`` are Megatron's vocab
    padding, never drawn) and its log-probability under softmax(logits / T) over the full vocabulary (before
    top-p: the quantity the trainer recomputes).

    Device-side and shape-static (a CUDA graph can hold it): a draw from ``probs`` is the argmax of
    ``probs / E`` with E ~ Exponential(1) per entry (the exponential race; the same distribution as
    ``torch.multinomial``, without its host-side checks), drawn from ``generator`` on the logits' device, so a
    seed draws the same on every rank. ``fused`` (``megatron.rollout_decode_kernels``, where Triton runs): without a
    nucleus the same draw (as a Gumbel-max) runs in two Triton kernels that read the logits once
    (engine/kernels/token_sampling.py)."""
    if fused and params.top_p >= 1.0:
        from oumi_megatron.engine.kernels.token_sampling import sample_tokens  # triton: on use

        return sample_tokens(logits, params.temperature, vocab_size, params.greedy, generator)
    scaled = logits if params.temperature == 1.0 else logits.float() / params.temperature
    logprobs = torch.log_softmax(scaled, dim=-1, dtype=torch.float32)  # bf16 logits: converted inside, no fp32 copy
    if params.greedy:  # on the logits: log_softmax's rounding could merge two near-equal neighbours
        tokens = logits[:, :vocab_size].argmax(dim=-1)
    else:
        probs = logprobs[:, :vocab_size].exp()
        if params.top_p < 1.0:
            probs = probs / probs.sum(dim=-1, keepdim=True)  # the nucleus is a share of the usable vocabulary's mass
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least the top token)
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
        # never 0: a zero probability over a zero draw would be NaN, which argmax picks
        race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-30)
        tokens = (probs / race).argmax(dim=-1)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]
