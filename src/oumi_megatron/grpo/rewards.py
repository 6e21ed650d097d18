"""Reward functions from Oumi's REWARD_FUNCTION registry, weighted and checked.

Oumi registers functions in two conventions; both are supported:
- TRL style, called once per batch: ``fn(completions=[str], prompts=[str], **dataset_columns, **kwargs) -> [float]``
- verl style, called per sample: ``fn(data_source, solution_str, ground_truth, extra_info, **kwargs) -> float``
  (ground_truth from the row's ``reward_model.ground_truth``, as Oumi's GRPO datasets produce).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from oumi_megatron.grpo.reward_metrics import RewardsAndMetrics


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned a non-finite value (grpo.on_reward_error: raise)."""


@dataclass
class RewardResult:
    total: torch.Tensor
    """[N] weighted sum of the functions' rewards (0 for invalid samples)."""
    valid: torch.Tensor
    """[N] False for samples dropped under grpo.on_reward_error: skip."""
    per_function: dict[str, torch.Tensor] = field(default_factory=dict)
    """[N] each function's reward (0 for invalid samples), then the metrics functions declare (``<name>/<metric>``)."""
    errors: list[str] = field(default_factory=list)
    """Why samples were dropped (the first few), for the warning a skipped step logs."""


MAX_ABS_REWARD = 1e12
"""The largest reward magnitude accepted: beyond it, the advantages' float32 statistics and the loss overflow."""


def as_reward(value: Any) -> float:
    """A reward function's value as a float. Only numbers count (int, float, numpy and one-element
    torch scalars): ``float("0.5")`` would silently accept a string, so strings and other types
    raise TypeError. ``None`` and NaN become NaN (no reward for this sample)."""
    if value is None:
        return float("nan")
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        return float(value.item())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"returned {type(value).__name__} {value!r}; a reward must be a number (int or float)")


def builtin_rewards() -> dict[str, Callable]:
    """This package's reward functions by name (in Oumi's registry too, where Oumi is installed)."""
    from oumi_megatron.grpo.code_tests import code_tests

    return {"code_tests": code_tests}


def load_reward_registry() -> Any:
    """Oumi's REWARD_FUNCTION registry with Oumi's reward functions and this package's registered."""
    import oumi.datasets.grpo.rewards  # noqa: F401 - registers Oumi's reward functions
    from oumi.core.registry import REGISTRY

    builtin_rewards()  # registers ours
    return REGISTRY


def _registry_function(name: str) -> Callable:
    try:
        registry = load_reward_registry()
    except ImportError:  # engine-only machines (no Oumi): this package's own rewards
        if name in builtin_rewards():
            return builtin_rewards()[name]
        raise
    fn = registry.get_reward_function(name)
    if fn is None:
        raise KeyError(f"grpo.reward_functions: {name!r} is not in Oumi's REWARD_FUNCTION registry")
    return fn


def _is_verl_style(fn: Callable) -> bool:
    return "solution_str" in inspect.signature(fn).parameters


class RewardComputer:
    """Weighted reward functions. ``functions`` maps names to callables used instead of Oumi's
    registry (for code that runs without Oumi); other names resolve through the registry."""

    def __init__(self, specs: list[Any], on_error: str = "raise", functions: dict[str, Callable] | None = None) -> None:
        functions = functions or {}
        self.specs = [
            (s.name, float(s.weight), dict(s.kwargs), functions.get(s.name) or _registry_function(s.name)) for s in specs
        ]
        self.on_error = on_error
        self.columns = [name for name, *_ in self.specs] + [
            f"{name}/{metric}" for name, _, _, fn in self.specs for metric in getattr(fn, "reward_metrics", ())]
        """What every result's ``per_function`` holds: each function's reward, then the metrics they declare."""

    @property
    def uses_sandbox(self) -> bool:
        """A function runs model-written code (utils/sandbox.py)."""
        return any(getattr(fn, "uses_sandbox", False) for *_, fn in self.specs)

    def _fail(self, name: str, index: int | None, completion: str | None, why: str) -> NoReturn:
        # a sample's failure comes with its index and completion, a whole batch's with neither
        where = "a batch" if index is None or completion is None else f"sample {index} (completion {completion[:80]!r})"
        raise RewardFunctionError(
            f"reward function {name!r} {why} on {where}. Fix the function, or set "
            "grpo.on_reward_error: skip to drop and count such samples."
        )

    def _handle(self, name: str, index: int | None, completion: str | None, why: str, errors: list[str]) -> None:
        """A failed reward: raise (``on_reward_error: raise``) or note why (``skip``; the value stays NaN)."""
        if self.on_error == "raise":
            self._fail(name, index, completion, why)
        if len(errors) < 5:
            errors.append(f"{name!r} {why} on " + (f"sample {index}" if index is not None else "the batch"))

    def _store(self, values: torch.Tensor, i: int, value: Any, name: str, completion: str, errors: list[str]) -> None:
        try:
            values[i] = as_reward(value)
        except TypeError as e:
            self._handle(name, i, completion, str(e), errors)
            return
        except OverflowError:  # an int past float's range (10 ** 400)
            self._handle(name, i, completion, f"returned an integer beyond float's range ({str(value)[:20]}...)", errors)
            return
        if not torch.isfinite(values[i]):
            self._handle(name, i, completion, f"returned {values[i].item()}", errors)
        elif abs(values[i].item()) > MAX_ABS_REWARD:
            self._handle(name, i, completion, f"returned {values[i].item():g}, beyond the +-{MAX_ABS_REWARD:g} a reward "
                         "may take (its square and the loss would overflow)", errors)
            values[i] = float("nan")  # under skip: dropped as a sample without a reward

    def _values(self, name: str, fn: Callable, kwargs: dict[str, Any], prompts: list[str], completions: list[str],
                rows: list[dict[str, Any]], errors: list[str], metrics: dict[str, torch.Tensor]) -> torch.Tensor:
        """One function's reward per sample, NaN where it gave none (under ``skip``); its declared metrics into
        ``metrics`` (0 where it gave none)."""
        n = len(completions)
        values = torch.full((n,), float("nan"), dtype=torch.float64)
        for metric in getattr(fn, "reward_metrics", ()):
            metrics[f"{name}/{metric}"] = torch.zeros(n, dtype=torch.float64)
        if _is_verl_style(fn):
            for i, (text, row) in enumerate(zip(completions, rows)):
                try:
                    gt = (row.get("reward_model") or {}).get("ground_truth")
                    out = fn(data_source=row.get("data_source"), solution_str=text, ground_truth=gt,
                             extra_info=row.get("extra_info"), **kwargs)
                except Exception as e:  # noqa: BLE001 - any failure of user code is reported the same way
                    self._handle(name, i, text, f"raised {type(e).__name__}: {e}", errors)
                    continue
                self._store(values, i, out, name, text, errors)
            return values
        columns = {k: [row.get(k) for row in rows] for k in rows[0] if k not in ("prompt", "completion")} if rows else {}
        try:
            outs = fn(completions=completions, prompts=prompts, **columns, **kwargs)
        except Exception as e:  # noqa: BLE001
            self._handle(name, None, None, f"raised {type(e).__name__}: {e}", errors)
            return values
        if isinstance(outs, RewardsAndMetrics):
            declared = set(getattr(fn, "reward_metrics", ()))
            if set(outs.metrics) != declared or any(len(v) != n for v in outs.metrics.values()):
                self._handle(name, None, None, f"returned metrics {sorted(outs.metrics)} (one value per completion "
                                               f"each), not its reward_metrics {sorted(declared)}", errors)
                return values
            for metric, column in outs.metrics.items():
                metrics[f"{name}/{metric}"] = torch.tensor(column, dtype=torch.float64)
            outs = outs.rewards
        if isinstance(outs, (str, bytes, dict)) or not hasattr(outs, "__len__") or len(outs) != n:
            got = f"{len(outs)} values" if isinstance(outs, (list, tuple)) else repr(outs)[:80]
            self._handle(name, None, None, f"returned {got} for {n} completions (one number each is needed)", errors)
            return values
        for i, out in enumerate(outs):
            self._store(values, i, out, name, completions[i], errors)
        return values

    def __call__(self, prompts: list[str], completions: list[str], rows: list[dict[str, Any]]) -> RewardResult:
        n = len(completions)
        total = torch.zeros(n, dtype=torch.float64)
        valid = torch.ones(n, dtype=torch.bool)
        per_function: dict[str, torch.Tensor] = {}
        metrics: dict[str, torch.Tensor] = {}
        errors: list[str] = []
        for name, weight, kwargs, fn in self.specs:
            values = self._values(name, fn, kwargs, prompts, completions, rows, errors, metrics)
            bad = ~torch.isfinite(values)
            valid &= ~bad
            per_function[name] = torch.where(bad, torch.zeros_like(values), values)
            total += weight * per_function[name]
        return RewardResult(total=torch.where(valid, total, torch.zeros_like(total)), per_function=per_function | metrics,
                            valid=valid, errors=errors)
