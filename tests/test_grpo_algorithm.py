"""GRPO as pure tensor functions: hand-computed values and degenerate cases."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from oumi_megatron.config.grpo_params import MegatronGrpoParams
from oumi_megatron.grpo.algorithm import aggregate, clipped_surrogate, group_advantages, kl_divergence
from oumi_megatron.grpo.loss import make_grpo_loss_fn


def test_group_advantages_mean_and_std() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.2, 0.4, 0.6, 0.8])
    adv = group_advantages(r, group_size=4)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as TRL
    assert torch.allclose(adv[:4], (torch.tensor([1.0, 0.0, 0.0, 1.0]) - 0.5) / (std + 1e-6))
    assert torch.allclose(adv.view(2, 4).sum(1), torch.zeros(2), atol=1e-6)
    unscaled = group_advantages(r, group_size=4, scale_rewards=False)
    assert torch.allclose(unscaled[4:], torch.tensor([-0.3, -0.1, 0.1, 0.3]), atol=1e-6)


def test_identical_rewards_give_zero_advantage_not_nan() -> None:
    adv = group_advantages(torch.tensor([0.7, 0.7, 0.7, 0.0, 1.0, 0.5]), group_size=3)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[:3], torch.zeros(3))
    assert adv[3] < 0 < adv[4]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize(("value", "size"), [(0.1, 8), (93.71, 16), (1 / 3, 5), (-2.7e4, 7), (1e-9, 2)])
def test_identical_group_advantage_is_exactly_zero_in_any_dtype(dtype: torch.dtype, value: float, size: int) -> None:
    # issue 10: 8 x 0.1 gave -0.0074 each, 16 x 93.71 gave -0.86 (float32 mean off by one rounding step)
    other = torch.tensor([0.0, 1.0] * (size // 2) + [0.5] * (size % 2))
    r = torch.cat([torch.full((size,), value), other]).to(dtype)
    for scale in (True, False):
        adv = group_advantages(r, group_size=size, scale_rewards=scale)
        assert adv.dtype == torch.float32
        assert torch.equal(adv[:size], torch.zeros(size)), adv[:size]
        assert adv[size:].abs().max() > 0.1  # the group with variance is untouched


def test_group_advantages_match_trl_formula_in_fp64() -> None:
    """TRL: (r - mean) / (std + eps) per group, unbiased std; checked on random groups."""
    g = torch.Generator().manual_seed(0)
    r = torch.rand(64, generator=g, dtype=torch.float64)
    grouped = r.view(-1, 8)
    want = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
    assert torch.allclose(group_advantages(r, 8).double(), want, atol=1e-6, rtol=1e-6)
    want_unscaled = (grouped - grouped.mean(1, keepdim=True)).view(-1)
    assert torch.allclose(group_advantages(r, 8, scale_rewards=False).double(), want_unscaled, atol=1e-7)


def test_skipped_samples_change_nothing_in_their_group() -> None:
    """on_reward_error: skip: [1, 1, 1, skipped] gives the valid ones 0 (not +0.5), and a skipped
    sample's value never enters the statistics: any value there gives the same advantages."""
    valid = torch.tensor([True, True, True, False])
    for placeholder in (0.0, 1.0, -5.0, 123.0):
        adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, placeholder]), 4, valid=valid)
        assert torch.equal(adv, torch.zeros(4))
    r = torch.tensor([0.2, 0.9, 0.4, 0.0, 0.7, 0.1])
    valid = torch.tensor([True, True, True, False, True, True])
    adv = group_advantages(r, 6, valid=valid)
    kept = r[valid]
    want = (kept - kept.mean()) / (kept.std() + 1e-6)
    assert torch.allclose(adv[valid], want, atol=1e-6) and adv[3] == 0.0
    # the same as the group without the skipped sample, whatever its placeholder value
    assert torch.equal(group_advantages(torch.tensor([0.2, 0.9, 0.4, 55.0, 0.7, 0.1]), 6, valid=valid), adv)
    # a group with a single valid sample has nothing to compare it with
    assert torch.equal(group_advantages(torch.tensor([3.0, 0.0]), 2, valid=torch.tensor([True, False])), torch.zeros(2))


def test_group_advantages_rejects_incomplete_groups() -> None:
    with pytest.raises(ValueError, match="divisible by group_size=4"):
        group_advantages(torch.zeros(6), group_size=4)


def test_kl_estimators() -> None:
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    log_ratio = math.log(2.0)
    assert kl_divergence(lp, ref, "k1").item() == pytest.approx(log_ratio)
    assert kl_divergence(lp, ref, "k2").item() == pytest.approx(0.5 * log_ratio**2)
    assert kl_divergence(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + log_ratio)  # q/p - 1 - log(q/p)
    same = torch.tensor([-1.3, -0.2])
    for est in ("k1", "k2", "k3"):
        assert torch.allclose(kl_divergence(same, same, est), torch.zeros(2))
    assert (kl_divergence(torch.randn(100), torch.randn(100), "k3") >= 0).all()
    with pytest.raises(ValueError, match="k1"):
        kl_divergence(lp, ref, "k9")


def test_clipped_surrogate_clips_asymmetrically() -> None:
    old = torch.zeros(1, 4)
    lp = torch.log(torch.tensor([[1.0, 1.5, 0.5, 1.1]]))  # ratios 1, 1.5, 0.5, 1.1
    loss, clipped = clipped_surrogate(lp, old, torch.tensor([1.0]), epsilon=0.2, epsilon_high=0.28)
    # positive advantage: ratio capped at 1.28 above, not below
    assert torch.allclose(loss, -torch.tensor([[1.0, 1.28, 0.5, 1.1]]), atol=1e-6)
    assert clipped.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    loss, clipped = clipped_surrogate(lp, old, torch.tensor([-1.0]), epsilon=0.2, epsilon_high=0.28)
    # negative advantage: -min(-r, -clip(r)) = max(r, clip(r)): ratio 0.5 is raised to 0.8
    assert torch.allclose(loss, torch.tensor([[1.0, 1.5, 0.8, 1.1]]), atol=1e-6)
    assert clipped.tolist() == [[0.0, 0.0, 1.0, 0.0]]


def test_surrogate_gradient_is_policy_gradient_at_ratio_one() -> None:
    lp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss, _ = clipped_surrogate(lp, lp.detach(), adv, epsilon=0.2)
    loss.sum().backward()
    assert torch.allclose(lp.grad, -adv[:, None].expand(2, 3))


def test_aggregations() -> None:
    per_token = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    s, c = aggregate(per_token, mask, "token_mean")
    assert (s.item(), c.item()) == (10.0, 4)  # (1+2+3+4) / 4 tokens
    s, c = aggregate(per_token, mask, "seq_mean")
    assert s.item() == pytest.approx(2.0 + 4.0) and c.item() == 2  # mean(2, 4)
    s, c = aggregate(per_token, mask, "seq_mean_token_sum_norm", max_len=4)
    assert s.item() == pytest.approx(6 / 4 + 4 / 4) and c.item() == 2
    s, c = aggregate(per_token, torch.zeros_like(mask), "seq_mean")
    assert s.item() == 0.0 and c.item() == 0  # an all-masked row contributes nothing, no NaN
    # a sequence with no trained token (a skipped reward) does not dilute the sequence mean
    s, c = aggregate(per_token, torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]]), "seq_mean")
    assert s.item() == pytest.approx(2.0) and c.item() == 1
    with pytest.raises(ValueError, match="max_len"):
        aggregate(per_token, mask, "seq_mean_token_sum_norm")


def test_grpo_loss_fn_masks_prompt_and_padding_and_adds_kl() -> None:
    grpo = MegatronGrpoParams(epsilon=0.2, epsilon_high=None, beta=0.1, kl_estimator="k1", tis_cap=None,
                           loss_aggregation="token_mean", max_completion_length=4)
    lp = torch.log(torch.tensor([[0.9, 0.5, 0.5, 0.9]]))
    batch = {
        "completion_mask": torch.tensor([[0, 1, 1, 0]]),  # prompt, 2 completion tokens, padding
        "old_logprobs": lp.clone(),
        "ref_logprobs": torch.log(torch.tensor([[0.9, 0.25, 0.5, 0.1]])),
        "advantages": torch.tensor([1.0]),
    }
    loss_sum, count, m = make_grpo_loss_fn(grpo)(lp, batch)
    kl = math.log(2.0)  # only the 2nd token differs from the reference among unmasked tokens
    assert count.item() == 2
    assert loss_sum.item() == pytest.approx(-2.0 + 0.1 * kl)
    assert m["kl_sum"].item() == pytest.approx(kl) and m["clipped_tokens"].item() == 0.0
    assert m["completion_tokens"].item() == 2 and m["ratio_sum"].item() == pytest.approx(2.0)


def test_grpo_loss_without_old_logprobs_is_the_on_policy_loss() -> None:
    """A microbatch without ``old_logprobs`` (the step's first update, trained on by the policy that generated it):
    the loss and gradient equal those with ``old_logprobs`` = the logprobs themselves, detached; TIS weighs against
    the same; and the metrics carry the entropy and mismatch sums the skipped old-logprob pass would have given."""
    grpo = MegatronGrpoParams(epsilon=0.2, epsilon_high=None, beta=0.0, kl_estimator="k3", tis_cap=2.0,
                              loss_aggregation="token_mean", max_completion_length=4)
    lp = torch.tensor([[-1.0, -0.5, -2.0, -0.1]])
    batch = {"completion_mask": torch.tensor([[0, 1, 1, 0]]), "advantages": torch.tensor([1.5]),
             "rollout_logprobs": torch.tensor([[-1.0, -0.7, -1.9, -5.0]]), "entropy": torch.tensor([[9.0, 1.0, 2.0, 9.0]])}
    fn = make_grpo_loss_fn(grpo)
    a = lp.clone().requires_grad_(True)
    loss_a, count_a, m_a = fn(a, batch)
    loss_a.backward()
    b = lp.clone().requires_grad_(True)
    loss_b, count_b, m_b = fn(b, {**batch, "old_logprobs": lp.clone()})
    loss_b.backward()
    assert loss_a.item() == pytest.approx(loss_b.item()) and int(count_a) == int(count_b) == 2
    assert torch.allclose(a.grad, b.grad) and a.grad.abs().sum() > 0
    assert m_a["ratio_sum"].item() == 2.0 and m_a["tis_weight_sum"].item() == pytest.approx(m_b["tis_weight_sum"].item())
    assert m_a["entropy_sum"].item() == pytest.approx(3.0)  # masked tokens only
    assert m_a["mismatch_abs_sum"].item() == pytest.approx(0.3) and m_a["mismatch_abs_max"].item() == pytest.approx(0.2)
    assert m_a["mismatch_tokens"].item() == 2
    assert "entropy_sum" not in m_b and "mismatch_abs_sum" not in m_b  # the old-logprob pass reported those


@pytest.mark.parametrize("packed", [False, True])
def test_seq_mask_tis_leaves_out_sequences_that_drifted_beyond_the_cap(packed: bool) -> None:
    """grpo.off_policy_correction: seq_mask_tis: a sequence whose geometric-mean ratio p_trainer / p_rollout is
    outside [1/cap, cap] adds nothing to the policy gradient; the others get token TIS exactly as under ``tis``.
    Sequence 0 drifted by log 3 per token (ratio 3 > cap 2), sequence 1 by log 1.5 on one of two tokens (geometric
    mean sqrt(1.5), inside). Packed: both sequences in one row, told apart by segment_ids."""
    grpo = MegatronGrpoParams(epsilon=0.2, epsilon_high=None, beta=0.0, kl_estimator="k3", loss_aggregation="token_mean",
                              max_completion_length=4, tis_cap=2.0, off_policy_correction="seq_mask_tis")
    trainer = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    rollout = trainer - torch.tensor([[math.log(3.0), math.log(3.0)], [math.log(1.5), 0.0]])
    adv = torch.tensor([1.0, 1.0])
    batch: dict[str, torch.Tensor] = {"completion_mask": torch.ones(2, 2), "old_logprobs": trainer, "advantages": adv,
                                      "rollout_logprobs": rollout}
    if packed:
        batch = {"completion_mask": torch.ones(1, 4), "old_logprobs": trainer.reshape(1, 4), "rollout_logprobs": rollout.reshape(1, 4),
                 "advantages": torch.ones(1, 4), "segment_ids": torch.tensor([[0, 0, 1, 1]])}
    logprobs = batch["old_logprobs"].clone().requires_grad_(True)
    _, _, metrics = make_grpo_loss_fn(grpo)(logprobs, batch)
    loss, _, _ = make_grpo_loss_fn(grpo)(logprobs, batch)
    loss.backward()
    grad = logprobs.grad.reshape(2, 2)
    assert torch.all(grad[0] == 0.0)  # left out
    # kept: -A x TIS weight per token (ratio 1 at the update): min(1.5, 2) on the drifted token, 1 on the other
    assert torch.allclose(grad[1], torch.tensor([-1.5, -1.0]))
    assert metrics["off_policy_masked_tokens"].item() == 2.0
    tis_only = dataclasses.replace(grpo, off_policy_correction="tis")
    plain = torch.zeros_like(logprobs).requires_grad_(True)
    make_grpo_loss_fn(tis_only)(plain + batch["old_logprobs"], batch)[0].backward()
    assert torch.all(plain.grad.reshape(2, 2)[0] != 0.0)  # under tis alone it is trained on, capped at 2


@pytest.mark.parametrize("packed", [False, True])
def test_icepop_weighs_tokens_inside_the_band_by_their_ratio_and_leaves_the_others_out(packed: bool) -> None:
    """grpo.off_policy_correction: icepop: a token whose ratio p_trainer / p_rollout is inside [lower, upper] has its
    policy-gradient term weighted by the ratio itself (not capped); one outside the band adds nothing. Ratios: 1,
    4 (inside [0.5, 5]), 6 (above), 0.4 (below). Packed rows give the same, the band being per token."""
    grpo = MegatronGrpoParams(epsilon=0.2, epsilon_high=None, beta=0.0, kl_estimator="k3", loss_aggregation="token_mean",
                              max_completion_length=4, off_policy_correction="icepop")
    trainer = torch.full((1, 4), -1.0)
    rollout = trainer - torch.log(torch.tensor([[1.0, 4.0, 6.0, 0.4]]))
    batch: dict[str, torch.Tensor] = {"completion_mask": torch.ones(1, 4), "old_logprobs": trainer, "advantages": torch.tensor([1.0]),
                                      "rollout_logprobs": rollout}
    if packed:
        batch = {**batch, "advantages": torch.ones(1, 4), "segment_ids": torch.tensor([[0, 0, 1, 1]])}
    logprobs = trainer.clone().requires_grad_(True)
    loss, _, metrics = make_grpo_loss_fn(grpo)(logprobs, batch)
    loss.backward()
    # the loss sum (the engine divides by the count): d/dlp of -A x ratio (1 at the update) x weight
    assert torch.allclose(logprobs.grad, torch.tensor([[-1.0, -4.0, 0.0, 0.0]]))
    assert metrics["off_policy_masked_tokens"].item() == 2.0
    assert metrics["off_policy_weight_sum"].item() == pytest.approx(5.0)
    narrow = dataclasses.replace(grpo, icepop_lower=0.8, icepop_upper=2.0)  # the bounds are read: token 2 leaves too
    logprobs.grad = None
    make_grpo_loss_fn(narrow)(logprobs, batch)[0].backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-1.0, 0.0, 0.0, 0.0]]))
    on_policy = {k: v for k, v in batch.items() if k != "old_logprobs"}  # the first update: old logprobs are this forward's
    logprobs.grad = None
    make_grpo_loss_fn(grpo)(logprobs, on_policy)[0].backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-1.0, -4.0, 0.0, 0.0]]))


def test_logprob_mismatch_sums() -> None:
    from oumi_megatron.grpo.algorithm import logprob_mismatch

    trainer = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout = torch.tensor([[-1.1, -2.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the last token is not a completion token
    m = logprob_mismatch(rollout, trainer, mask)
    assert m["tokens"] == 2
    assert torch.isclose(m["abs_diff_sum"], torch.tensor(0.1))
    assert torch.isclose(m["abs_diff_max"], torch.tensor(0.1))
    assert torch.isclose(m["exp_abs_diff_sum"], torch.exp(torch.tensor(0.1)) + 1.0)


def test_truncated_importance_sampling_weights_and_loss() -> None:

    from oumi_megatron.grpo.algorithm import truncated_importance_weights
    from oumi_megatron.grpo.loss import make_grpo_loss_fn

    trainer = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.0, -2.0, 0.0]])  # p_t/p_r = 1, e, 1/e
    w = truncated_importance_weights(trainer, rollout, cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, float(torch.exp(torch.tensor(-1.0)))]]))
    grpo = MegatronGrpoParams(epsilon=0.2, epsilon_high=None, beta=0.0, kl_estimator="k3", loss_aggregation="token_mean",
                           max_completion_length=3, tis_cap=2.0)
    batch = {"completion_mask": torch.ones(1, 3), "old_logprobs": trainer, "advantages": torch.tensor([1.0]),
             "rollout_logprobs": rollout}
    logprobs = trainer.clone().requires_grad_(True)
    loss_sum, count, metrics = make_grpo_loss_fn(grpo)(logprobs, batch)
    loss_sum.backward()
    # at ratio 1 the gradient of -ratio * A is -A per token, scaled by the TIS weight
    assert torch.allclose(logprobs.grad, -w)
    assert metrics["tis_capped_tokens"] == 1 and int(count) == 3
    off = dataclasses.replace(grpo, tis_cap=None)
    plain, _, plain_metrics = make_grpo_loss_fn(off)(trainer.clone(), batch)
    assert "tis_weight_sum" not in plain_metrics and torch.isclose(plain, torch.tensor(-3.0))


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_skipped_sample_changes_nothing_in_the_loss(mode: str, packed: bool) -> None:
    """A sample whose reward was skipped stays in the batch (shapes stay fixed) but adds nothing to the
    loss or to the count it is normalized by: loss and count equal those of the batch without it."""
    from oumi_megatron.rollout.sample import Sample
    from oumi_megatron.trainer.batches import packed_layout, padded_layout

    grpo = MegatronGrpoParams(epsilon=0.2, epsilon_high=None, beta=0.0, kl_estimator="k3", tis_cap=None,
                           loss_aggregation=mode, max_completion_length=6)
    loss_fn = make_grpo_loss_fn(grpo)
    seqs = [[5, 6, 7, 8, 9], [5, 6, 10, 11], [5, 12, 13, 14, 15, 16], [5, 6, 7, 17]]
    adv = torch.tensor([0.5, -1.0, 1.5, 0.25])

    def loss(keep: list[int], trainable: list[bool]) -> tuple[float, int]:
        batch = [Sample(seqs[i][:2], seqs[i][2:], group=i, advantage=float(adv[i]), trainable=t)
                 for i, t in zip(keep, trainable, strict=True)]
        layout = packed_layout(batch, 1, 0) if packed else padded_layout(batch, 1, 0)
        total, count = 0.0, 0
        for mb in layout.microbatches:
            # logprobs that depend only on the token, so the layout (row, offset) cannot matter
            lp = -0.01 * mb["input_ids"].double()
            s, c, _ = loss_fn(lp, {**mb, "old_logprobs": lp - 0.05})
            total, count = total + float(s), count + int(c)
        return total, count

    with_skipped = loss([0, 1, 2, 3], [True, False, True, True])
    without = loss([0, 2, 3], [True, True, True])
    assert with_skipped[1] == without[1] > 0
    assert with_skipped[0] == pytest.approx(without[0], rel=1e-12)
    # and the skipped sample did matter when it was not skipped (the check can fail)
    assert loss([0, 1, 2, 3], [True] * 4) != with_skipped
