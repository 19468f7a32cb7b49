import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.reward.advantages import grpo_advantages, make_groups, rloo_advantages


def test_grpo_on_three_numbers():
    # mean 2, unbiased std 1
    got = grpo_advantages(torch.tensor([1.0, 2.0, 3.0]), [0, 0, 0], eps=0.0)
    torch.testing.assert_close(got, torch.tensor([-1.0, 0.0, 1.0]))
    got = grpo_advantages(torch.tensor([1.0, 2.0, 3.0]), [0, 0, 0], eps=1.0)
    torch.testing.assert_close(got, torch.tensor([-0.5, 0.0, 0.5]))


def test_grpo_without_std_scaling():
    got = grpo_advantages(torch.tensor([1.0, 2.0, 6.0]), [7, 7, 7], scale_by_std=False)
    torch.testing.assert_close(got, torch.tensor([-2.0, -1.0, 3.0]))


def test_grpo_interleaved_groups_with_string_ids():
    got = grpo_advantages(torch.tensor([1.0, 10.0, 3.0, 30.0]), ["a", "b", "a", "b"], eps=0.0)
    half = 1 / math.sqrt(2)
    torch.testing.assert_close(got, torch.tensor([-half, -half, half, half]))


def test_grpo_identical_scores_and_singletons_give_zero():
    assert grpo_advantages(torch.tensor([5.0, 5.0, 5.0]), [0, 0, 0]).tolist() == [0.0, 0.0, 0.0]
    assert grpo_advantages(torch.tensor([5.0]), [0]).tolist() == [0.0]


def test_rloo_on_three_numbers():
    # baselines: mean of the others = [2.5, 2.0, 1.5]
    got = rloo_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4, 4, 4]))
    torch.testing.assert_close(got, torch.tensor([-1.5, 0.0, 1.5]))


def test_groups_must_be_complete_when_a_size_is_configured():
    with pytest.raises(InvalidArgument, match="sample 1: group 1 has 2 samples, expected exactly 3"):
        grpo_advantages(torch.zeros(5), [0, 1, 0, 1, 0], group_size=3)
    make_groups([0, 1, 0, 1], 4, group_size=2)  # fine


def test_rloo_needs_two_per_group():
    with pytest.raises(InvalidArgument, match="sample 2: group 'z' has 1 samples, expected at least 2"):
        rloo_advantages(torch.zeros(3), ["y", "y", "z"])
    with pytest.raises(InvalidArgument, match="group_size must be >= 2"):
        rloo_advantages(torch.zeros(3), [0, 1, 2], group_size=1)


def test_bad_inputs_name_the_sample():
    with pytest.raises(InvalidArgument, match="group_ids has 2 entries for 3 samples"):
        grpo_advantages(torch.zeros(3), [0, 0])
    with pytest.raises(InvalidArgument, match="sample 2: scores is nan"):
        grpo_advantages(torch.tensor([0.0, 1.0, float("nan")]), [0, 0, 0])
    with pytest.raises(InvalidArgument, match="sample 1: group id 0.5 must be an int or a string"):
        grpo_advantages(torch.zeros(2), [0, 0.5])
    with pytest.raises(InvalidArgument, match="scores must be 1-D"):
        rloo_advantages(torch.zeros(2, 2), [0, 0])


@st.composite
def grouped_scores(draw, min_group=1):
    sizes = draw(st.lists(st.integers(min_group, 8), min_size=1, max_size=6))
    group_ids = [group for group, size in enumerate(sizes) for _ in range(size)]
    order = draw(st.permutations(range(len(group_ids))))
    scores = draw(st.lists(st.floats(-100, 100), min_size=len(group_ids), max_size=len(group_ids)))
    return torch.tensor(scores), [group_ids[i] for i in order]


def group_sums(advantages, group_ids):
    sums = {}
    for value, group in zip(advantages.tolist(), group_ids):
        sums[group] = sums.get(group, 0.0) + value
    return sums


@settings(max_examples=200, deadline=None)
@given(grouped_scores(), st.booleans())
def test_grpo_advantages_sum_to_zero_per_group(batch, scale_by_std):
    scores, group_ids = batch
    advantages = grpo_advantages(scores, group_ids, scale_by_std=scale_by_std)
    # Normalised advantages are O(sqrt(n)); raw ones are on the scale of the scores.
    tolerance = 1e-4 if scale_by_std else 1e-3
    for total in group_sums(advantages, group_ids).values():
        assert abs(total) < tolerance


@settings(max_examples=200, deadline=None)
@given(grouped_scores(min_group=2))
def test_rloo_advantages_sum_to_zero_per_group(batch):
    scores, group_ids = batch
    for total in group_sums(rloo_advantages(scores, group_ids), group_ids).values():
        assert abs(total) < 1e-3
