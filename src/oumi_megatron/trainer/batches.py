"""Samples (rollout/sample.py) -> the engine's microbatches, right-padded or packed: the engine's input, string-keyed
tensors (engine/engine.py).

Both layouts give every token the same tensors, aligned with the engine's logprob positions (position
t scores token t + 1): ``input_ids``, ``completion_mask`` (1 where a completion token the policy sampled is scored;
0 on prompts, padding and an environment's observation tokens),
``advantages`` (the sequence's advantage on each of its tokens) and ``segment_ids`` (which sequence a
token belongs to, numbered across the microbatch, -1 on padding), so the GRPO loss and its
aggregations are the same code for both.

Padded: one sequence per row, rows right-padded to the longest sequence; the default causal mask.

Packed (``megatron.enable_sequence_packing``): sequences are placed first-fit-decreasing into rows of
``capacity`` tokens (the longest sequence). Attention stays inside each sequence through a
block-diagonal causal mask; position ids restart at 0 in every sequence. Megatron-Core's rotary
embedding rotates by the row position, but RoPE scores depend only on the distance between query and
key, which packing does not change, so a packed sequence sees exactly what it sees alone (up to float
rounding). Megatron-Core's ``PackedSeqParams`` (THD, cu_seqlens) needs Transformer Engine's attention,
which the local spec used here does not have; the mask is the local spec's equivalent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oumi_megatron.rollout.sample import Sample


def mini_batches(samples: list[Sample], per_mini: int, count: int) -> list[list[Sample]]:
    """``samples`` (this rank's share of the step's batch) as ``count`` mini-batches (one optimizer step each) of
    ``per_mini``."""
    return [samples[m * per_mini:(m + 1) * per_mini] for m in range(count)]


@dataclass
class MicrobatchLayout:
    microbatches: list[dict[str, torch.Tensor]]
    placements: list[tuple[int, int, int, int]] = field(default_factory=list)
    """Per sequence: (microbatch, row, start, length)."""
    real_tokens: int = 0

    @property
    def processed_tokens(self) -> int:
        """Tokens the model runs on (rows x row length), padding included."""
        return sum(mb["input_ids"].numel() for mb in self.microbatches)

    @property
    def padded_tokens(self) -> int:
        """Tokens the padded layout of the same sequences runs on (one per row, longest length)."""
        return len(self.placements) * max((n for *_, n in self.placements), default=0)

    def per_sequence(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Cut per-microbatch [b, T] values (e.g. logprobs) back into one 1-D tensor per sequence."""
        return [tensors[m][r, s : s + n] for m, r, s, n in self.placements]


def _fill_row(row: dict[str, torch.Tensor], start: int, sample: Sample, segment: int, with_rollout_logprobs: bool) -> None:
    ids, prompt_len = sample.token_ids, len(sample.prompt_ids)
    n, loss_mask = len(ids), sample.loss_mask
    row["input_ids"][start : start + n] = torch.tensor(ids, dtype=torch.long)
    # logprob position t scores token t + 1: completion tokens sit at prompt_len .. n - 1
    if sample.trainable:
        if loss_mask is not None and len(loss_mask) != n - prompt_len:
            raise ValueError(f"a loss mask of {len(loss_mask)} tokens for a completion of {n - prompt_len}")
        row["completion_mask"][start + prompt_len - 1 : start + n - 1] = (
            1.0 if loss_mask is None else torch.tensor(loss_mask, dtype=torch.float32))
    if with_rollout_logprobs:
        row["rollout_logprobs"][start + prompt_len - 1 : start + n - 1] = torch.tensor(sample.logprobs)
    row["advantages"][start : start + n] = sample.advantage
    row["segment_ids"][start : start + n] = segment
    row["position_ids"][start : start + n] = torch.arange(n)


def _empty_rows(rows: int, length: int, pad_id: int, with_rollout_logprobs: bool) -> dict[str, torch.Tensor]:
    out = {
        "input_ids": torch.full((rows, length), pad_id, dtype=torch.long),
        "completion_mask": torch.zeros(rows, length),
        "advantages": torch.zeros(rows, length),
        "segment_ids": torch.full((rows, length), -1, dtype=torch.long),
        "position_ids": torch.zeros(rows, length, dtype=torch.long),
    }
    if with_rollout_logprobs:
        out["rollout_logprobs"] = torch.zeros(rows, length)
    return out


def mark_stale(layout: MicrobatchLayout, samples: list[Sample], version: int) -> None:
    """Each microbatch's ``stale_mask`` (asynchronous GRPO): 1 at the completion tokens a policy older than ``version``
    sampled (``Sample.versions``; ``samples``: the layout's, in its placements' order), for the mismatch by staleness."""
    for mb in layout.microbatches:
        mb["stale_mask"] = torch.zeros_like(mb["completion_mask"])
    for sample, (m, r, start, n) in zip(samples, layout.placements, strict=True):
        if sample.versions:
            first = start + len(sample.prompt_ids) - 1  # logprob position t scores token t + 1
            layout.microbatches[m]["stale_mask"][r, first : start + n - 1] = torch.tensor(
                [float(v < version) for v in sample.versions])


def _with_rollout_logprobs(samples: list[Sample]) -> bool:
    """The engine's logprobs go in when every sample has them (one backend: all or none)."""
    return all(s.logprobs is not None for s in samples)


def padded_layout(samples: list[Sample], micro_batch_size: int, pad_id: int) -> MicrobatchLayout:
    """One sequence per row, right-padded to the longest; ``micro_batch_size`` rows per microbatch."""
    n = len(samples)
    if n % micro_batch_size:
        raise ValueError(f"{n} sequences do not split into microbatches of {micro_batch_size}")
    length = max(s.length for s in samples)
    logprobs = _with_rollout_logprobs(samples)
    layout = MicrobatchLayout([], real_tokens=sum(s.length for s in samples))
    for first in range(0, n, micro_batch_size):
        mb = _empty_rows(micro_batch_size, length, pad_id, logprobs)
        for r in range(micro_batch_size):
            sample = samples[first + r]
            _fill_row({k: v[r] for k, v in mb.items()}, 0, sample, r, logprobs)
            layout.placements.append((len(layout.microbatches), r, 0, sample.length))
        layout.microbatches.append(mb)
    return layout


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of indices) of total length <= ``capacity``, longest sequences placed first."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > capacity:
            raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than the row capacity {capacity}")
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, T, T] True where attention is not allowed: across sequences, to the future, from padding.
    A padding position attends to itself only, so no softmax row is empty (its output is unused)."""
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = same & causal[None] & (segment_ids >= 0)[:, :, None]
    allowed |= torch.eye(length, dtype=torch.bool)[None] & (segment_ids < 0)[:, :, None]
    return ~allowed[:, None]


def packed_layout(samples: list[Sample], micro_batch_size: int, pad_id: int, min_microbatches: int = 0,
                  capacity: int | None = None) -> MicrobatchLayout:
    """Sequences packed into rows of ``capacity`` tokens (default: the longest sequence),
    ``micro_batch_size`` rows per microbatch, at least ``min_microbatches`` microbatches (empty ones
    are all padding, so ranks that must run the same number of microbatches can)."""
    lengths = [s.length for s in samples]
    capacity = capacity or max(lengths)
    bins = first_fit_decreasing(lengths, capacity)
    n_micro = max(-(-len(bins) // micro_batch_size), min_microbatches)
    logprobs = _with_rollout_logprobs(samples)
    layout = MicrobatchLayout([], placements=[(0, 0, 0, 0)] * len(lengths), real_tokens=sum(lengths))
    for m in range(n_micro):
        mb = _empty_rows(micro_batch_size, capacity, pad_id, logprobs)
        segment = 0
        for r in range(micro_batch_size):
            b = m * micro_batch_size + r
            if b >= len(bins):
                break
            row = {k: v[r] for k, v in mb.items()}
            start = 0
            for i in bins[b]:
                _fill_row(row, start, samples[i], segment, logprobs)
                layout.placements[i] = (m, r, start, lengths[i])
                start += lengths[i]
                segment += 1
        mb["attention_mask"] = block_causal_mask(mb["segment_ids"])
        layout.microbatches.append(mb)
    return layout
