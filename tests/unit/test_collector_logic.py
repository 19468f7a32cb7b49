"""Collector logic above gRPC: staleness admission, prompt source, trajectory layout."""

import asyncio

import pytest
import torch

from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.prompts import PromptItem, PromptSource
from rlfleet.services.common.errors import InvalidArgument, ResourceExhausted


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


async def admitted_now(gate: VersionGate, limit: int = 100) -> int:
    count = 0
    while count < limit and gate.may_start():
        await gate.admit()
        count += 1
    return count


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_gate_runs_at_most_k_steps_ahead(max_staleness):
    async def scenario():
        gate = VersionGate(groups_per_step=4, max_staleness=max_staleness)
        # Version 0: steps 0..k may start.
        assert await admitted_now(gate) == 4 * (max_staleness + 1)
        for version in range(1, 4):
            await gate.begin_push()
            assert not gate.may_start()  # closed while weights swap
            await gate.end_push(version)
            # Each push opens exactly one more step, and every group started
            # for step s starts at a version >= s - k.
            assert await admitted_now(gate) == 4
            step = gate.step_of(gate.groups_started - 1)
            assert gate.version >= step - max_staleness
    run(scenario())


def test_gate_versions_are_monotone_and_failed_push_keeps_version():
    async def scenario():
        gate = VersionGate(version=3)
        await gate.begin_push()
        await gate.end_push(None)
        assert gate.version == 3 and gate.may_start()
        await gate.begin_push()
        with pytest.raises(ValueError):
            await gate.end_push(2)
    run(scenario())


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_push_without_a_step_moves_the_step_count_not_the_lead(max_staleness):
    """TorchRL's recipe pushes once before training: step 0 then runs on those weights and the
    lead over the trainer stays k steps (else sync mode would generate a step that goes stale)."""
    async def scenario():
        gate = VersionGate(groups_per_step=2, max_staleness=max_staleness)
        for version in (1, 2):  # pushes with nothing admitted: the trainer has not taken a step
            await gate.begin_push()
            await gate.end_push(version)
        admitted = []
        for version in (3, 4, 5):
            while gate.may_start():
                admitted.append(await gate.admit())
            assert len(admitted) == 2 * (max_staleness + version - 2)  # k+1 steps ahead, then one per push
            await gate.begin_push()
            await gate.end_push(version)
        # Step s started at version >= 2 + s - k: never more than k steps ahead of the trainer.
        assert all(started >= 2 + gate.step_of(index) - max_staleness for index, started in admitted)
        assert [started for index, started in admitted if gate.step_of(index) == 0] == [2, 2]
    run(scenario())


def test_give_back_reopens_a_slot():
    async def scenario():
        gate = VersionGate(groups_per_step=2, max_staleness=0)
        assert await admitted_now(gate) == 2
        await gate.give_back()
        assert await admitted_now(gate) == 1
    run(scenario())


def records(n):
    return [{"prompt": f"q{i}", "answer": str(i)} for i in range(n)]


def test_prompt_source_epochs_shuffle_resume_and_priority():
    async def scenario():
        source = PromptSource(records(5), shuffle=True, seed=1, epochs=2)
        first = [(await source.next()).text for _ in range(5)]
        assert sorted(first) == [f"q{i}" for i in range(5)] and first != [f"q{i}" for i in range(5)]
        state = source.state()
        assert state == {"epoch": 1, "index": 0}
        source.submit([PromptItem(prompt_id="", text="urgent")])
        source.requeue(PromptItem(prompt_id="r", text="again"))
        assert (await source.next()).text == "again"
        assert (await source.next()).text == "urgent"
        second = [(await source.next()).text for _ in range(5)]
        assert sorted(second) == sorted(first) and source.exhausted
        resumed = PromptSource(records(5), shuffle=True, seed=1, epochs=2)
        resumed.load_state(state)
        assert [(await resumed.next()).text for _ in range(5)] == second
    run(scenario())


def test_prompt_source_validation_and_bounds():
    async def scenario():
        source = PromptSource([{"prompt": 3}])
        with pytest.raises(InvalidArgument, match="row 0"):
            await source.next()
        bounded = PromptSource(max_submitted=2)
        with pytest.raises(ResourceExhausted):
            bounded.submit([PromptItem("a", text="x")] * 3)
        assert bounded.queued == 0
        chat = PromptSource([{"prompt": [{"role": "user", "content": "hi"}]}])
        assert (await chat.next()).chat == [{"role": "user", "content": "hi"}]
    run(scenario())


class _Pool:
    """Stands in for ReplicaPool: probes answer what the replica now serves."""

    def __init__(self, serving, on_probe=None):
        self.serving, self.on_probe, self.failed = serving, on_probe, []

    async def probe(self, replica):
        if self.on_probe is not None:
            self.on_probe()
        return self.serving

    async def mark_failed(self, replica, error):
        replica.healthy = False
        self.failed.append(error)


class _Fanout:
    def __init__(self):
        self.pushes, self.busy = 0, False


def check_in_rotation(serving, on_probe=None, busy=False):
    from rlfleet.services.collector.replicas import Replica
    from rlfleet.services.collector.service import CollectorService

    service = CollectorService.__new__(CollectorService)
    service.pool, service.fanout = _Pool(serving, on_probe), _Fanout()
    service.fanout.busy = busy
    replica = Replica("gen:1", None, None, healthy=True, policy_version=7)
    if on_probe is not None:
        service.pool.on_probe = lambda: on_probe(service.fanout)
    run(service._check_in_rotation(replica))
    return replica.healthy, service.pool.failed


def test_a_replica_in_rotation_that_restarted_is_taken_out_for_a_resync():
    assert check_in_rotation(7) == (True, [])
    assert check_in_rotation(0) == (False, ["serves version 0, not 7 (restarted?)"])
    assert check_in_rotation(None) == (True, [])  # unreachable: its calls will tell
    assert check_in_rotation(0, busy=True) == (True, [])  # a push in flight: versions are moving

    def push_meanwhile(fanout):
        fanout.pushes += 1
    assert check_in_rotation(8, on_probe=push_meanwhile) == (True, [])  # judged at the next check
