"""SamplingSpec validation, log-prob extraction and engine config, without vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.common.sampling_spec import SamplingSpec
from rlfleet.services.generation.config import GenerationEngineConfig
from rlfleet.services.generation.sampling import SampleAccumulator, sampled_log_probs
from rlfleet.services.generation.status import TokenRate
from rlfleet.v1 import sampling_pb2


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
        # vLLM refuses > 2 and quietly samples (0, 0.01) at 0.01 or greedily: refused up front.
        ({"temperature": 2.5}, "sampling.temperature"),
        ({"temperature": 0.001}, "sampling.temperature"),
        ({"temperature": 1e-6}, "sampling.temperature"),
        ({"stop": ("a",) * 17}, "sampling.stop has 17 strings, at most 16"),
        ({"stop": ("a" * 1025,)}, "sampling.stop"),
        ({"stop_token_ids": (1,) * 1025}, "sampling.stop_token_ids has 1025 ids, at most 1024"),
    ],
)
def test_sampling_spec_rejects_bad_fields(kwargs, field_name):
    with pytest.raises(InvalidArgument, match=field_name):
        SamplingSpec(**kwargs).validate()


def test_default_sampling_spec_is_valid():
    SamplingSpec().validate()
    for temperature in (0.0, 0.01, 0.7, 2.0):
        SamplingSpec(temperature=temperature).validate()
    sent = sampling_pb2.SamplingParams(temperature=0.01).temperature  # float32 on the wire: 0.0099999998
    assert sent < 0.01
    SamplingSpec(temperature=sent).validate()


def test_greedy_computes_one_sample_whatever_n():
    assert SamplingSpec(n=4, temperature=0.0).computed_samples == 1
    assert SamplingSpec(n=4, temperature=0.7).computed_samples == 4


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


# --- the engine's bounds and greedy groups, against a stand-in for vLLM's AsyncLLM ------------------

@dataclass
class FakeCompletion:
    index: int
    token_ids: list[int]
    logprobs: FakeFlatLogprobs
    finish_reason: str | None
    stop_reason: str | None = None
    weight_versions: list | None = None


class FakeVLLM:
    """Answers every request with ``params.n`` samples of two tokens each; records the params."""

    errored = False

    def __init__(self, fail_with: Exception | None = None):
        self.params = []
        self.fail_with = fail_with

    def generate(self, prompt, params, request_id):
        self.params.append(params)

        async def stream():
            if self.fail_with is not None:
                raise self.fail_with
            for step, finish in ((0, None), (1, "length")):
                token = 10 + step
                yield SimpleNamespace(num_cached_tokens=0, outputs=[
                    FakeCompletion(i, [token + i], FakeFlatLogprobs([token + i], [-0.5 - i]), finish)
                    for i in range(params.n)])
        return stream()


@pytest.fixture
def engine(monkeypatch):
    from rlfleet.services.generation.vllm_engine import GenerationEngine
    from rlfleet.services.generation.status import EngineState

    # What to_vllm decides, without importing vLLM.
    monkeypatch.setattr("rlfleet.services.generation.rollout.to_vllm",
                        lambda spec: SimpleNamespace(n=spec.computed_samples))
    engine = GenerationEngine(GenerationEngineConfig(model="/m", max_n=8, max_model_len=64))
    engine.replica.vllm = FakeVLLM()
    engine.replica.move_to(EngineState.STARTING)
    engine.replica.move_to(EngineState.SERVING)
    engine.replica.vocab_size = 100
    engine.replica.admission_open.set()
    return engine


async def collect(engine, spec, prompt=(1, 2, 3), request_id="r"):
    return [sample async for sample in engine.generate(list(prompt), spec, request_id)]


async def test_greedy_group_is_one_computed_sample_sent_n_times(engine):
    samples = await collect(engine, SamplingSpec(n=4, temperature=0.0, max_tokens=8))
    assert [p.n for p in engine.replica.vllm.params] == [1]
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert all(s.response_token_ids == [10, 11] and s.behavior_log_probs == [-0.5, -0.5] for s in samples)
    sampled = await collect(engine, SamplingSpec(n=3, temperature=1.0, max_tokens=8), request_id="s")
    assert engine.replica.vllm.params[-1].n == 3
    assert [s.response_token_ids for s in sampled] == [[10, 11], [11, 12], [12, 13]]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (SamplingSpec(n=9), "sampling.n is 9, this replica serves at most max_n=8"),
        (SamplingSpec(n=10**9), "max_n=8"),
        (SamplingSpec(max_tokens=64), "sampling.max_tokens is 64, it must be below max_model_len 64"),
        (SamplingSpec(stop_token_ids=(100,), max_tokens=4), "sampling.stop_token_ids: token id 100 outside vocabulary"),
    ],
)
async def test_sampling_bounds_are_checked_before_anything_is_built(engine, spec, message):
    with pytest.raises(InvalidArgument, match=message):
        engine.check_sampling(spec)
    with pytest.raises(InvalidArgument, match=message):
        await collect(engine, spec)
    assert engine.replica.vllm.params == []  # nothing reached vLLM


async def test_prompt_bounds(engine):
    assert engine.max_prompt_tokens == 63
    with pytest.raises(InvalidArgument, match="prompt is 64 tokens long, .* max_prompt_tokens=63"):
        await collect(engine, SamplingSpec(max_tokens=1), prompt=[1] * 64)
    engine.config = GenerationEngineConfig(model="/m", max_n=8, max_model_len=64, max_prompt_tokens=10)
    assert engine.max_prompt_tokens == 10
    with pytest.raises(InvalidArgument, match="max_prompt_tokens=10"):
        await collect(engine, SamplingSpec(max_tokens=1), prompt=[1] * 11)
    # Text is refused untokenized beyond 32 characters per allowed token.
    with pytest.raises(InvalidArgument, match="prompt.text has 321 characters"):
        await engine.encode_text("x" * 321)
    with pytest.raises(InvalidArgument, match="prompt.chat.messages has 400 characters"):
        await engine.encode_chat([{"role": "user", "content": "x" * 396}])


async def test_a_request_vllm_refuses_is_invalid_argument_not_internal(engine, monkeypatch):
    class Refused(ValueError):
        pass

    monkeypatch.setattr("rlfleet.services.generation.vllm_engine._vllm_validation_error", lambda: Refused)
    engine.replica.vllm = FakeVLLM(fail_with=Refused("n must be 1 when using greedy sampling"))
    with pytest.raises(InvalidArgument, match="vLLM refused request r: n must be 1"):
        await collect(engine, SamplingSpec(n=2, max_tokens=4))
    assert engine.status().requests_in_flight == 0


async def test_servicer_refuses_n_before_reading_the_prompt(engine):
    from rlfleet.services.generation.servicer import GenerationServicer
    from rlfleet.v1 import generation_pb2, sampling_pb2, tensor_pb2

    working = SimpleNamespace(check_working=lambda: None)  # a service that has not failed
    request = generation_pb2.GenerateRequest(
        prompt=sampling_pb2.Prompt(token_ids=tensor_pb2.Tensor(dtype=99)),  # malformed, never read
        sampling=sampling_pb2.SamplingParams(n=2**31 - 1, max_tokens=4))
    with pytest.raises(InvalidArgument, match="sampling.n is 2147483647"):
        [reply async for reply in GenerationServicer(engine, working).Generate(request, None)]
    request.sampling.n = 2
    request.sampling.stop_token_ids[:] = [1] * 5000
    with pytest.raises(InvalidArgument, match="stop_token_ids has 5000 ids"):
        [reply async for reply in GenerationServicer(engine, working).Generate(request, None)]
