"""The runs sharing a replica (``served_runs``): ids, slots, ends, and what an ended run leaves behind."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlfleet.services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from rlfleet.services.generation.served_adapters import ServedAdapter
from rlfleet.services.generation.served_runs import ServedRuns
from rlfleet.wire import shm


class FakeEngine:
    def __init__(self):
        self.removed: list[int] = []

    async def remove_lora(self, lora_id: int) -> None:
        self.removed.append(lora_id)


def test_a_run_takes_a_slot_once_and_a_run_beyond_the_slots_is_refused_naming_those_who_hold_them():
    runs = ServedRuns(max_runs=2)
    first = runs.take("run-a")
    assert runs.take("run-a") is first and first.version == 0
    runs.take("run-b")
    with pytest.raises(ResourceExhausted, match=r"max_runs=2 runs at once \(run-a, run-b\)"):
        runs.take("run-c")
    assert runs.names() == ["run-a", "run-b"]


@pytest.mark.parametrize("run_id", ["run a", "x" * 129, "run/a", "ü"])
def test_a_run_id_of_another_shape_is_refused(run_id):
    with pytest.raises(InvalidArgument, match="not a run id"):
        ServedRuns(max_runs=4).take(run_id)


def test_a_replica_without_slots_serves_its_own_run_only():
    with pytest.raises(FailedPrecondition, match="serves no runs but its own"):
        ServedRuns(max_runs=0).take("run-a")


async def test_an_ended_run_leaves_when_its_last_call_ends_with_its_adapters_and_directory(tmp_path):
    runs = ServedRuns(max_runs=1)
    run = runs.take("run-a")
    held = run.adapters._held = shm.HeldDirectory("rlfleet-lora-", directory=str(tmp_path))  # as its first adapter makes
    root = run.adapters._root = Path(held.path)
    (root / "v1-1").mkdir(parents=True)
    run.adapters.current = ServedAdapter(1, SimpleNamespace(lora_int_id=7, lora_name="rlfleet-v1-7"), root / "v1-1")
    run.calls = 1
    engine = FakeEngine()
    assert runs.end("run-a", engine) is run
    with pytest.raises(FailedPrecondition, match="ended"):
        runs.take("run-a")  # ended, a call still running: no new calls
    with pytest.raises(ResourceExhausted):
        runs.take("run-b")  # its slot is held until the call ends
    run.calls = 0
    runs.release(run, engine)
    assert runs.names() == []
    await asyncio.wait_for(run.adapters._tasks.wait(), 10)
    assert engine.removed == [7] and not root.exists()
    assert runs.take("run-b").version == 0
    with pytest.raises(NotFound, match="not served"):
        runs.end("run-a", engine)


def test_a_push_must_be_newer_than_the_runs_version():
    run = ServedRuns(max_runs=1).take("run-a")
    run.adapters.current = ServedAdapter(3, None, None)  # its version: its current adapter's
    with pytest.raises(FailedPrecondition, match="run run-a: weights version 3 is not newer than its current 3"):
        run.check_version(3)
    run.check_version(4)


async def test_a_new_run_takes_the_slot_of_the_longest_idle_run_never_one_with_a_call_or_a_push(tmp_path):
    runs = ServedRuns(max_runs=3, idle_seconds=60)
    engine = FakeEngine()
    busy, pushing, idle = runs.take("busy"), runs.take("pushing"), runs.take("idle")
    busy.calls = 1
    await pushing.lock.acquire()
    for run in (busy, pushing, idle):
        run.last_used -= 3600  # all idle for an hour by the clock
    runs.take("new", engine)
    assert runs.names() == ["busy", "new", "pushing"]  # only the idle one gave its slot
    with pytest.raises(NotFound):
        runs.get("idle")
    with pytest.raises(ResourceExhausted, match="run_idle_seconds=60"):
        runs.take("another", engine)  # busy has a call in flight, pushing a push under way, new is fresh
    pushing.lock.release()
    runs.take("pushing")  # a call or push marks it used: no longer idle
    with pytest.raises(ResourceExhausted):
        runs.take("another", engine)


def test_a_run_is_found_by_the_name_it_gave_and_the_latest_to_give_a_name_holds_it():
    runs = ServedRuns(max_runs=3)
    with pytest.raises(FailedPrecondition, match=r"policy_run 'r1': no run of that name.*names here: none"):
        runs.named("r1")
    first = runs.take("run-a", name="r1")
    assert runs.named("r1") is first and first.name == "r1"
    assert runs.take("run-a") is first and runs.named("r1") is first  # a call without its name keeps it
    again = runs.take("run-b", name="r1")  # run r1 started anew under another id
    assert runs.named("r1") is again
    runs.take("run-a", name="r0")  # the old one renamed: its former name stays with the new run
    assert runs.named("r0") is first and runs.named("r1") is again
    with pytest.raises(InvalidArgument, match="run_name"):
        runs.take("run-c", name="not a name")
    with pytest.raises(InvalidArgument, match="policy_run"):
        runs.named("not/a name")


async def test_an_ended_run_is_no_ones_policy_and_its_name_leaves_with_it():
    runs = ServedRuns(max_runs=2)
    run = runs.take("run-a", name="r0")
    run.calls = 1  # a call in flight: the run stays until it ends
    runs.end("run-a", FakeEngine())
    with pytest.raises(FailedPrecondition, match="names here: r0"):
        runs.named("r0")
    run.calls = 0
    runs.release(run, FakeEngine())
    with pytest.raises(FailedPrecondition, match="names here: none"):
        runs.named("r0")
