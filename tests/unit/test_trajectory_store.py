"""The trajectory buffer without sockets: batching, leases, capacity, durability; every test that opens a
store runs on both backends, a SQLite file and a PostgreSQL database (``tests/postgres.py``)."""

from __future__ import annotations

import asyncio
import sqlite3

import psycopg
import pytest
import torch

from rlfleet.services.common.errors import InvalidArgument, NotFound, ResourceExhausted
from rlfleet.services.trajectory.appends import MAX_KEY_BYTES
from rlfleet.services.trajectory.buffer import OUTBOX_SIZE, ReaderOptions, Settlement, TrajectoryBuffer
from rlfleet.services.trajectory.rows import split_rows
from rlfleet.services.trajectory.store import Dropped, TrajectoryStore
from rlfleet.wire import WireError, decode_tensordict, encode_tensordict
from rlfleet.wire.batch_schema import row_schema
from tests.trajectories import check_rows, groups, make_trajectories, payload_bytes, trajectory_ids
from tests.waiting import wait_for_async

WAIT = 10.0
"""Bound on what the async buffer does on its own (a store call, waking a reader, a 0.3 s lease running out):
milliseconds, 10 s for a loaded CI machine."""


class FakeClock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request) -> str:
    return request.param


@pytest.fixture
def fresh_db(backend, request):
    """A new, empty database at each call: ``:memory:``, or a new PostgreSQL database's URL."""
    if backend == "sqlite":
        return lambda: ":memory:"
    return request.getfixturevalue("postgres").create_database


@pytest.fixture
def db(backend, fresh_db, tmp_path) -> str:
    """The test's durable database, reopened by this path or URL: a SQLite file, or a PostgreSQL database."""
    return str(tmp_path / "trajectories.sqlite3") if backend == "sqlite" else fresh_db()


@pytest.fixture
def store(clock, fresh_db):
    store = TrajectoryStore(fresh_db(), capacity=100, clock=clock)
    yield store
    store.close()


# --- batching -----------------------------------------------------------------------


def test_batches_have_exactly_batch_size_rows_in_append_order(store):
    store.append(make_trajectories(groups(0, 3, 2), first_id=0))
    store.append(make_trajectories(groups(3, 2, 2), first_id=6))
    first = store.lease("a", 4, lease_seconds=10)
    second = store.lease("a", 4, lease_seconds=10)
    assert (first.size, second.size) == (4, 4)
    assert list(first.batch.batch_size) == [4]
    assert trajectory_ids(first.batch) == [f"traj-{i}" for i in range(4)]
    assert trajectory_ids(second.batch) == [f"traj-{i}" for i in range(4, 8)]  # spans both appends
    check_rows(first.batch)
    check_rows(second.batch)
    assert store.lease("a", 4, lease_seconds=10) is None  # only 2 ready: wait, never a short batch
    assert store.stats().ready == 2 and store.stats().leased == 8


def test_oldest_policy_version_is_served_first_then_append_order(db):
    store = TrajectoryStore(db, capacity=100)
    store.append(make_trajectories(groups(0, 1, 2), first_id=0, policy_version=3))
    store.append(make_trajectories(groups(1, 1, 2), first_id=2, policy_version=1))  # a late, older group
    store.append(make_trajectories(groups(2, 1, 2), first_id=4, policy_version=1))
    first = store.lease("a", 2, lease_seconds=10, whole_groups=True)
    assert trajectory_ids(first.batch) == ["traj-2", "traj-3"]
    store.nack("a", first.lease_id)  # a released batch goes back to its place at the head
    assert trajectory_ids(store.lease("a", 4, lease_seconds=10).batch) == ["traj-2", "traj-3", "traj-4", "traj-5"]
    store.close()
    reopened = TrajectoryStore(db, capacity=100)  # the order survives a restart
    assert trajectory_ids(reopened.lease("a", 6, lease_seconds=10).batch) == [f"traj-{i}" for i in (2, 3, 4, 5, 0, 1)]
    reopened.close()


def test_whole_groups_never_split_a_group(store):
    store.append(make_trajectories([1, 1, 1]))
    store.append(make_trajectories([2, 2, 2, 3, 3, 3], first_id=3))
    delivery = store.lease("a", 6, lease_seconds=10, whole_groups=True)
    td = decode_tensordict(delivery.batch)
    assert td["group_id"].tolist() == [1, 1, 1, 2, 2, 2]
    assert store.lease("a", 6, lease_seconds=10, whole_groups=True) is None  # group 3 alone is not 6
    with pytest.raises(InvalidArgument, match="open.batch_size: 4 is not a multiple of the size 3"):
        store.lease("b", 4, lease_seconds=10, whole_groups=True)


def test_whole_groups_skip_a_group_partly_leased_by_a_row_reader(store):
    store.append(make_trajectories([1, 1, 2, 2]))
    rows = store.lease("rows", 1, lease_seconds=10)
    assert decode_tensordict(rows.batch)["group_id"].tolist() == [1]
    delivery = store.lease("groups", 2, lease_seconds=10, whole_groups=True)
    assert decode_tensordict(delivery.batch)["group_id"].tolist() == [2, 2]


def test_a_group_is_appended_whole_and_group_size_must_agree(store):
    store.append(make_trajectories([5, 5, 6, 6], group_size=True))
    bad = make_trajectories([7, 7, 8], group_size=True)
    bad.entries["group_size"].tensor.data = torch.tensor([3, 3, 1]).numpy().tobytes()
    with pytest.raises(InvalidArgument, match=r"entries\[group_size\]\[0\]: says 3 but this Append carries 2"):
        store.append(bad)
    assert store.stats().ready == 4


def test_min_policy_version_filters_one_reader_and_deletes_nothing(store):
    store.append(make_trajectories([1, 1], first_id=0, policy_version=1))
    store.append(make_trajectories([2, 2], first_id=2, policy_version=3))
    store.append(make_trajectories([3, 3], first_id=4, policy_version=2))
    delivery = store.lease("a", 2, lease_seconds=10, min_policy_version=2)
    assert trajectory_ids(delivery.batch) == ["traj-4", "traj-5"]  # v1 skipped, then the oldest left (v2)
    for whole_groups in (False, True):
        assert store.lease("b", 2, lease_seconds=10, whole_groups=whole_groups, min_policy_version=4) is None
        assert store.lease("b", 1, lease_seconds=10, whole_groups=whole_groups, min_policy_version=2**64 - 1) is None
    stats = store.stats()
    assert (stats.dropped_stale, stats.ready, stats.leased) == (0, 4, 2)
    assert store.database.execute("SELECT count(*) FROM trajectories").fetchone()[0] == 6
    rest = store.lease("c", 4, lease_seconds=10)  # another reader, no filter: the skipped rows are all there
    assert trajectory_ids(rest.batch) == ["traj-0", "traj-1", "traj-2", "traj-3"]


def test_a_filter_skips_whole_groups_by_their_oldest_row(store):
    group = make_trajectories([1, 1], first_id=0, policy_version=5)
    group.entries["policy_version_start"].tensor.data = torch.tensor([4, 5]).numpy().tobytes()  # a mixed group
    store.append(group)
    store.append(make_trajectories([2], first_id=2, policy_version=5))
    assert trajectory_ids(store.lease("a", 1, lease_seconds=10, min_policy_version=5).batch) == ["traj-2"]
    assert store.lease("a", 1, lease_seconds=10, min_policy_version=5) is None  # not traj-1 alone either
    assert trajectory_ids(store.lease("b", 2, lease_seconds=10, min_policy_version=4).batch) == ["traj-0", "traj-1"]


# --- drop stale ----------------------------------------------------------------------------


def test_drop_stale_deletes_ready_groups_below_the_version_and_says_which(db, clock):
    path = db
    store = TrajectoryStore(path, capacity=100, documented=row_schema(), clock=clock)
    appends = [make_trajectories([group, group], first_id=2 * n, policy_version=version, prompt_ids=True)
               for n, (group, version) in enumerate([(1, 1), (2, 1), (3, 2), (4, 3), (2, 2)])]  # group 2 twice
    for msg in appends:
        store.append(msg)
    leased = store.lease("a", 2, lease_seconds=60, whole_groups=True)  # group 1 (oldest) is out
    assert decode_tensordict(leased.batch)["group_id"].tolist() == [1, 1]

    dropped = store.drop_stale(3)
    assert dropped == Dropped(dropped=6, group_ids=(2, 3), prompt_ids=("prompt-2", "prompt-3"))  # distinct, oldest first
    stats = store.stats()
    assert (stats.ready, stats.leased, stats.dropped_stale, stats.acked) == (2, 2, 6, 0)
    assert stats.buffered_bytes == payload_bytes(appends[0]) + payload_bytes(appends[3])  # groups 1 and 4 left
    assert store.drop_stale(3) == Dropped(dropped=0, group_ids=(), prompt_ids=())  # again: nothing more
    assert store.drop_stale(0) == Dropped(dropped=0, group_ids=(), prompt_ids=())
    assert store.database.execute("SELECT count(*) FROM trajectories").fetchone()[0] == 4
    store.close()

    store = TrajectoryStore(path, capacity=100, documented=row_schema(), clock=clock)  # durable, and the lease is back
    stats = store.stats()
    assert (stats.ready, stats.leased) == (4, 0)
    assert stats.buffered_bytes == payload_bytes(appends[0]) + payload_bytes(appends[3])
    assert store.drop_stale(2**64 - 1) == Dropped(dropped=4, group_ids=(1, 4), prompt_ids=("prompt-1", "prompt-4"))
    assert store.stats().buffered_bytes == 0 and store.lease("a", 1, lease_seconds=60) is None
    store.close()


def test_drop_stale_leaves_leased_rows_and_reports_no_prompts_without_the_column(store):
    store.append(make_trajectories([1, 1, 1], policy_version=1))
    partly = store.lease("rows", 1, lease_seconds=60)  # one row of group 1 is out
    assert store.drop_stale(2) == Dropped(dropped=2, group_ids=(1,), prompt_ids=())
    assert store.stats().ready == 0
    store.nack("rows", partly.lease_id)  # back, and still stale
    assert store.lease("fresh", 1, lease_seconds=60, min_policy_version=2) is None
    assert store.drop_stale(2) == Dropped(dropped=1, group_ids=(1,), prompt_ids=())
    assert store.stats().dropped_stale == 3
    store.append(make_trajectories([2, 2], first_id=3, policy_version=2))  # the buffer works on
    assert trajectory_ids(store.lease("fresh", 2, lease_seconds=60, min_policy_version=2).batch) == ["traj-3", "traj-4"]


# --- leases -----------------------------------------------------------------------------


def test_expired_lease_is_redelivered_with_the_same_rows(store, clock):
    store.append(make_trajectories(groups(0, 2, 2)))
    first = store.lease("a", 2, lease_seconds=0.5)
    assert not first.redelivered and first.expires_at == clock.now + 0.5
    clock.now += 0.4
    assert store.expire() == ([], first.expires_at)
    clock.now += 0.2
    expired, next_expiry = store.expire()
    assert expired == [(first.lease_id, "a")] and next_expiry is None
    again = store.lease("b", 2, lease_seconds=0.5)
    assert again.redelivered
    assert trajectory_ids(again.batch) == trajectory_ids(first.batch)  # back at the head of the queue
    assert store.stats().redelivered_batches == 1
    with pytest.raises(NotFound, match="lease_id"):
        store.ack("a", first.lease_id)  # too late: the batch is someone else's now


def test_acked_batch_is_never_delivered_again(store, clock):
    store.append(make_trajectories(groups(0, 2, 2)))
    delivery = store.lease("a", 2, lease_seconds=0.5)
    assert store.ack("a", delivery.lease_id) == 2
    clock.now += 3600
    assert store.expire() == ([], None)
    rest = store.lease("a", 2, lease_seconds=0.5)
    assert set(trajectory_ids(rest.batch)).isdisjoint(trajectory_ids(delivery.batch))
    store.ack("a", rest.lease_id)
    assert store.lease("a", 1, lease_seconds=0.5) is None
    with pytest.raises(NotFound):
        store.ack("a", delivery.lease_id)
    stats = store.stats()
    assert (stats.ready, stats.leased, stats.acked, stats.appended) == (0, 0, 4, 4)


def test_nack_releases_immediately(store):
    store.append(make_trajectories(groups(0, 3, 2)))
    delivery = store.lease("a", 2, lease_seconds=60)
    assert store.nack("a", delivery.lease_id) == 2
    again = store.lease("a", 2, lease_seconds=60)
    assert again.redelivered and trajectory_ids(again.batch) == trajectory_ids(delivery.batch)


def test_concurrent_readers_get_disjoint_batches_and_only_ack_their_own(store):
    store.append(make_trajectories(groups(0, 4, 2)))
    a1, b1, a2, b2 = (store.lease(owner, 2, lease_seconds=60) for owner in "abab")
    ids = [trajectory_ids(d.batch) for d in (a1, b1, a2, b2)]
    flat = [i for batch in ids for i in batch]
    assert len(set(flat)) == 8
    with pytest.raises(NotFound):
        store.ack("b", a1.lease_id)
    assert store.release_owner("a") == 4  # reader a's stream ended
    again = store.lease("b", 4, lease_seconds=60)
    assert again.redelivered and trajectory_ids(again.batch) == ids[0] + ids[2]


# --- append: capacity, idempotency, validation -------------------------------------------


def test_capacity_backpressure_is_all_or_nothing(clock, fresh_db):
    store = TrajectoryStore(fresh_db(), capacity=5, clock=clock)
    store.append(make_trajectories([1, 1, 2, 2]), "k1")
    with pytest.raises(ResourceExhausted, match="4 of 5 buffered"):
        store.append(make_trajectories([3, 3], first_id=4), "k2")
    stats = store.stats()
    assert (stats.ready, stats.appended) == (4, 4)
    assert store.database.execute("SELECT count(*) FROM trajectories").fetchone()[0] == 4
    leased = store.lease("a", 4, lease_seconds=60)  # leased rows still count against capacity
    with pytest.raises(ResourceExhausted):
        store.append(make_trajectories([3, 3], first_id=4), "k2")
    store.ack("a", leased.lease_id)
    assert store.append(make_trajectories([3, 3], first_id=4), "k2").appended == 2  # k2 was not recorded
    with pytest.raises(InvalidArgument, match="can never fit"):
        store.append(make_trajectories(groups(10, 3, 2)))
    store.close()


def test_capacity_in_bytes_is_all_or_nothing_and_survives_a_reopen(db, clock):
    path = db
    first, second = make_trajectories([1, 1]), make_trajectories([2, 2], first_id=2)
    limit = payload_bytes(first) + payload_bytes(second) - 1
    store = TrajectoryStore(path, capacity=100, capacity_bytes=limit, clock=clock)
    store.append(first)
    with pytest.raises(ResourceExhausted, match=f"{payload_bytes(first)} of {limit} bytes buffered"):
        store.append(second, "k2")
    stats = store.stats()
    assert (stats.ready, stats.buffered_bytes, stats.capacity_bytes) == (2, payload_bytes(first), limit)
    store.close()

    store = TrajectoryStore(path, capacity=100, capacity_bytes=limit, clock=clock)  # bytes are counted from the rows
    assert store.stats().buffered_bytes == payload_bytes(first)
    leased = store.lease("a", 2, lease_seconds=60)  # leased rows still count
    with pytest.raises(ResourceExhausted, match="bytes buffered"):
        store.append(second, "k2")
    store.ack("a", leased.lease_id)
    assert store.stats().buffered_bytes == 0
    assert store.append(second, "k2").appended == 2  # k2 was not recorded
    with pytest.raises(InvalidArgument, match=r"trajectories: \d+ bytes of trajectories can never fit"):
        store.append(make_trajectories(groups(10, 3, 2)))
    store.close()


def test_idempotency_key_makes_a_resend_a_no_op(clock, fresh_db):
    store = TrajectoryStore(fresh_db(), capacity=100, idempotency_window=2, clock=clock)
    assert store.append(make_trajectories([1, 1]), "collector/1").appended == 2
    assert store.append(make_trajectories([1, 1]), "collector/1").appended == 0
    assert store.append(make_trajectories([2]), "").appended == 1
    assert store.append(make_trajectories([2]), "").appended == 1  # empty key: no dedup
    store.append(make_trajectories([3]), "collector/3")
    store.append(make_trajectories([4]), "collector/4")  # window of 2: "collector/1" is forgotten
    assert store.append(make_trajectories([1, 1]), "collector/1").appended == 2
    assert store.append(make_trajectories([4]), "collector/4").appended == 0
    assert store.stats().appended == 8
    store.close()


def test_group_keys_skip_only_the_groups_appended_before_and_survive_a_reopen(db, clock):
    path = db
    store = TrajectoryStore(path, capacity=100, clock=clock)
    first = store.append(make_trajectories(groups(0, 3, 2)), group_keys=["c/0", "c/1", "c/2"])
    assert (first.appended, first.buffered, first.duplicate_groups) == (6, 6, (False, False, False))
    # Groups 1 (rows traj-6, traj-7) and 3 (traj-8, traj-9): group 1's key was stored before.
    second = store.append(make_trajectories([1, 1, 3, 3], first_id=6), group_keys=["c/1", "c/3"])
    assert (second.appended, second.buffered, second.duplicate_groups) == (2, 8, (True, False))
    assert store.stats().appended == 8
    store.close()

    store = TrajectoryStore(path, capacity=100, clock=clock)  # the keys are in the file
    again = store.append(make_trajectories([3, 3, 0, 0], first_id=8), group_keys=["c/3", "c/0"])
    assert (again.appended, again.buffered, again.duplicate_groups) == (0, 8, (True, True))
    assert store.append(make_trajectories([2, 2], first_id=4), "c/2").appended == 0  # one table for both kinds
    plain = store.append(make_trajectories([4], first_id=10), "c/4")
    assert (plain.appended, plain.duplicate_groups) == (1, ())  # without group_keys: no per-group answer
    delivery = store.lease("a", 9, lease_seconds=60)
    assert trajectory_ids(delivery.batch) == [f"traj-{i}" for i in (0, 1, 2, 3, 4, 5, 8, 9, 10)]
    check_rows(delivery.batch)
    store.close()


def test_group_keys_are_remembered_in_the_idempotency_window(clock, fresh_db):
    store = TrajectoryStore(fresh_db(), capacity=100, idempotency_window=2, clock=clock)
    store.append(make_trajectories(groups(0, 3, 1)), group_keys=["k/0", "k/1", "k/2"])  # "k/0" is forgotten
    result = store.append(make_trajectories(groups(0, 3, 1), first_id=3), group_keys=["k/0", "k/1", "k/2"])
    assert (result.appended, result.duplicate_groups) == (1, (False, True, True))
    longest = "é" * (MAX_KEY_BYTES // 2)  # the limit counts UTF-8 bytes, and is inclusive
    assert store.append(make_trajectories([5]), group_keys=[longest]).appended == 1
    assert store.append(make_trajectories([5]), group_keys=[longest]).duplicate_groups == (True,)
    store.close()


def test_filtered_groups_are_logged_counted_and_never_delivered_and_a_retry_learns_their_fate(db, clock):
    path = db
    store = TrajectoryStore(path, capacity=4, max_filtered_groups=2, clock=clock)
    # Three groups of two: the middle one filtered; capacity 4 holds the other two (filtered take none).
    first = store.append(make_trajectories(groups(0, 3, 2)), group_keys=["f/0", "f/1", "f/2"],
                         filtered_groups=[False, True, False])
    assert (first.appended, first.buffered, first.filtered_groups) == (4, 4, (False, True, False))
    stats = store.stats()
    assert (stats.filtered_groups, stats.filtered_trajectories, stats.appended) == (1, 2, 4)
    delivery = store.lease("a", 4, lease_seconds=60)
    assert trajectory_ids(delivery.batch) == ["traj-0", "traj-1", "traj-4", "traj-5"]
    store.ack("a", delivery.lease_id)
    assert store.lease("a", 2, lease_seconds=60) is None  # the filtered group is never delivered
    # Filtered-only groups need no room: the log is bounded by max_filtered_groups instead.
    for i in range(3, 6):
        assert store.append(make_trajectories([i, i], first_id=2 * i), group_keys=[f"f/{i}"],
                            filtered_groups=[True]).filtered_groups == (True,)
    store.close()

    store = TrajectoryStore(path, capacity=4, max_filtered_groups=2, clock=clock)
    assert (store.stats().filtered_groups, store.stats().filtered_trajectories) == (4, 8)  # counted for ever
    logged = store.database.execute("SELECT key, group_size FROM filtered ORDER BY seq").fetchall()  # the file is locked
    assert logged == [("f/4", 2), ("f/5", 2)]  # the newest two kept
    # A retry (a collector restarted after its Append) is told how each group was stored, whatever it asks now.
    again = store.append(make_trajectories(groups(0, 3, 2)), group_keys=["f/0", "f/1", "f/2"],
                         filtered_groups=[True, False, True])
    assert (again.appended, again.duplicate_groups, again.filtered_groups) == (0, (True,) * 3, (False, True, False))
    assert store.stats().filtered_groups == 4
    store.close()


def test_a_file_written_before_filtered_groups_opens_and_its_keys_read_as_not_filtered(db, backend, clock):
    path = db
    old_tables = "CREATE TABLE idempotency_keys (key TEXT PRIMARY KEY, appended INTEGER NOT NULL)"
    if backend == "sqlite":  # what the code before filtered groups and schema versions wrote
        old = sqlite3.connect(path)
        old.executescript(f"{old_tables}; INSERT INTO idempotency_keys VALUES ('old/0', 2);")
        old.close()
    else:  # a PostgreSQL store at schema version 1 (as rlfleet never wrote one: the migration step is shared)
        old_tables = old_tables.replace("(key", "(rowid BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE, key")
        with psycopg.connect(path, autocommit=True) as old:
            old.execute("CREATE SCHEMA rlfleet_trajectory; SET search_path TO rlfleet_trajectory")
            old.execute(f"{old_tables}; INSERT INTO idempotency_keys (key, appended) VALUES ('old/0', 2); "
                        "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL); "
                        "INSERT INTO meta VALUES ('schema_version', '1')")
    store = TrajectoryStore(path, capacity=10, clock=clock)
    result = store.append(make_trajectories([0, 0]), group_keys=["old/0"], filtered_groups=[True])
    assert (result.duplicate_groups, result.filtered_groups, store.stats().filtered_groups) == ((True,), (False,), 0)
    assert store.database.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()[0] == "2"
    store.close()


def test_a_database_of_a_newer_schema_version_is_refused(db):
    TrajectoryStore(db, capacity=10).close()
    store = TrajectoryStore(db, capacity=10)
    store.database.execute("UPDATE meta SET value = '99' WHERE name = 'schema_version'")
    store.close()
    with pytest.raises(RuntimeError, match="schema version 99, written by a newer rlfleet; this one knows versions up to 2"):
        TrajectoryStore(db, capacity=10)


@pytest.mark.parametrize("group_keys, filtered, message", [
    ([], [True, False], r"^filtered_groups: needs group_keys"),
    (["x/1", "x/2"], [True], r"^filtered_groups: 1 flags for the 2 groups in trajectories"),
])
def test_invalid_filtered_flags_name_the_problem_and_store_nothing(store, group_keys, filtered, message):
    with pytest.raises(InvalidArgument, match=message):
        store.append(make_trajectories([1, 1, 2, 2]), group_keys=group_keys, filtered_groups=filtered)
    assert (store.buffered, store.stats().filtered_groups) == (0, 0)


@pytest.mark.parametrize("idempotency_key, group_keys, message", [
    ("x", ["x/1", "x/2"], r"^group_keys: set either idempotency_key or group_keys, not both$"),
    ("", ["x/1"], r"^group_keys: 1 keys for the 2 groups in trajectories"),
    ("", ["x/1", "x/2", "x/3"], r"^group_keys: 3 keys for the 2 groups in trajectories"),
    ("", ["x/1", ""], r"^group_keys\[1\]: empty"),
    ("", ["x/1", "x/1"], r"^group_keys\[1\]: 'x/1' repeats group_keys\[0\]"),
    ("", ["x/1", "é" * 257], rf"^group_keys\[1\]: 514 bytes, longer than the {MAX_KEY_BYTES} bytes"),
    ("k" * (MAX_KEY_BYTES + 1), [], rf"^idempotency_key: {MAX_KEY_BYTES + 1} bytes, longer than the {MAX_KEY_BYTES}"),
])
def test_invalid_dedup_keys_name_the_problem_and_store_nothing(store, idempotency_key, group_keys, message):
    store.append(make_trajectories([0]), group_keys=["x/0"])
    msg = make_trajectories([1, 1, 2, 2], first_id=1)
    with pytest.raises(InvalidArgument, match=message):
        store.append(msg, idempotency_key, group_keys=group_keys)
    assert (store.buffered, store.stats().appended) == (1, 1)
    assert store.append(msg, group_keys=["x/1", "x/2"]).appended == 4  # no key was burnt


def test_group_keys_capacity_counts_only_the_rows_to_store(clock, fresh_db):
    store = TrajectoryStore(fresh_db(), capacity=4, clock=clock)
    store.append(make_trajectories([0, 0]), group_keys=["g/0"])
    store.ack("a", store.lease("a", 2, lease_seconds=60).lease_id)
    whole = make_trajectories(groups(0, 3, 2))  # 6 rows could never fit; the 4 new ones do
    assert store.append(whole, group_keys=["g/0", "g/1", "g/2"]).duplicate_groups == (True, False, False)
    assert store.buffered == 4
    assert store.append(whole, group_keys=["g/0", "g/1", "g/2"]).appended == 0  # nothing to store: no backpressure
    with pytest.raises(ResourceExhausted, match="4 of 4 buffered, 2 more do not fit"):
        store.append(make_trajectories([1, 1, 3, 3], first_id=2), group_keys=["g/1", "g/3"])
    with pytest.raises(InvalidArgument, match="6 trajectories to store can never fit the buffer's capacity of 4"):
        store.append(make_trajectories(groups(4, 3, 2)), group_keys=["g/4", "g/5", "g/6"])
    store.close()

    known, new = make_trajectories([0, 0]), make_trajectories([1, 1], first_id=2)
    whole = make_trajectories([0, 0, 1, 1])
    limit = payload_bytes(new)
    assert payload_bytes(known) <= limit < payload_bytes(whole)
    store = TrajectoryStore(fresh_db(), capacity=100, capacity_bytes=limit, clock=clock)
    store.append(known, group_keys=["g/0"])
    with pytest.raises(ResourceExhausted, match="bytes buffered"):
        store.append(whole, group_keys=["g/0", "g/1"])
    store.ack("a", store.lease("a", 2, lease_seconds=60).lease_id)
    assert store.append(whole, group_keys=["g/0", "g/1"]).appended == 2  # only group 1's bytes count
    assert store.stats().buffered_bytes == limit
    store.close()


@pytest.mark.parametrize("mutate, message", [
    (lambda m: m.entries.pop("group_id"), r"trajectories.entries\[group_id\]: missing"),
    (lambda m: m.entries["policy_version_start"].tensor.CopyFrom(
        encode_tensordict({"x": torch.zeros(2, dtype=torch.int32)}, [2]).entries["x"].tensor),
     r"trajectories.entries\[policy_version_start\]: must be a \[2\] int64 tensor, got tensor DTYPE_INT32"),
    (lambda m: m.entries["score"].tensor.__setattr__("data", b"\x00" * 3),
     r"trajectories.entries\[score\].tensor.data"),
    (lambda m: m.entries["tokens"].nested.entries["response"].ragged.lengths.__setitem__(0, 99),
     r"trajectories.entries\[tokens\].nested.entries\[response\].ragged.lengths"),
])
def test_malformed_appends_name_the_field_and_store_nothing(store, mutate, message):
    msg = make_trajectories([1, 1])
    mutate(msg)
    with pytest.raises((InvalidArgument, WireError), match=message):
        store.append(msg, "key")
    assert store.stats().appended == 0
    assert store.append(make_trajectories([1, 1]), "key").appended == 2  # the key was not burnt


def test_batch_must_be_one_dimensional(store):
    msg = encode_tensordict({"group_id": torch.zeros(2, 2, dtype=torch.int64)}, batch_size=[2, 2])
    with pytest.raises(InvalidArgument, match=r"trajectories.batch_size: must be 1-D"):
        store.append(msg)


def test_rows_of_one_buffer_share_a_schema(store):
    store.append(make_trajectories([1]))
    other = make_trajectories([2], first_id=1)
    other.entries["score"].tensor.CopyFrom(encode_tensordict({"s": torch.zeros(1, dtype=torch.float64)}, [1])
                                           .entries["s"].tensor)
    with pytest.raises(InvalidArgument, match=r"entries\[score\]: tensor DTYPE_FLOAT64 .* DTYPE_FLOAT32"):
        store.append(other)
    delivery = store.lease("a", 1, lease_seconds=1)
    store.ack("a", delivery.lease_id)
    assert store.append(other).appended == 1  # an empty buffer takes a new schema


def test_with_the_batch_schema_only_documented_keys_in_their_documented_form_are_stored(clock, fresh_db):
    store = TrajectoryStore(fresh_db(), capacity=100, documented=row_schema(), clock=clock)
    assert store.append(make_trajectories([1, 1])).appended == 2  # a subset of the documented keys
    extra = make_trajectories([2, 2], first_id=2)
    extra.entries["my_metric"].CopyFrom(extra.entries["score"])
    nested_extra = make_trajectories([2, 2], first_id=2)
    nested_extra.entries["next"].nested.entries["value"].CopyFrom(extra.entries["score"])
    flat_done = make_trajectories([2, 2], first_id=2)
    flat_done.entries["next"].nested.entries["done"].tensor.shape[:] = [2]  # [B] where [B, 1] is documented
    as_strings = make_trajectories([2, 2], first_id=2)
    as_strings.entries["query"].strings.values[:] = ["a", "b"]
    as_strings.entries["score"].strings.values[:] = ["1", "2"]  # a string column under a tensor key
    for msg, message in [
        (extra, r"entries\[my_metric\]: not a key of the batch schema \(docs/batch-schema.md\)"),
        (nested_extra, r"entries\[next\].nested.entries\[value\]: not a key of the batch schema"),
        (flat_done, r"entries\[next\].nested.entries\[done\]: tensor DTYPE_BOOL with trailing dims \[\], "
                    r"but the batch schema .* says tensor DTYPE_BOOL with trailing dims \[1\]"),
        (as_strings, r"entries\[score\]: strings, but the batch schema .* says tensor DTYPE_FLOAT32"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            store.append(msg)
    assert store.stats().appended == 2  # nothing half-applied


# --- durability -----------------------------------------------------------------------------


def test_reopen_keeps_acknowledged_appends_and_readies_leased_rows(db, backend, clock):
    path = db
    store = TrajectoryStore(path, capacity=100, clock=clock)
    store.append(make_trajectories(groups(0, 2, 2), first_id=0), "c/0")
    store.append(make_trajectories(groups(2, 2, 2), first_id=4), "c/1")
    acked = store.lease("a", 2, lease_seconds=60)
    store.ack("a", acked.lease_id)
    leased = store.lease("a", 2, lease_seconds=60)
    store.close()

    store = TrajectoryStore(path, capacity=100, clock=clock)
    stats = store.stats()
    assert (stats.ready, stats.leased) == (6, 0)
    assert store.append(make_trajectories(groups(0, 2, 2)), "c/0").appended == 0  # keys survive
    again = store.lease("b", 2, lease_seconds=60)
    assert again.redelivered and trajectory_ids(again.batch) == trajectory_ids(leased.batch)
    rest = store.lease("b", 4, lease_seconds=60, whole_groups=True)  # groups survive too
    assert not rest.redelivered
    assert decode_tensordict(rest.batch)["group_id"].tolist() == [2, 2, 3, 3]
    delivered = trajectory_ids(again.batch) + trajectory_ids(rest.batch)
    assert sorted(delivered) == sorted(f"traj-{i}" for i in range(2, 8))
    check_rows(rest.batch)
    store.close()
    if backend == "sqlite":
        mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
        assert mode == "wal"


def test_a_group_is_stored_once_and_its_payload_goes_with_its_last_row(db, clock):
    path = db
    store = TrajectoryStore(path, capacity=100, clock=clock)
    store.append(make_trajectories([0, 0, 0, 1, 1, 2, 2, 2, 2]), group_keys=["g/0", "g/1", "g/2"])
    assert store.database.execute("SELECT count(*) FROM units").fetchone()[0] == 3
    first = store.lease("a", 4, lease_seconds=60)  # group 0 and one row of group 1
    assert trajectory_ids(first.batch) == [f"traj-{i}" for i in range(4)]
    check_rows(first.batch)
    store.ack("a", first.lease_id)
    assert [unit for (unit,) in store.database.execute("SELECT unit FROM units ORDER BY unit")] == [4, 6]
    dropped = store.drop_stale(1)  # group 1's other row and group 2: nothing is leased
    assert dropped.dropped == 5
    assert store.database.execute("SELECT count(*) FROM units").fetchone()[0] == 0
    assert store.stats().buffered_bytes == 0
    store.close()


def test_a_file_written_before_groups_were_stored_whole_is_read_as_it_is(db, clock):
    """Such a file holds each row as its own message and no group payloads: its rows are delivered,
    counted and acked as before, beside groups appended since."""
    path = db
    store = TrajectoryStore(path, capacity=100, clock=clock)
    old = make_trajectories([0, 0, 1, 1], prompt_ids=True)
    store.append(old, "old")
    with store.database.transaction():  # what the previous code wrote: rows with their data, no units table rows
        for seq, row in enumerate(split_rows(old), start=1):
            store.database.execute("UPDATE trajectories SET data = ? WHERE seq = ?", (row, seq))
        store.database.execute("DELETE FROM units")
    store.close()

    store = TrajectoryStore(path, capacity=100, clock=clock)
    assert store.stats().buffered_bytes == sum(map(len, split_rows(old)))
    new = make_trajectories([2, 2], first_id=4, prompt_ids=True)
    store.append(new, "new")
    assert store.stats().buffered_bytes == sum(map(len, split_rows(old))) + payload_bytes(new)
    mixed = store.lease("a", 6, lease_seconds=60, whole_groups=True)
    assert trajectory_ids(mixed.batch) == [f"traj-{i}" for i in range(6)]
    check_rows(mixed.batch)
    store.nack("a", mixed.lease_id)
    assert store.drop_stale(1).prompt_ids == ("prompt-0", "prompt-1", "prompt-2")
    assert store.stats().buffered_bytes == 0 and store.database.execute("SELECT count(*) FROM trajectories").fetchone()[0] == 0
    store.close()


def test_a_second_store_cannot_open_a_file_in_use(db):
    path = db
    store = TrajectoryStore(path, capacity=10)
    with pytest.raises(RuntimeError, match="in use by another process"):
        TrajectoryStore(path, capacity=10, lock_timeout_seconds=0.1)
    store.close()
    TrajectoryStore(path, capacity=10).close()


# --- the async buffer -------------------------------------------------------------------------


class Commands:
    """The reader's side of a stream: acks and nacks, then end."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()

    def send(self, kind: str, lease_id: str) -> None:
        self.queue.put_nowait((kind, lease_id))

    def close(self) -> None:
        self.queue.put_nowait(None)

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        return item


@pytest.fixture
async def buffer(fresh_db):
    location = fresh_db()
    buffer = TrajectoryBuffer(lambda: TrajectoryStore(location, capacity=100), default_lease_seconds=60,
                              spawn=lambda coroutine, name: asyncio.get_running_loop().create_task(coroutine, name=name))
    await buffer.start()
    yield buffer
    await buffer.stop()


@pytest.fixture
def leases(monkeypatch) -> list[tuple[int, bool]]:
    """Every lease attempt the buffer makes, as it runs on the store thread: (rows ready then, leased)."""
    attempts: list[tuple[int, bool]] = []
    lease = TrajectoryStore.lease

    def recorded(store, *args, **kwargs):
        ready = store.stats().ready
        delivery = lease(store, *args, **kwargs)
        attempts.append((ready, delivery is not None))
        return delivery

    monkeypatch.setattr(TrajectoryStore, "lease", recorded)
    return attempts


async def test_a_reader_waits_for_a_full_batch_and_respects_prefetch(buffer, leases):
    commands = Commands()
    stream = buffer.stream(ReaderOptions(batch_size=4, prefetch=1), commands)
    waiting = asyncio.ensure_future(anext(stream))
    await buffer.append(make_trajectories([1, 1]))
    # The reader looks once the 2 rows are in, and takes nothing: no short batch. Until the next
    # append it waits for a change, so it cannot have answered meanwhile.
    await wait_for_async(lambda: any(ready == 2 for ready, _ in leases), WAIT, "a lease attempt with 2 of 4 ready")
    assert (2, True) not in leases and not waiting.done()
    await buffer.append(make_trajectories([2, 2, 3, 3, 4, 4], first_id=2))
    first = await asyncio.wait_for(waiting, WAIT)
    assert trajectory_ids(first.batch) == [f"traj-{i}" for i in range(4)]
    second = asyncio.ensure_future(anext(stream))
    # Prefetch 1: with 4 rows ready the reader asks for no second lease until it acks the first. The
    # store thread runs calls in order: a lease asked for with the first batch would be done by now.
    attempts = len(leases)
    stats = await buffer.stats()
    assert (stats.ready, stats.leased, len(leases)) == (4, 4, attempts) and not second.done()
    commands.send("ack", first.lease_id)
    # The ack's answer comes first, then the batch its slot let through.
    assert await asyncio.wait_for(second, WAIT) == Settlement(first.lease_id, nack=False, applied=True, trajectories=4)
    assert (await asyncio.wait_for(anext(stream), WAIT)).size == 4
    await stream.aclose()
    stats = await buffer.stats()
    assert (stats.acked, stats.leased, stats.ready) == (4, 0, 4)  # closing released the un-acked batch


async def test_a_stream_ending_or_a_lease_expiring_redelivers(buffer):
    await buffer.append(make_trajectories(groups(0, 2, 2)))
    commands = Commands()
    stream = buffer.stream(ReaderOptions(batch_size=4, lease_seconds=0.3), commands)
    first = await asyncio.wait_for(anext(stream), WAIT)
    # The expiry task releases the batch once its lease runs out: another reader gets it.
    other = buffer.stream(ReaderOptions(batch_size=4, lease_seconds=60), Commands())
    again = await asyncio.wait_for(anext(other), WAIT)
    assert again.redelivered and trajectory_ids(again.batch) == trajectory_ids(first.batch)
    commands.send("ack", first.lease_id)  # too late: answered, nothing changes, the stream goes on
    late = await asyncio.wait_for(anext(stream), WAIT)
    assert isinstance(late, Settlement) and (late.lease_id, late.applied, late.trajectories) == (first.lease_id,
                                                                                                False, 0)
    assert "expired and released for redelivery" in late.reason
    commands.close()
    assert [m async for m in stream] == []
    await other.aclose()  # the reader left without acking
    third = buffer.stream(ReaderOptions(batch_size=4), Commands())
    assert (await asyncio.wait_for(anext(third), WAIT)).redelivered
    await third.aclose()
    assert (await buffer.stats()).redelivered_batches == 2


async def test_lease_expiry_looks_again_only_for_a_lease_that_expires_before_it_would_look(buffer, monkeypatch):
    looks = []
    expire = TrajectoryStore.expire
    monkeypatch.setattr(TrajectoryStore, "expire", lambda store: looks.append(1) or expire(store))
    await buffer.append(make_trajectories(groups(0, 6, 2)))  # three batches of 4
    streams = []

    async def lease(seconds: float):
        streams.append(buffer.stream(ReaderOptions(batch_size=4, lease_seconds=seconds), Commands()))
        delivery = await asyncio.wait_for(anext(streams[-1]), WAIT)
        await asyncio.sleep(0.2)  # the expiry task looks, if it does, and waits again
        return delivery

    await lease(60)
    assert len(looks) == 1  # it had no lease to wait for
    await lease(60)  # expires after the first one: looked at in time anyway, no call on the store thread
    assert len(looks) == 1
    short = await lease(2.0)  # expires before the first one: it must look earlier
    assert len(looks) == 2
    other = buffer.stream(ReaderOptions(batch_size=4, lease_seconds=60), Commands())
    again = await asyncio.wait_for(anext(other), WAIT)  # the short lease expired in time
    assert again.redelivered and trajectory_ids(again.batch) == trajectory_ids(short.batch)
    for stream in (*streams, other):
        await stream.aclose()


async def test_every_command_is_answered_in_order_even_at_half_close(buffer):
    await buffer.append(make_trajectories(groups(0, 4, 2)))
    commands = Commands()
    stream = buffer.stream(ReaderOptions(batch_size=2, prefetch=3), commands)
    batches = [await asyncio.wait_for(anext(stream), WAIT) for _ in range(3)]
    commands.send("nack", batches[1].lease_id)
    commands.send("ack", batches[0].lease_id)
    commands.send("ack", batches[0].lease_id)  # twice: the second is not applied
    commands.send("ack", "no-such-lease")
    commands.close()
    answers = [m async for m in stream if isinstance(m, Settlement)]
    assert [(a.lease_id, a.nack, a.applied, a.trajectories) for a in answers] == [
        (batches[1].lease_id, True, True, 2), (batches[0].lease_id, False, True, 2),
        (batches[0].lease_id, False, False, 0), ("no-such-lease", False, False, 0)]
    stats = await buffer.stats()
    assert (stats.acked, stats.leased, stats.ready) == (2, 0, 6)


async def test_a_reader_that_acks_without_reading_is_held_back(buffer):
    """Answers queue up to OUTBOX_SIZE; then the stream stops taking the reader's commands."""
    commands = Commands()
    stream = buffer.stream(ReaderOptions(batch_size=2), commands)
    started = asyncio.ensure_future(anext(stream))  # starts the stream; nothing to deliver yet
    for i in range(OUTBOX_SIZE * 4):
        commands.send("ack", f"bogus-{i}")
    # It reads what fits: the answer `started` takes, OUTBOX_SIZE queued, one more waiting for room.
    held = OUTBOX_SIZE * 4 - OUTBOX_SIZE - 2
    await wait_for_async(lambda: commands.queue.qsize() <= held, WAIT, "the stream to read a full outbox's worth")
    await buffer.stats()  # the store thread has answered every ack the stream took: it would take more now
    assert commands.queue.qsize() == held  # the rest not read: flow control
    first = await asyncio.wait_for(started, WAIT)
    assert first.lease_id == "bogus-0" and not first.applied
    commands.close()
    rest = [m async for m in stream]
    assert [m.lease_id for m in rest] == [f"bogus-{i}" for i in range(1, OUTBOX_SIZE * 4)]


async def test_open_is_validated(buffer):
    with pytest.raises(InvalidArgument, match="open.batch_size: must be > 0"):
        await anext(buffer.stream(ReaderOptions(batch_size=0), Commands()))
    with pytest.raises(InvalidArgument, match="exceeds the buffer's capacity"):
        await anext(buffer.stream(ReaderOptions(batch_size=101), Commands()))
