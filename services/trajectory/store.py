"""The durable trajectory buffer: database rows plus an in-memory index of them.

The database — a SQLite file (WAL mode), or PostgreSQL (``services/common/database.py``) — holds every
buffered group as one serialized TensorDict message of its rows (``rows.py``), and a row per trajectory
that indexes it; nothing is acknowledged before its transaction commits.
Memory holds only the index — which rows are ready, which are leased to which
reader, until when — never the payloads. Leases live in memory only, on
purpose: after a restart every stored row is ready again, which is exactly
"un-acked batches are redelivered". A per-row delivery count is persisted so a
batch delivered before a crash is still flagged ``redelivered`` after it.

Groups: all rows of one ``append`` call sharing a ``group_id`` form one group
(the collector appends a GRPO group whole, in one call). A ``group_size``
entry, if present, must equal that count, so a collector that splits groups
gets an error instead of silently mis-batched groups. ``group_id``s are not
merged across calls. A group's policy version is its oldest row's.

Deduplication: an ``idempotency_key`` makes a resent call a no-op; ``group_keys``
(one per group) skip just the groups appended before, so one call can carry
several groups. Both kinds share one table of the most recent keys.

Filtered groups (dynamic sampling: the collector found their scores constant) are appended in the
same call and transaction as the others but go to the filtered log instead of the buffer: never
delivered, no capacity taken, the newest ``max_filtered_groups`` kept, counted for ever (``meta``), and
their dedup keys remember that they were filtered, so a caller retrying after a crash learns how its
group was stored.

Which rows are ready, in what order, and which are leased to whom is the in-memory index
(``index.py``); this module keeps it and the database in step, the database first.

Rows leave only by an ack or by ``drop_stale`` (an operator's call). A
reader's ``min_policy_version`` filters what that reader is given and deletes
nothing: readers cannot delete data they were not given.

A lost PostgreSQL connection fails the call that met it (``DatabaseUnavailable``: UNAVAILABLE); the
next call reconnects and rebuilds the index from the database, as a restart would: leases are dropped
and every stored row is ready again (an ack of a dropped lease is NOT_FOUND, as for an expired one),
and an Append or ack whose COMMIT was cut off is seen as it landed, or not.

A store is not thread-safe: sqlite3 connections are bound to the thread that
opened them, so one thread owns the store (see ``buffer.TrajectoryBuffer``).
Nothing here knows about gRPC.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Literal, Sequence, TypeVar

from rlfleet.rpc.records import BufferStats, DroppedStale
from rlfleet.services.common.database import Database, chunks, open_database
from rlfleet.services.common.errors import InvalidArgument, ResourceExhausted
from rlfleet.services.trajectory import rows as rowcodec
from rlfleet.services.trajectory import samples as sample_log
from rlfleet.services.trajectory import schema as tables
from rlfleet.services.trajectory.appends import AppendedGroup, groups_of
from rlfleet.services.trajectory.index import BufferIndex, Row, Unit, rows_of, share
from rlfleet.v1 import tensor_pb2
from rlfleet.wire.rows import concat_tensordicts

log = logging.getLogger("rlfleet.trajectory.store")
T = TypeVar("T")

#: The string column whose values ``drop_stale`` reports (when the rows have it).
PROMPT_ID_KEY = "prompt_id"
DEFAULT_CAPACITY_BYTES = 8 << 30
DEFAULT_SCHEMA = "rlfleet_trajectory"


@dataclass(frozen=True)
class AppendResult:
    appended: int
    """Trajectories stored by the call (0 for a duplicate idempotency key; with group keys, the rows of
    the groups not skipped)."""
    buffered: int
    """Trajectories buffered (ready + leased) after the call."""
    duplicate_groups: tuple[bool, ...] = ()
    """With group keys: for each group, in order, whether it was skipped as appended before; else empty."""
    filtered_groups: tuple[bool, ...] = ()
    """With group keys: for each group, in order, whether it is (or, skipped, was) stored as filtered."""


@dataclass(frozen=True)
class Delivery:
    """A leased batch."""

    lease_id: str
    batch: tensor_pb2.TensorDict
    expires_at: float
    """Seconds since the epoch."""
    redelivered: bool
    """True if any row of the batch was delivered before."""
    size: int


Dropped = DroppedStale
"""What ``drop_stale`` deleted: the SDK's record (``DropStaleResponse``)."""
Stats = BufferStats
"""The buffer's occupancy and counters: the SDK's record (``GetStatsResponse``)."""


class TrajectoryStore:
    """Bounded, durable buffer of trajectories with leased batch delivery."""

    def __init__(self, path: str, capacity: int, *, capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
                 synchronous: Literal["FULL", "NORMAL"] = "FULL",
                 idempotency_window: int = 100_000, max_filtered_groups: int = 10_000,
                 sample_groups_per_version: int = 8, max_sample_groups: int = 2_000,
                 lock_timeout_seconds: float = 10.0, schema: str = DEFAULT_SCHEMA,
                 documented: rowcodec.Schema | None = None, clock: Callable[[], float] = time.time):
        """``path``: a SQLite file (``:memory:``: nothing kept) or a ``postgresql://`` URL, the tables in
        ``schema`` there; ``capacity`` bounds the buffered rows, ``capacity_bytes`` their serialized payloads;
        ``documented``: the schema every append must keep to (its keys may be a subset); None
        accepts any layout."""
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self._idempotency_window = idempotency_window
        self._max_filtered_groups = max_filtered_groups
        self._clock = clock
        self._db = open_database(path, role="trajectory", schema=schema, lock_timeout_seconds=lock_timeout_seconds,
                                 synchronous=synchronous)
        try:
            tables.create(self._db)
        except BaseException:
            self._db.close()
            raise
        self.path = self._db.name
        """The database in messages: the file, or the URL less its password."""
        self.samples = sample_log.SampleLog(self._db, groups_per_version=sample_groups_per_version,
                                            max_groups=max_sample_groups, clock=clock)
        """The sample log (``samples.py``): read it on the store's thread."""
        self.index: BufferIndex  # set by _load
        """Which rows are ready and which leased (``index.py``): rebuilt from the database by ``_load``."""
        self._appended = self._acked = self._redelivered_batches = self._dropped_stale = 0
        self.reconnects = 0
        """Times the index was rebuilt after a lost connection (leases dropped, rows ready again)."""
        self._documented = documented
        self._load()

    # --- lifecycle ----------------------------------------------------------------
    def _load(self) -> None:
        """(Re)build the index from the database: every stored row ready, no leases."""
        self.index = index = BufferIndex()
        self._last_seq = self._db.last_id("trajectories", "seq")
        row = self._db.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
        self._schema = json.loads(row[0]) if row else None
        row = self._db.execute("SELECT value FROM meta WHERE name = 'filtered'").fetchone()
        self._filtered = tuple(json.loads(row[0])) if row else (0, 0)
        # length() of a blob reads its size, not its content
        unit_bytes = dict(self._db.execute("SELECT unit, length(data) FROM units"))
        cursor = self._db.execute(
            "SELECT seq, unit, group_id, group_size, policy_version_start, deliveries, length(data) "
            "FROM trajectories ORDER BY seq")
        for seq, unit_id, group_id, group_size, version, deliveries, nbytes in cursor:
            own_payload = nbytes > 0  # else the row is in its unit's payload
            if not own_payload:
                nbytes = share(unit_bytes.get(unit_id, 0), group_size, seq - unit_id)
            index.load(Row(seq, unit_id, version, deliveries, nbytes, own_payload), group_id, group_size)
        index.loaded()
        if set(unit_bytes) - set(index.units):  # not left behind by this code: a payload goes with its last row
            with self._db.transaction():
                self._db.execute("DELETE FROM units WHERE unit NOT IN (SELECT unit FROM trajectories)")
        if index.ready:
            log.info("reopened trajectory store", extra={"path": self._db.name, "ready": index.ready})

    def _ensure_open(self) -> None:
        """After a lost connection: reconnect and rebuild the index (``DatabaseUnavailable`` if not yet)."""
        if not self._db.lost:
            return
        self._db.reconnect()
        self._load()
        self.reconnects += 1
        log.warning("trajectory store reconnected: index rebuilt from the database, leases dropped",
                    extra={"database": self._db.name, "ready": self.index.ready})

    @property
    def database(self) -> Database:
        """The database the rows are kept in, for what only it can say (row counts, the schema version); a
        write through it bypasses the store's index."""
        return self._db

    def close(self) -> None:
        """Close the database. Leases are dropped: their rows are ready again on reopen."""
        self._db.close()

    # --- append ---------------------------------------------------------------------
    def append(self, msg: tensor_pb2.TensorDict, idempotency_key: str = "",
               group_keys: Sequence[str] = (), filtered_groups: Sequence[bool] = (),
               committed_version: int | None = None) -> AppendResult:
        """Store the rows of ``msg``, all or none (durable once this returns), less the groups appended
        before: ``idempotency_key`` deduplicates the whole call, ``group_keys`` each group (see
        ``dedup_keys``); ``filtered_groups`` sends groups to the filtered log (see the module doc). A
        call with nothing new to store is a no-op, checked no further than its validity. The new
        groups are also counted, and copied where there is room, in the sample log, with
        ``committed_version`` (None: unknown) for their staleness."""
        groups = groups_of(msg, idempotency_key, group_keys, filtered_groups)
        self._ensure_open()
        self._find_stored(groups)
        duplicates = tuple(group.stored_before is not None for group in groups) if group_keys else ()
        fates = tuple(group.stored_as_filtered for group in groups) if group_keys else ()
        new = [group for group in groups if group.stored_before is None]
        if not new:
            return AppendResult(0, self.buffered, duplicates, fates)
        kept = [group for group in new if not group.filtered]
        count = sum(len(group.rows) for group in kept)
        self._check_room(count)
        schema = self._admitted_schema(msg) if kept else self._schema
        for group, payload in zip(new, rowcodec.split_units(msg, [group.rows for group in new])):
            group.payload = payload
        self._check_room_bytes(sum(len(group.payload) for group in kept))
        units, records = self._new_units(kept)
        dropped = [group for group in new if group.filtered]
        filtered = (self._filtered[0] + len(dropped), self._filtered[1] + sum(len(group.rows) for group in dropped))
        with self._db.transaction():
            self._insert(units, records, kept)
            if dropped:
                self._log_filtered(dropped)
                self._set_meta("filtered", json.dumps(filtered))
            if schema != self._schema:
                self._set_meta("schema", json.dumps(schema))
            self._remember_keys(new)
            self.samples.record(msg, [sample_log.NewGroup(g.rows, g.filtered, g.payload) for g in new],
                                committed_version)
        # Committed: only now does the in-memory index change.
        self._last_seq = records[-1][0] if records else self._last_seq
        self._schema, self._filtered = schema, filtered
        self.index.add(units)
        self._appended += count
        return AppendResult(count, self.buffered, duplicates, fates)

    def _check_room(self, count: int) -> None:
        """InvalidArgument if ``count`` more trajectories could never fit, ResourceExhausted if not now."""
        if count > self.capacity:
            raise InvalidArgument(f"trajectories.batch_size: {count} trajectories to store can never fit "
                                  f"the buffer's capacity of {self.capacity}")
        if self.buffered + count > self.capacity:
            raise ResourceExhausted(
                f"trajectory buffer full: {self.buffered} of {self.capacity} buffered, {count} more "
                "do not fit; retry after trainers ack batches")

    def _check_room_bytes(self, size: int) -> None:
        """As ``_check_room``, for ``size`` more bytes of payloads."""
        if size > self.capacity_bytes:
            raise InvalidArgument(f"trajectories: {size} bytes of trajectories can never fit the buffer's "
                                  f"capacity_bytes of {self.capacity_bytes}")
        if self.index.bytes + size > self.capacity_bytes:
            raise ResourceExhausted(
                f"trajectory buffer full: {self.index.bytes} of {self.capacity_bytes} bytes buffered, {size} more "
                "do not fit; retry after trainers ack batches")

    def _insert(self, units: Sequence[Unit], records: Sequence[tuple], groups: Sequence[AppendedGroup]) -> None:
        """The buffered groups' rows and payloads (``units`` and ``records`` made of ``groups`` by
        ``_new_units``); call inside ``self._db.transaction()``."""
        self._db.executemany(
            "INSERT INTO trajectories (seq, unit, group_id, group_size, policy_version_start, data) "
            "VALUES (?, ?, ?, ?, ?, ?)", records)
        if records:
            self._db.claim_ids("trajectories", "seq", records[-1][0])
        self._db.executemany("INSERT INTO units (unit, data) VALUES (?, ?)",
                             [(unit.id, group.payload) for unit, group in zip(units, groups)])

    def _set_meta(self, name: str, value: str) -> None:
        self._db.execute("INSERT INTO meta (name, value) VALUES (?, ?) "
                         "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (name, value))

    def _log_filtered(self, groups: Sequence[AppendedGroup]) -> None:
        """Keep ``groups`` in the filtered log, the newest ``max_filtered_groups`` of it; call inside
        ``self._db.transaction()``."""
        now = self._clock()
        self._db.executemany("INSERT INTO filtered (key, group_id, group_size, policy_version_start, filtered_at, "
                             "data) VALUES (?, ?, ?, ?, ?, ?)",
                             [(group.key, group.group_id, len(group.rows), group.version, now, group.payload)
                              for group in groups])
        self._db.execute("DELETE FROM filtered WHERE seq <= (SELECT max(seq) FROM filtered) - ?",
                         (self._max_filtered_groups,))

    def _find_stored(self, groups: Sequence[AppendedGroup]) -> None:
        """Set ``stored_before`` of each group whose key is among the remembered deduplication keys."""
        keys = list(dict.fromkeys(group.key for group in groups if group.key))
        stored: dict[str, bool] = {}
        for chunk in chunks(keys):
            stored.update((key, bool(filtered)) for key, filtered in self._db.execute(
                f"SELECT key, filtered FROM idempotency_keys WHERE key IN ({','.join('?' * len(chunk))})", chunk))
        for group in groups:
            group.stored_before = stored.get(group.key)

    def _remember_keys(self, groups: Sequence[AppendedGroup]) -> None:
        """Record the keys of the stored groups (filtered or not; groups sharing the Append's one
        idempotency key under it once); call inside ``self._db.transaction()``."""
        rows_per_key: dict[str, list[int]] = {}
        for group in groups:
            if group.key:
                rows_per_key.setdefault(group.key, [0, int(group.filtered)])[0] += len(group.rows)
        if not rows_per_key:
            return
        self._db.executemany("INSERT INTO idempotency_keys (key, appended, filtered) VALUES (?, ?, ?)",
                             [(key, appended, was_filtered) for key, (appended, was_filtered) in rows_per_key.items()])
        # Bounded dedup window: forget the oldest keys (rowid order = insertion order).
        self._db.execute("DELETE FROM idempotency_keys WHERE rowid <= "
                         "(SELECT max(rowid) FROM idempotency_keys) - ?", (self._idempotency_window,))

    def _admitted_schema(self, msg: tensor_pb2.TensorDict) -> rowcodec.Schema:
        """The schema of ``msg``, if the buffer may take it: the documented one's, and the buffered rows'."""
        schema = rowcodec.schema_of(msg)
        violation = self._documented is not None and rowcodec.schema_violation(self._documented, schema)
        if violation:
            raise InvalidArgument(violation)
        if self._schema is not None and self.buffered:
            mismatch = rowcodec.schema_mismatch(self._schema, schema)
            if mismatch:
                raise InvalidArgument(mismatch)
        return schema

    def _new_units(self, groups: Sequence[AppendedGroup]) -> tuple[list[Unit], list[tuple]]:
        """``groups`` (their payloads made) as index entries and the trajectories table's records,
        numbered from the next seq."""
        next_seq = self._next_seq()
        units: list[Unit] = []
        records = []
        for group in groups:
            unit = Unit(next_seq, group.group_id, len(group.rows), group.version)
            for position, version in enumerate(group.versions):
                unit.ready.append(Row(next_seq, unit.id, version, 0, share(len(group.payload), unit.size, position)))
                records.append((next_seq, unit.id, unit.group_id, unit.size, version, b""))
                next_seq += 1
            units.append(unit)
        return units, records

    def _next_seq(self) -> int:
        return self._last_seq + 1

    # --- delivery ---------------------------------------------------------------------
    def lease(self, owner: str, batch_size: int, *, lease_seconds: float, whole_groups: bool = False,
              min_policy_version: int = 0) -> Delivery | None:
        """Lease exactly ``batch_size`` ready rows to ``owner``, or None if not enough are ready.

        Oldest policy version first, then append order (a released batch goes
        back to its place at the head). With
        ``whole_groups`` only complete groups are taken, and a group whose size
        does not divide ``batch_size`` is an error (it could never be delivered).
        ``min_policy_version`` is this reader's filter: groups whose
        policy_version_start (their oldest row's) is below it are skipped, and
        stay ready for other readers; nothing is deleted (see ``drop_stale``).
        The skipped groups are the head of the delivery order, so skipping them
        costs one bisection.
        """
        if batch_size <= 0:
            raise InvalidArgument(f"open.batch_size: must be > 0, got {batch_size}")
        self._ensure_open()
        plan = self.index.plan(batch_size, min_policy_version, whole_groups)
        if plan is None:
            return None
        rows = rows_of(plan)
        with self._db.transaction():
            for chunk in chunks([row.seq for row in rows]):
                self._db.execute("UPDATE trajectories SET deliveries = deliveries + 1 "
                                 f"WHERE seq IN ({','.join('?' * len(chunk))})", chunk)
            parts = self._parts(rows)
        batch = concat_tensordicts(parts)
        redelivered = any(row.deliveries for row in rows)
        lease = self.index.lease(plan, owner, self._clock() + lease_seconds)
        self._redelivered_batches += redelivered
        return Delivery(lease.id, batch, lease.expires_at, redelivered, len(rows))

    # --- drop stale -------------------------------------------------------------------------
    def drop_stale(self, below_policy_version: int) -> Dropped:
        """Delete the ready rows of every group whose policy_version_start is below
        ``below_policy_version`` (durable once this returns). Leased rows are left alone: acked,
        they are gone; released, the next call drops them."""
        self._ensure_open()
        units = self.index.ready_below(below_policy_version)
        rows = [row for unit in units for row in unit.ready]
        if not rows:
            return Dropped(dropped=0, group_ids=(), prompt_ids=())
        with self._db.transaction():
            prompt_ids = self._prompt_ids(rows)
            self._delete_rows([row.seq for row in rows], [unit.id for unit in units if not unit.leased])
        # Committed: only now does the in-memory index change.
        self.index.drop_ready(units)
        self._dropped_stale += len(rows)
        group_ids = tuple(dict.fromkeys(unit.group_id for unit in units))
        log.info("dropped stale trajectories", extra={
            "dropped": len(rows), "groups": len(group_ids), "below_policy_version": below_policy_version})
        return Dropped(dropped=len(rows), group_ids=group_ids, prompt_ids=tuple(dict.fromkeys(prompt_ids)))

    def _prompt_ids(self, rows: Sequence[Row]) -> list[str]:
        """The rows' prompt ids in order; none unless the buffered schema has the column."""
        if not self._schema or self._schema.get(PROMPT_ID_KEY) != ["strings"]:
            return []
        return list(concat_tensordicts(self._parts(rows)).entries[PROMPT_ID_KEY].strings.values)

    def _parts(self, rows: Sequence[Row]) -> list[tensor_pb2.TensorDict]:
        """Messages whose concatenation is ``rows``, in order: each group's payload read once, and
        whole when all its rows are taken; call inside ``self._db.transaction()``."""
        own: dict[int, bytes] = {}  # rows stored one by one (files written before units)
        for chunk in chunks([row.seq for row in rows if row.own_payload]):
            own.update(self._db.execute(
                f"SELECT seq, data FROM trajectories WHERE seq IN ({','.join('?' * len(chunk))})", chunk))
        units: dict[int, tensor_pb2.TensorDict] = {}
        for chunk in chunks(sorted({row.unit for row in rows if not row.own_payload})):
            for unit_id, data in self._db.execute(
                    f"SELECT unit, data FROM units WHERE unit IN ({','.join('?' * len(chunk))})", chunk):
                units[unit_id] = tensor_pb2.TensorDict.FromString(data)
        parts: list[tensor_pb2.TensorDict] = []
        start = 0
        while start < len(rows):
            row = rows[start]
            if row.own_payload:
                parts.append(tensor_pb2.TensorDict.FromString(own[row.seq]))
                start += 1
                continue
            end = start + 1
            while end < len(rows) and rows[end].unit == row.unit and not rows[end].own_payload:
                end += 1
            parts.extend(rowcodec.rows_of(units[row.unit], [r.seq - r.unit for r in rows[start:end]]))
            start = end
        return parts

    # --- ack / release -------------------------------------------------------------------
    def ack(self, owner: str, lease_id: str) -> int:
        """Delete a leased batch for good; returns its size."""
        self._ensure_open()
        lease = self.index.owned(owner, lease_id)
        with self._db.transaction():
            self._delete_rows([row.seq for row in lease.rows], self.index.emptied_by(lease))
        self.index.acked(lease)
        self._acked += len(lease.rows)
        return len(lease.rows)

    def nack(self, owner: str, lease_id: str) -> int:
        """Release a leased batch for immediate redelivery; returns its size."""
        return self.index.release(self.index.owned(owner, lease_id))

    def release_owner(self, owner: str) -> int:
        """Release every batch ``owner`` holds (its stream ended); returns the rows released."""
        return sum(self.index.release(lease) for lease in list(self.index.leases.values()) if lease.owner == owner)

    def expire(self) -> tuple[list[tuple[str, str]], float | None]:
        """Release leases past their expiry: ([(lease_id, owner)], next expiry or None)."""
        expired = self.index.expired(self._clock())
        for lease in expired:
            self.index.release(lease)
        return [(lease.id, lease.owner) for lease in expired], self.index.next_expiry()

    # --- stats ---------------------------------------------------------------------------
    @property
    def buffered(self) -> int:
        """Ready + leased trajectories (what ``capacity`` bounds)."""
        return self.index.buffered

    def stats(self) -> Stats:
        self._ensure_open()  # counts of a lost connection's index would be a guess
        return Stats(ready=self.index.ready, leased=self.index.leased, acked=self._acked, capacity=self.capacity,
                     appended=self._appended, redelivered_batches=self._redelivered_batches,
                     dropped_stale=self._dropped_stale, buffered_bytes=self.index.bytes,
                     capacity_bytes=self.capacity_bytes, filtered_groups=self._filtered[0],
                     filtered_trajectories=self._filtered[1])

    def read_samples(self, read: Callable[[sample_log.SampleLog], T]) -> T:
        """``read(self.samples)``, on a live connection."""
        self._ensure_open()
        return read(self.samples)

    # --- database helpers -------------------------------------------------------------
    def _delete_rows(self, seqs: Sequence[int], emptied_units: Sequence[int]) -> None:
        """Delete rows, and the payloads of the groups they leave empty; call inside
        ``self._db.transaction()``."""
        for chunk in chunks(seqs):
            self._db.execute(f"DELETE FROM trajectories WHERE seq IN ({','.join('?' * len(chunk))})", chunk)
        for chunk in chunks(emptied_units):
            self._db.execute(f"DELETE FROM units WHERE unit IN ({','.join('?' * len(chunk))})", chunk)

