"""Microbatch layouts (trainer/batches.py): padded and packed hold the same tokens and loss inputs.

The model-level parity (logprobs, loss, gradients) is tests/test_engine.py::test_packed_microbatches_match_padded.
"""

from __future__ import annotations

import pytest
import torch

from oumi_megatron.grpo.algorithm import aggregate
from oumi_megatron.rollout.sample import Sample, SampleStatus
from oumi_megatron.trainer.batches import (
    block_causal_mask,
    first_fit_decreasing,
    packed_layout,
    padded_layout,
)


def _batch() -> list[Sample]:
    ids = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11, 12, 13, 14], [15, 16, 17], [18, 19]]
    prompt_lengths = [2, 1, 2, 3, 1, 1]
    advantages = [1.0, -1.0, 0.5, 2.0, -0.5, 0.0]
    trainable = [True, True, True, False, True, True]
    logprobs = [[-0.1, -0.2, -0.3], [-0.4], [-0.5], [-0.6], [-0.7, -0.8], [-0.9]]
    return [Sample(t[:p], t[p:], group=i, logprobs=lp, advantage=a, trainable=tr)
            for i, (t, p, a, tr, lp) in enumerate(zip(ids, prompt_lengths, advantages, trainable, logprobs))]


def test_first_fit_decreasing_respects_capacity_and_places_everything() -> None:
    lengths = [5, 2, 3, 4, 3, 2]
    bins = first_fit_decreasing(lengths, 5)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 5 for b in bins)
    assert len(bins) == 4  # 19 tokens need at least 4 rows of 5


def test_packed_and_padded_hold_the_same_sequences() -> None:
    batch = _batch()
    padded, packed = padded_layout(batch, 2, pad_id=0), packed_layout(batch, 2, pad_id=0)
    assert padded.processed_tokens == 6 * 5 and packed.processed_tokens == 2 * 2 * 5  # 4 rows of 5 tokens
    assert padded.real_tokens == packed.real_tokens == 19
    assert padded.padded_tokens == packed.padded_tokens == 30
    for name in ("input_ids", "completion_mask", "advantages", "position_ids", "rollout_logprobs"):
        a = padded.per_sequence([mb[name] for mb in padded.microbatches])
        b = packed.per_sequence([mb[name] for mb in packed.microbatches])
        assert all(torch.equal(x, y) for x, y in zip(a, b)), name
    mask = padded.per_sequence([mb["completion_mask"] for mb in padded.microbatches])
    # sequence 0: prompt of 2, completion 3 -> positions 1, 2, 3 score the completion tokens
    assert mask[0].tolist() == [0, 1, 1, 1, 0]
    assert mask[3].sum() == 0  # not trainable (skipped reward): kept, never trained on
    rollout = padded.per_sequence([mb["rollout_logprobs"] for mb in padded.microbatches])
    assert rollout[0].tolist() == pytest.approx([0.0, -0.1, -0.2, -0.3, 0.0])  # aligned with the completion mask


def test_block_causal_mask_keeps_attention_inside_each_sequence() -> None:
    seg = torch.tensor([[0, 0, 1, 1, 1, -1]])
    allowed = ~block_causal_mask(seg)[0, 0]
    assert allowed[1].tolist() == [True, True, False, False, False, False]
    assert allowed[4].tolist() == [False, False, True, True, True, False]
    assert allowed[5].tolist() == [False, False, False, False, False, True]  # padding sees itself only


def test_packed_layout_pads_to_the_requested_number_of_microbatches() -> None:
    layout = packed_layout(_batch(), 2, pad_id=0, min_microbatches=3)
    assert len(layout.microbatches) == 3
    empty = layout.microbatches[2]
    assert empty["completion_mask"].sum() == 0 and (empty["segment_ids"] == -1).all()


def test_segment_aggregation_equals_one_row_per_sequence() -> None:
    batch = _batch()
    padded, packed = padded_layout(batch, 6, pad_id=0), packed_layout(batch, 4, pad_id=0)
    g = torch.Generator().manual_seed(0)
    per_seq_values = [torch.randn(s.length, generator=g) for s in batch]

    def place(layout):  # noqa: ANN001, ANN202
        mb = layout.microbatches[0]
        values = torch.zeros_like(mb["completion_mask"])
        for (_, r, s, n), v in zip(layout.placements, per_seq_values):
            values[r, s : s + n] = v
        return values, mb

    (va, a), (vb, b) = place(padded), place(packed)
    for mode in ("token_mean", "seq_mean", "seq_mean_token_sum_norm"):
        sa, ca = aggregate(va, a["completion_mask"], mode, 8, a["segment_ids"])
        sb, cb = aggregate(vb, b["completion_mask"], mode, 8, b["segment_ids"])
        assert torch.allclose(sa, sb, atol=1e-6) and int(ca) == int(cb), mode
    # padded rows without segment ids aggregate per row, as before
    s_rows, c_rows = aggregate(va, a["completion_mask"], "seq_mean", 8)
    s_seg, c_seg = aggregate(va, a["completion_mask"], "seq_mean", 8, a["segment_ids"])
    # 6 sequences, one untrainable (a skipped reward): it is not in the sequence mean's count
    assert torch.allclose(s_rows, s_seg) and int(c_rows) == int(c_seg) == 5


def test_observation_tokens_are_out_of_the_loss_in_both_layouts() -> None:
    """A multi-turn episode's completion is turn 1 + observation + turn 2 (issue 46): ``Sample.loss_mask`` marks the
    policy's tokens, both layouts score only those, and through the real GRPO loss (KL and TIS on) the gradient at every
    observation position is exactly zero while the policy's tokens get one."""
    from oumi_megatron.config.grpo_params import MegatronGrpoParams
    from oumi_megatron.grpo.loss import make_grpo_loss_fn
    from oumi_megatron.trainer.batches import mini_batches

    episode = Sample([1, 2], [3, 4, 90, 91, 92, 5, 6], 0, SampleStatus.FINISHED, [-0.1] * 7,
                     loss_mask=[1, 1, 0, 0, 0, 1, 1], advantage=1.0, trainable=True)
    single = Sample([1, 2], [7, 8, 9], 0, SampleStatus.FINISHED, [-0.2] * 3, advantage=-1.0, trainable=True)
    batch = mini_batches([episode, single], 2, 1)[0]
    assert [s.loss_mask for s in batch] == [[1, 1, 0, 0, 0, 1, 1], None]
    padded, packed = padded_layout(batch, 2, pad_id=0), packed_layout(batch, 2, pad_id=0)
    masks = [lay.per_sequence([mb["completion_mask"] for mb in lay.microbatches]) for lay in (padded, packed)]
    assert masks[0][0].tolist() == masks[1][0].tolist() == [0, 1, 1, 0, 0, 0, 1, 1, 0]  # position t scores token t + 1
    assert masks[0][1].tolist() == masks[1][1].tolist() == [0, 1, 1, 1, 0]
    grpo = MegatronGrpoParams(beta=0.1, tis_cap=2.0, max_completion_length=8)
    mb = padded.microbatches[0]
    logprobs = torch.full(mb["input_ids"].shape, -1.0, requires_grad=True)
    extra = {"old_logprobs": torch.full_like(logprobs, -1.1), "ref_logprobs": torch.full_like(logprobs, -0.9)}
    loss, _, _ = make_grpo_loss_fn(grpo)(logprobs, {**mb, **extra})
    loss.backward()
    grad = logprobs.grad[0]
    assert (grad[3:6] == 0).all() and (grad[[1, 2, 6, 7]] != 0).all(), grad
    with pytest.raises(ValueError, match="a loss mask of 2 tokens for a completion of 3"):
        padded_layout(mini_batches([Sample([1], [2, 3, 4], 0, loss_mask=[1, 0], advantage=1.0, trainable=True)], 1, 1)[0],
                      1, pad_id=0)
