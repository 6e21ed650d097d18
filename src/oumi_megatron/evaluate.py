"""``oumi-megatron eval -c cfg.yaml --model DIR``: the training run's held-out evaluation for any HF folder.

The same prompts (``data.validation``), rewards, generation limits and rollout backend as the
evaluation during training (trainer/evaluation.py), so the base model, an exported ``hf_model`` and the
run's own ``eval/`` metrics (and those of every eval set, ``grpo.eval_metric_prefixes``) are directly comparable.
The weights are read in memory by Megatron-Bridge (nothing is converted on disk); the layout is the config's (TP/PP under torchrun).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from oumi_megatron.data import load_eval_sets
from oumi_megatron.errors import UserInputError
from oumi_megatron.validation import validate_config


def evaluate_hf_model(config: Any, model_dir: str | None = None, log: Any = None, samples: int = 1) -> dict[str, float]:
    """Collective: greedy eval of ``model_dir`` (default: ``model.model_name``) on ``data.validation``; ``samples`` > 1:
    that many sampled completions per prompt (pass@k)."""
    if samples < 1:
        raise UserInputError(f"--samples {samples}: sample at least 1 completion per prompt (1: greedy).")
    if model_dir is not None:
        config.model.model_name = str(model_dir)
    if not (config.data.validation and config.data.validation.datasets):
        raise UserInputError("data.validation has no datasets, so there is nothing to evaluate on. Add the held-out "
                             "prompts under data.validation.datasets (e.g. dataset_name: openai/gsm8k with "
                             "dataset_path: data/arithmetic_eval_seen.jsonl).")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config.training.eval_strategy = "no"  # this is the evaluation; the training schedule does not apply
    layout = validate_config(config, world_size=world_size).require_layout()
    eval_sets = load_eval_sets(config, log=log)

    from oumi_megatron.assembly import evaluate_model

    return evaluate_model(config, layout, eval_sets, samples=samples)


def write_metrics(metrics: dict[str, float], path: str | Path) -> None:
    """The metrics as one JSON object (atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    tmp.replace(path)
