"""The training and evaluation prompts: loaded from Oumi's dataset registry and checked before any heavy work.

A bad data file must be reported before the model is converted (minutes, hours at 70B), in one
message naming the file, the row and the fix: a missing or empty file, a line that is not JSON or
not UTF-8, a row without the ``prompt`` column (or that the dataset class cannot transform).
Every row is transformed once here, so no step later meets a row it cannot use.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oumi_megatron.errors import UserInputError
from oumi_megatron.plugins import load_plugins

if TYPE_CHECKING:
    from oumi_megatron.config.training_config import MegatronTrainingConfig


class DataError(UserInputError):
    """A training data file or row that cannot be used; the message names the file, the row and the fix."""


class PromptDataset:
    """The rows of several datasets as one sequence (``data.train.datasets`` in order); ``rows`` gives, per
    dataset, the row numbers it contributes (default: all of them, in order)."""

    def __init__(self, parts: list[Any], rows: list[list[int]] | None = None) -> None:
        self.parts = parts
        self.rows = rows if rows is not None else [list(range(len(p))) for p in parts]
        self.sizes = [len(r) for r in self.rows]

    def __len__(self) -> int:
        return sum(self.sizes)

    def __getitem__(self, i: int) -> Any:
        for part, rows in zip(self.parts, self.rows):
            if i < len(rows):
                return part[rows[i]]
            i -= len(rows)
        raise IndexError(i)


def sampled_rows(size: int, sample_count: int | None) -> list[int]:
    """Oumi's ``sample_count`` without shuffling (oumi/builders/data.py): the first ``sample_count`` rows; more
    than the dataset has repeats it whole, then its first rows."""
    if sample_count is None:
        return list(range(size))
    return [i % size for i in range(sample_count)]


def _scan_jsonl(path: Path, where: str) -> list[int]:
    """Line numbers of the rows of a local jsonl file; a clear error for the first bad line."""
    if not path.is_file():
        raise DataError(f"{where}: {path} does not exist. Fix dataset_path (relative paths start at the folder "
                        "you launch from).")
    rows = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: {path} line {number} is not valid UTF-8 ({e.reason} at byte {e.start}). "
                                "Save the file as UTF-8.") from e
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: {path} line {number} is not valid JSON ({e.msg} at column {e.colno}). "
                                "Each line must be one JSON object.") from e
            if not isinstance(value, dict):
                raise DataError(f"{where}: {path} line {number} is a JSON {type(value).__name__}, not an object "
                                "with the dataset's columns.")
            rows.append(number)
    if not rows:
        raise DataError(f"{where}: {path} has no rows. Point dataset_path at a file with prompts.")
    return rows


def _check_prompt(row: Any) -> str | None:
    """What is wrong with a transformed row's ``prompt`` (None if usable)."""
    if not isinstance(row, dict) or "prompt" not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        return f"has no 'prompt' column (it has {keys})"
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return None if prompt.strip() else "has an empty 'prompt'"
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        contents = [m.get("content") for m in prompt]
        if not all(isinstance(c, str) for c in contents):
            # pandas fills a column that other rows have with NaN: this row has no prompt
            return "has no prompt text (its 'prompt' is missing or not text)"
        return None if any(c.strip() for c in contents) else "has an empty 'prompt'"
    return "has a 'prompt' that is neither text nor a list of chat messages ({'role': ..., 'content': ...})"


def load_prompts(config: MegatronTrainingConfig, log: Any = None, split: str = "train") -> PromptDataset:
    """``data.train`` (or ``data.validation``, the eval prompts) through Oumi's dataset registry, every
    row transformed and checked once."""
    from oumi.core.registry import REGISTRY

    load_plugins(config.grpo.plugins)  # a plugin may register the dataset (the demo's does)
    started = time.perf_counter()
    parts: list[Any] = []
    rows: list[list[int]] = []
    for i, d in enumerate(getattr(config.data, split).datasets):
        where = f"data.{split}.datasets[{i}] ({d.dataset_name})"
        cls = REGISTRY.get_dataset(d.dataset_name, subset=d.subset)
        if cls is None:
            raise DataError(
                f"{where}: {d.dataset_name!r} is not a registered Oumi dataset. GRPO datasets (e.g. openai/gsm8k, "
                "d1shs0ap/countdown, and oumi-megatron/char-class from grpo.plugins: [oumi_megatron.examples.demo_task]) are; register "
                "your own with @register_dataset in a module named in grpo.plugins."
            )
        if split == "train" and getattr(cls, "eval_only", False):
            raise DataError(f"{where}: {d.dataset_name!r} is an evaluation set (its class says eval_only): it is never "
                            "trained on. Move it under data.validation.datasets.")
        lines = None
        path = Path(d.dataset_path).expanduser() if d.dataset_path else None
        if path is not None:
            if path.suffix.lower() == ".jsonl":
                lines = _scan_jsonl(path, where)
            elif not path.exists():
                raise DataError(f"{where}: {path} does not exist. Fix dataset_path.")
        source = str(path) if path is not None else d.dataset_name
        try:
            dataset = cls(dataset_name=d.dataset_name, dataset_path=d.dataset_path, subset=d.subset, split=d.split,
                          **(d.dataset_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - pandas / datasets errors do not name the file
            raise DataError(f"{where}: cannot load {source}: {type(e).__name__}: {e}") from e
        if len(dataset) == 0:
            raise DataError(f"{where}: {source} has no rows. Point it at data with prompts.")
        if d.sample_count is not None and d.shuffle:
            raise DataError(f"{where}: sample_count with shuffle: true is not supported by MEGATRON_GRPO (the trainer "
                            "shuffles the training prompts itself). Set shuffle: false to use the first sample_count rows.")
        if d.sample_count is not None and d.sample_count < 1:
            raise DataError(f"{where}: sample_count is {d.sample_count}: use at least 1 row, or null for all of them.")
        rows.append(sampled_rows(len(dataset), d.sample_count))
        for index in range(len(dataset)):
            row_name = f"row {index}" + (f" (line {lines[index]})" if lines and index < len(lines) else "")
            try:
                row = dataset[index]
            except Exception as e:  # noqa: BLE001 - the dataset class's transform of a malformed row
                raise DataError(f"{where}: {source} {row_name} cannot be read by {cls.__name__}: "
                                f"{type(e).__name__}: {e}. Fix or remove the row.") from e
            problem = _check_prompt(row)
            if problem is not None:
                raise DataError(f"{where}: {source} {row_name} {problem}. Every row needs a prompt "
                                f"(a {d.dataset_name} row as {cls.__name__} expects).")
        parts.append(dataset)
    prompts = PromptDataset(parts, rows)
    if log is not None:
        what = "Training" if split == "train" else "Evaluation"
        log.info(f"{what} data: {len(prompts)} prompts checked in {time.perf_counter() - started:.1f} s.")
    return prompts


def load_eval_sets(config: MegatronTrainingConfig, log: Any = None) -> dict[str, PromptDataset]:
    """``data.validation`` as eval sets by metric prefix (``grpo.eval_metric_prefixes``; default: one set, ``eval``),
    each the datasets with that prefix, in order."""
    everything = load_prompts(config, log=log, split="validation")
    prefixes = list(config.grpo.eval_metric_prefixes) or ["eval"] * len(everything.parts)
    sets: dict[str, PromptDataset] = {}
    for prefix in dict.fromkeys(prefixes):
        mine = [i for i, p in enumerate(prefixes) if p == prefix]
        sets[prefix] = PromptDataset([everything.parts[i] for i in mine], [everything.rows[i] for i in mine])
    return sets


def steps_for_epochs(epochs: float, rows: int, prompts_per_step: int) -> int:
    """GRPO steps for ``epochs`` passes over ``rows`` prompts, ``prompts_per_step`` each (the last partial
    step included)."""
    return max(1, math.ceil(epochs * rows / prompts_per_step))


def prompt_token_ids(tokenizer: Any, prompt: Any, limit: int, system: str | None = None) -> tuple[list[int], int]:
    """A row's ``prompt`` (text or chat messages) rendered with the tokenizer's chat template and the
    generation prompt, left-truncated to ``limit`` tokens (as TRL does), and its full length. ``system``: a system
    message first (an environment's instructions, e.g. how to call its tool), before the row's own if it has one."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    if system:
        if messages and messages[0].get("role") == "system":
            messages = [{"role": "system", "content": f"{system}\n\n{messages[0]['content']}"}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": system}, *messages]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return ids[-limit:], len(ids)
