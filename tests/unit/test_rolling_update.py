"""Rolling updates, the logic above the services: routing by version pin, draining, the gate's open
admission and commit wait, the batch order and the window bound (the real services:
tests/integration/test_weight_sync.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlfleet.client.channel import ChannelSettings
from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.replicas import Replica, ReplicaPool, VersionRetired
from rlfleet.services.collector.generate_stage import off_pin
from rlfleet.services.collector.rolling import RollingSettings, RollingUpdate
from rlfleet.v1 import generation_pb2, sampling_pb2
from tests.waiting import settle



def pool_of(*versions: int) -> ReplicaPool:
    pool = ReplicaPool(ChannelSettings())
    pool.replicas = [Replica(f"r{i}", None, None, healthy=True, policy_version=v) for i, v in enumerate(versions)]
    return pool


async def test_a_pinned_request_goes_only_to_a_replica_serving_its_version():
    pool = pool_of(1, 2, 2)
    for _ in range(4):
        replica = await pool.acquire(version=1, timeout=1)
        assert replica.address == "r0"
        pool.release(replica)
    picked = {(await pool.acquire(version=2, timeout=1)).address for _ in range(4)}
    assert picked == {"r1", "r2"}
    with pytest.raises(VersionRetired, match="no replica in rotation serves version 3"):
        await pool.acquire(version=3, timeout=1)
    checkpoint = pool_of(0, 1)  # version 0 (the checkpoint's) is a version like any other
    assert (await checkpoint.acquire(version=0, timeout=1)).address == "r0"


async def test_a_draining_replica_takes_no_new_work_but_the_last_on_a_version_takes_its_pins():
    pool = pool_of(1, 1, 2)
    pool.replicas[0].draining = True
    assert {(await pool.acquire(timeout=1)).address for _ in range(6)} == {"r1", "r2"}
    assert (await pool.acquire(version=1, timeout=1)).address == "r1"
    pool.replicas[1].draining = True  # both replicas of version 1 draining: pinned groups may finish there
    assert (await pool.acquire(version=1, timeout=1)).address in {"r0", "r1"}
    assert (await pool.acquire(timeout=1)).address == "r2"
    assert pool.least_loaded().address == "r2"


async def test_a_drain_waits_for_what_the_replica_runs_and_the_last_one_for_the_pinned_groups():
    pool = pool_of(1, 1)
    first, second = pool.replicas
    busy = await pool.acquire(prefer=first, samples=4, timeout=1)
    drain = asyncio.create_task(pool.drain(first, time.monotonic() + 30))
    await settle()
    assert first.draining and not drain.done()
    pool.release(busy, 4)
    assert await asyncio.wait_for(drain, 5)

    pool.hold_pin(1)
    second.policy_version = 2  # the other switched: the first is the last on version 1
    await pool.undrain(first)
    drain = asyncio.create_task(pool.drain(first, time.monotonic() + 30))
    await settle()
    assert not drain.done(), "drained while a group pinned to its version still generates"
    await pool.release_pin(1)
    assert await asyncio.wait_for(drain, 5)


async def test_replicas_drained_together_wait_for_the_groups_pinned_to_their_version():
    """rolling_max_unavailable 2: each of the last two replicas on version 1 is draining, so neither counts
    the other as serving it; both wait until the pinned group ends."""
    pool = pool_of(1, 1)
    pool.hold_pin(1)
    log: list = []
    update = RollingUpdate(pool, RollingSettings(max_unavailable=2, drain_seconds=30), 1, 2, 2)
    rolling = asyncio.create_task(update.run(streams(pool, log)))
    await settle()
    assert not log, "a replica switched while a group pinned to its version still generated"
    turn = await pool.acquire(version=1, timeout=1)  # its next turn still finds version 1
    assert turn.policy_version == 1
    pool.release(turn)
    await pool.release_pin(1)
    await asyncio.wait_for(rolling, 5)
    assert update.switched == 2


async def test_a_drain_that_runs_out_of_time_says_so():
    pool = pool_of(1, 1)
    busy = await pool.acquire(prefer=pool.replicas[0], timeout=1)
    assert not await pool.drain(busy, time.monotonic() + 0.1)
    assert busy.draining


async def test_a_rolling_update_keeps_admission_open_and_groups_wait_for_its_commit():
    gate = VersionGate(version=1, groups_per_step=1, max_staleness=4)
    await gate.begin_rolling()
    assert gate.may_start() and gate.rolling
    waiting = asyncio.create_task(gate.committed(2))
    await settle()
    assert not waiting.done()
    await gate.end_rolling(2)
    assert await waiting and gate.version == 2 and not gate.rolling

    await gate.begin_rolling()
    waiting = asyncio.create_task(gate.committed(3))
    await settle()
    await gate.end_rolling(None)  # no replica applied it, or it could not be recorded
    assert not await waiting and gate.version == 2
    assert not await gate.committed(3)  # no push in flight: known at once


class _Stream:
    """A staged replica's side of a push (ReplicaPush): commit applies, or fails."""

    def __init__(self, replica: Replica, log: list, applies: bool = True, seconds: float = 0.0):
        self.replica, self.log, self.applies, self.seconds = replica, log, applies, seconds
        self.applied = False

    async def commit(self):
        self.log.append(("commit", self.replica.address, self.replica.draining,
                         sorted(r.address for r in self.log_pool.replicas if r.draining)))
        await asyncio.sleep(self.seconds)
        self.applied = self.applies
        if self.applies:
            self.replica.policy_version = 2

    def outcome(self):
        return type("Outcome", (), {"applied": self.applied, "error": "" if self.applied else "replica gone"})()


def streams(pool: ReplicaPool, log: list, **kwargs) -> list[_Stream]:
    out = []
    for replica in pool.replicas:
        stream = _Stream(replica, log, **kwargs)
        stream.log_pool = pool
        out.append(stream)
    return out


async def test_replicas_switch_k_at_a_time_each_drained_the_others_serving():
    pool = pool_of(1, 1, 1, 1, 1)
    log: list = []
    update = RollingUpdate(pool, RollingSettings(max_unavailable=2, drain_seconds=5), 1, 2, 5)
    await update.run(streams(pool, log))
    assert update.switched == 5 and all(r.policy_version == 2 and not r.draining for r in pool.replicas)
    draining_at_commit = [entry[3] for entry in log]
    assert all(entry[2] for entry in log), "a replica applied without being drained"
    assert max(len(d) for d in draining_at_commit) <= 2
    assert [entry[1] for entry in log] == ["r0", "r1", "r2", "r3", "r4"]


async def test_a_replica_that_fails_to_apply_leaves_rotation_at_once_and_the_update_goes_on():
    pool = pool_of(1, 1, 1)
    log: list = []
    staged = streams(pool, log)
    staged[1].applies = False
    update = RollingUpdate(pool, RollingSettings(), 1, 2, 3)
    await update.run(staged)
    assert update.switched == 2
    assert [r.healthy for r in pool.replicas] == [True, False, True]
    assert pool.replicas[1].last_error == "replica gone"


async def test_past_its_bound_the_replicas_left_switch_together_without_draining():
    pool = pool_of(1, 1, 1, 1)
    held = await pool.acquire(prefer=pool.replicas[3], timeout=1)  # never released: its drain would wait
    log: list = []
    update = RollingUpdate(pool, RollingSettings(max_unavailable=1, drain_seconds=60, max_seconds=0.3), 1, 2, 4)
    started = time.monotonic()
    await update.run(streams(pool, log, seconds=0.2))
    assert time.monotonic() - started < 5
    assert update.switched == 4 and held.policy_version == 2
    assert len(log[-1][3]) >= 2, "the replicas left did not switch together"
    status = update.status()
    assert status.in_progress and status.max_window_seconds == 0.3
    update.finish(True)
    assert not update.status().in_progress and update.status().committed


def sample(version: int, spans: list[int], finish=sampling_pb2.FINISH_REASON_LENGTH) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse(policy_version_start=spans[0], policy_version_end=spans[-1],
                                               finish_reason=finish)
    for v in spans:
        response.policy_version_spans.add(version=v, start=0, end=1)
    return response


def test_a_sample_off_its_pin_is_seen_and_an_aborted_one_does_not_count():
    assert not off_pin([sample(3, [3]), sample(3, [3, 3])], 3)
    assert off_pin([sample(3, [3]), sample(3, [3, 4])], 3)
    assert off_pin([sample(3, [2])], 3)
    assert not off_pin([sample(3, [3]), sample(3, [4], sampling_pb2.FINISH_REASON_ABORT)], 3)
