"""Multi-turn episodes on the static cache without a turn barrier: each row takes its turns at its own pace.

A batch of episodes is one generation (``EpisodeGeneration``): the prompts are prefilled once, then every decode step
feeds one token per row at one shared cache slot, as single-turn generation does. What differs is per row, on the
device, so the step keeps fixed shapes (and stays one CUDA graph for the whole batch):
- **Its own position.** ``pos[r]`` is the rotary position of the token row r feeds; it advances only when the row
  feeds one. A row that waits leaves the slot unwritten for itself (``valid`` False there), so its history stays
  contiguous in positions although it is not in slots (RoPE sees positions, never slots; learned absolute position
  embeddings count the row's valid slots).
- **Forced tokens.** An observation is fed as forced tokens through the same step: a row whose block (its turn's last
  token, not fed yet, then the observation) is pending feeds ``forced[r, forced_at[r]]`` instead of its sampled token,
  and samples nothing until the block's last token, whose logits give the next turn's first token. One step per
  observation token, for that row only: the other rows decode meanwhile.
- **Its own turn's room.** ``turn_left[r]`` counts what the row may still sample in its turn; a row whose sampled token
  ends the turn (EOS, a stop token) or uses the room stops feeding (``active`` False) and waits.

The host reads which rows stopped every ``check_every`` steps (``episode_check_every``: 4 on a GPU, 1 on the CPU; two
small copies, then the tokens of the rows that stopped),
hands their turns to the episodes' ``TurnHandler`` (environments/episodes.py: the environment answers), and writes the
answered rows' blocks, rooms and ``active`` flags into the buffers in place. A row waits at most ``check_every`` steps
for its answer; the decode steps a batch takes are its longest episode's tokens plus those waits (the metric
``rollout/decode_steps`` against ``rollout/critical_path_tokens``).

Cache slots: the longest prompt, then one slot per step; a row feeds at most ``budget`` tokens (its whole completion)
and waits at most ``check_every`` steps per turn for an answer in line, so ``width + budget + (max_turns + 1) *
check_every + 1`` slots hold any batch. Answers from the background (``grpo.environment_workers``) take as long as the
environment takes, while the other rows decode: such a batch keeps ``budget`` more slots for those waits, and a row
whose wait would leave too few slots for the rest of its episode (the rest of its budget, a look per turn left) is
waited for before the next step: the batch never runs out of slots, whatever the environment's pace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from oumi_megatron.rollout.base import ANSWERING, EpisodeRun, NextTurn, TurnEnd, TurnHandler
from oumi_megatron.rollout.decoding.decoder import GenerationStats, StaticCacheDecoder, _Generation
from oumi_megatron.rollout.decoding.generation_mode import generation_mode
from oumi_megatron.rollout.decoding.padding import left_pad
from oumi_megatron.rollout.sampling import SamplingParams, pick_tokens

if TYPE_CHECKING:
    from oumi_megatron.rollout.decoding.policy_stages import PolicyStages

EPISODE_CHECK_EVERY = 4
"""Decode steps between the host's looks at which episodes' turns ended, on a GPU (each look: two [rows] copies and a
sync, which stalls the queue of captured steps); a row waits up to this many steps for its observation. The most any
device uses: the cache's slots are counted with it (``episode_slots``)."""


def episode_check_every(device: torch.device) -> int:
    """``EPISODE_CHECK_EVERY`` on a GPU; every step on the CPU, where a look costs microseconds against a decode step's
    milliseconds and no row waits at all."""
    return EPISODE_CHECK_EVERY if device.type == "cuda" else 1


def episode_slots(width: int, budget: int, max_turns: int, check_every: int, background: bool) -> int:
    """Cache slots a batch of episodes can use (module docstring); ``background``: the environment answers in the
    background, and rows may wait up to ``budget`` more steps in all for its answers."""
    return width + budget * (2 if background else 1) + (max_turns + 1) * check_every + 1


class EpisodeGeneration(_Generation):
    """The device state of one batch of episodes, ``n`` rows per prompt (rows ``i * n .. i * n + n - 1``)."""

    def __init__(self, stages: PolicyStages, params: SamplingParams, vocab_size: int, generator: torch.Generator,
                 n: int, rows: int, width: int, budget: int, max_turns: int, check_every: int, background: bool) -> None:
        first = max(params.max_new_tokens, 1)
        super().__init__(stages, params, vocab_size, generator, n, rows, width,
                         extra_slots=episode_slots(width, budget, max_turns, check_every, background) - width - first)
        device, long = stages.device, torch.long
        self.budget, self.max_turns, self.check_every = budget, max_turns, check_every
        self.pos = torch.full((rows,), width, dtype=long, device=device)
        self.active = torch.ones(rows, dtype=torch.bool, device=device)
        self.forced = torch.zeros(rows, budget + 2, dtype=long, device=device)
        """Per row, its pending block: the turn's last token, an end-of-turn token where the turn was cut, the
        observation (at most the episode's budget)."""
        self.forced_len = torch.zeros(rows, dtype=long, device=device)
        self.forced_at = torch.zeros(rows, dtype=long, device=device)
        self.out_tokens = torch.full((rows, budget + 1), params.pad_token_id, dtype=long, device=device)
        """Per row, every token it sampled, in order (column ``budget``: where the rows that sample nothing write)."""
        self.out_logprobs = torch.zeros(rows, budget + 1, dtype=torch.float32, device=device)
        self.out_at = torch.zeros(rows, dtype=long, device=device)
        self.turn_left = torch.full((rows,), first, dtype=long, device=device)

    @classmethod
    def for_episodes(cls, stages: PolicyStages, prompts: list[list[int]], n: int, params: SamplingParams,
                     vocab_size: int, generator: torch.Generator, budget: int, max_turns: int, check_every: int,
                     background: bool, width: int | None = None) -> EpisodeGeneration:
        ids, real = left_pad(prompts, params.pad_token_id, width)
        run = cls(stages, params, vocab_size, generator, n, len(prompts) * n, ids.shape[1], budget, max_turns, check_every,
                  background)
        run.prompt_ids, run.prompt_real = ids.to(stages.device), real
        run.valid[:, :run.width] = real.repeat_interleave(n, dim=0).to(stages.device)
        return run

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

    # -- the step: fixed shapes, no host value -----------------------------------------------------------------------
    def decode_step(self, kv_len: int | None) -> None:
        """Every active row feeds one token at ``cursor.slot``: its pending block's next one, else its last sample."""
        forcing = self.forced_at < self.forced_len
        block_token = self.forced.gather(1, self.forced_at.clamp(max=self.forced.shape[1] - 1)[:, None])
        fed = torch.where(forcing[:, None], block_token, self.current)
        self.valid.index_copy_(1, self.cursor.slot, self.active[:, None])
        valid = self.valid if kv_len is None else self.valid[:, :kv_len]
        positions = valid.sum(dim=-1, keepdim=True) - 1 if self.stages.learned_positions else None
        # [1, rows, 1, dim]: each row's own position (Megatron-Core's RoPE broadcasts over the batch dimension)
        rotary = None if self.rotary is None else self.rotary.index_select(0, self.pos).transpose(0, 1)
        self.cursor.kv_len = kv_len
        logits = self.stages.forward(fed, positions, self._mask(valid), rotary)
        self.cursor.slot += 1
        self.pos += self.active.long()
        self._record(logits)

    def _record(self, logits: torch.Tensor | None) -> None:
        """Each row's sample, kept where the row samples (not inside a block); rows whose turn ended stop."""
        if logits is not None:
            tokens, logprobs = pick_tokens(logits, self.params, self.vocab_size, self.generator)
            self.picked.copy_(tokens)
            self.picked_logprob.copy_(logprobs)
        self.stages.share_from_last_stage(self.picked, self.picked_logprob)
        forcing = self.forced_at < self.forced_len
        samples = self.active & (self.forced_at + 1 >= self.forced_len)  # not in a block, or at its last token
        column = torch.where(samples, self.out_at, self.budget)[:, None]
        self.out_tokens.scatter_(1, column, self.picked[:, None])
        self.out_logprobs.scatter_(1, column, self.picked_logprob[:, None])
        self.out_at += samples.long()
        self.forced_at += forcing.long()
        self.turn_left -= samples.long()
        ended = self.turn_left <= 0
        if self.ends is not None:
            ended |= (self.picked[:, None] == self.ends[None, :]).any(dim=1)
        self.active &= ~(samples & ended)
        self.current.copy_(self.picked[:, None])
        self.step += 1

    # -- the loop ------------------------------------------------------------------------------------------------------
    def play(self, turns: TurnHandler, graphs: bool, peers_done: Callable[[bool], bool]) -> EpisodeRun:
        """Decode steps (after the prefill) until every episode is over here and on every expert peer; every
        ``check_every`` steps the turns that ended go to ``turns`` and its answers into the buffers."""
        rows, slots = self.valid.shape
        host = _HostView(rows, self.params)
        slot, steps, in_flight = self.width, 0, 0.0
        with self.cache.attached():
            while True:
                if steps % self.check_every == 0:
                    in_flight += host.going() * min(steps, self.check_every)
                    if peers_done(self._answer(turns, host, slots - slot)):
                        break
                if slot >= slots:
                    raise RuntimeError(f"a batch of episodes used all {slots} cache slots with episodes still going: "
                                       "each row feeds at most its budget and waits at most check_every steps per turn, "
                                       "so this is a bug in the episode decoder's bookkeeping; please report it")
                if self.graph is not None:
                    self.graph.replay()
                elif graphs and not self.capture_failed:
                    self.graph = self._capture()  # one eager step, then the captured one
                else:
                    self.decode_step(slot + 1)
                slot += 1
                steps += 1
        return EpisodeRun(decode_steps=steps, continued_ttft_s=host.ttft, concurrency=in_flight / max(steps, 1),
                          answer_s=host.answer_s)

    def _answer(self, turns: TurnHandler, host: _HostView, slots_left: int) -> bool:
        """The turns that ended since the last look go to ``turns``; its answers, and those that came back from the
        background, go into the buffers (waiting for those of rows that cannot wait another look: ``slots_left``).
        True when every episode here is over."""
        active_t, out_at, fed = torch.stack((self.active.long(), self.out_at, self.pos - self.width)).cpu().tolist()
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
        # A row resumed at the next look instead of now needs check_every more slots on top of the rest of its episode:
        # where they are not there, its answer is waited for now (the others wait with it).
        k = self.check_every
        while any(slots_left < k + (self.budget - fed[r]) + (self.max_turns - host.turns[r] + 1) * k + 1
                  for r in host.answering):
            answered = host.timed(turns.answered, True)
            if not answered:
                raise RuntimeError(f"rows {sorted(host.answering)} wait for the environment, which answers none of them")
            for r, answer in answered:
                host.answering.discard(r)
                decided.append((r, answer))
        resumed: list[tuple[int, list[int], int]] = []
        for r, answer in decided:
            if answer is None:
                host.done[r] = True
                continue
            block = [host.last_token[r], *answer.appended]
            if answer.room < 1 or len(block) > self.forced.shape[1]:
                raise ValueError(f"episode {r}: a next turn of room {answer.room} after a block of {len(block)} tokens "
                                 f"does not fit its budget ({self.budget} tokens)")
            resumed.append((r, block, answer.room))
        if resumed:
            self._resume(resumed)
            host.resumed([r for r, _, _ in resumed], out_at)
        return all(host.done)

    def _resume(self, resumed: list[tuple[int, list[int], int]]) -> None:
        """The rows' blocks, rooms and ``active`` written in place (the captured step reads these tensors)."""
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
                 max_turns: int) -> tuple[EpisodeRun, GenerationStats]:
    """A batch of episodes on ``decoder``: ``n`` rows per prompt, the first turns up to ``params.max_new_tokens``
    tokens, later ones as ``turns`` answers; what it cost, and the decoder's stats of it (the environment's time out of
    ``decode_s``)."""
    k, background = episode_check_every(decoder.stages.device), turns.background

    def make(width: int | None) -> EpisodeGeneration:
        return EpisodeGeneration.for_episodes(decoder.stages, prompts, n, params, decoder.vocab_size, generator, budget,
                                              max_turns, k, background, width)

    with generation_mode(decoder.engine):
        run, keep = decoder.prepared(("episodes", budget, max_turns, k, background), prompts, n, params, generator, make)
        started = time.perf_counter()
        run.prefill()
        run.synchronize()
        prefill_s = time.perf_counter() - started
        result = run.play(turns, decoder.graphs, decoder.peers_done)
        run.synchronize()
        keep()
    path = decoder.path.replace("CUDA-graph", "eager (capture failed)") if run.capture_failed else decoder.path
    stats = GenerationStats(path=f"{path}, episodes without a turn barrier", tokens=int(run.out_at.sum()),
                            prefill_s=prefill_s, decode_steps=result.decode_steps,
                            decode_s=time.perf_counter() - started - prefill_s - result.answer_s,
                            kv_cache_bytes=run.cache.nbytes, capture_s=run.capture_s)
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
