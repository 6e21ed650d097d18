"""Rollout dumps (``grpo.rollout_dump_steps``, verl's ``rollout_data_dir``): every N-th step's samples, token for token.

Each data-parallel rank's samples go to ``output_dir/rollouts/step_XXXXXX_rank_XXXXX.jsonl`` (the rank: its DP rank),
written by its replica's first rank (the other ranks of a replica hold the same samples), one JSON line per sample:
``prompt_ids``, ``completion_ids``, ``loss_mask`` (null for single-turn samples: every token is the policy's),
``logprobs`` (the engine's), ``reward`` (the weighted reward functions; null where the reward was skipped or the
episode failed), ``turns``, ``finished``, ``round`` (dynamic sampling's generation round), and ``prompt`` / ``text``:
the prompt and the completion decoded with their special tokens, so the chat template's turns and the environment's
observations read as the model saw them. A step's file appears whole or not at all (a temporary file, renamed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from oumi_megatron.rollout.base import Rollout


class RolloutDump:
    """The samples of the steps ``grpo.rollout_dump_steps`` names, gathered per step and written at its end."""

    def __init__(self, folder: Path, every: int, writes: bool) -> None:
        """``writes``: whether this rank writes its replica's samples (the replica's first rank)."""
        self.folder, self.every, self.writes = folder, every, writes
        self.lines: list[str] = []

    def wanted(self, step: int) -> bool:
        """Whether GRPO step ``step + 1``'s samples are dumped here."""
        return self.writes and self.every > 0 and (step + 1) % self.every == 0

    def add(self, step: int, round_index: int, tokenizer: Any, rollouts: list[Rollout], rewards: list[float | None],
            turns: list[int]) -> None:
        if not self.wanted(step):
            return
        prompts = tokenizer.batch_decode([r.prompt_ids for r in rollouts], skip_special_tokens=False)
        texts = tokenizer.batch_decode([r.completion_ids for r in rollouts], skip_special_tokens=False)
        for r, reward, turn, prompt, text in zip(rollouts, rewards, turns, prompts, texts, strict=True):
            self.lines.append(json.dumps({
                "prompt_ids": r.prompt_ids, "completion_ids": r.completion_ids, "loss_mask": r.loss_mask,
                "logprobs": r.logprobs, "reward": reward, "turns": turn, "finished": r.finished, "round": round_index,
                "prompt": prompt, "text": text}))

    def write(self, step: int, dp_rank: int) -> Path | None:
        """The step's file (temporary file, then renamed); None where nothing is dumped."""
        if not self.wanted(step):
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"step_{step + 1:06d}_rank_{dp_rank:05d}.jsonl"
        tmp = path.with_name(f".{path.name}.partial")
        tmp.write_text("".join(line + "\n" for line in self.lines))
        os.replace(tmp, path)
        self.lines = []
        return path
