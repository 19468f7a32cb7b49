"""SamplingSpec validation, log-prob extraction and engine config, without vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from pydantic import ValidationError

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.generation.config import GenerationEngineConfig
from rlfleet.services.generation.status import TokenRate
from rlfleet.services.generation.sampling import (
    SampleAccumulator,
    SamplingSpec,
    sampled_log_probs,
)


@dataclass
class FakeFlatLogprobs:
    """The fields of vLLM's FlatLogprobs that the engine reads."""

    token_ids: list[int]
    logprobs: list[float]
    start_indices: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.start_indices = self.start_indices or list(range(len(self.token_ids)))

    def __len__(self):
        return len(self.start_indices)


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"n": 0}, "sampling.n"),
        ({"temperature": -0.1}, "sampling.temperature"),
        ({"temperature": float("nan")}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_k": -1}, "sampling.top_k"),
        ({"max_tokens": 0}, "sampling.max_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "sampling.min_tokens"),
        ({"stop": ("",)}, "sampling.stop"),
        ({"stop_token_ids": (-1,)}, "sampling.stop_token_ids"),
    ],
)
def test_sampling_spec_rejects_bad_fields(kwargs, field_name):
    with pytest.raises(InvalidArgument, match=field_name):
        SamplingSpec(**kwargs).validate()


def test_default_sampling_spec_is_valid():
    SamplingSpec().validate()


def test_sampled_log_probs_reads_one_entry_per_position():
    flat = FakeFlatLogprobs(token_ids=[5, 9], logprobs=[-0.5, -1.5])
    assert sampled_log_probs([5, 9], flat) == [-0.5, -1.5]


def test_sampled_log_probs_refuses_misalignment():
    with pytest.raises(RuntimeError, match="positions"):
        sampled_log_probs([5, 9], FakeFlatLogprobs(token_ids=[5], logprobs=[-0.5]))
    with pytest.raises(RuntimeError, match="sampled 9"):
        sampled_log_probs([5, 9], FakeFlatLogprobs(token_ids=[5, 7], logprobs=[-0.5, -1.0]))


def test_accumulator_concatenates_deltas_and_records_first_token():
    sample = SampleAccumulator(index=2)
    sample.add([], None, now=1.0)
    sample.add([3], FakeFlatLogprobs([3], [-0.1]), now=2.0)
    sample.add([4, 6], FakeFlatLogprobs([4, 6], [-0.2, -0.3]), now=3.0)
    assert sample.response_token_ids == [3, 4, 6]
    assert sample.behavior_log_probs == [-0.1, -0.2, -0.3]
    assert sample.first_token_at == 2.0


def test_config_rejects_engine_owned_kwargs():
    GenerationEngineConfig(model="/m", engine_kwargs={"tensor_parallel_size": 2})
    with pytest.raises(ValidationError, match="logprobs_mode"):
        GenerationEngineConfig(model="/m", engine_kwargs={"logprobs_mode": "raw_logprobs"})
    with pytest.raises(ValidationError):
        GenerationEngineConfig(model="/m", max_queued_requests=0)


def test_token_rate_counts_within_window(monkeypatch):
    clock = iter([0.0, 10.0])
    monkeypatch.setattr("rlfleet.services.generation.status.time.monotonic", lambda: next(clock))
    rate = TokenRate(window_s=5.0)
    rate.add(100, now=1.0)  # falls out of the window by t=10
    rate.add(50, now=8.0)
    assert rate.per_second() == pytest.approx(50 / 5.0)
