"""The replica's fair share of its batch between runs (``fair_share.FairShare``): the rule alone, no vLLM."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from rlfleet.services.generation.fair_share import FairShare


async def _backlog(share: FairShare, runs: dict[str, float], calls: int, grants: list[str], cost: float = 8.0):
    """Each run queues ``calls`` one-sequence calls at its weight; the grants are recorded in order, each
    released at once (the batch frees one sequence at a time)."""
    async def call(run_id: str, weight: float) -> None:
        lease = await share.acquire(run_id, weight, 1, cost)
        grants.append(run_id)
        await asyncio.sleep(0)
        lease.close()

    tasks = [asyncio.create_task(call(run_id, weight)) for _ in range(calls) for run_id, weight in runs.items()]
    await asyncio.gather(*tasks)


async def test_while_the_batch_has_room_every_call_goes_in_at_once():
    share = FairShare(capacity=4)
    leases = [await share.acquire("a", 1.0, 1, 8) for _ in range(3)]
    assert share.in_use == 3
    lease = await share.acquire("b", 1.0, 1, 8)
    assert share.in_use == 4 and not share.waiting_by_run
    for held in [*leases, lease]:
        held.close()
    assert share.in_use == 0


@pytest.mark.parametrize("weights", [{"a": 1.0, "b": 1.0, "c": 1.0}, {"a": 1.0, "b": 2.0, "c": 4.0}])
async def test_backlogged_runs_get_the_batch_in_proportion_to_their_weights(weights):
    share = FairShare(capacity=1)
    blocker = await share.acquire("x", 1.0, 1, 8)  # the batch is full: every call below waits
    grants: list[str] = []
    backlog = asyncio.create_task(_backlog(share, weights, 70, grants))
    await asyncio.sleep(0)
    blocker.close()
    await backlog
    total = sum(weights.values())
    first = Counter(grants[:70])  # while every run still has calls waiting
    for run_id, weight in weights.items():
        assert abs(first[run_id] - 70 * weight / total) <= 1, (first, weights)


async def test_a_run_alone_gets_the_whole_batch_and_an_idle_one_saves_no_credit():
    share = FairShare(capacity=1)
    grants: list[str] = []
    await _backlog(share, {"a": 1.0}, 50, grants)  # a alone: everything, nobody else waiting
    assert grants == ["a"] * 50
    blocker = await share.acquire("a", 1.0, 1, 8)
    grants.clear()
    backlog = asyncio.create_task(_backlog(share, {"a": 1.0, "b": 1.0}, 10, grants))
    await asyncio.sleep(0)
    blocker.close()
    await backlog
    # b idled while a ran 50 calls: it does not get 50 calls in a row now, it alternates with a.
    assert max(len(run) for run in "".join(grants).replace("ab", "a b").replace("ba", "b a").split()) <= 2


async def test_a_backlog_of_ten_thousand_never_starves_another_runs_call():
    share = FairShare(capacity=2)
    held = [await share.acquire("big", 1.0, 1, 8) for _ in range(2)]
    waiting = [asyncio.create_task(share.acquire("big", 1.0, 1, 8)) for _ in range(10_000)]
    await asyncio.sleep(0)
    other = asyncio.create_task(share.acquire("small", 1.0, 1, 8))
    await asyncio.sleep(0)
    assert share.waiting_by_run == {"big": 10_000, "small": 1}
    held[0].close()  # one sequence back: the small run's call goes in before the backlog's next
    await asyncio.sleep(0)
    assert other.done() and sum(task.done() for task in waiting) <= 1
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert share.waiting_by_run == {}


async def test_a_cancelled_waiter_takes_nothing_and_lets_the_next_in():
    share = FairShare(capacity=2)
    held = await share.acquire("b", 1.0, 2, 8)
    big = asyncio.create_task(share.acquire("a", 1.0, 2, 8))
    small = asyncio.create_task(share.acquire("b", 1.0, 1, 8))
    await asyncio.sleep(0)
    assert share.waiting_by_run == {"a": 1, "b": 1}
    held.release(1)  # one free: the head (a's, two sequences, tagged before b's next) does not fit; b's waits
    await asyncio.sleep(0)
    assert not small.done()
    big.cancel()
    await asyncio.gather(big, return_exceptions=True)
    await asyncio.sleep(0)
    assert small.done() and share.in_use == 2 and share.waiting_by_run == {}


async def test_a_call_larger_than_the_batch_goes_in_alone_once_it_is_empty():
    share = FairShare(capacity=4)
    small = await share.acquire("a", 1.0, 1, 8)
    large = asyncio.create_task(share.acquire("b", 1.0, 16, 128))
    await asyncio.sleep(0)
    assert not large.done()
    small.close()
    lease = await large
    assert share.in_use == 16
    lease.release(15)
    assert lease.held == 1 and share.in_use == 1
    lease.close()
    lease.close()  # closing twice gives nothing back twice
    assert share.in_use == 0


def test_a_batch_of_no_sequences_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        FairShare(0)
