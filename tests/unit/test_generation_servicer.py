"""The generation servicer's reply building: the message a client decodes is exactly the one built field by field."""

from __future__ import annotations

import random

import torch

from rlfleet.services.common.sampling_spec import SamplingSpec, sampling_to_proto
from rlfleet.services.generation.sampling import SampleResult, SampleTiming
from rlfleet.services.generation.servicer import _sample_to_proto
from rlfleet.v1 import generation_pb2, sampling_pb2
from rlfleet.wire import decode_tensor, encode_tensor
from rlfleet.wire.tensor import encode_values


def _sample(stop_reason) -> SampleResult:
    generator = random.Random(2)
    tokens = [generator.randrange(512) for _ in range(64)]
    return SampleResult(
        request_id="req-1", index=3, prompt_length=5, response_token_ids=tokens,
        behavior_log_probs=[-generator.expovariate(1.0) for _ in tokens], finish_reason="stop",
        stop_reason=stop_reason, policy_version_start=4, policy_version_end=5,
        policy_version_spans=[(4, 0, 10), (5, 10, 64)], timing=SampleTiming(0.25, None, 1.5))


def test_sample_reply_equals_the_message_built_field_by_field():
    spec = SamplingSpec(n=4, temperature=0.7, max_tokens=64, stop=("x",), seed=9)
    prompt_ids = [7, 8, 9, 10, 11]
    template = generation_pb2.GenerateResponse(request_id="req-1", sampling=sampling_to_proto(spec))
    encode_values(prompt_ids, torch.int64, template.prompt_token_ids)
    for stop_reason, wire_stop in ((None, ""), (42, "42"), ("x", "x")):
        sample = _sample(stop_reason)
        expected = generation_pb2.GenerateResponse(
            request_id="req-1", sample_index=3, finish_reason=sampling_pb2.FINISH_REASON_STOP, stop_reason=wire_stop,
            policy_version_start=4, policy_version_end=5, sampling=sampling_to_proto(spec),
            timing=generation_pb2.SampleTiming(queued_seconds=0.25, first_token_seconds=0.0, total_seconds=1.5),
            policy_version_spans=[generation_pb2.VersionSpan(version=4, start=0, end=10),
                                  generation_pb2.VersionSpan(version=5, start=10, end=64)])
        expected.prompt_token_ids.CopyFrom(encode_tensor(torch.tensor(prompt_ids, dtype=torch.int64)))
        expected.response_token_ids.CopyFrom(encode_tensor(torch.tensor(sample.response_token_ids)))
        expected.behavior_log_probs.CopyFrom(encode_tensor(torch.tensor(sample.behavior_log_probs,
                                                                        dtype=torch.float32)))
        reply = _sample_to_proto(sample, template)
        assert reply == expected
        assert decode_tensor(reply.response_token_ids).tolist() == sample.response_token_ids
        assert decode_tensor(reply.behavior_log_probs).tolist() == torch.tensor(
            sample.behavior_log_probs, dtype=torch.float32).tolist()
    assert not template.HasField("response_token_ids")  # the template is copied, never filled
