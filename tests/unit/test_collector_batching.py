"""Many groups per reward / trajectory call: the coalescer's rules, and the byte surgery that merges
the groups' requests and splits the answer (checked against the reward service's own engine)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlfleet.services.collector.batched_calls import append_request, merge_reward_requests, split_reward_response
from rlfleet.services.collector.coalescer import Coalescer
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.v1 import reward_pb2, tensor_pb2
from rlfleet.wire import (Ragged, WireError, decode_ragged, decode_tensor, decode_tensordict, encode_ragged,
                          encode_tensor, encode_tensordict)
from rlfleet.wire.rows import concat_raggeds, concat_tensordicts, split_ragged, split_tensor, split_tensordict


# --- the coalescer ---------------------------------------------------------------------------------------
class _Service:
    """A fake service whose calls block until released (a unit test of the coalescing logic)."""

    def __init__(self, refuse: str | None = None, fail_all: Exception | None = None):
        self.calls: list[list[str]] = []
        self.release = asyncio.Event()
        self.refuse, self.fail_all = refuse, fail_all

    async def call(self, items: list[str]) -> list[str]:
        self.calls.append(list(items))
        await self.release.wait()
        if self.fail_all is not None:
            raise self.fail_all
        if self.refuse in items:
            raise InvalidArgument(f"{self.refuse} refused")
        return [item.upper() for item in items]


async def _started(service: _Service, count: int) -> None:
    while len(service.calls) < count:
        await asyncio.sleep(0)


def test_what_queues_while_a_call_is_in_flight_goes_out_in_one_call():
    async def scenario():
        service = _Service()
        coalescer = Coalescer(service.call, split_on=lambda exc: True)
        first = asyncio.ensure_future(coalescer.submit("a"))
        await _started(service, 1)
        rest = [asyncio.ensure_future(coalescer.submit(x)) for x in "bcd"]
        await asyncio.sleep(0)
        service.release.set()
        return await first, await asyncio.gather(*rest), service.calls, coalescer

    first, rest, calls, coalescer = asyncio.run(scenario())
    assert (first, rest) == ("A", ["B", "C", "D"])
    assert calls == [["a"], ["b", "c", "d"]]
    assert (coalescer.calls, coalescer.items) == (2, 4)


def test_calls_take_at_most_max_items_and_max_bytes_and_run_side_by_side_up_to_concurrency():
    async def scenario():
        service = _Service()
        coalescer = Coalescer(service.call, split_on=lambda exc: True, max_items=3, max_bytes=100, concurrency=2)
        first = asyncio.ensure_future(coalescer.submit("a", 10))
        await _started(service, 1)
        second = asyncio.ensure_future(coalescer.submit("b", 10))
        await _started(service, 2)  # the second slot: in flight beside the first
        sizes = {"c": 10, "d": 10, "e": 10, "f": 10, "g": 95, "h": 200}
        rest = [asyncio.ensure_future(coalescer.submit(x, size)) for x, size in sizes.items()]
        await asyncio.sleep(0)
        service.release.set()
        await asyncio.gather(first, second, *rest)
        return service.calls

    calls = asyncio.run(scenario())
    assert calls[:2] == [["a"], ["b"]]
    assert sorted(calls[2:]) == sorted([["c", "d", "e"], ["f"], ["g"], ["h"]])  # 3 items; 10 + 95 > 100; alone


def test_a_call_refused_for_one_item_is_made_again_item_by_item_so_only_that_one_fails():
    async def scenario():
        service = _Service(refuse="bad")
        coalescer = Coalescer(service.call, split_on=lambda exc: isinstance(exc, InvalidArgument))
        blocker = asyncio.ensure_future(coalescer.submit("a"))
        await _started(service, 1)
        rest = [asyncio.ensure_future(coalescer.submit(x)) for x in ("b", "bad", "c")]
        await asyncio.sleep(0)
        service.release.set()
        return await blocker, await asyncio.gather(*rest, return_exceptions=True), service.calls

    first, rest, calls = asyncio.run(scenario())
    assert first == "A" and rest[0] == "B" and rest[2] == "C"
    assert isinstance(rest[1], InvalidArgument) and "bad refused" in str(rest[1])
    assert calls == [["a"], ["b", "bad", "c"], ["b"], ["bad"], ["c"]]


def test_a_failure_that_is_not_about_one_item_reaches_every_caller_without_a_retry():
    async def scenario():
        service = _Service(fail_all=ConnectionError("reward is down"))
        coalescer = Coalescer(service.call, split_on=lambda exc: isinstance(exc, InvalidArgument))
        first = asyncio.ensure_future(coalescer.submit("a"))
        await _started(service, 1)
        rest = [asyncio.ensure_future(coalescer.submit(x)) for x in "bc"]
        await asyncio.sleep(0)
        service.release.set()
        return await asyncio.gather(first, *rest, return_exceptions=True), service.calls

    results, calls = asyncio.run(scenario())
    assert all(isinstance(r, ConnectionError) for r in results)
    assert calls == [["a"], ["b", "c"]]


def test_a_call_that_answers_the_wrong_number_of_results_fails_every_caller():
    async def wrong(items):
        return items[1:]

    async def scenario():
        coalescer = Coalescer(wrong, split_on=lambda exc: False)
        return await asyncio.gather(coalescer.submit("a"), return_exceptions=True)

    (result,) = asyncio.run(scenario())
    assert isinstance(result, AssertionError)


# --- row surgery -----------------------------------------------------------------------------------------
def test_ragged_and_tensor_rows_split_and_concatenate_byte_for_byte():
    rows = [torch.randn(n, 2) for n in (3, 0, 5, 1)]
    ragged = encode_ragged(Ragged.from_list(rows, torch.float32))
    parts = split_ragged(ragged, [1, 2, 1])
    assert [list(p.lengths) for p in parts] == [[3], [0, 5], [1]]
    assert concat_raggeds(parts) == ragged
    for got, want in zip(decode_ragged(parts[1]).to_list(), rows[1:3]):
        assert torch.equal(got, want)
    dense = encode_tensor(torch.arange(12, dtype=torch.int64).reshape(4, 3))
    assert [decode_tensor(part).tolist() for part in split_tensor(dense, [1, 2, 1])] == [
        [[0, 1, 2]], [[3, 4, 5], [6, 7, 8]], [[9, 10, 11]]]


def test_tensordicts_concatenate_and_split_back_row_for_row():
    def group(first: int, n: int) -> tensor_pb2.TensorDict:
        return encode_tensordict({
            "group_id": torch.full((n,), first), "score": torch.randn(n),
            "tokens": {"full": Ragged.from_list([torch.arange(first, first + i + 1) for i in range(n)], torch.int64)},
        }, batch_size=[n])

    a, b = group(10, 2), group(20, 3)
    both = concat_tensordicts([a, b])
    assert list(both.batch_size) == [5]
    decoded = decode_tensordict(both)
    assert decoded["group_id"].tolist() == [10, 10, 20, 20, 20]
    rows = split_tensordict(both)
    assert rows[:2] == split_tensordict(a) and rows[2:] == split_tensordict(b)
    request = append_request([("p#1", a, False), ("q#2", b, False)], 7)
    assert list(request.group_keys) == ["p#1", "q#2"] and request.trajectories == both
    assert request.committed_version == 7  # the store records the groups' staleness with it
    assert list(request.filtered_groups) == []  # nothing filtered: the field stays empty
    assert append_request([("p#1", a, False)], 0).trajectories == a
    assert list(append_request([("p#1", a, False), ("q#2", b, True)], 0).filtered_groups) == [False, True]


def test_tensordicts_that_do_not_share_a_schema_are_not_concatenated():
    first = encode_tensordict({"score": torch.randn(2), "x": torch.zeros(2)}, batch_size=[2])
    missing = encode_tensordict({"score": torch.randn(1)}, batch_size=[1])
    other_kind = encode_tensordict({"score": torch.randn(1), "x": Ragged.from_list([torch.zeros(2)])}, batch_size=[1])
    for second in (missing, other_kind):
        with pytest.raises(ValueError, match=r"entries\[x\]: rows to concatenate do not share a schema"):
            concat_tensordicts([first, second])


# --- reward requests merged and answers split, against the reward service's engine ------------------------
def _reward_request(group_id: int, lengths: list[int], answer: str,
                    environment_rewards: list[float] = ()) -> reward_pb2.ComputeRewardsRequest:
    generator = torch.Generator().manual_seed(group_id)
    behaviour = [-torch.rand(n, generator=generator) for n in lengths]
    reference = [-torch.rand(n, generator=generator) for n in lengths]
    request = reward_pb2.ComputeRewardsRequest(
        response_token_ids=encode_ragged(Ragged.from_list([torch.arange(n) for n in lengths], torch.int64)),
        behavior_log_probs=encode_ragged(Ragged.from_list(behaviour, torch.float32)),
        ref_log_probs=encode_ragged(Ragged.from_list(reference, torch.float32)),
        prompt_texts=["what?"] * len(lengths), response_texts=[answer if i % 2 else "no" for i in range(len(lengths))],
        tasks=[reward_pb2.Task(reward_fn="exact_match", ground_truth=answer)], group_ids=[group_id] * len(lengths),
        kl_estimator=reward_pb2.KL_ESTIMATOR_K3, advantage_mode=reward_pb2.ADVANTAGE_MODE_GRPO,
        environment_rewards=environment_rewards)
    return request


@pytest.mark.parametrize("environment_rewards", [
    ([], []),
    ([0.5, -1.0, 2.25, 0.0], []),  # the second group has none: 0 for each of its samples
    ([], [3.0, -0.5, 1.5]),
    ([0.5, -1.0, 2.25, 0.0], [3.0, -0.5, 1.5]),
], ids=["none", "first only", "second only", "both"])
def test_groups_scored_in_one_merged_call_get_what_each_would_get_alone(environment_rewards):
    from rlfleet.services.reward.config import RewardServiceConfig
    from rlfleet.services.reward.reward_engine import RewardEngine
    from rlfleet.services.reward.servicer import request_from_proto, response_to_proto

    config = RewardServiceConfig()
    engine = RewardEngine(config)
    engine.load()

    def score(request):
        return response_to_proto(engine.compute(request_from_proto(request, config)))

    requests = [_reward_request(7, [3, 5, 2, 4], "42", environment_rewards[0]),
                _reward_request(9, [6, 1, 2], "7", environment_rewards[1])]
    merged = merge_reward_requests(requests)
    if any(environment_rewards):
        assert list(merged.environment_rewards) == (environment_rewards[0] or [0.0] * 4) + (
            environment_rewards[1] or [0.0] * 3)
    else:
        assert not merged.environment_rewards
    answers = split_reward_response(score(merged), [4, 3])
    for answer, request in zip(answers, requests):
        alone = score(request)
        assert answer.kl_coef == alone.kl_coef
        for field in ("scores", "clipped_scores", "advantages", "kl_mean", "kl_sum"):
            torch.testing.assert_close(decode_tensor(getattr(answer, field)), decode_tensor(getattr(alone, field)))
        for field in ("kl", "rewards"):
            assert list(getattr(answer, field).lengths) == list(getattr(alone, field).lengths)
            torch.testing.assert_close(decode_ragged(getattr(answer, field)).values,
                                       decode_ragged(getattr(alone, field)).values)
    # exact_match's scores plus each sample's environment reward.
    assert decode_tensor(answers[0].scores).tolist() == [
        score + reward for score, reward in zip([0.0, 1.0, 0.0, 1.0], environment_rewards[0] or [0.0] * 4)]


def test_a_group_with_environment_rewards_not_one_per_sample_is_not_merged():
    # Merged, its values would land on the other group's samples; alone, the reward service refuses it.
    requests = [_reward_request(7, [3, 5, 2, 4], "42", [1.0] * 5), _reward_request(9, [6, 1, 2], "7", [1.0] * 2)]
    with pytest.raises(WireError, match="environment_rewards: 5 entries for a group of 4 samples"):
        merge_reward_requests(requests)


def test_an_answer_without_one_row_per_sample_is_a_wire_error():
    reply = reward_pb2.ComputeRewardsResponse(scores=encode_tensor(torch.zeros(3)))
    with pytest.raises(WireError, match="scores"):
        split_reward_response(reply, [2, 2])


def test_reference_requests_merge_and_the_answer_splits_back_per_group():
    from rlfleet.v1 import reference_pb2

    from rlfleet.services.collector.batched_calls import merge_reference_requests, split_reference_response

    def request(lengths, starts):
        return reference_pb2.ScoreLogProbsRequest(
            token_ids=encode_ragged(Ragged.from_list([torch.arange(n) for n in lengths], torch.int64)),
            response_starts=starts)

    merged = merge_reference_requests([request([5, 4], [2, 1]), request([3], [1])])
    assert list(merged.token_ids.lengths) == [5, 4, 3] and list(merged.response_starts) == [2, 1, 1]
    answer = [torch.randn(3), torch.randn(3), torch.randn(2)]  # length - start per sequence
    reply = reference_pb2.ScoreLogProbsResponse(ref_log_probs=encode_ragged(Ragged.from_list(answer, torch.float32)))
    first, second = split_reference_response(reply, [2, 1])
    assert [t.tolist() for t in decode_ragged(first).to_list()] == [answer[0].tolist(), answer[1].tolist()]
    assert decode_ragged(second).to_list()[0].tolist() == answer[2].tolist()
    with pytest.raises(WireError, match="ref_log_probs: the reference service answered 3 rows for 2 sequences"):
        split_reference_response(reply, [1, 1])
