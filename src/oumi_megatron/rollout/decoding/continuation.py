"""Multi-turn episodes on the static cache: each later turn prefills only what was appended (the environment's
observation), never the history again (``EpisodeDecoding``; environments/episodes.py drives it).

One ``_Generation`` serves every turn of a batch of episodes: its cache has room for the longest prompt, the whole
episode budget and one more turn (``width + first turn + budget`` slots), so a later turn works in place on the same
buffers and replays the decode-step CUDA graph the first turn captured (and, with ``rollout_cuda_graphs_kept``, the
one a previous batch of the same shape captured): no capture and no allocation per turn.

Between turns the rows' histories end at different slots (their turns ended at different steps, their observations
differ in length). One continued turn:
1. **Realign.** Every continuing row's cached history is moved, within the cache, so that its history plus its block
   (the tokens not cached yet: a turn's last token, the observation) ends at one slot ``C`` for every row, the longest
   row's end. A key cached at slot ``s`` and moved by ``d`` slots is rotated by ``d`` (RoPE: a key rotated by the
   angle of ``s + d`` is what the layer would have written there), values are moved as they are. So each row stays
   contiguous, and the decode steps after it feed every row at one slot again: the same fixed-shape step (and CUDA
   graph) as a single-turn generation. One gather per layer per turn, about the cost of one decode step's attention
   over the cache.
2. **Extend.** The blocks, left-padded to one width ``L``, run once at slots ``C - L .. C - 1``: their real tokens
   write their keys and values (static_cache.py ``CacheCursor.extend``) and attend to their row's history and to
   the block before them; the last position's logits give each row's first token of the turn.
3. **Decode** as ``StaticCacheDecoder.generate`` does, from slot ``C``; rows that do not continue are finished.

``C`` is at most the longest prompt plus the episode budget (every turn and observation counts against it) and a
later turn's room at most the first turn's, so the cache never overflows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from oumi_megatron.rollout.decoding.decoder import GenerationStats, StaticCacheDecoder, _Generation
from oumi_megatron.rollout.decoding.static_cache import StaticKVCache
from oumi_megatron.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from oumi_megatron.rollout.decoding.policy_stages import PolicyStages


class EpisodeDecoding:
    """The rows of one batch of episodes (``n`` per prompt, rows ``i * n .. i * n + n - 1``) across their turns;
    ``budget`` bounds each episode's whole completion (turns and observations, as ``run_episodes`` counts it)."""

    def __init__(self, decoder: StaticCacheDecoder, prompts: list[list[int]], n: int, generator: torch.Generator,
                 budget: int) -> None:
        self.decoder, self.prompts, self.n, self.generator, self.budget = decoder, prompts, n, generator, budget
        self.run: _Generation | None = None
        self.history: list[list[int]] = [list(p) for p in prompts for _ in range(n)]
        """Per row, the token ids in its cache's order: the prompt, then every turn's and observation's tokens."""

    def history_prompts(self) -> list[list[int]]:
        """Each row's prompt (the first turn's ``Rollout.prompt_ids``)."""
        return [list(p) for p in self.prompts for _ in range(self.n)]

    def first_turn(self, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor, GenerationStats]:
        """The prompts' first turn; the caller hands each row's kept tokens to ``keep``."""
        d = self.decoder
        with d.engine.generation_mode():
            self.run, keep = d.prepare(self.prompts, self.n, params, self.generator, extra_slots=self.budget)
            out = d.run(self.run, self.run.prefill)
            keep()  # for the next batch of this shape: it refills the buffers once this batch's turns are over
        return out

    def next_turn(self, appended: list[list[int] | None],
                  params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor, GenerationStats]:
        """The next turn of the rows whose ``appended`` is not None (those ids follow the row's last turn); the other
        rows are done (their tokens in the result are padding). ``params.max_new_tokens`` may not pass the first
        turn's. The caller hands the kept tokens to ``keep``."""
        assert self.run is not None, "first_turn comes first"
        d = self.decoder
        with d.engine.generation_mode():
            extend = _continue_in_place(self.run, self.history, appended, params)
            out = d.run(self.run, extend)
        for r, a in enumerate(appended):
            if a is not None:
                self.history[r] += a
        return out

    def keep(self, turns: list[list[int] | None]) -> None:
        """Each continuing row's new turn (its tokens up to and including its EOS, as the caller returned them) joins
        its history; None: the row did not continue."""
        for r, ids in enumerate(turns):
            if ids is not None:
                self.history[r] += ids


def _continue_in_place(run: _Generation, history: list[list[int]], appended: list[list[int] | None],
                       params: SamplingParams) -> Callable[[], None]:
    """``run`` set up for a new turn over its realigned cache, and that turn's prefill (the blocks)."""
    stages, device = run.stages, run.stages.device
    rows, slots = len(history), run.valid.shape[1]
    valid = run.valid.cpu()
    pending = int(run.cursor.slot)
    if pending < slots:  # the slot of each row's last token picked: marked valid, never fed (not cached)
        valid[:, pending] = False
    cached = valid.sum(dim=1).tolist()  # the first ``cached[r]`` ids of history[r] are in the cache, contiguous
    end = [int(torch.nonzero(v).max()) + 1 if c else 0 for v, c in zip(valid, cached)]
    blocks: list[list[int]] = []
    for r, extra in enumerate(appended):
        if extra is None:
            blocks.append([])
            continue
        block = history[r][cached[r]:] + list(extra)  # e.g. the turn's last token, never fed, then the observation
        if not block:  # nothing new: the last cached token runs again, for the logits of what follows it
            cached[r], end[r] = cached[r] - 1, end[r] - 1
            block = history[r][-1:]
        blocks.append(block)
    going = [a is not None for a in appended]
    lengths = [len(b) for b in blocks]
    C = max((cached[r] + lengths[r] for r in range(rows) if going[r]), default=1)
    L = max((lengths[r] for r in range(rows) if going[r]), default=1)
    room = max(params.max_new_tokens, 1)
    if C + room > slots or room > run.tokens.shape[1]:
        raise ValueError(f"an episode's turn does not fit its cache: history and block end at slot {C}, the turn "
                         f"needs {room} more of {slots} slots (at most {run.tokens.shape[1]} per turn); the episodes' "
                         "budget bounds every turn and observation together (EpisodeDecoding's budget)")
    shift = [C - lengths[r] - end[r] if going[r] else 0 for r in range(rows)]
    new_valid = torch.zeros(rows, slots, dtype=torch.bool)
    for r in range(rows):
        if going[r]:
            new_valid[r, C - lengths[r] - cached[r]:C - lengths[r]] = True
    new_valid = new_valid.to(device)
    _realign(stages, run.cache, torch.tensor(shift), new_valid)
    run.use(params, C)
    run.restart(new_valid)

    def extend() -> None:
        _extend(run, blocks, going, cached, C, L)

    return extend


def _realign(stages: PolicyStages, cache: StaticKVCache, shift: torch.Tensor, valid: torch.Tensor) -> None:
    """Each layer's keys and values with row ``r`` moved ``shift[r]`` slots (keys rotated by as many positions), in
    place (a captured graph reads these tensors); zeros where ``valid`` is False."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    device, slots = valid.device, valid.shape[1]
    source = (torch.arange(slots)[None, :] - shift[:, None]).clamp(0, slots - 1).to(device)
    keep = valid[:, None, :, None]
    freqs = None
    table = stages.rotary_table(int(shift.abs().max()) + 1)
    if table is not None and bool(shift.any()):
        angles = table[shift.abs().to(device)]  # [rows, 1, 1, rot]: the angle of |shift|, negated for a shift left
        freqs = (angles * shift.sign().to(device, angles.dtype)[:, None, None, None]).transpose(0, 1)  # [1, rows, 1, rot]
    for keys, values in cache.layers:
        index = source[:, None, :, None].expand(keys.shape[0], keys.shape[1], slots, keys.shape[3])
        moved_keys = keys.gather(2, index)  # a copy: the layer's tensors are then overwritten whole
        if freqs is not None:  # [slots, rows, heads, dim] as Megatron-Core's RoPE takes it
            moved_keys = apply_rotary_pos_emb(moved_keys.permute(2, 0, 1, 3), freqs, config=stages.config)
            moved_keys = moved_keys.permute(1, 2, 0, 3)
        keys.copy_(moved_keys * keep)
        values.copy_(values.gather(2, index) * keep)


def _extend(run: _Generation, blocks: list[list[int]], going: list[bool], cached: list[int], C: int, L: int) -> None:
    """The blocks at slots ``C - L .. C - 1`` (left-padded): their keys and values into the cache, then each
    continuing row's first token of the turn from the last position's logits."""
    stages, device, pad = run.stages, run.stages.device, run.params.pad_token_id
    rows = len(blocks)
    ids = torch.full((rows, L), pad, dtype=torch.long)
    real = torch.zeros(rows, L, dtype=torch.bool)
    positions = torch.zeros(rows, L, dtype=torch.long)
    for r, block in enumerate(blocks):
        if block:
            ids[r, L - len(block):] = torch.tensor(block)
            real[r, L - len(block):] = True
            positions[r, L - len(block):] = torch.arange(cached[r], cached[r] + len(block))
    slots = run.valid.shape[1]
    allowed = run.valid.cpu()[:, None, :].expand(rows, L, slots).clone()  # each row's history
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    # the block, up to each position (a shorter block's padding slots hold the end of its row's history)
    allowed[:, :, C - L:C] |= causal[None] & real[:, None, :]
    allowed[:, :, 0] |= ~real  # a padding position attends somewhere (its output is never used): no empty softmax
    allowed = allowed.to(device)
    mask = ~allowed[:, None] if run.neg_inf is None else torch.where(allowed[:, None], run.zero, run.neg_inf)
    row, position = torch.nonzero(real, as_tuple=True)
    run.cursor.extend = (row.to(device), position.to(device), (C - L + position).to(device))
    rotary = None if run.rotary is None else run.rotary[C - L:C]
    try:
        with run.cache.attached():
            logits = stages.forward(ids.to(device), positions.to(device), mask, rotary)
    finally:
        run.cursor.extend = None
    run.valid[:, C - L:C] |= real.to(device)
    run.cursor.slot.fill_(C)
    run.finished.copy_(~torch.tensor(going, device=device))
    run._record(logits)
