"""The LR schedule spans the whole run in optimizer steps (ppo_epochs x num_mini_batches per GRPO step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from oumi_megatron.engine.optimizer import OptimSettings, build_scheduler


def _training(**kw) -> SimpleNamespace:  # noqa: ANN003
    base = dict(max_steps=10, warmup_steps=2, warmup_ratio=None, lr_scheduler_type="linear", learning_rate=1e-3,
                weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("updates_per_step", [1, 4])
def test_warmup_and_decay_follow_grpo_steps(updates_per_step: int) -> None:
    settings = OptimSettings.from_training_params(_training(), updates_per_step=updates_per_step)
    assert (settings.total_steps, settings.warmup_steps) == (10 * updates_per_step, 2 * updates_per_step)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = build_scheduler(opt, settings)
    lrs = []  # LR in use at each GRPO step's first update (the engine steps the schedule after each)
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        for _ in range(updates_per_step):
            sched.step(increment=1)
    # warmup ends after 2 GRPO steps whatever the number of updates per step, then linear decay to 0
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(1e-3)
    assert lrs[1] == pytest.approx(0.5e-3)
    assert lrs[-1] == pytest.approx(1e-3 * (1 - (9 * updates_per_step - settings.warmup_steps)
                                            / (settings.total_steps - settings.warmup_steps)))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # decayed fully at the last update


def test_warmup_ratio_is_a_share_of_all_optimizer_steps() -> None:
    settings = OptimSettings.from_training_params(_training(max_steps=50, warmup_steps=0, warmup_ratio=0.1),
                                                  updates_per_step=2)
    assert (settings.total_steps, settings.warmup_steps) == (100, 10)
