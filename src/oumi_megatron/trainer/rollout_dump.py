"""Rollout dumps (``grpo.rollout_dump_steps``, verl's ``rollout_data_dir``): every N-th step's samples, token for token,
and their reader (``oumi-megatron rollouts`` shows them: rollout_view.py).

Each data-parallel rank's samples go to ``output_dir/rollouts/step_XXXXXX_rank_XXXXX.jsonl`` (the rank: its DP rank),
written by its replica's first rank (the other ranks of a replica hold the same samples), one JSON line per sample, as
scored (every round's, before dynamic sampling chooses): the ``Sample``'s fields (rollout/sample.py) but its advantage
(not known yet): ``prompt_ids``, ``completion_ids``, ``group``, ``status`` (finished / truncated / failed) and
``failure``, ``logprobs`` (the engine's), ``loss_mask`` (null for single-turn samples: every token is the policy's),
``versions`` (each completion token's policy version), ``turns``, ``tool_calls``, ``env_info``, ``round`` (dynamic
sampling's generation round), ``reward`` (the weighted reward functions; null where the reward was skipped or the
episode failed), ``rewards`` (each function's) and ``overlong_penalty``; then ``finished`` (the status is finished),
``prompt`` / ``text``: the prompt and the completion decoded with their special tokens, so the chat template's turns
and the environment's observations read as the model saw them, and ``completion_tokens``: each completion token decoded
on its own (a character split over two tokens shows as U+FFFD in each). A step's file appears whole or not at all (a
temporary file, renamed).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from oumi_megatron.errors import UserInputError
from oumi_megatron.rollout.sample import Sample

DUMP_NAME = re.compile(r"step_(\d{6,})_rank_(\d{5,})\.jsonl")
"""A dump file's name: its GRPO step and its data-parallel rank."""


_NOT_KNOWN_YET = ("advantage", "trainable")
"""A ``Sample``'s fields the advantage phase fills, after the dump is taken."""


class RolloutDump:
    """The samples of the steps ``grpo.rollout_dump_steps`` names, gathered per step and written at its end."""

    def __init__(self, folder: Path, every: int, writes: bool) -> None:
        """``writes``: whether this rank writes its replica's samples (the replica's first rank)."""
        self.folder, self.every, self.writes = folder, every, writes
        self.lines: list[str] = []

    def wanted(self, step: int) -> bool:
        """Whether GRPO step ``step + 1``'s samples are dumped here."""
        return self.writes and self.every > 0 and (step + 1) % self.every == 0

    def add(self, step: int, tokenizer: Any, samples: list[Sample]) -> None:
        """``samples`` (scored) into GRPO step ``step + 1``'s file, if it is dumped."""
        if not self.wanted(step):
            return
        prompts = tokenizer.batch_decode([s.prompt_ids for s in samples], skip_special_tokens=False)
        texts = tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=False)
        pieces = tokenizer.batch_decode([[i] for s in samples for i in s.completion_ids], skip_special_tokens=False)
        start = 0
        for sample, prompt, text in zip(samples, prompts, texts, strict=True):
            tokens, start = pieces[start:start + len(sample.completion_ids)], start + len(sample.completion_ids)
            line = {f.name: getattr(sample, f.name) for f in fields(Sample) if f.name not in _NOT_KNOWN_YET}
            line.update(status=sample.status.value, finished=sample.finished, prompt=prompt, text=text,
                        completion_tokens=tokens)
            # an environment's info is the user's: a value JSON cannot hold is written as its text
            self.lines.append(json.dumps(line, default=str))

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


class RolloutDumpError(UserInputError):
    """A path that holds no rollout dumps, or a dump line that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class DumpFile:
    step: int | None
    """The GRPO step, from the file's name (None: a file renamed by hand)."""
    rank: int | None
    """The data-parallel rank whose samples it holds."""
    path: Path


def find_dumps(path: str | Path) -> list[DumpFile]:
    """The dump files at ``path``: a run's ``output_dir`` (its ``rollouts/``), a ``rollouts/`` folder, or one file;
    by step, then rank."""
    path = Path(path).expanduser()
    if not path.exists():
        raise RolloutDumpError(f"{path} does not exist. Give a run's output_dir, its rollouts/ folder or one "
                               "step_XXXXXX_rank_XXXXX.jsonl file.")
    if path.is_file():
        match = DUMP_NAME.fullmatch(path.name)
        return [DumpFile(int(match.group(1)), int(match.group(2)), path) if match else DumpFile(None, None, path)]
    folder = path / "rollouts" if (path / "rollouts").is_dir() else path
    found = [DumpFile(int(m.group(1)), int(m.group(2)), p) for p in folder.iterdir() if (m := DUMP_NAME.fullmatch(p.name))]
    found.sort(key=lambda d: (d.step or 0, d.rank or 0))
    if not found:
        raise RolloutDumpError(f"{path} holds no rollout dumps (step_XXXXXX_rank_XXXXX.jsonl{' in rollouts/' if folder != path else ''}). "
                               "A run writes them every grpo.rollout_dump_steps steps (0, the default, writes none).")
    return found


_LISTS = ("prompt_ids", "completion_ids")
_PER_TOKEN = ("loss_mask", "logprobs", "completion_tokens")


def read_dump(path: Path) -> list[dict[str, Any]]:
    """The samples of one dump file, each line checked: a JSON object with the token lists, per-token fields as long as
    the completion; a clear error naming the file, the line and the field otherwise."""
    samples = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path} line {number}"
            try:
                sample = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RolloutDumpError(f"{where} is not a JSON line ({e}); a dump file holds one JSON object per "
                                       "sample (was it cut short or edited?).") from e
            if not isinstance(sample, dict):
                raise RolloutDumpError(f"{where} is a JSON {type(sample).__name__}, not a sample object.")
            for key in _LISTS:
                if not isinstance(sample.get(key), list) or not all(isinstance(i, int) for i in sample[key]):
                    raise RolloutDumpError(f"{where}: '{key}' is missing or not a list of token ids; not a rollout dump.")
            n = len(sample["completion_ids"])
            for key in _PER_TOKEN:
                value = sample.get(key)
                if value is not None and (not isinstance(value, list) or len(value) != n):
                    raise RolloutDumpError(f"{where}: '{key}' has {len(value) if isinstance(value, list) else value!r} "
                                           f"entries for {n} completion tokens.")
            samples.append(sample)
    return samples


def mask_runs(sample: dict[str, Any]) -> list[tuple[int, int, bool]]:
    """(start, end, the policy's) of each run of equal loss-mask values over the completion: the policy's turns
    (trained) and the environment's observations (not trained); one policy run where the sample has no mask."""
    n = len(sample["completion_ids"])
    mask = sample.get("loss_mask") or [1] * n
    runs: list[tuple[int, int, bool]] = []
    for i, m in enumerate(mask):
        if runs and runs[-1][2] == bool(m):
            runs[-1] = (runs[-1][0], i + 1, bool(m))
        else:
            runs.append((i, i + 1, bool(m)))
    return runs
