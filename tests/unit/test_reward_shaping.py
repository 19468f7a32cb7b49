import pytest
import torch

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.reward.shaping import last_token_index, shape_rewards, shape_rewards_ragged

KL = torch.tensor([[0.1, 0.2, 0.3], [0.5, -0.5, 7.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])
SCORES = torch.tensor([2.0, -15.0])


def test_score_at_last_token_minus_beta_kl_everywhere():
    shaped = shape_rewards(SCORES, KL, MASK, kl_coef=0.1, score_clip=10.0)
    assert shaped.raw_scores.tolist() == [2.0, -15.0]  # before clipping
    torch.testing.assert_close(shaped.score_rewards, torch.tensor([[0.0, 0.0, 2.0], [0.0, -10.0, 0.0]]))
    torch.testing.assert_close(shaped.kl_rewards, torch.tensor([[-0.01, -0.02, -0.03], [-0.05, 0.05, 0.0]]))
    torch.testing.assert_close(shaped.rewards, torch.tensor([[-0.01, -0.02, 1.97], [-0.05, -9.95, 0.0]]))


def test_no_clip_and_zero_beta():
    shaped = shape_rewards(SCORES, KL, MASK, kl_coef=0.0)
    assert shaped.score_rewards[1, 1] == -15.0
    assert shaped.kl_rewards.eq(0).all()


def test_left_padded_mask_puts_the_score_on_the_last_real_token():
    mask = torch.tensor([[False, True, True], [False, False, True]])
    assert last_token_index(mask).tolist() == [2, 2]
    shaped = shape_rewards(torch.tensor([1.0, 3.0]), torch.zeros(2, 3), mask, kl_coef=0.1)
    assert shaped.score_rewards.tolist() == [[0.0, 0.0, 1.0], [0.0, 0.0, 3.0]]


def test_ragged_matches_padded():
    ragged = shape_rewards_ragged(SCORES, [KL[0], KL[1, :2]], kl_coef=0.1, score_clip=10.0)
    padded = shape_rewards(SCORES, KL, MASK, kl_coef=0.1, score_clip=10.0)
    assert [row.numel() for row in ragged.rewards] == [3, 2]
    for index, length in enumerate([3, 2]):
        for field in ("score_rewards", "kl_rewards", "rewards"):
            torch.testing.assert_close(getattr(ragged, field)[index], getattr(padded, field)[index, :length])


def test_invalid_inputs_name_the_sample():
    with pytest.raises(InvalidArgument, match="sample 1: the response has no tokens"):
        shape_rewards_ragged(SCORES, [KL[0], torch.zeros(0)], kl_coef=0.1)
    with pytest.raises(InvalidArgument, match="sample 0: scores is nan"):
        shape_rewards(torch.tensor([float("nan"), 1.0]), KL, MASK, kl_coef=0.1)
    bad_kl = KL.clone()
    bad_kl[1, 1] = float("inf")
    with pytest.raises(InvalidArgument, match="sample 1, token 1: kl is inf"):
        shape_rewards(SCORES, bad_kl, MASK, kl_coef=0.1)
    with pytest.raises(InvalidArgument, match="scores has shape"):
        shape_rewards(SCORES[:1], KL, MASK, kl_coef=0.1)
    with pytest.raises(InvalidArgument, match="kl_coef must be finite"):
        shape_rewards(SCORES, KL, MASK, kl_coef=-1.0)
