"""The training and evaluation prompts: loaded from Oumi's dataset registry and checked before any heavy work.

A bad data file must be reported before the model is converted (minutes, hours at 70B), in one
message naming the file, the row and the fix: a missing or empty file, a line that is not JSON or
not UTF-8, a row without the ``prompt`` column (or that the dataset class cannot transform).
Every row is transformed once here, so no step later meets a row it cannot use. ``oumi-megatron validate`` reads
each dataset's first rows the same way (``dataset_heads``), collecting every dataset's problem, before any GPU is
touched.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oumi_megatron.config.problems import Problem
from oumi_megatron.errors import UserInputError
from oumi_megatron.plugins import load_plugins

if TYPE_CHECKING:
    from oumi_megatron.config.training_config import MegatronTrainingConfig


class DataError(UserInputError):
    """A training data file or row that cannot be used; the message names the file, the row and the fix."""


HEAD_ROWS = 8
"""Rows per dataset ``oumi-megatron validate`` loads and transforms (training checks every row at its start)."""


@dataclass
class DatasetHead:
    """The first rows of one dataset of ``data.train`` / ``data.validation``, as its Oumi dataset class transforms them,
    or why they could not be read (``problem``: the config cannot train; ``warning``: not checkable here, e.g. a Hub
    dataset offline)."""

    where: str
    """``data.train.datasets[0]``."""
    name: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    total: int | None = None
    """The dataset's rows, where counted cheaply (a local jsonl's lines, a loaded dataset's length)."""
    problem: Problem | None = None
    warning: str | None = None


class PromptDataset:
    """The rows of several datasets as one sequence (``data.train.datasets`` in order); ``rows`` gives, per
    dataset, the row numbers it contributes (default: all of them, in order)."""

    def __init__(self, parts: list[Any], rows: list[list[int]] | None = None,
                 sources: list[tuple[str, str]] | None = None) -> None:
        """``sources``: each part's (field, dataset name), ``("data.train.datasets[0]", "openai/gsm8k")``."""
        self.parts = parts
        self.rows = rows if rows is not None else [list(range(len(p))) for p in parts]
        self.sizes = [len(r) for r in self.rows]
        self.sources = sources or [(f"dataset {i}", "") for i in range(len(parts))]

    def __len__(self) -> int:
        return sum(self.sizes)

    def heads(self, rows: int = HEAD_ROWS) -> list[DatasetHead]:
        """Each dataset's first ``rows`` rows (already checked), for the checks that read rows (the rewards' arguments)."""
        return [DatasetHead(where, name, [dict(part[j]) for j in range(min(rows, len(part)))], len(part))
                for (where, name), part in zip(self.sources, self.parts)]

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


def _jsonl_line(raw: bytes, number: int, path: Path, where: str) -> str | None:
    """One line of a jsonl file as text (None: blank); a clear error where it is not one UTF-8 JSON object."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: {path} line {number} is not valid UTF-8 ({e.reason} at byte {e.start}). "
                        "Save the file as UTF-8.") from e
    if not line.strip():
        return None
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: {path} line {number} is not valid JSON ({e.msg} at column {e.colno}). "
                        "Each line must be one JSON object.") from e
    except (ValueError, RecursionError) as e:  # a number past Python's digit limit; nesting past the recursion limit
        why = "nested too deep" if isinstance(e, RecursionError) else str(e).split(";")[0]
        raise DataError(f"{where}: {path} line {number} cannot be read as JSON ({why}). Fix or remove the row.") from e
    if not isinstance(value, dict):
        raise DataError(f"{where}: {path} line {number} is a JSON {type(value).__name__}, not an object "
                        "with the dataset's columns.")
    return line


def _scan_jsonl(path: Path, where: str, limit: int | None = None) -> list[tuple[int, str]]:
    """(line number, text) of the rows of a local jsonl file (the first ``limit``); a clear error for the first bad
    line."""
    if not path.is_file():
        raise DataError(f"{where}: {path} does not exist. Fix dataset_path (relative paths start at the folder "
                        "you launch from).")
    rows: list[tuple[int, str]] = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if limit is not None and len(rows) == limit:
                break
            line = _jsonl_line(raw, number, path, where)
            if line is not None:  # the text kept for a head only: a whole file's stays on disk
                rows.append((number, (line if line.endswith("\n") else line + "\n") if limit is not None else ""))
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
    sources: list[tuple[str, str]] = []
    for i, d in enumerate(getattr(config.data, split).datasets):
        sources.append((f"data.{split}.datasets[{i}]", str(d.dataset_name)))
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
                lines = [number for number, _ in _scan_jsonl(path, where)]
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
    prompts = PromptDataset(parts, rows, sources)
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
        sets[prefix] = PromptDataset([everything.parts[i] for i in mine], [everything.rows[i] for i in mine],
                                     [everything.sources[i] for i in mine])
    return sets


def _unregistered(name: str, where: str) -> Problem:
    from oumi.core.registry import REGISTRY, RegistryType

    known = sorted(REGISTRY.get_all(RegistryType.DATASET))
    close = difflib.get_close_matches(name.lower(), known, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return Problem(f"{where}.dataset_name", f"{name!r} is not a registered Oumi dataset.{hint} GRPO datasets (e.g. "
                   "openai/gsm8k, d1shs0ap/countdown) are; register your own with @register_dataset in a module named in "
                   "grpo.plugins (and on PYTHONPATH).")


def _unreachable(e: BaseException) -> bool:
    """Whether loading failed because the Hub cannot be reached (offline), not because the dataset is wrong."""
    text = f"{type(e).__name__}: {e}"
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or os.environ.get("HF_DATASETS_OFFLINE")
    return ("Couldn't reach" in text or "OfflineModeIsEnabled" in text or "offline" in text.lower()
            or (bool(offline) and isinstance(e, (ConnectionError, OSError))))


def dataset_heads(config: MegatronTrainingConfig, split: str = "train", rows: int = HEAD_ROWS) -> list[DatasetHead]:
    """Each dataset of ``data.<split>``: registered with Oumi, its ``dataset_path`` present, its first ``rows`` rows
    loaded through its Oumi class (a local jsonl: only those lines are read) and each transformed into a usable prompt.
    Collects every dataset's problem instead of stopping at the first (``oumi-megatron validate``)."""
    from oumi.core.registry import REGISTRY

    load_plugins(config.grpo.plugins)
    heads = []
    for i, d in enumerate(getattr(config.data, split).datasets):
        where = f"data.{split}.datasets[{i}]"
        head = DatasetHead(where, str(d.dataset_name))
        heads.append(head)
        cls = REGISTRY.get_dataset(d.dataset_name, subset=d.subset)
        if cls is None:
            head.problem = _unregistered(str(d.dataset_name), where)
            continue
        if d.sample_count is not None and (d.shuffle or d.sample_count < 1):
            head.problem = Problem(f"{where}.shuffle" if d.shuffle else f"{where}.sample_count",
                                   "sample_count with shuffle: true is not supported by MEGATRON_GRPO (the trainer shuffles "
                                   "the prompts itself): set shuffle: false to use the first sample_count rows." if d.shuffle
                                   else f"is {d.sample_count}: use at least 1 row, or null for all of them.")
            continue
        path = Path(d.dataset_path).expanduser() if d.dataset_path else None
        if path is not None and not path.exists():
            head.problem = Problem(f"{where}.dataset_path", f"{path} does not exist (relative paths start at the folder "
                                   f"you launch from, here {Path.cwd()}). Fix dataset_path, or remove it to load "
                                   f"{d.dataset_name} from the Hugging Face Hub.")
            continue
        try:
            head.rows, head.total = _first_rows(cls, d, path, where, rows)
        except DataError as e:
            field_name = f"{where}.dataset_path" if path is not None else f"{where}.dataset_name"
            head.problem = Problem(field_name, str(e).removeprefix(f"{where}: "))
        except Exception as e:  # noqa: BLE001 - the dataset class's own failure, reported with the dataset
            if path is None and _unreachable(e):
                head.warning = (f"{where} ({d.dataset_name}): its rows were not checked: the Hugging Face Hub cannot be "
                                f"reached ({type(e).__name__}). Training downloads it (or set dataset_path to a local copy).")
            else:
                source = path if path is not None else d.dataset_name
                head.problem = Problem(f"{where}.dataset_path" if path is not None else f"{where}.dataset_name",
                                       f"cannot load {source} with {cls.__name__}: {type(e).__name__}: {e}")
    return heads


def _first_rows(cls: Any, d: Any, path: Path | None, where: str, rows: int) -> tuple[list[dict[str, Any]], int | None]:
    """The first ``rows`` rows of one dataset, transformed; DataError naming the row where one is unusable."""
    kwargs = dict(dataset_name=d.dataset_name, subset=d.subset, split=d.split, **(d.dataset_kwargs or {}))
    if path is not None and path.suffix.lower() == ".jsonl":
        lines = _scan_jsonl(path, where, rows)
        with path.open("rb") as f:
            total = sum(1 for line in f if line.strip())
        with tempfile.TemporaryDirectory() as tmp:  # the class reads only these lines, as it reads the whole file
            head_file = Path(tmp) / path.name
            head_file.write_text("".join(text for _, text in lines), encoding="utf-8")
            dataset = cls(dataset_path=str(head_file), **kwargs)
            out = [_transformed(dataset, index, f"{path} line {number}", cls, d, where)
                   for index, (number, _) in enumerate(lines[: len(dataset)])]
        return out, total
    dataset = cls(dataset_path=str(path) if path is not None else None, **kwargs)
    if len(dataset) == 0:
        raise DataError(f"{where}: {path or d.dataset_name} has no rows. Point it at data with prompts.")
    return [_transformed(dataset, index, f"{path or d.dataset_name} row {index}", cls, d, where)
            for index in range(min(rows, len(dataset)))], len(dataset)


def _transformed(dataset: Any, index: int, row_name: str, cls: Any, d: Any, where: str) -> dict[str, Any]:
    try:
        row = dataset[index]
    except Exception as e:  # noqa: BLE001 - the dataset class's transform of a malformed row
        raise DataError(f"{where}: {row_name} cannot be read by {cls.__name__}: {type(e).__name__}: {e}. Fix or remove "
                        "the row, or the class's transform.") from e
    problem = _check_prompt(row)
    if problem is not None:
        raise DataError(f"{where}: {row_name} {problem}. Every row needs a prompt (a {d.dataset_name} row as "
                        f"{cls.__name__}'s transform makes it: return a 'prompt', text or chat messages).")
    return dict(row)


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
