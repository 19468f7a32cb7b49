"""A group's samples decoded once (``GroupSamples.decode``): the same group whatever dtypes its samples
came in, empty responses included, and a bad message named."""

import pytest
import torch

from rlfleet.services.collector.trajectories import GroupSamples
from rlfleet.v1 import generation_pb2, sampling_pb2
from rlfleet.wire import WireError, encode_tensor

PROMPTS = [torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3]), torch.tensor([7])]
RESPONSES = [torch.arange(5), torch.tensor([40, 41]), torch.zeros(0, dtype=torch.int64)]
LOG_PROBS = [-torch.arange(1, 6) / 8, torch.tensor([-0.5, -0.25]), torch.zeros(0)]


def sample(index: int, token_dtype: torch.dtype, log_prob_dtype: torch.dtype) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(
        sample_index=index, prompt_token_ids=encode_tensor(PROMPTS[index].to(token_dtype)),
        response_token_ids=encode_tensor(RESPONSES[index].to(token_dtype)),
        behavior_log_probs=encode_tensor(LOG_PROBS[index].to(log_prob_dtype)),
        policy_version_start=3, policy_version_end=4, finish_reason=sampling_pb2.FINISH_REASON_LENGTH)


@pytest.mark.parametrize("token_dtype, log_prob_dtype", [
    (torch.int64, torch.float32),  # as replicas send them: each column's bytes joined
    (torch.int32, torch.float64),  # anything else: each tensor decoded and converted
])
def test_a_group_decodes_to_its_samples_in_order(token_dtype, log_prob_dtype):
    group = GroupSamples.decode([sample(i, token_dtype, log_prob_dtype) for i in range(3)])
    assert group.prompts.values.dtype == group.responses.values.dtype == torch.int64
    assert group.prompts.values.tolist() == [1, 2, 3, 1, 2, 3, 7]
    assert group.prompts.lengths.tolist() == [3, 3, 1]
    assert group.responses.values.tolist() == [0, 1, 2, 3, 4, 40, 41]
    assert group.responses.lengths.tolist() == [5, 2, 0]
    assert group.behavior_log_probs.values.dtype == torch.float32
    assert torch.equal(group.behavior_log_probs.values, torch.cat(LOG_PROBS))
    assert group.behavior_log_probs.lengths.tolist() == [5, 2, 0]
    assert group.full.values.tolist() == [1, 2, 3, 0, 1, 2, 3, 4, 1, 2, 3, 40, 41, 7]
    assert group.full.lengths.tolist() == [8, 5, 1]
    assert group.versions.values.tolist() == [3] * 7  # no spans: the start version throughout
    assert group.versions.lengths.tolist() == [5, 2, 0]
    assert group.turn_versions.values.tolist() == [[3, 4]] * 3
    assert group.turn_versions.lengths.tolist() == [1, 1, 1]
    group.responses.values[0] = 9  # a tensor of its own, not a view of the messages' bytes


def test_a_group_with_version_spans_labels_each_token():
    samples = [sample(i, torch.int64, torch.float32) for i in range(2)]
    samples[0].policy_version_spans.add(version=3, start=0, end=2)
    samples[0].policy_version_spans.add(version=4, start=2, end=5)
    group = GroupSamples.decode(samples)
    assert group.versions.values.tolist() == [3, 3, 4, 4, 4, 3, 3]
    assert group.versions.lengths.tolist() == [5, 2]


def test_a_bad_sample_names_its_field():
    samples = [sample(i, torch.int64, torch.float32) for i in range(2)]
    samples[1].response_token_ids.data = b"\x00" * 3
    with pytest.raises(WireError, match=r"response_token_ids\.data: has 3 bytes, expected 16"):
        GroupSamples.decode(samples)
