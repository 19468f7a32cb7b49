"""The ``resume`` swap without vLLM: continuation budgets and seeds, span stitching, and one
``generate`` call's requests (the call's own, then one continuation per aborted sample) read back
as finished samples, against scripted vLLM output streams."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from rlfleet.services.common.errors import Unavailable
from rlfleet.services.common.sampling_spec import SamplingSpec
from rlfleet.services.generation.resume import continuation_seed, continuation_spec, resume_blocker
from rlfleet.services.generation.rollout import Rollout
from rlfleet.services.generation.sampling import SampleAccumulator

PROMPT = [1, 2, 3]


def span(version: int, start: int, end: int):
    """One of vLLM's WeightVersionSpans (versions are strings there)."""
    return SimpleNamespace(version=str(version), start=start, end=end)


# ---------------------------------------------------------------- the rules


def test_continuation_takes_the_budget_left():
    spec = SamplingSpec(n=4, temperature=0.7, top_p=0.9, max_tokens=10, min_tokens=4, stop_token_ids=(7,), seed=5)
    after_3 = continuation_spec(spec, index=2, sampled=3)
    assert (after_3.n, after_3.max_tokens, after_3.min_tokens) == (1, 7, 1)
    assert (after_3.temperature, after_3.top_p, after_3.stop_token_ids) == (0.7, 0.9, (7,))
    assert continuation_spec(spec, index=2, sampled=6).min_tokens == 0
    assert continuation_spec(spec, index=2, sampled=9).max_tokens == 1
    with pytest.raises(ValueError, match="10 of max_tokens=10"):
        continuation_spec(spec, index=0, sampled=10)


def test_continuation_seed():
    assert continuation_seed(None, 3, 5) is None
    assert continuation_seed(100, 3, 0) == 103  # nothing sampled yet: vLLM's own seed + index
    seeds = {continuation_seed(100, index, sampled) for index in range(4) for sampled in range(1, 5)}
    assert len(seeds) == 16 and all(0 <= s < 2**63 for s in seeds)
    assert continuation_seed(100, 1, 2) == continuation_seed(100, 1, 2)  # reproducible for one swap point
    assert continuation_seed(100, 1, 2) not in range(100, 100 + 64)  # not a sibling sample's seed


def test_only_stop_strings_block_a_resume():
    assert resume_blocker(SamplingSpec(stop_token_ids=(5,), min_tokens=2, seed=1, ignore_eos=True)) is None
    assert "stop strings" in resume_blocker(SamplingSpec(stop=("</answer>",)))


def test_spans_are_stitched_across_requests():
    sample = SampleAccumulator(index=0, response_token_ids=[5, 6, 7])
    assert sample.spans([span(1, 0, 3)]) == [(1, 0, 3)]
    assert sample.continue_after([span(1, 0, 3)]) == 3
    sample.response_token_ids += [8, 9]
    assert sample.spans([span(2, 0, 2)]) == [(1, 0, 3), (2, 3, 5)]
    assert sample.continue_after([span(2, 0, 2)]) == 5
    # A continuation aborted before its first token adds nothing; the same version again merges.
    assert sample.continue_after([]) == 5
    sample.response_token_ids += [10]
    assert sample.spans([span(2, 0, 1)]) == [(1, 0, 3), (2, 3, 6)]
    assert sample.spans(None) == [(1, 0, 3), (2, 3, 5)]


def test_every_swap_mode_is_spelled_alike_on_the_wire_in_the_sdk_and_the_engine():
    """One table (rlfleet.choices, from the proto's enum) that the SDK, the collector's settings, the weight
    stream and the engine all read."""
    from typing import get_args, get_type_hints

    from rlfleet.choices import SWAP_MODE_NAMES, SWAP_MODES
    from rlfleet.client.push import MODES
    from rlfleet.services.collector.config import CollectorConfig
    from rlfleet.services.generation.weight_swaps import WeightSwaps
    from rlfleet.v1 import weights_pb2

    engine_modes = get_args(get_type_hints(WeightSwaps.update)["mode"])
    assert MODES is SWAP_MODES and set(engine_modes) == {"wait", "abort", "keep", "resume"} == set(MODES)
    assert set(get_args(CollectorConfig.model_fields["swap_mode"].annotation)) == {"", *MODES}
    assert {SWAP_MODE_NAMES[value]: value for value in MODES.values()} == MODES
    assert set(SWAP_MODE_NAMES) == set(weights_pb2.UpdateMode.values())
    assert SWAP_MODE_NAMES[weights_pb2.UPDATE_MODE_UNSPECIFIED] == "keep"
    assert MODES["resume"] == weights_pb2.UPDATE_MODE_RESUME


async def test_engine_status_reports_resumed_samples_and_tokens():
    from rlfleet.services.generation.servicer import GenerationServicer
    from rlfleet.services.generation.status import EngineState, EngineStatus

    status = EngineStatus(model="/m", state=EngineState.SERVING, policy_version=3, requests_in_flight=0,
                          requests_waiting=0, requests_running=0, max_queued_requests=4, tokens_per_second=0.0,
                          resumed_samples=5, resumed_tokens=120)
    engine = SimpleNamespace(status=lambda: status, swapping=False,
                             weights=SimpleNamespace(transfer_world_size=1, max_push_bytes=1))
    reply = await GenerationServicer(engine, SimpleNamespace(check_working=lambda: None)).GetEngineStatus(None, None)
    assert (reply.resumed_samples, reply.resumed_tokens) == (5, 120)


# ---------------------------------------------------------------- one call, scripted vLLM


@dataclass
class FakeFlatLogprobs:
    token_ids: list[int]
    logprobs: list[float]
    start_indices: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.start_indices = list(range(len(self.token_ids)))

    def __len__(self):
        return len(self.start_indices)


def completion(index: int, tokens: list[int], finish: str | None = None, spans=None):
    return SimpleNamespace(index=index, token_ids=tokens, logprobs=FakeFlatLogprobs(tokens, [-t / 100 for t in tokens]),
                           finish_reason=finish, stop_reason=None, weight_versions=spans)


def output(*completions):
    return SimpleNamespace(num_cached_tokens=0, outputs=list(completions))


class FakeHost:
    """The engine side of a Rollout: each submitted request answers with the next script; a script
    entry "swap" moves the version (what a swap does while the request runs)."""

    def __init__(self, *scripts, resume: bool = True, pins=()):
        self.scripts = list(scripts)
        self.pins = list(pins)  # the adapter version each request is pinned to, in order (none: not pinned)
        self.policy_version = 1
        self.resume = resume
        self.submitted: list[tuple[str, list[int], SamplingSpec]] = []
        self.closed: list[str] = []
        self.resumed_samples = self.resumed_tokens = 0

    async def open_stream(self, prompt, params, request_id, required_version=None):
        if not self.scripts:
            raise Unavailable("engine is failed")
        self.submitted.append((request_id, prompt, params))
        return self._stream(request_id, self.scripts.pop(0)), 0, self.pins.pop(0) if self.pins else None

    async def _stream(self, request_id, script):
        try:
            for entry in script:
                await asyncio.sleep(0)
                if entry == "swap":
                    self.policy_version += 1
                elif entry == "hang":
                    await asyncio.Event().wait()
                else:
                    yield entry
        finally:
            self.closed.append(request_id)

    def resumes(self, swap_serial):
        return self.resume

    def count_tokens(self, num_tokens, now, first):
        pass

    def count_resume(self, carried_tokens):
        self.resumed_samples += 1
        self.resumed_tokens += carried_tokens


@pytest.fixture(autouse=True)
def no_vllm(monkeypatch):
    # The continuation's SamplingSpec itself stands for vLLM's SamplingParams.
    monkeypatch.setattr("rlfleet.services.generation.rollout.to_vllm", lambda spec: spec)


async def run(host, spec, prompt=PROMPT, required_version=None):
    rollout = Rollout(host, prompt, spec, "r", called_at=0.0, required_version=required_version)
    return {sample.index: sample async for sample in rollout.samples()}


async def test_two_samples_resumed_one_of_them_twice():
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=6, min_tokens=4, seed=5)
    host = FakeHost(
        [output(completion(0, [10, 11]), completion(1, [20])), "swap",
         output(completion(0, [], "abort", [span(1, 0, 2)]), completion(1, [], "abort", [span(1, 0, 1)]))],
        [output(completion(0, [12, 13, 14, 15], "length", [span(2, 0, 4)]))],
        [output(completion(0, [21])), "swap", output(completion(0, [], "abort", [span(2, 0, 1)]))],
        [output(completion(0, [22, 23, 24, 25], "length", [span(3, 0, 4)]))],
    )
    samples = await run(host, spec)

    first, second = samples[0], samples[1]
    assert first.finish_reason == second.finish_reason == "length"
    assert first.response_token_ids == [10, 11, 12, 13, 14, 15]
    assert first.behavior_log_probs == [-t / 100 for t in first.response_token_ids]
    assert first.policy_version_spans == [(1, 0, 2), (2, 2, 6)]
    assert (first.policy_version_start, first.policy_version_end) == (1, 2)
    assert second.response_token_ids == [20, 21, 22, 23, 24, 25]
    assert second.policy_version_spans == [(1, 0, 1), (2, 1, 2), (3, 2, 6)]
    assert first.prompt_length == second.prompt_length == len(PROMPT)
    # Each continuation: prompt + what that sample had, one sample, the budget left.
    continuations = [(prompt, params.n, params.max_tokens, params.min_tokens) for _, prompt, params in host.submitted[1:]]
    assert continuations == [([1, 2, 3, 10, 11], 1, 4, 2), ([1, 2, 3, 20], 1, 5, 3), ([1, 2, 3, 20, 21], 1, 4, 2)]
    assert (host.resumed_samples, host.resumed_tokens) == (3, 2 + 1 + 2)
    assert len({request_id for request_id, _, _ in host.submitted}) == 4


async def test_a_call_bound_to_a_version_is_never_continued_on_other_weights():
    """A rolling update's pin: the swap that would resume the samples ends them with "abort" instead."""
    spec = SamplingSpec(n=1, temperature=1.0, max_tokens=6, seed=5)
    host = FakeHost([output(completion(0, [10, 11])), "swap", output(completion(0, [], "abort", [span(1, 0, 2)]))],
                    [output(completion(0, [12], "length", [span(2, 0, 1)]))])
    samples = await run(host, spec, required_version=1)
    assert samples[0].finish_reason == "abort" and samples[0].response_token_ids == [10, 11]
    assert len(host.submitted) == 1 and host.resumed_samples == 0


async def test_a_greedy_group_is_resumed_once_and_sent_n_times():
    host = FakeHost(
        [output(completion(0, [10])), "swap", output(completion(0, [], "abort", [span(1, 0, 1)]))],
        [output(completion(0, [11, 12], "stop", [span(2, 0, 2)]))],
    )
    samples = await run(host, SamplingSpec(n=3, temperature=0.0, max_tokens=8))
    assert sorted(samples) == [0, 1, 2]
    assert all(s.response_token_ids == [10, 11, 12] and s.finish_reason == "stop" for s in samples.values())
    assert len(host.submitted) == 2 and host.submitted[1][2].n == 1


async def test_stop_strings_finish_with_abort_at_a_resume_swap():
    host = FakeHost([output(completion(0, [10, 11])), "swap", output(completion(0, [], "abort", [span(1, 0, 2)]))])
    (sample,) = (await run(host, SamplingSpec(max_tokens=8, stop=("x",)))).values()
    assert sample.finish_reason == "abort" and sample.response_token_ids == [10, 11]
    assert sample.policy_version_spans == [(1, 0, 2)]
    assert len(host.submitted) == 1 and host.resumed_samples == 0


async def test_an_abort_that_is_not_a_resume_swaps_is_reported():
    host = FakeHost([output(completion(0, [10], "abort", [span(1, 0, 1)]))], resume=False)
    (sample,) = (await run(host, SamplingSpec(max_tokens=8))).values()
    assert sample.finish_reason == "abort" and len(host.submitted) == 1


async def test_a_continuation_the_engine_cannot_take_finishes_with_abort():
    host = FakeHost([output(completion(0, [10, 11])), "swap", output(completion(0, [], "abort", [span(1, 0, 2)]))])
    (sample,) = (await run(host, SamplingSpec(max_tokens=8))).values()  # no script left: Unavailable
    assert sample.finish_reason == "abort" and sample.response_token_ids == [10, 11]
    assert sample.policy_version_spans == [(1, 0, 2)]


async def test_closing_the_call_closes_every_current_request():
    host = FakeHost(
        [output(completion(0, [10]), completion(1, [20])), "swap",
         output(completion(0, [], "abort", [span(1, 0, 1)]), completion(1, [], "abort", [span(1, 0, 1)]))],
        [output(completion(0, [11], "length", [span(2, 0, 1)]))],
        [output(completion(0, [21])), "hang"],
    )
    samples = Rollout(host, PROMPT, SamplingSpec(n=2, max_tokens=2), "r", called_at=0.0).samples()
    first = await samples.__anext__()
    assert first.response_token_ids == [10, 11]
    await samples.aclose()
    assert sorted(host.closed) == ["r", "r/resume-1", "r/resume-2"]


async def test_requests_pinned_to_adapters_report_their_versions_not_vllms_labels():
    """vLLM labels tokens with the engine's weight version, which an adapter push does not move: a request
    pinned to adapter 5, resumed (a resume swap) on adapter 6, has its tokens under 5 then 6."""
    host = FakeHost(
        [output(completion(0, [10, 11])), "swap", output(completion(0, [], "abort", [span(1, 0, 2)]))],
        [output(completion(0, [12, 13], "length", [span(1, 0, 2)]))],
        pins=[5, 6],
    )
    (sample,) = (await run(host, SamplingSpec(max_tokens=4))).values()
    assert sample.response_token_ids == [10, 11, 12, 13]
    assert sample.policy_version_spans == [(5, 0, 2), (6, 2, 4)]
    assert (sample.policy_version_start, sample.policy_version_end) == (5, 6)
