"""Reward functions from Oumi's REWARD_FUNCTION registry, weighted and checked.

Oumi registers functions in two conventions; both are supported:
- TRL style, called once per batch: ``fn(completions=[str], prompts=[str], **dataset_columns, **kwargs) -> [float]``
- verl style, called per sample: ``fn(data_source, solution_str, ground_truth, extra_info, **kwargs) -> float``
  (ground_truth from the row's ``reward_model.ground_truth``, as Oumi's GRPO datasets produce).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from oumi_megatron.config.problems import Problem
from oumi_megatron.grpo.reward_metrics import RewardsAndMetrics

if TYPE_CHECKING:
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig
    from oumi_megatron.data import DatasetHead


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


def check_reward_functions(config: MegatronTrainingConfig, found: Findings) -> None:
    """``grpo.reward_functions``: at least one, each registered (``grpo.plugins`` are imported) with a finite weight."""
    g = config.grpo
    if not g.reward_functions:
        found.add("grpo.reward_functions", "is empty, and the training data has no default reward (gsm8k and countdown data "
                                           "get theirs automatically); GRPO needs a reward. Add at least one registered "
                                           "reward function, e.g.\n      grpo:\n        reward_functions:\n"
                                           "          - name: gsm8k")
    registered: set[str] | None = None
    for i, rf in enumerate(g.reward_functions):
        if not rf.name:
            found.add(f"grpo.reward_functions[{i}].name", "is empty. Set it to a registered reward function name.")
            continue
        if not math.isfinite(rf.weight):
            found.add(f"grpo.reward_functions[{i}].weight", f"must be a finite number, got {rf.weight!r}.")
        if registered is None:
            registered = _registered_reward_functions()
        if rf.name not in registered:
            found.add(f"grpo.reward_functions[{i}].name",
                      f"{rf.name!r} is not in Oumi's REWARD_FUNCTION registry. Known: {sorted(registered)}. Register your "
                      "own with @register('name', RegistryType.REWARD_FUNCTION) in a module named in grpo.plugins (the "
                      "CPU demo's char_class: oumi_megatron.examples.demo_task).")


def _registered_reward_functions() -> set[str]:
    from oumi.core.registry import RegistryType

    return set(load_reward_registry().get_all(RegistryType.REWARD_FUNCTION))


_REWARD_GIVES = frozenset({"completions", "prompts"})
"""What every TRL-style reward call passes besides the rows' columns (``RewardComputer``)."""


def _columns(rows: list[dict], environment: bool) -> set[str]:
    """The keyword arguments a batch of these rows gives a TRL-style reward (the first row's columns but the prompt;
    ``env_info`` where episodes run an environment)."""
    columns = {k for k in rows[0] if k not in ("prompt", "completion")} if rows else set()
    return columns | ({"env_info"} if environment else set())


def reward_argument_problems(config: MegatronTrainingConfig, heads: list[DatasetHead]) -> list[Problem]:
    """Each reward function's keyword arguments against the rows it will be called with (the first rows of each
    dataset in ``heads``): a TRL-style function's required parameters are among the columns, ``completions``,
    ``prompts`` and its ``kwargs``, and without ``**kwargs`` it accepts every column; a verl-style one finds
    ``reward_model.ground_truth`` in the rows."""
    problems: list[Problem] = []
    for i, rf in enumerate(config.grpo.reward_functions):
        try:
            fn = _registry_function(rf.name)
        except KeyError:
            continue  # reported by check_reward_functions
        where_rf = f"grpo.reward_functions[{i}]"
        params = inspect.signature(fn).parameters
        for head in heads:
            if not head.rows:
                continue
            data = f"{head.where} ({head.name})"
            if _is_verl_style(fn):
                if not all(isinstance(r.get("reward_model"), dict) and "ground_truth" in r["reward_model"] for r in head.rows):
                    problems.append(Problem(where_rf, f"{rf.name!r} is a verl-style reward (solution_str, ground_truth): it "
                                            f"reads each row's reward_model.ground_truth, which the rows of {data} do not "
                                            "have. Return {'reward_model': {'ground_truth': ...}} from the dataset's "
                                            "transform, or use a TRL-style reward (completions, **columns)."))
                continue
            columns = _columns(head.rows, config.grpo.environment is not None)
            given = _REWARD_GIVES | columns | set(rf.kwargs)
            required = [n for n, p in params.items() if p.default is p.empty
                        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            missing = [n for n in required if n not in given]
            if missing:
                problems.append(Problem(where_rf, f"{rf.name!r} needs the keyword argument(s) {', '.join(map(repr, missing))}, "
                                        f"which the rows of {data} do not have (their columns after the dataset's "
                                        f"transform: {', '.join(sorted(columns)) or 'none'} besides 'prompt'; every call also "
                                        f"gets completions and prompts). Return {' and '.join(map(repr, missing))} from the "
                                        f"dataset's transform, or set it in {where_rf}.kwargs."))
            clash = sorted(set(rf.kwargs) & (columns | _REWARD_GIVES))
            if clash:
                problems.append(Problem(f"{where_rf}.kwargs", f"sets {', '.join(map(repr, clash))}, which every call already "
                                        f"passes from the rows of {data}: the call would get it twice. Rename the argument."))
            positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
            if positional:
                problems.append(Problem(where_rf, f"{rf.name!r} has positional-only parameter(s) {positional}; rewards are "
                                        "called with keyword arguments (completions=..., prompts=..., one per column)."))
            if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                unexpected = sorted(given - set(rf.kwargs) - set(params))
                if unexpected:
                    problems.append(Problem(where_rf, f"{rf.name!r} takes no **kwargs, and every call passes "
                                            f"{', '.join(map(repr, unexpected))} (from the rows of {data}), which it does "
                                            "not accept. Add **kwargs to its signature."))
    return problems
