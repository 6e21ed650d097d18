"""Multi-turn episodes on the static cache without a turn barrier: each row takes its turns at its own pace.

A batch of episodes is one generation (``EpisodeGeneration``): the prompts are prefilled once, then every decode step
feeds one token per row, as single-turn generation does, and the observations (the environment's answers) are written
into the cache by append forwards, one per look of the host. What differs from single-turn decoding is per row and on
the device, so each forward has fixed shapes (a decode step is one CUDA graph for the whole batch, an append one per
bucket):

- **Its own slots.** ``pos[r]`` is at once the cache slot row r writes next and the rotary position of the token it
  feeds there: a decode step scatters each row's key and value at its own slot (static_cache.py ``row_slots``) and
  advances ``pos[r]`` only where the row fed a token (``active``). A row that waits for its answer consumes no slot,
  so a row's history is its left-padded prompt, then its fed tokens contiguous from slot ``width`` (RoPE reads
  ``pos``; learned absolute position embeddings count the row's valid slots).
- **Observations appended in one forward.** A row whose turn ended and was answered has a block to feed: the turn's
  last token (sampled, not fed yet), an end-of-turn token where ``max_turn_tokens`` cut the turn, then the
  observation. At the look that brings the answers, the answered rows (a group) feed their blocks in one forward of
  [C, G] tokens (``append_step``): token j of the block of row r is written at slot ``pos[r] + j`` and attends to the
  row's valid history and to the block's tokens up to j (prefix-causal inside the chunk), over the group's cache rows
  only (static_cache.py ``chunk``). The logits of each block's last token give the row's next turn's first token, and
  the row is active again at the next decode step: the same tokens and logprobs as feeding the block one token a step.
- **Chunk buckets.** A look's group of G rows with blocks of up to C tokens runs in the bucket (G and C each rounded up to
  a power of two or 1.5 times one, G at most the batch's rows: ``bucket``): a handful of shapes per batch, each captured as a
  CUDA graph the first time it occurs and replayed after (one eager run, then the capture, as the decode step; the
  graphs share one memory pool and are kept with the generation). A bucket's padding changes nothing: the tokens past a
  row's block and the padding rows (a row outside the group, with an empty block) write to the scratch slot, never
  valid, and leave every row's state as it is. On the CPU appends run eagerly; the step reads no host value either way.
- **Its own turn's room.** ``turn_left[r]`` counts what the row may still sample in its turn; a row whose sampled token
  ends the turn (EOS, a stop token) or uses the room stops feeding (``active`` False) and waits.
- ``observations="forced"``: the path before appends, kept as the reference of the parity tests and the benchmark: a
  block is fed through the decode step as forced tokens, one per step (``forced``), the row sampling nothing until the
  block's last token. Greedy episodes are the same either way.

The host reads which rows stopped every ``check_every`` steps (``episode_check_every``: 4 on a GPU, 1 on the CPU; two
small copies, then the tokens of the rows that stopped), hands their turns to the episodes' ``TurnHandler``
(environments/episodes.py: the environment answers) and appends the answered rows' blocks (writing their rooms and
``active`` flags in place). A row waits at most ``check_every`` steps for its answer in line. The decode steps a batch
takes (``rollout/decode_steps``) are its longest episode's sampled tokens less one per turn (a turn's first token comes
from the prefill or an append) plus those waits; the appends are counted apart (``rollout/append_forwards``, at most
one per look). Sampled (non-greedy) episodes draw other random numbers than the forced path does (an append draws for
its group once where the forced path drew for every row at each step of the block): the same distribution, other
samples.

**Cache slots**: ``episode_slots(width, budget) = width + budget + 1``. A row feeds each token of its completion at most
once (its sampled tokens but the last, its blocks once each), and a completion holds at most ``budget`` tokens, so its
fed tokens take slots [width, width + budget) at most, whatever the environment's pace: a row that waits, in line or
for an answer from the background (``grpo.environment_workers``), takes no slot. The last slot, ``width + budget``, is
the scratch: where a chunk's padding writes (and where a row that fed its whole budget would write while inactive);
it is never valid. The host checks both ends: a resume whose block and room would go past the row's budget is refused
(ValueError), and a row found past its budget at a look is a bug in this bookkeeping (RuntimeError; its writes were
clamped to the scratch slot).

**Expert parallelism**: the replicas take every forward together, as single-turn decoding does: every decode step
until all their episodes are over (a replica whose episodes ended keeps stepping with no row active), and an append
wherever any replica appends (one collective per look decides it; a replica with no answered row appends a padding
row), so that no MoE layer's all-to-all waits for a peer that runs another forward.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from oumi_megatron.rollout.base import ANSWERING, EpisodeRun, NextTurn, TurnEnd, TurnHandler
from oumi_megatron.rollout.decoding.decoder import GenerationStats, StaticCacheDecoder, _Generation
from oumi_megatron.rollout.decoding.generation_mode import generation_mode
from oumi_megatron.rollout.decoding.padding import left_pad
from oumi_megatron.rollout.decoding.static_cache import ChunkWrite
from oumi_megatron.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from oumi_megatron.rollout.decoding.policy_stages import PolicyStages

EPISODE_CHECK_EVERY = 4
"""Decode steps between the host's looks at which episodes' turns ended, on a GPU (each look: two [rows] copies and a
sync, which stalls the queue of captured steps); a row waits up to this many steps for its observation."""

OBSERVATIONS = ("appended", "forced")
"""How a block reaches the cache: one append forward per look (the default), or forced tokens through the decode
steps (the reference)."""


def episode_check_every(device: torch.device) -> int:
    """``EPISODE_CHECK_EVERY`` on a GPU; every step on the CPU, where a look costs microseconds against a decode step's
    milliseconds and no row waits at all."""
    return EPISODE_CHECK_EVERY if device.type == "cuda" else 1


def episode_slots(width: int, budget: int) -> int:
    """Cache slots a batch of episodes uses (module docstring): the prompts' ``width``, a slot for each token a row may
    feed (its ``budget``), and the scratch slot."""
    return width + budget + 1


def bucket(n: int, cap: int | None = None) -> int:
    """``n`` rounded up to the next size of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5x them; at most
    ``cap``): an append's group or chunk size, so that a few shapes occur, each padded by less than a third (a power of
    two alone pads up to half: a 37-token block computed as 64)."""
    size = 1 << max(n - 1, 0).bit_length()
    if size >= 4 and 3 * size // 4 >= n:
        size = 3 * size // 4
    return size if cap is None else min(size, cap)


class _Append:
    """The device inputs of the append forwards of one (group, chunk) bucket, written by the host before each (a captured
    graph reads them in place), and the bucket's graph once captured."""

    def __init__(self, groups: int, chunk: int, device: torch.device) -> None:
        long = torch.long
        self.rows = torch.zeros(groups, dtype=long, device=device)
        """The group's rows; padding rows: one row outside the group, with an empty block."""
        self.ids = torch.zeros(groups, chunk, dtype=long, device=device)
        self.lens = torch.zeros(groups, dtype=long, device=device)
        """Each row's block length (0: a padding row)."""
        self.room = torch.zeros(groups, dtype=long, device=device)
        """Each row's next turn's room (its first token is sampled here)."""
        self.offsets = torch.arange(chunk, device=device)
        self.picked = torch.zeros(groups, dtype=long, device=device)
        self.picked_logprob = torch.zeros(groups, dtype=torch.float32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def fill(self, resumed: list[tuple[int, list[int], int]], spare: int, pad_id: int) -> None:
        groups, chunk = self.ids.shape
        rows, ids = [spare] * groups, torch.full((groups, chunk), pad_id, dtype=torch.long)
        lens, room = [0] * groups, [0] * groups
        for i, (r, block, turn_room) in enumerate(resumed):
            rows[i], lens[i], room[i] = r, len(block), turn_room
            ids[i, :len(block)] = torch.tensor(block)
        for buffer, value in ((self.rows, torch.tensor(rows)), (self.ids, ids), (self.lens, torch.tensor(lens)),
                              (self.room, torch.tensor(room))):
            buffer.copy_(value)


class _SpanTimer:
    """Seconds inside ``span()`` blocks as the device ran them: CUDA events on a GPU (read once, after the batch's
    synchronize: no sync per span), the host's clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.host_s = 0.0

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        if not self.cuda:
            started = time.perf_counter()
            yield
            self.host_s += time.perf_counter() - started
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.events.append((start, end))

    def seconds(self) -> float:
        """The spans' time (on a GPU: once the device has run them)."""
        return self.host_s + sum(start.elapsed_time(end) for start, end in self.events) / 1e3

    def reset(self) -> None:
        self.events.clear()
        self.host_s = 0.0


class EpisodeGeneration(_Generation):
    """The device state of one batch of episodes, ``n`` rows per prompt (rows ``i * n .. i * n + n - 1``)."""

    def __init__(self, stages: PolicyStages, params: SamplingParams, vocab_size: int, generator: torch.Generator,
                 n: int, rows: int, width: int, budget: int, check_every: int, observations: str = "appended") -> None:
        if observations not in OBSERVATIONS:
            raise ValueError(f"observations must be one of {OBSERVATIONS}, got {observations!r}")
        first = max(params.max_new_tokens, 1)
        super().__init__(stages, params, vocab_size, generator, n, rows, width,
                         extra_slots=episode_slots(width, budget) - width - first)
        device, long = stages.device, torch.long
        self.budget, self.check_every = budget, check_every
        self.forced_mode = observations == "forced"
        slots = self.valid.shape[1]
        self.scratch = slots - 1
        """The scratch slot (module docstring): never valid."""
        self.slot_ids = torch.arange(slots, device=device)
        self.pos = torch.full((rows,), width, dtype=long, device=device)
        """Per row, the slot (and rotary position) of the next token it feeds."""
        self.active = torch.ones(rows, dtype=torch.bool, device=device)
        self.forced = torch.zeros(rows, budget + 2, dtype=long, device=device)
        """Forced observations: per row, its pending block (the turn's last token, an end-of-turn token where the turn
        was cut, the observation)."""
        self.forced_len = torch.zeros(rows, dtype=long, device=device)
        self.forced_at = torch.zeros(rows, dtype=long, device=device)
        self.out_tokens = torch.full((rows, budget + 1), params.pad_token_id, dtype=long, device=device)
        """Per row, every token it sampled, in order (column ``budget``: where the rows that sample nothing write)."""
        self.out_logprobs = torch.zeros(rows, budget + 1, dtype=torch.float32, device=device)
        self.out_at = torch.zeros(rows, dtype=long, device=device)
        self.turn_left = torch.full((rows,), first, dtype=long, device=device)
        self.appends: dict[tuple[int, int], _Append] = {}
        """Per (group, chunk) bucket, its inputs and graph."""
        self.append_timer = _SpanTimer(device)
        self.append_forwards = 0
        self.append_tokens = [0, 0]
        """The blocks' tokens the appends fed, and the tokens their buckets computed (padding included)."""

    @classmethod
    def for_episodes(cls, stages: PolicyStages, prompts: list[list[int]], n: int, params: SamplingParams,
                     vocab_size: int, generator: torch.Generator, budget: int, check_every: int,
                     observations: str = "appended", width: int | None = None) -> EpisodeGeneration:
        ids, real = left_pad(prompts, params.pad_token_id, width)
        run = cls(stages, params, vocab_size, generator, n, len(prompts) * n, ids.shape[1], budget, check_every,
                  observations)
        run.load_prompts(ids, real, n)
        run.valid[:, :run.width] = real.repeat_interleave(n, dim=0).to(stages.device)
        return run

    def use(self, params: SamplingParams, width: int) -> None:
        super().use(params, width)
        if self.graph is None:  # the sampling changed: the appends' graphs sample as the decode step's did
            self.appends.clear()

    def restart(self, valid: torch.Tensor) -> None:
        super().restart(valid)
        self.pos.fill_(self.width)
        self.active.fill_(True)
        self.forced_len.zero_()
        self.forced_at.zero_()
        self.out_tokens.fill_(self.params.pad_token_id)
        self.out_logprobs.zero_()
        self.out_at.zero_()
        self.turn_left.fill_(max(self.params.max_new_tokens, 1))
        self.append_timer.reset()
        self.append_forwards = 0
        self.append_tokens = [0, 0]

    # -- the forwards: fixed shapes, no host value -------------------------------------------------------------------
    def decode_step(self, kv_len: int | None) -> None:
        """Every row feeds one token at its own slot ``pos[r]`` (valid where the row is active): its last sample, or
        (forced observations) its pending block's next token."""
        write = self.pos.clamp(max=self.scratch)  # a row past its budget writes the scratch slot; the next look raises
        fed = self.current
        if self.forced_mode:
            forcing = self.forced_at < self.forced_len
            block_token = self.forced.gather(1, self.forced_at.clamp(max=self.forced.shape[1] - 1)[:, None])
            fed = torch.where(forcing[:, None], block_token, self.current)
        self.valid.scatter_(1, write[:, None], self.active[:, None])
        valid = self.valid if kv_len is None else self.valid[:, :kv_len]
        positions = valid.sum(dim=-1, keepdim=True) - 1 if self.stages.learned_positions else None
        # [1, rows, 1, dim]: each row's own position (Megatron-Core's RoPE broadcasts over the batch dimension)
        rotary = None if self.rotary is None else self.rotary.index_select(0, write).transpose(0, 1)
        self.cursor.kv_len, self.cursor.row_slots = kv_len, write
        try:
            logits = self.stages.forward(fed, positions, self._mask(valid), self._layer_rotary(rotary))
        finally:
            self.cursor.row_slots = None
        self.pos += self.active.long()
        self._record(logits)

    def _record(self, logits: torch.Tensor | None) -> None:
        """Each row's sample, kept where the row samples (not inside a forced block); rows whose turn ended stop."""
        self._pick(logits, self.picked, self.picked_logprob)
        samples = self.active
        if self.forced_mode:
            forcing = self.forced_at < self.forced_len
            samples = samples & (self.forced_at + 1 >= self.forced_len)  # not in a block, or at its last token
            self.forced_at += forcing.long()
        column = torch.where(samples, self.out_at, self.budget)[:, None]
        self.out_tokens.scatter_(1, column, self.picked[:, None])
        self.out_logprobs.scatter_(1, column, self.picked_logprob[:, None])
        self.out_at += samples.long()
        self.turn_left -= samples.long()
        ended = self.turn_left <= 0
        if self.ends is not None:
            ended |= (self.picked[:, None] == self.ends[None, :]).any(dim=1)
        self.active &= ~(samples & ended)
        self.current.copy_(self.picked[:, None])
        self.step += 1

    def append_step(self, a: _Append) -> None:
        """The group's blocks fed in one forward (module docstring): block token j of group row i at slot
        ``pos[rows[i]] + j``, prefix-causal within the block; each block's last token's logits give the row's next
        turn's first token."""
        groups, chunk = a.ids.shape
        base = self.pos.index_select(0, a.rows)
        at = base[:, None] + a.offsets[None, :]  # [G, C]: the block's slots
        real = a.offsets[None, :] < a.lens[:, None]
        write = torch.where(real, at, self.scratch).clamp_(max=self.scratch)
        history = self.valid.index_select(0, a.rows)  # [G, slots]
        s = self.slot_ids
        # a token attends to its row's history, to its block's tokens up to itself, and to its own slot (for padding:
        # the scratch slot, so that no softmax row is empty)
        block = (s >= base[:, None, None]) & (s <= at[:, :, None]) & (s < (base + a.lens)[:, None, None])
        allowed = history[:, None, :] | block | (s == write[:, :, None])  # [G, C, slots]
        positions = history.sum(dim=-1, keepdim=True) + a.offsets[None, :] if self.stages.learned_positions else None
        rotary = None
        if self.rotary is not None:  # [C, G, 1, dim]: each token's own position
            rotary = self.rotary.index_select(0, write.flatten()).view(groups, chunk, *self.rotary.shape[2:]).transpose(0, 1)
        self.cursor.kv_len = None
        self.cursor.chunk = ChunkWrite(a.rows, a.rows[:, None].expand(groups, chunk).flatten(), write.flatten())
        try:
            logits = self.stages.forward(a.ids, positions, self._mask_where(allowed[:, None]), rotary,
                                         last=(a.lens - 1).clamp(min=0))
        finally:
            self.cursor.chunk = None
        self.valid.index_put_((a.rows[:, None].expand(groups, chunk), write), real)  # the blocks are history now
        self._pick(logits, a.picked, a.picked_logprob)
        fed = a.lens > 0  # padding rows: every value below is the row's own again
        out_at = self.out_at.index_select(0, a.rows)
        column = torch.where(fed, out_at, self.budget)
        self.out_tokens.index_put_((a.rows, column), a.picked)
        self.out_logprobs.index_put_((a.rows, column), a.picked_logprob)
        left = torch.where(fed, a.room - 1, self.turn_left.index_select(0, a.rows))
        ended = left <= 0
        if self.ends is not None:
            ended |= (a.picked[:, None] == self.ends[None, :]).any(dim=1)
        self.active.index_copy_(0, a.rows, torch.where(fed, ~ended, self.active.index_select(0, a.rows)))
        self.turn_left.index_copy_(0, a.rows, left)
        self.out_at.index_copy_(0, a.rows, out_at + fed.long())
        self.pos.index_copy_(0, a.rows, base + a.lens)
        self.current.index_copy_(0, a.rows, torch.where(fed[:, None], a.picked[:, None],
                                                        self.current.index_select(0, a.rows)))

    def _mask_where(self, allowed: torch.Tensor) -> torch.Tensor:
        """``allowed`` (True = may attend) as the layers' mask: boolean (True = may not attend), or SDPA's additive bias."""
        return ~allowed if self.neg_inf is None else torch.where(allowed, self.zero, self.neg_inf)

    # -- the loop ------------------------------------------------------------------------------------------------------
    def play(self, turns: TurnHandler, graphs: bool, peers_done: Callable[[bool], bool]) -> EpisodeRun:
        """Decode steps (after the prefill) until every episode is over here and on every expert peer; every
        ``check_every`` steps the turns that ended go to ``turns`` and its answers into the cache."""
        rows, slots = self.valid.shape
        host = _HostView(rows, self.params)
        steps, in_flight, reach = 0, 0.0, self.width
        with self.stages.generating(self.cache):
            while True:
                if steps % self.check_every == 0:
                    in_flight += host.going() * min(steps, self.check_every)
                    done, resumed, reach = self._answer(turns, host)
                    if self.forced_mode:
                        if resumed:
                            self._resume(resumed)
                    elif not peers_done(not resumed):  # this replica or an expert peer appends: all do
                        self._append(resumed, graphs)
                    if peers_done(done):
                        break
                if self.graph is not None:
                    self.graph.replay()
                elif graphs and not self.capture_failed:
                    self.graph = self._capture()  # one eager step, then the captured one
                    self.steps_in_capture += self.graph is not None
                else:
                    self.decode_step(min(reach + 1, slots))  # eager: the slots any row has reached
                reach += 1
                steps += 1
        return EpisodeRun(decode_steps=steps, continued_ttft_s=host.ttft, concurrency=in_flight / max(steps, 1),
                          answer_s=host.answer_s, append_forwards=self.append_forwards)

    def _answer(self, turns: TurnHandler, host: _HostView) -> tuple[bool, list[tuple[int, list[int], int]], int]:
        """The turns that ended since the last look go to ``turns``; its answers, and those that came back from the
        background, are returned as (row, block, room) to resume. Also whether every episode here is over, and the
        last slot any row may have written once the blocks are in (eager steps attend up to it)."""
        active_t, out_at, fed = torch.stack((self.active.long(), self.out_at, self.pos - self.width)).cpu().tolist()
        if max(fed) > self.budget:
            raise RuntimeError(f"a row of a batch of episodes fed {max(fed)} tokens, more than its budget of {self.budget}: "
                               "each row feeds at most its budget, so this is a bug in the episode decoder's bookkeeping; "
                               "please report it")
        active = [bool(a) for a in active_t]
        host.saw_first_tokens(out_at)
        stopped = [r for r in range(len(active)) if not active[r] and not host.done[r] and r not in host.answering]
        for r in stopped:
            host.turns[r] += 1
        decided: list[tuple[int, NextTurn | None]] = []
        if stopped:
            index = torch.tensor(stopped, device=self.out_tokens.device)
            tokens = self.out_tokens.index_select(0, index).cpu()
            logprobs = self.out_logprobs.index_select(0, index).cpu()
            ends = []
            for i, r in enumerate(stopped):
                ids = tokens[i, host.read_at[r]:out_at[r]].tolist()
                ends.append(TurnEnd(r, ids, logprobs[i, host.read_at[r]:out_at[r]].tolist(),
                                    bool(ids) and ids[-1] in host.end_ids))
                host.read_at[r], host.last_token[r] = out_at[r], ids[-1]
            for end, answer in zip(ends, host.timed(turns.turns_ended, ends), strict=True):
                if answer is ANSWERING:
                    host.answering.add(end.row)
                else:
                    decided.append((end.row, answer))
        if host.answering:  # nothing else to do here: wait for the background's first answer
            idle = not any(active) and all(answer is None for _, answer in decided)
            for r, answer in host.timed(turns.answered, idle):
                host.answering.discard(r)
                decided.append((r, answer))
        resumed: list[tuple[int, list[int], int]] = []
        reach = self.width + max(fed)
        for r, answer in decided:
            if answer is None:
                host.done[r] = True
                continue
            block = [host.last_token[r], *answer.appended]
            if answer.room < 1 or fed[r] + len(block) + answer.room - 1 > self.budget:
                raise ValueError(f"episode {r}: a next turn of room {answer.room} after a block of {len(block)} tokens "
                                 f"does not fit its budget ({self.budget} tokens, {fed[r]} fed)")
            resumed.append((r, block, answer.room))
            reach = max(reach, self.width + fed[r] + len(block))
        if resumed:
            host.resumed([r for r, _, _ in resumed], out_at)
        return all(host.done), resumed, reach

    def _append(self, resumed: list[tuple[int, list[int], int]], graphs: bool) -> None:
        """The resumed rows' blocks into the cache by one append forward of their bucket (``resumed`` empty: an expert
        peer appends, this replica runs a padding row alongside)."""
        rows = self.valid.shape[0]
        groups = bucket(len(resumed), rows)
        chunk = bucket(max((len(block) for _, block, _ in resumed), default=1))
        a = self.appends.get((groups, chunk))
        if a is None:
            a = self.appends[(groups, chunk)] = _Append(groups, chunk, self.stages.device)
        members = {r for r, _, _ in resumed}
        spare = next(r for r in range(rows) if r not in members) if groups > len(resumed) else 0
        a.fill(resumed, spare, self.params.pad_token_id)
        self.append_forwards += 1
        self.append_tokens[0] += sum(len(block) for _, block, _ in resumed)
        self.append_tokens[1] += groups * chunk
        if a.graph is not None:
            with self.append_timer.span():
                a.graph.replay()
        elif graphs and not self.capture_failed:
            a.graph = self._capture(lambda: self.append_step(a))  # this append runs eagerly (in capture_s), then capture
        else:
            with self.append_timer.span():
                self.append_step(a)

    def _resume(self, resumed: list[tuple[int, list[int], int]]) -> None:
        """Forced observations: the rows' blocks, rooms and ``active`` written in place (the captured step reads
        these tensors)."""
        device = self.forced.device
        index = torch.tensor([r for r, _, _ in resumed], device=device)
        blocks = torch.full((len(resumed), self.forced.shape[1]), self.params.pad_token_id, dtype=torch.long)
        for i, (_, block, _) in enumerate(resumed):
            blocks[i, :len(block)] = torch.tensor(block)
        self.forced.index_copy_(0, index, blocks.to(device))
        self.forced_len.index_copy_(0, index, torch.tensor([len(b) for _, b, _ in resumed], device=device))
        self.forced_at.index_fill_(0, index, 0)
        self.turn_left.index_copy_(0, index, torch.tensor([room for _, _, room in resumed], device=device))
        self.active.index_fill_(0, index, True)


def run_episodes(decoder: StaticCacheDecoder, prompts: list[list[int]], n: int, params: SamplingParams,
                 generator: torch.Generator, turns: TurnHandler, budget: int,
                 observations: str = "appended") -> tuple[EpisodeRun, GenerationStats]:
    """A batch of episodes on ``decoder``: ``n`` rows per prompt, the first turns up to ``params.max_new_tokens``
    tokens, later ones as ``turns`` answers, their observations ``OBSERVATIONS``; what it cost, and the decoder's stats
    of it (the environment's time out of ``decode_s``)."""
    k = episode_check_every(decoder.stages.device)

    def make(width: int | None) -> EpisodeGeneration:
        return EpisodeGeneration.for_episodes(decoder.stages, prompts, n, params, decoder.vocab_size, generator, budget,
                                              k, observations, width)

    with generation_mode(decoder.engine):
        run, keep = decoder.prepared(("episodes", budget, k, observations), prompts, n, params, generator, make)
        started = time.perf_counter()
        run.prefill(decoder.kept.limit > 0)
        run.synchronize()
        prefill_s = time.perf_counter() - started
        result = run.play(turns, decoder.graphs, decoder.peers_done)
        run.synchronize()
        keep()
    path = decoder.path.replace("CUDA-graph", "eager (capture failed)") if run.capture_failed else decoder.path
    how = "as forced tokens" if observations == "forced" else "appended in one forward"
    stats = GenerationStats(path=f"{path}, episodes without a turn barrier, observations {how}",
                            tokens=int(run.out_at.sum()), prefill_s=prefill_s, decode_steps=result.decode_steps,
                            decode_s=time.perf_counter() - started - prefill_s - result.answer_s,
                            kv_cache_bytes=run.cache.nbytes, capture_s=run.capture_s,
                            steps_in_capture=run.steps_in_capture, append_forwards=result.append_forwards,
                            append_s=run.append_timer.seconds(), append_tokens=tuple(run.append_tokens))
    return result, stats


class _HostView:
    """What the host knows of a batch of episodes between looks."""

    def __init__(self, rows: int, params: SamplingParams) -> None:
        self.done = [False] * rows
        self.read_at = [0] * rows
        """Per row, where its current turn's samples start in ``out_tokens``."""
        self.end_ids = frozenset(params.end_ids)
        self.last_token = [0] * rows
        """Per row, its latest turn's last token: the first of the block that resumes it (sampled, not fed yet)."""
        self.answering: set[int] = set()
        """Rows whose turn the environment answers in the background."""
        self.turns = [0] * rows
        """Per row, the turns it has ended."""
        self.waiting: dict[int, tuple[float, int]] = {}
        """Rows resumed with an observation: when, and their sample count then (their next turn's first token is the
        one after it)."""
        self.ttft: list[float] = []
        self.answer_s = 0.0

    def going(self) -> int:
        return self.done.count(False)

    def resumed(self, rows: list[int], out_at: list[int]) -> None:
        now = time.perf_counter()
        for r in rows:
            self.waiting[r] = (now, out_at[r])

    def timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, its time counted as the host's in the episodes' answers (``answer_s``)."""
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.answer_s += time.perf_counter() - started

    def saw_first_tokens(self, out_at: list[int]) -> None:
        now = time.perf_counter()
        for r, (since, count) in list(self.waiting.items()):
            if out_at[r] > count:
                self.ttft.append(now - since)
                del self.waiting[r]
