"""The GRPO variants selected by name (grpo/registry.py): GSPO and batch-level reward scaling against TRL's
formulas (fp64, values and gradients), dual clip and RLOO by hand, the registries' seams (validation
lists the names, a user module registers its own), and DAPO's dynamic sampling and overlong shaping (by hand,
and in the real trainer on 2 DP ranks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, VENV_BIN, free_port, run_cli
from oumi_megatron.grpo.algorithm import (
    group_advantages,
    groups_with_signal,
    leave_one_out_advantages,
    overlong_penalty,
    scale_rewards_mode,
    sequence_mean,
)
from oumi_megatron.grpo.loss import make_grpo_loss_fn
from oumi_megatron.grpo.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from oumi_megatron.trainer.rollout_batch import choose_groups


def _grpo(**kw):  # noqa: ANN003, ANN202
    base = dict(epsilon=0.2, epsilon_high=0.28, beta=0.0, kl_estimator="k3", loss_aggregation="seq_mean", tis_cap=None,
                max_completion_length=8, policy_loss="grpo", clip_ratio_c=None, num_generations=4, scale_rewards="group")
    from oumi_megatron.config.grpo_params import MegatronGrpoParams

    return MegatronGrpoParams(**{**base, **kw})


def _trl_gspo(logps, old, adv, mask, eps_low, eps_high):  # noqa: ANN001, ANN202
    """TRL GRPOTrainer._compute_loss with importance_sampling_level="sequence" (the per-token loss before
    aggregation), transcribed from its documented formula."""
    log_ratio = logps - old
    log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    return -torch.min(coef_1 * adv.unsqueeze(1), coef_2 * adv.unsqueeze(1))


def test_gspo_matches_trls_sequence_level_loss_in_fp64() -> None:
    g = torch.Generator().manual_seed(0)
    logps = (-torch.rand(6, 9, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logps.detach() + 0.2 * torch.randn(6, 9, generator=g, dtype=torch.float64)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    ours, _ = POLICY_LOSSES["gspo"](logps, old, adv, mask, _grpo(epsilon=0.05, epsilon_high=0.08))
    (ours * mask).sum().backward()
    grad_ours, logps.grad = logps.grad.clone(), None
    theirs = _trl_gspo(logps, old, adv, mask, 0.05, 0.08)
    (theirs * mask).sum().backward()
    assert torch.allclose(ours, theirs, atol=1e-12) and torch.allclose(grad_ours, logps.grad, atol=1e-12)
    # every token of a sequence shares one ratio: the loss is constant along each row's masked tokens
    row = ours[0][mask[0] > 0]
    assert torch.allclose(row, row[0].expand_as(row))


def test_gspo_on_packed_rows_equals_one_row_per_sequence() -> None:
    g = torch.Generator().manual_seed(1)
    lengths = [3, 5, 4]
    per_seq = [(-torch.rand(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64))
               for n in lengths]
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    padded_lp = torch.zeros(3, 5, dtype=torch.float64)
    padded_old, padded_mask = torch.zeros_like(padded_lp), torch.zeros_like(padded_lp)
    for i, ((lp, noise), n) in enumerate(zip(per_seq, lengths)):
        padded_lp[i, :n], padded_old[i, :n], padded_mask[i, :n] = lp, lp + 0.1 * noise, 1.0
    padded, _ = POLICY_LOSSES["gspo"](padded_lp, padded_old, adv, padded_mask, _grpo())
    # the same three sequences packed into one row of 12 tokens, per-token advantages, segment ids 0, 1, 2
    packed_lp = torch.cat([padded_lp[i, :n] for i, n in enumerate(lengths)])[None]
    packed_old = torch.cat([padded_old[i, :n] for i, n in enumerate(lengths)])[None]
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    packed, _ = POLICY_LOSSES["gspo"](packed_lp, packed_old, adv[ids], torch.ones_like(packed_lp), _grpo(), ids)
    assert torch.allclose(packed[0], torch.cat([padded[i, :n] for i, n in enumerate(lengths)]), atol=1e-12)
    # padding (segment id -1) gets 0, and is not in any sequence's mean
    means = sequence_mean(torch.tensor([[1.0, 3.0, 100.0]]), torch.ones(1, 3), torch.tensor([[0, 0, -1]]))
    assert means.tolist() == [[2.0, 2.0, 0.0]]


def test_batch_scaling_matches_trls_formula_in_fp64() -> None:
    """TRL scale_rewards="batch": (r - mean of the group) / (std of all rewards + eps)."""
    r = torch.rand(32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ours = group_advantages(r, 8, "batch", eps=1e-4)
    theirs = (r - r.view(-1, 8).mean(1).repeat_interleave(8)) / (r.std() + 1e-4)
    assert torch.allclose(ours.double(), theirs, atol=1e-6)  # ours returns float32
    assert torch.equal(group_advantages(r, 8, "none"), group_advantages(r, 8, False))
    assert torch.equal(group_advantages(r, 8, "group"), group_advantages(r, 8, True))
    assert [scale_rewards_mode(v) for v in (True, False, "batch", "True")] == ["group", "none", "batch", "group"]
    with pytest.raises(ValueError, match="group, batch, none"):
        scale_rewards_mode("per_token")


def test_dual_clip_bounds_negative_advantage_tokens_by_hand() -> None:
    """A = -1, ratio 5: PPO's loss is -min(5 x -1, 1.28 x -1) = 5; dual clip c = 3 caps it at 3, with no gradient."""
    lp = torch.tensor([[float(torch.log(torch.tensor(5.0))), 0.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    adv, mask = torch.tensor([-1.0]), torch.ones(1, 2)
    plain, _ = POLICY_LOSSES["grpo"](lp, old, adv, mask, _grpo())
    dual, clipped = POLICY_LOSSES["grpo"](lp, old, adv, mask, _grpo(clip_ratio_c=3.0))
    assert plain[0, 0].item() == pytest.approx(5.0) and dual[0, 0].item() == pytest.approx(3.0)
    assert dual[0, 1].item() == pytest.approx(1.0) and clipped.tolist() == [[1.0, 0.0]]  # ratio 1: untouched
    dual.sum().backward()
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 1].item() == pytest.approx(1.0)  # -A x ratio


def test_rloo_is_reward_minus_the_others_mean() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.3])
    adv = leave_one_out_advantages(r, 4)
    assert torch.allclose(adv[:4], torch.tensor([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3]))
    assert torch.equal(adv[4:], torch.zeros(4))  # a constant group: exactly 0
    skipped = leave_one_out_advantages(r, 4, valid=torch.tensor([True, True, False, True] + [True] * 4))
    assert skipped[2] == 0 and skipped[0].item() == pytest.approx(1 - 0.5)  # others: the two valid 0 and 1
    assert ADVANTAGE_ESTIMATORS["rloo"](r, torch.ones(8, dtype=torch.bool), _grpo()).tolist() == adv.tolist()


def test_a_user_module_registers_its_own_loss_and_validation_names_the_registered_ones(tmp_path, make_config,  # noqa: ANN001
                                                                                        monkeypatch) -> None:
    from oumi_megatron.validation import validate_config

    (tmp_path / "my_grpo_variants.py").write_text(
        "import torch\n"
        "from oumi_megatron.grpo.registry import register_policy_loss\n\n"
        "@register_policy_loss('plain_pg')\n"
        "def plain_pg(logprobs, old_logprobs, advantages, mask, grpo, segment_ids=None):\n"
        "    return -torch.exp(logprobs - old_logprobs) * advantages.unsqueeze(-1), torch.zeros_like(logprobs)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = validate_config(make_config(grpo={"policy_loss": "plain_pg"}), world_size=1, model_shape=None, check_bridge=False)
    assert "grpo.policy_loss" in bad.fields() and "'grpo', 'gspo'" in bad.format_problems()
    good = validate_config(make_config(grpo={"policy_loss": "plain_pg", "plugins": ["my_grpo_variants"]}), world_size=1,
                           model_shape=None, check_bridge=False)
    assert "grpo.policy_loss" not in good.fields(), good.format_problems()
    lp = torch.zeros(1, 3, requires_grad=True)
    loss, count, _ = make_grpo_loss_fn(_grpo(policy_loss="plain_pg"))(
        lp, {"completion_mask": torch.ones(1, 3), "old_logprobs": torch.zeros(1, 3), "advantages": torch.tensor([2.0])})
    assert loss.item() == pytest.approx(-2.0) and count.item() == 1  # seq_mean of -1 x 2 per token
    missing = validate_config(make_config(grpo={"plugins": ["no_such_module_here"]}), world_size=1, model_shape=None,
                              check_bridge=False)
    assert "grpo.plugins" in missing.fields() and "no_such_module_here" in missing.format_problems()
    sys.modules.pop("my_grpo_variants", None)
    POLICY_LOSSES.remove("plain_pg")


@pytest.mark.parametrize(("field", "value", "text"), [("scale_rewards", "tokens", "group, batch, none"),
                                                      ("clip_ratio_c", 0.5, "must be > 1"),
                                                      ("advantage_estimator", "ppo_gae", "'grpo', 'rloo'"),
                                                      ("dynamic_sampling_max_rounds", 0, "positive integer"),
                                                      ("overlong_buffer_length", 10_000, "grpo.max_completion_length ="),
                                                      ("overlong_penalty_factor", -1.0, "must be >= 0")])
def test_bad_variant_settings_name_the_field(make_config, field: str, value, text: str) -> None:  # noqa: ANN001
    from oumi_megatron.validation import validate_config

    r = validate_config(make_config(grpo={field: value}), world_size=1, model_shape=None, check_bridge=False)
    assert f"grpo.{field}" in r.fields() and text in r.format_problems(), r.format_problems()


def test_overlong_penalty_is_dapos_soft_punishment_by_hand() -> None:
    # max 16 tokens, buffer 4: no penalty up to 12, then -1/4 per token, -factor at 16 and beyond
    lengths = torch.tensor([0, 12, 13, 14, 16, 20])
    assert overlong_penalty(lengths, 16, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(lengths, 16, 4, factor=0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]


def test_groups_with_signal_and_the_dynamic_sampling_choice() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.9, 0.7, 0.7])  # groups of 2: varied, equal, varied, equal
    valid = torch.tensor([True, True, True, True, True, False, True, True])
    # group 2 has one valid reward left: no comparison, no advantage, no signal
    assert groups_with_signal(rewards, valid, 2).tolist() == [True, False, False, False]
    assert groups_with_signal(rewards, torch.ones(8, dtype=torch.bool), 2).tolist() == [True, False, True, False]
    rounds = [torch.tensor([True, False, False]), torch.tensor([False, True, True])]
    assert choose_groups(rounds, 3) == ([(0, 0), (1, 1), (1, 2)], [])
    assert choose_groups(rounds, 2) == ([(0, 0), (1, 1)], [])  # the first informative ones, in generation order
    assert choose_groups(rounds[:1], 3) == ([(0, 0)], [(0, 1), (0, 2)])  # rounds ran out: dropped groups fill


def test_collation_payload_per_rank_is_its_share_at_dp4(tmp_path: Path) -> None:
    """Collation by need, counted at DP 4 (tests/workers/dp_exchange_worker.py, 4 gloo ranks; DP 2 is the dynamic
    sampling run below): 48 rollouts generated round-robin over the DP ranks and dealt contiguously to the ranks that
    train on them. Through ``exchange_objects_dp`` each rank receives its own share and nothing else: within 1% of the
    share's pickled size, a quarter of the batch (seen: 1.0008 x the share, 141 kB of 566 kB; 283 kB each at DP 2),
    where an all-gather of every rank's rollouts delivers the whole batch to every rank whatever DP is."""
    out = tmp_path / "dp4.json"
    proc = run_cli([str(VENV_BIN / "torchrun"), "--nproc_per_node", "4", "--master-port", str(free_port()),
                    str(REPO / "tests" / "workers" / "dp_exchange_worker.py"), str(out)])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    ranks = json.loads(out.read_text())
    assert [r["dp"] for r in ranks] == [4] * 4
    for r in ranks:
        assert r["got_own_share"], r
        assert r["share_bytes"] <= r["received_bytes"] <= 1.01 * r["share_bytes"], r
        assert r["all_gather_bytes"] >= 0.99 * 4 * r["share_bytes"], r  # the old collation: the whole batch


def run_dynamic_sampling_worker(model_dir: Path, work: Path, backend: str = "megatron") -> None:
    """tests/workers/dynamic_sampling_worker.py on 2 ranks (gloo on CPU, NCCL on GPUs, tests/test_gpu.py), and its checks:
    "letters" prompts get a constant reward, so their groups must be dropped and further rounds refill the batch
    with "digits" groups whose rewards differ; with one round allowed, dropped groups fill the batch untrained.
    Each rank's sequences are its share of the filtered batch (redistributed over DP), and the metrics count
    rounds, dropped and filled groups. ``backend``: megatron (embedded) or vllm (an engine colocated in each rank,
    weights synced after every update)."""
    proc = run_cli([str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master-port", str(free_port()),
                    str(REPO / "tests" / "workers" / "dynamic_sampling_worker.py"), str(model_dir), str(work), backend])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    ranks = [json.loads((work / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    timed = ("time/", "tokens_per_s", "rollout/tokens_per_s", "rollout/decode_ms_per_step", "weight_sync/seconds",
             "weight_sync/gbps", "weight_sync/export_s")  # wall-clock readings differ by rank
    untimed = [[{k: v for k, v in m.items() if not k.startswith(timed)} for m in r["metrics"]] for r in ranks]
    assert untimed[0] == untimed[1]  # every rank saw the same filtered batch (loss, rewards, counts)
    for steps in (r["steps"] for r in ranks):
        for step, m in zip(steps, ranks[0]["metrics"]):
            assert step["share_matches_prompts"] and step["batch_samples"] == 32
            # collation by need: the rank's own share, not every rank's rollouts (the old gather received 2-8x that)
            assert 0 < step["collation_bytes"] <= 1.5 * step["share_bytes"], step
            assert set(step["kept_targets"]) <= {"digits"} and all(step["kept_rewards_differ"])
            assert all(step["filler_rewards_equal"]) and len(step["kept_targets"]) + len(step["filler_targets"]) == 4
            letters = step["consumed_targets"].count("letters")
            assert len(step["consumed_targets"]) == 4 * step["rounds"] == 4 * m["dynamic_sampling/rounds"]
            # every letters group is dropped (a digits group whose 8 rewards happen to be equal is too)
            assert m["dynamic_sampling/groups_dropped"] >= letters
            assert m["dynamic_sampling/groups_generated"] == len(step["consumed_targets"])
            assert m["dynamic_sampling/groups_filled"] == len(step["filler_targets"])
            assert m["batch/untrained_samples"] == 8 * len(step["filler_targets"])
    steps = ranks[0]["steps"]
    assert all(len(s["kept_targets"]) == 4 for s in steps[:3]), steps  # refilled up to 4 informative groups
    assert any(s["rounds"] > 1 for s in steps[:3]), steps
    assert all(s["rounds"] == 1 for s in steps[3:]) and any(s["filler_targets"] for s in steps[3:]), steps


@pytest.mark.parametrize("backend", ["megatron", "vllm"])
def test_dynamic_sampling_drops_equal_reward_groups_and_refills_on_two_dp_ranks(tmp_path: Path, tiny_model_dir: Path,
                                                                               backend: str) -> None:
    """The real trainer (tiny model, DP=2 gloo ranks, embedded or vLLM rollouts): see ``run_dynamic_sampling_worker``."""
    run_dynamic_sampling_worker(tiny_model_dir, tmp_path, backend)
