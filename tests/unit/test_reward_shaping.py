import pytest
import torch

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.reward.shaping import last_token_index_flat, shape_rewards_flat

# Two samples back to back (3 and 3 tokens); the last token of the second does not count.
KL = torch.tensor([0.1, 0.2, 0.3, 0.5, -0.5, 7.0])
MASK = torch.tensor([True, True, True, True, True, False])
SAMPLE_IDS = torch.tensor([0, 0, 0, 1, 1, 1])
SCORES = torch.tensor([2.0, -15.0])


def test_score_at_last_token_minus_beta_kl_everywhere():
    shaped = shape_rewards_flat(SCORES, KL, MASK, SAMPLE_IDS, kl_coef=0.1, score_clip=10.0)
    assert shaped.raw_scores.tolist() == [2.0, -15.0]  # before clipping
    torch.testing.assert_close(shaped.score_rewards, torch.tensor([0.0, 0.0, 2.0, 0.0, -10.0, 0.0]))
    torch.testing.assert_close(shaped.kl_rewards, torch.tensor([-0.01, -0.02, -0.03, -0.05, 0.05, 0.0]))
    torch.testing.assert_close(shaped.rewards, torch.tensor([-0.01, -0.02, 1.97, -0.05, -9.95, 0.0]))


def test_no_clip_and_zero_beta():
    shaped = shape_rewards_flat(SCORES, KL, MASK, SAMPLE_IDS, kl_coef=0.0)
    assert shaped.score_rewards[4] == -15.0
    assert shaped.kl_rewards.eq(0).all()


def test_leading_tokens_that_do_not_count_leave_the_score_on_the_last_counted_one():
    mask = torch.tensor([False, True, True, False, False, True])
    assert last_token_index_flat(mask, SAMPLE_IDS, 2).tolist() == [2, 5]
    shaped = shape_rewards_flat(torch.tensor([1.0, 3.0]), torch.zeros(6), mask, SAMPLE_IDS, kl_coef=0.1)
    assert shaped.score_rewards.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 3.0]


def test_invalid_inputs_name_the_sample():
    no_counted_token = torch.tensor([True, True, True, False, False, False])
    with pytest.raises(InvalidArgument, match="sample 1: the response has no tokens"):
        shape_rewards_flat(SCORES, KL, no_counted_token, SAMPLE_IDS, kl_coef=0.1)
    with pytest.raises(InvalidArgument, match="sample 0: scores is nan"):
        shape_rewards_flat(torch.tensor([float("nan"), 1.0]), KL, MASK, SAMPLE_IDS, kl_coef=0.1)
    bad_kl = KL.clone()
    bad_kl[4] = float("inf")
    with pytest.raises(InvalidArgument, match="kl holds NaN/inf at a counted token"):
        shape_rewards_flat(SCORES, bad_kl, MASK, SAMPLE_IDS, kl_coef=0.1)
    bad_kl[4], bad_kl[5] = 0.0, float("inf")  # not counted: may hold anything
    shape_rewards_flat(SCORES, bad_kl, MASK, SAMPLE_IDS, kl_coef=0.1)
    with pytest.raises(InvalidArgument, match="scores has shape"):
        shape_rewards_flat(SCORES[:, None], KL, MASK, SAMPLE_IDS, kl_coef=0.1)
    with pytest.raises(InvalidArgument, match="must share one flat shape"):
        shape_rewards_flat(SCORES, KL, MASK[:5], SAMPLE_IDS, kl_coef=0.1)
    with pytest.raises(InvalidArgument, match="kl_coef must be finite"):
        shape_rewards_flat(SCORES, KL, MASK, SAMPLE_IDS, kl_coef=-1.0)
