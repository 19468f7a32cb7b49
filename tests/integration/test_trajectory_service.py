"""The trajectory service as a real process: redelivery, SIGKILL durability, errors, capacity, DropStale;
the exactly-once and durability tests on both backends (a SQLite file, a PostgreSQL database), and what
PostgreSQL adds: connection loss, one owner per schema."""

from __future__ import annotations

import queue

import grpc
import pytest

import rlfleet.client as sdk
from rlfleet.v1 import trajectory_pb2 as pb
from rlfleet.v1 import trajectory_pb2_grpc
from rlfleet.wire import decode_tensordict
from tests.trajectories import check_rows, groups, make_trajectories, payload_bytes, trajectory_ids
from tests.waiting import wait_for

TIMEOUT = 60
"""Per call, and for what one call sets off (a commit, a lease expiry): milliseconds of work, but the machine
is shared with other heavy test runs."""


@pytest.fixture(params=["sqlite", "postgres"])
def database(request, tmp_path) -> list[str]:
    """The service's database flags on each backend: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return ["--db-path", str(tmp_path / "t.sqlite3")]
    return ["--database-url", request.getfixturevalue("postgres").create_database()]


def start_trajectory(start_service, database, *args):
    """``database``: a SQLite file, or the flags of the ``database`` fixture."""
    flags = database if isinstance(database, list) else ["--db-path", str(database)]
    return start_service("trajectory", *flags, "--log-format", "text", *args).wait_ready(180)


def connect(proc):
    channel = grpc.insecure_channel(proc.address)
    return trajectory_pb2_grpc.TrajectoryServiceStub(channel), channel


def append(stub, group_ids, first_id, key="", **layout):
    request = pb.AppendRequest(trajectories=make_trajectories(group_ids, first_id=first_id, **layout),
                               idempotency_key=key)
    return stub.Append(request, timeout=TIMEOUT)


class Reader:
    """A trainer's StreamBatches call, driven synchronously."""

    def __init__(self, stub, **open_fields):
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(pb.StreamBatchesRequest(open=pb.OpenBatchStream(**open_fields)))
        self._call = stub.StreamBatches(iter(self._requests.get, None), timeout=5 * TIMEOUT)

    def next(self) -> pb.StreamBatchesResponse:
        return next(self._call)

    def ack(self, lease_id: str) -> None:
        self._requests.put(pb.StreamBatchesRequest(ack=pb.AckBatch(lease_id=lease_id)))

    def synced(self) -> None:
        """Return once the server has handled this stream's open: its first lease attempt runs on the store
        thread before the answer to a later ack (the store runs calls in order)."""
        self.ack("no-such-lease")
        assert not self.next().settled.applied

    def disconnect(self) -> None:
        self._call.cancel()


def stats(stub) -> pb.GetStatsResponse:
    return stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT)


def test_a_batch_left_unacked_is_delivered_again(start_service, database):
    proc = start_trajectory(start_service, database)
    stub, channel = connect(proc)
    assert append(stub, groups(0, 2, 2), first_id=0, key="c/0").appended == 4

    leaver = Reader(stub, batch_size=4, consumer="rank-0")
    first = leaver.next()
    assert not first.redelivered and list(first.batch.batch_size) == [4]
    check_rows(first.batch)
    leaver.disconnect()  # gone without acking

    slow = Reader(stub, batch_size=4, lease_seconds=0.5, consumer="rank-1")
    second = slow.next()
    assert second.redelivered and trajectory_ids(second.batch) == trajectory_ids(first.batch)
    # Still connected, but its lease runs out: the batch moves on to the next reader.
    third_reader = Reader(stub, batch_size=4, consumer="rank-2")
    third = third_reader.next()
    assert third.redelivered and trajectory_ids(third.batch) == trajectory_ids(first.batch)
    third_reader.ack(third.lease_id)
    wait_for(lambda: stats(stub).acked == 4, TIMEOUT, "the ack to be committed")
    current = stats(stub)
    assert (current.ready, current.leased, current.redelivered_batches) == (0, 0, 2)
    slow.disconnect()
    third_reader.disconnect()
    channel.close()


def test_sigkill_loses_no_acknowledged_append_and_redelivers_unacked(start_service, database):
    proc = start_trajectory(start_service, database)
    stub, channel = connect(proc)
    for n in range(3):
        assert append(stub, groups(2 * n, 2, 2), first_id=4 * n, key=f"c/{n}").appended == 4
    reader = Reader(stub, batch_size=4)
    acked = reader.next()
    reader.ack(acked.lease_id)
    answer = reader.next()  # the server's answer: the ack is committed
    assert (answer.settled.lease_id, answer.settled.applied, answer.settled.trajectories) == (acked.lease_id, True, 4)
    assert not answer.lease_id and not answer.HasField("batch")
    unacked = reader.next()
    proc.kill()
    proc.process.wait(TIMEOUT)
    channel.close()

    proc = start_trajectory(start_service, database)
    stub, channel = connect(proc)
    current = stats(stub)
    assert (current.ready, current.leased) == (8, 0)
    assert append(stub, groups(0, 2, 2), first_id=0, key="c/0").appended == 0  # keys survived too
    reader = Reader(stub, batch_size=4, prefetch=2)
    again, rest = reader.next(), reader.next()
    assert again.redelivered and trajectory_ids(again.batch) == trajectory_ids(unacked.batch)
    assert not rest.redelivered
    delivered = set(trajectory_ids(again.batch) + trajectory_ids(rest.batch))
    assert delivered == {f"traj-{i}" for i in range(4, 12)}
    assert delivered.isdisjoint(trajectory_ids(acked.batch))
    check_rows(rest.batch)
    reader.disconnect()
    channel.close()


def test_every_ack_is_answered_and_a_late_one_does_not_end_the_stream(start_service, database):
    proc = start_trajectory(start_service, database)
    stub, channel = connect(proc)
    append(stub, groups(0, 4, 2), first_id=0)
    reader = Reader(stub, batch_size=4, lease_seconds=0.5)
    first = reader.next()
    # Its lease (0.5 s) runs out and the expiry task releases it for redelivery.
    wait_for(lambda: stats(stub).ready == 8, TIMEOUT, "the expired lease to be released")
    reader.ack(first.lease_id)  # too late
    late = reader.next()
    assert (late.settled.lease_id, late.settled.applied, late.settled.nack) == (first.lease_id, False, False)
    assert "expired and released for redelivery" in late.settled.reason
    again = reader.next()  # the stream goes on, and the batch comes back
    assert again.redelivered and trajectory_ids(again.batch) == trajectory_ids(first.batch)
    reader.disconnect()
    patient = Reader(stub, batch_size=4, lease_seconds=600)
    batch = patient.next()
    patient.ack(batch.lease_id)
    answer = patient.next().settled
    assert (answer.lease_id, answer.applied, answer.trajectories, answer.reason) == (batch.lease_id, True, 4, "")
    assert stats(stub).acked == 4  # answered after the commit
    patient.disconnect()
    channel.close()


def test_an_sdk_stream_ending_at_its_idle_bound_has_the_ack_of_the_batch_moved_past_applied(start_service, tmp_path,
                                                                                          caplog):
    """The SDK's ``batches(idle_timeout=...)``: asking for the next batch acks the last one, and when none comes
    the stream ends the clean way, that ack answered first (not reopened as if it had broken)."""
    proc = start_trajectory(start_service, tmp_path / "t.sqlite3")
    stub, channel = connect(proc)
    append(stub, groups(0, 2, 2), first_id=0)
    with sdk.connect(proc.address, timeout=TIMEOUT) as client:  # a reader may use the service's own address
        batches = client.batches(4, idle_timeout=1.0)  # nothing more will come
        first = next(batches)
        with pytest.raises(sdk.DeadlineExceededError, match="idle_timeout"):
            next(batches)
        assert batches.closed and (first.settled, first.confirmed) == ("ack", True)
    current = stats(stub)
    assert (current.acked, current.ready, current.leased) == (4, 0, 0)
    assert "StreamBatches broke" not in caplog.text
    channel.close()


def test_malformed_requests_are_invalid_argument_and_the_service_keeps_serving(start_service, tmp_path):
    proc = start_trajectory(start_service, tmp_path / "t.sqlite3")
    stub, channel = connect(proc)
    missing = make_trajectories([1, 1])
    del missing.entries["group_id"]
    broken = make_trajectories([1, 1])
    broken.entries["score"].tensor.data = b"\x00" * 7
    undocumented = make_trajectories([1, 1])
    undocumented.entries["my_metric"].CopyFrom(undocumented.entries["score"])
    for request, field in [
        (pb.AppendRequest(trajectories=undocumented), "trajectories.entries[my_metric]: not a key of the batch schema"),
        (pb.AppendRequest(trajectories=missing), "trajectories.entries[group_id]"),
        (pb.AppendRequest(trajectories=broken), "trajectories.entries[score].tensor.data"),
        (pb.AppendRequest(), "trajectories: missing"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            stub.Append(request, timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()

    with pytest.raises(grpc.RpcError) as err:
        Reader(stub, batch_size=0).next()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "open.batch_size" in err.value.details()

    assert append(stub, [1, 1], first_id=0).appended == 2  # still serving
    assert stats(stub).appended == 2
    channel.close()


def test_group_keys_deduplicate_each_group_of_a_multi_group_append(start_service, database):
    proc = start_trajectory(start_service, database)
    stub, channel = connect(proc)
    request = pb.AppendRequest(trajectories=make_trajectories(groups(0, 2, 2)), group_keys=["c/0", "c/1"])
    first = stub.Append(request, timeout=TIMEOUT)
    assert (first.appended, first.buffered, list(first.duplicate_groups)) == (4, 4, [False, False])
    resent = stub.Append(request, timeout=TIMEOUT)
    assert (resent.appended, resent.buffered, list(resent.duplicate_groups)) == (0, 4, [True, True])

    with pytest.raises(grpc.RpcError) as err:
        stub.Append(pb.AppendRequest(trajectories=make_trajectories(groups(2, 2, 2), first_id=4),
                                     group_keys=["c/2"]), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == ("group_keys: 1 keys for the 2 groups in trajectories; give one key per group, "
                                   "in the order of each group's first row")

    reader = Reader(stub, batch_size=4)
    batch = reader.next()
    assert trajectory_ids(batch.batch) == [f"traj-{i}" for i in range(4)]  # each row once
    check_rows(batch.batch)
    current = stats(stub)
    assert (current.ready, current.leased, current.appended) == (0, 4, 4)
    reader.disconnect()
    channel.close()


def test_a_full_buffer_is_resource_exhausted(start_service, tmp_path):
    proc = start_trajectory(start_service, tmp_path / "t.sqlite3", "--capacity", "6")
    stub, channel = connect(proc)
    assert append(stub, groups(0, 2, 2), first_id=0).appended == 4
    with pytest.raises(grpc.RpcError) as err:
        append(stub, groups(2, 2, 2), first_id=4)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    current = stats(stub)
    assert (current.ready, current.appended, current.capacity) == (4, 4, 6)
    channel.close()


def test_concurrent_readers_get_disjoint_whole_group_batches(start_service, tmp_path):
    proc = start_trajectory(start_service, tmp_path / "t.sqlite3")
    stub, channel = connect(proc)
    for n in range(4):
        append(stub, groups(2 * n, 2, 2), first_id=4 * n, key=f"c/{n}")
    readers = [Reader(stub, batch_size=4, whole_groups=True, prefetch=2, consumer=f"rank-{r}") for r in range(2)]
    batches = [reader.next() for reader in readers] + [reader.next() for reader in readers]
    ids = [trajectory_ids(batch.batch) for batch in batches]
    assert sorted(i for batch in ids for i in batch) == sorted(f"traj-{i}" for i in range(16))
    for batch in batches:
        group_ids = decode_tensordict(batch.batch)["group_id"].tolist()
        assert all(group_ids.count(g) == 2 for g in group_ids)  # whole groups of 2
    for reader, batch in zip(readers * 2, batches):
        reader.ack(batch.lease_id)
    wait_for(lambda: stats(stub).acked == 16, TIMEOUT, "every ack to be committed")
    for reader in readers:
        reader.disconnect()
    channel.close()


def test_a_readers_min_policy_version_deletes_nothing(start_service, tmp_path):
    proc = start_trajectory(start_service, tmp_path / "t.sqlite3")
    stub, channel = connect(proc)
    for n in range(3):
        append(stub, groups(2 * n, 2, 2), first_id=4 * n, policy_version=n)
    # Filters that match nothing: with whole groups and without, the highest version a uint64 holds.
    filtered = [Reader(stub, batch_size=batch_size, whole_groups=whole_groups, min_policy_version=2**64 - 1)
                for batch_size, whole_groups in [(1, False), (2, True)]]
    for reader in filtered:
        reader.synced()
    append(stub, groups(6, 2, 2), first_id=12, policy_version=3)  # wakes the filtered readers: still nothing
    newest = Reader(stub, batch_size=4, min_policy_version=3)
    assert trajectory_ids(newest.next().batch) == [f"traj-{i}" for i in range(12, 16)]
    for reader in filtered:
        reader.synced()
    current = stats(stub)
    assert (current.ready, current.leased, current.dropped_stale) == (12, 4, 0)
    everything = Reader(stub, batch_size=12)  # another reader still gets every row the filters skipped
    batch = everything.next()
    assert trajectory_ids(batch.batch) == [f"traj-{i}" for i in range(12)]
    check_rows(batch.batch)
    for reader in [*filtered, newest, everything]:
        reader.disconnect()
    channel.close()


def test_drop_stale_deletes_durably_and_names_the_groups_and_prompts(start_service, database):
    proc = start_trajectory(start_service, database)
    stub, channel = connect(proc)
    for n, version in enumerate([1, 1, 2, 3]):  # groups 0..3 of 2, prompt-<group>
        append(stub, groups(n, 1, 2), first_id=2 * n, policy_version=version, prompt_ids=True)
    reader = Reader(stub, batch_size=2, whole_groups=True)
    leased = reader.next()  # group 0 is out: DropStale leaves it alone
    assert trajectory_ids(leased.batch) == ["traj-0", "traj-1"]

    dropped = stub.DropStale(pb.DropStaleRequest(below_policy_version=3), timeout=TIMEOUT)
    assert (dropped.dropped, list(dropped.group_ids), list(dropped.prompt_ids)) == (4, [1, 2], ["prompt-1", "prompt-2"])
    current = stats(stub)
    assert (current.ready, current.leased, current.dropped_stale, current.acked) == (2, 2, 4, 0)
    proc.kill()  # answered means committed: nothing comes back after a SIGKILL
    proc.process.wait(TIMEOUT)
    channel.close()

    proc = start_trajectory(start_service, database)
    stub, channel = connect(proc)
    assert (stats(stub).ready, stats(stub).dropped_stale) == (4, 0)  # groups 0 and 3
    dropped = stub.DropStale(pb.DropStaleRequest(below_policy_version=2**64 - 1), timeout=TIMEOUT)
    assert (dropped.dropped, list(dropped.group_ids), list(dropped.prompt_ids)) == (4, [0, 3], ["prompt-0", "prompt-3"])
    assert stub.DropStale(pb.DropStaleRequest(below_policy_version=2**64 - 1), timeout=TIMEOUT).dropped == 0
    current = stats(stub)
    assert (current.ready, current.buffered_bytes, current.dropped_stale) == (0, 0, 4)
    channel.close()


def test_a_buffer_full_in_bytes_is_resource_exhausted(start_service, tmp_path):
    first, second = make_trajectories(groups(0, 2, 2), first_id=0), make_trajectories(groups(2, 2, 2), first_id=4)
    limit = payload_bytes(first) + payload_bytes(second) - 1
    proc = start_trajectory(start_service, tmp_path / "t.sqlite3", "--capacity-bytes", str(limit))
    stub, channel = connect(proc)
    assert stub.Append(pb.AppendRequest(trajectories=first), timeout=TIMEOUT).appended == 4
    with pytest.raises(grpc.RpcError) as err:
        stub.Append(pb.AppendRequest(trajectories=second), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{payload_bytes(first)} of {limit} bytes buffered" in err.value.details()
    current = stats(stub)
    assert (current.ready, current.appended) == (4, 4)
    assert (current.buffered_bytes, current.capacity_bytes) == (payload_bytes(first), limit)
    channel.close()


def test_an_append_answered_just_before_a_sigkill_is_there_after_restart_and_delivered_once(start_service, database):
    proc = start_trajectory(start_service, database)
    stub, channel = connect(proc)
    assert append(stub, groups(0, 2, 2), first_id=0, key="c/0").appended == 4
    proc.kill()  # the moment the answer is in: answered means committed
    proc.process.wait(TIMEOUT)
    channel.close()

    proc = start_trajectory(start_service, database)
    stub, channel = connect(proc)
    assert stats(stub).ready == 4
    assert append(stub, groups(0, 2, 2), first_id=0, key="c/0").appended == 0  # the collector's retry: a no-op
    reader = Reader(stub, batch_size=4)
    batch = reader.next()
    assert trajectory_ids(batch.batch) == [f"traj-{i}" for i in range(4)] and not batch.redelivered
    reader.ack(batch.lease_id)
    assert reader.next().settled.applied
    assert (stats(stub).ready, stats(stub).leased) == (0, 0)  # delivered once
    reader.disconnect()
    channel.close()


# --- PostgreSQL: one owner per schema, connection loss ------------------------------------------


def unavailable(call) -> str:
    """The details of ``call()``'s UNAVAILABLE status (any other outcome fails the test)."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    return err.value.details()


def test_a_cut_connection_is_unavailable_naming_the_database_then_nothing_is_lost_or_doubled(start_service, postgres):
    url = postgres.create_database()
    proc = start_trajectory(start_service, ["--database-url", url])
    stub, channel = connect(proc)
    assert append(stub, groups(0, 4, 2), first_id=0, key="c/0").appended == 8
    reader = Reader(stub, batch_size=2)
    acked = reader.next()
    reader.ack(acked.lease_id)
    assert reader.next().settled.applied  # committed
    held = reader.next()  # leased, not acked, when the connection is cut

    assert postgres.terminate(url.rsplit("/", 1)[1]) == 1
    details = unavailable(lambda: append(stub, groups(4, 1, 2), first_id=8, key="c/1"))
    assert details.startswith(f"trajectory database unreachable: {url}: "), details
    # The next call reconnects (the index rebuilt from the database, as after a restart): the resend is stored once.
    assert append(stub, groups(4, 1, 2), first_id=8, key="c/1").appended == 2
    assert append(stub, groups(4, 1, 2), first_id=8, key="c/1").appended == 0
    assert proc.process.poll() is None
    # The lease held across the loss was dropped with the old index: its ack is not applied, its rows come back.
    reader.ack(held.lease_id)
    answer = reader.next().settled
    assert (answer.lease_id, answer.applied) == (held.lease_id, False)
    delivered = []
    for _ in range(4):
        batch = reader.next()
        delivered += trajectory_ids(batch.batch)
        reader.ack(batch.lease_id)
        assert reader.next().settled.applied
    assert delivered[:2] == trajectory_ids(held.batch)
    assert sorted(delivered) == sorted(f"traj-{i}" for i in range(2, 10))  # each once; the acked ones never
    assert (stats(stub).ready, stats(stub).leased) == (0, 0)
    reader.disconnect()
    channel.close()


def test_a_database_crash_is_an_outage_and_the_service_serves_again_once_it_is_back(start_service, postgres):
    url = postgres.create_database()
    proc = start_trajectory(start_service, ["--database-url", url])
    stub, channel = connect(proc)
    assert append(stub, groups(0, 2, 2), first_id=0, key="c/0").appended == 4
    postgres.kill()
    try:
        for call in (lambda: append(stub, groups(2, 1, 2), first_id=4, key="c/1"), lambda: stats(stub)):
            assert unavailable(call).startswith(f"trajectory database unreachable: {url}: ")
        assert proc.process.poll() is None and proc.health() == 1  # SERVING: the outage is the database's
    finally:
        postgres.start()  # crash recovery: what was committed is back
    assert append(stub, groups(2, 1, 2), first_id=4, key="c/1").appended == 2
    assert append(stub, groups(0, 2, 2), first_id=0, key="c/0").appended == 0
    reader = Reader(stub, batch_size=6)
    batch = reader.next()
    assert trajectory_ids(batch.batch) == [f"traj-{i}" for i in range(6)]
    check_rows(batch.batch)
    reader.disconnect()
    channel.close()


def test_a_second_service_on_the_same_schema_is_refused_at_start(start_service, postgres):
    url = postgres.create_database()
    first = start_trajectory(start_service, ["--database-url", url])
    second = start_service("trajectory", "--database-url", url, "--lock-timeout-seconds", "0.2", "--log-format", "text")
    assert second.process.wait(TIMEOUT) != 0
    assert (f"{url} (schema rlfleet_trajectory): the trajectory database is in use by another process"
            in second.log_tail()), second.log_tail()
    stub, channel = connect(first)
    assert append(stub, [1, 1], first_id=0).appended == 2  # the owner serves on
    channel.close()
