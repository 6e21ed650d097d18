"""Reward functions through Oumi's registry: weights, both call conventions, and failures."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from oumi_megatron.grpo.rewards import RewardComputer, RewardFunctionError


def spec(name: str, weight: float = 1.0, **kwargs) -> SimpleNamespace:  # noqa: ANN003
    return SimpleNamespace(name=name, weight=weight, kwargs=kwargs)


@pytest.fixture(scope="module")
def registry():  # noqa: ANN201
    from oumi.core.registry import REGISTRY, RegistryType

    import oumi_megatron.examples.demo_task  # noqa: F401

    for name, fn in {
        "test_flaky": lambda completions, **kw: [float("nan") if c == "bad" else 1.0 for c in completions],
        "test_raises": lambda completions, **kw: 1 / 0,
    }.items():
        if REGISTRY.get_reward_function(name) is None:
            REGISTRY.register(name, RegistryType.REWARD_FUNCTION, fn)
    return REGISTRY


def test_weighted_sum_per_function_and_trl_columns(registry) -> None:  # noqa: ANN001
    rc = RewardComputer([spec("char_class", 2.0), spec("soft_5tokens_completions", 0.5)])
    rows = [{"prompt": "p", "target": "digits"}, {"prompt": "p", "target": "letters"}]
    r = rc(["p", "p"], ["1234", "ab12"], rows)
    assert r.per_function["char_class"].tolist() == [1.0, 0.5]
    soft = r.per_function["soft_5tokens_completions"]
    assert torch.allclose(r.total, 2.0 * torch.tensor([1.0, 0.5], dtype=torch.float64) + 0.5 * soft)
    assert r.valid.all()


def test_verl_style_reward_gets_ground_truth(registry) -> None:  # noqa: ANN001
    rc = RewardComputer([spec("gsm8k")])
    rows = [{"data_source": "gsm8k", "reward_model": {"ground_truth": "72"}, "extra_info": {}}] * 2
    r = rc(["q", "q"], ["so #### 72", "so #### 71"], rows)
    assert r.total.tolist() == [1.0, 0.0]


def test_nan_reward_stops_the_step_naming_function_and_sample(registry) -> None:  # noqa: ANN001
    rc = RewardComputer([spec("test_flaky")])
    with pytest.raises(RewardFunctionError, match=r"'test_flaky' returned nan on sample 1 \(completion 'bad'\)"):
        rc(["p"] * 3, ["ok", "bad", "ok"], [{"prompt": "p"}] * 3)
    with pytest.raises(RewardFunctionError, match="'test_raises' raised ZeroDivisionError"):
        RewardComputer([spec("test_raises")])(["p"], ["x"], [{"prompt": "p"}])


def test_skip_drops_and_counts_invalid_samples(registry) -> None:  # noqa: ANN001
    r = RewardComputer([spec("test_flaky")], on_error="skip")(["p"] * 3, ["ok", "bad", "ok"], [{"prompt": "p"}] * 3)
    assert r.valid.tolist() == [True, False, True]
    assert r.total.tolist() == [1.0, 0.0, 1.0] and all(math.isfinite(x) for x in r.total.tolist())


def test_unknown_reward_function_is_named(registry) -> None:  # noqa: ANN001
    with pytest.raises(KeyError, match="'no_such_fn' is not in Oumi's REWARD_FUNCTION registry"):
        RewardComputer([spec("no_such_fn")])


@pytest.mark.parametrize("bad", ["0.5", b"1", [0.5], {"score": 1.0}, object()])
def test_a_reward_that_is_not_a_number_is_rejected(registry, bad) -> None:  # noqa: ANN001
    """float("0.5") would accept a string; a reward must be a number."""
    from oumi.core.registry import REGISTRY, RegistryType

    name = f"test_returns_{type(bad).__name__}"
    if REGISTRY.get_reward_function(name) is None:
        REGISTRY.register(name, RegistryType.REWARD_FUNCTION, lambda completions, _v=bad, **kw: [_v for _ in completions])
    with pytest.raises(RewardFunctionError, match=rf"'{name}' returned {type(bad).__name__} .*a reward must be a number"):
        RewardComputer([spec(name)])(["p"], ["x"], [{"prompt": "p"}])
    r = RewardComputer([spec(name)], on_error="skip")(["p", "p"], ["x", "y"], [{"prompt": "p"}] * 2)
    assert r.valid.tolist() == [False, False] and "a reward must be a number" in r.errors[0]


def test_numbers_of_every_kind_are_accepted(registry) -> None:  # noqa: ANN001
    import numpy as np

    from oumi_megatron.grpo.rewards import as_reward

    for value, want in ((1, 1.0), (0.25, 0.25), (np.float32(0.5), 0.5), (np.int64(2), 2.0), (torch.tensor(0.75), 0.75)):
        assert as_reward(value) == want
    assert math.isnan(as_reward(None))
    with pytest.raises(TypeError):
        as_reward(True)  # a bool is a bug in the function (a missing float()), not a reward


def test_a_batch_function_returning_the_wrong_count_is_named(registry) -> None:  # noqa: ANN001
    from oumi.core.registry import REGISTRY, RegistryType

    if REGISTRY.get_reward_function("test_short") is None:
        REGISTRY.register("test_short", RegistryType.REWARD_FUNCTION, lambda completions, **kw: [1.0])
    with pytest.raises(RewardFunctionError, match=r"'test_short' returned 1 values for 3 completions"):
        RewardComputer([spec("test_short")])(["p"] * 3, ["a", "b", "c"], [{"prompt": "p"}] * 3)


def test_a_reward_too_large_for_the_advantages_is_an_error_or_skipped(registry) -> None:  # noqa: ANN001
    """10 ** 400 (past float's range) and 1e300 (finite, but its square and the loss overflow) are a reward function's
    errors: named under raise, dropped as samples without a reward under skip, and the group's advantages stay finite.
    Before, the first raised a raw OverflowError even under skip and the second gave NaN advantages."""
    from oumi_megatron.grpo.algorithm import group_advantages

    fn = {"test_huge": lambda completions, **kw: [10 ** 400 if c == "int" else 1e300 if c == "big" else 1.0
                                                  for c in completions]}
    with pytest.raises(RewardFunctionError, match="beyond float's range"):
        RewardComputer([spec("test_huge")], functions=fn)(["p"] * 2, ["ok", "int"], [{"prompt": "p"}] * 2)
    with pytest.raises(RewardFunctionError, match="beyond the"):
        RewardComputer([spec("test_huge")], functions=fn)(["p"] * 2, ["ok", "big"], [{"prompt": "p"}] * 2)
    r = RewardComputer([spec("test_huge")], on_error="skip", functions=fn)(["p"] * 4, ["ok", "int", "big", "ok"],
                                                                           [{"prompt": "p"}] * 4)
    assert r.valid.tolist() == [True, False, False, True] and r.total.tolist() == [1.0, 0.0, 0.0, 1.0]
    advantages = group_advantages(r.total, 4, valid=r.valid)
    assert torch.isfinite(advantages).all(), advantages
