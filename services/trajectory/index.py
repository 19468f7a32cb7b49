"""The trajectory store's in-memory index: which stored rows are ready, in delivery order, and which are leased.

Memory only, never the payloads: the database holds those (``store.py``). The store changes the
index only after the transaction that matches the change committed, so the index always says what
the database holds; after a restart or a lost connection it is rebuilt from the database with every
row ready and no leases.

Delivery order: oldest policy version first, then append order. Serving the stalest group first
keeps what a trainer consumes as close to on-policy as the buffer allows (a late-finishing old group
is not overtaken indefinitely by newer ones).
"""

from __future__ import annotations

import bisect
import collections
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlfleet.services.common.errors import InvalidArgument, NotFound


@dataclass
class Row:
    seq: int
    unit: int
    policy_version_start: int
    deliveries: int
    nbytes: int
    """Its share of its group's stored (serialized) payload: what ``capacity_bytes`` bounds."""
    own_payload: bool = False
    """Stored with its own payload in the trajectories table (files written before units), not in its unit's."""


@dataclass
class Unit:
    """One group: the rows one append call carried under one group_id."""

    id: int
    group_id: int
    size: int
    min_version: int
    ready: list[Row] = field(default_factory=list)  # sorted by seq
    leased: int = 0


@dataclass
class Lease:
    id: str
    owner: str
    rows: list[Row]
    expires_at: float


Plan = list[tuple[Unit, int]]
"""A batch to lease: (group, how many of its first ready rows) in delivery order."""


class BufferIndex:
    """The ready rows in delivery order, the leases, and the counts and bytes they add up to."""

    def __init__(self) -> None:
        self.units: dict[int, Unit] = {}
        self._ready_units: list[int] = []  # unit ids with ready rows, in delivery order (see _order)
        self.leases: dict[str, Lease] = {}
        self.ready = 0
        self.leased = 0
        self.bytes = 0
        """Payload bytes of the ready + leased rows."""

    @property
    def buffered(self) -> int:
        """Ready + leased rows."""
        return self.ready + self.leased

    # --- filling -----------------------------------------------------------------------
    def load(self, row: Row, group_id: int, group_size: int) -> None:
        """A stored row, read back in seq order; ``loaded()`` once all are."""
        unit = self.units.get(row.unit)
        if unit is None:
            unit = self.units[row.unit] = Unit(row.unit, group_id, group_size, row.policy_version_start)
            self._ready_units.append(row.unit)
        unit.ready.append(row)
        unit.min_version = min(unit.min_version, row.policy_version_start)
        self.ready += 1
        self.bytes += row.nbytes

    def loaded(self) -> None:
        self._ready_units.sort(key=self._order)

    def add(self, units: Sequence[Unit]) -> None:
        """Newly appended groups, all their rows ready."""
        for unit in units:
            self.units[unit.id] = unit
            bisect.insort(self._ready_units, unit.id, key=self._order)
            self.ready += len(unit.ready)
            self.bytes += sum(row.nbytes for row in unit.ready)

    # --- leasing ------------------------------------------------------------------------
    def plan(self, batch_size: int, min_policy_version: int, whole_groups: bool) -> Plan | None:
        """The first ``batch_size`` ready rows at or above ``min_policy_version`` in delivery order, or None
        if there are not that many; ``whole_groups``: complete groups only (InvalidArgument for a group
        whose size does not divide ``batch_size``: it could never be delivered)."""
        start = self.first_ready_at(min_policy_version)
        if whole_groups:
            return self._plan_whole_groups(batch_size, start)  # scans even when short: bad group sizes fail fast
        return self._plan_rows(batch_size, start) if self.ready >= batch_size else None

    def _plan_rows(self, batch_size: int, start: int) -> Plan | None:
        plan, need = [], batch_size
        for index in range(start, len(self._ready_units)):
            unit = self.units[self._ready_units[index]]
            take = min(need, len(unit.ready))
            plan.append((unit, take))
            need -= take
            if not need:
                return plan
        return None  # the filter skipped too much

    def _plan_whole_groups(self, batch_size: int, start: int) -> Plan | None:
        plan, need = [], batch_size
        for index in range(start, len(self._ready_units)):
            unit = self.units[self._ready_units[index]]
            if unit.leased:
                continue  # part of this group is out with another reader
            if batch_size % unit.size:
                raise InvalidArgument(
                    f"open.batch_size: {batch_size} is not a multiple of the size {unit.size} of "
                    f"group {unit.group_id}; with whole_groups it could never be delivered")
            if len(unit.ready) <= need:
                plan.append((unit, len(unit.ready)))
                need -= len(unit.ready)
                if not need:
                    return plan
        return None

    def lease(self, plan: Plan, owner: str, expires_at: float) -> Lease:
        """Lease the planned rows to ``owner`` (their deliveries counted)."""
        rows = rows_of(plan)
        for unit, count in plan:
            del unit.ready[:count]
            unit.leased += count
            if not unit.ready:
                self._remove_ready_unit(unit.id)
        for row in rows:
            row.deliveries += 1
        lease = Lease(uuid.uuid4().hex, owner, rows, expires_at)
        self.leases[lease.id] = lease
        self.ready -= len(rows)
        self.leased += len(rows)
        return lease

    def owned(self, owner: str, lease_id: str) -> Lease:
        """``owner``'s live lease ``lease_id``; NotFound if there is none."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.owner != owner:
            raise NotFound(f"lease_id: {lease_id!r} is not a live lease of this stream (unknown, already "
                           "acked, or expired and released for redelivery)")
        return lease

    def emptied_by(self, lease: Lease) -> list[int]:
        """The groups acking ``lease`` leaves without rows: their payloads go with it."""
        acked = collections.Counter(row.unit for row in lease.rows)
        return [unit_id for unit_id, count in acked.items()
                if self.units[unit_id].leased == count and not self.units[unit_id].ready]

    def acked(self, lease: Lease) -> None:
        """``lease``'s rows are deleted for good."""
        del self.leases[lease.id]
        for row in lease.rows:
            unit = self.units[row.unit]
            unit.leased -= 1
            if not unit.leased and not unit.ready:
                del self.units[unit.id]
        self.leased -= len(lease.rows)
        self.bytes -= sum(row.nbytes for row in lease.rows)

    def release(self, lease: Lease) -> int:
        """``lease``'s rows are ready again, back in their place; returns how many."""
        del self.leases[lease.id]
        for row in lease.rows:
            unit = self.units[row.unit]
            unit.leased -= 1
            if not unit.ready:
                bisect.insort(self._ready_units, unit.id, key=self._order)
            bisect.insort(unit.ready, row, key=lambda r: r.seq)
        self.leased -= len(lease.rows)
        self.ready += len(lease.rows)
        return len(lease.rows)

    def expired(self, now: float) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.expires_at <= now]

    def next_expiry(self) -> float | None:
        return min((lease.expires_at for lease in self.leases.values()), default=None)

    # --- dropping -----------------------------------------------------------------------
    def ready_below(self, policy_version: int) -> list[Unit]:
        """The groups with ready rows whose policy_version_start is below ``policy_version``, in order."""
        return [self.units[unit_id] for unit_id in self._ready_units[:self.first_ready_at(policy_version)]]

    def drop_ready(self, units: Sequence[Unit]) -> list[Row]:
        """The ready rows of ``units`` (the head of the delivery order, from ``ready_below``) are deleted;
        returns them."""
        rows = [row for unit in units for row in unit.ready]
        del self._ready_units[:len(units)]
        for unit in units:
            unit.ready = []
            if not unit.leased:
                del self.units[unit.id]
        self.ready -= len(rows)
        self.bytes -= sum(row.nbytes for row in rows)
        return rows

    # --- order --------------------------------------------------------------------------
    def first_ready_at(self, policy_version: int) -> int:
        """Index in the delivery order of the first group whose policy_version_start is >= ``policy_version``."""
        if not policy_version:
            return 0
        return bisect.bisect_left(self._ready_units, (policy_version,), key=self._order)

    def _order(self, unit_id: int) -> tuple[int, int]:
        """Delivery order: oldest policy version first, then append order (the module doc says why)."""
        return self.units[unit_id].min_version, unit_id

    def _remove_ready_unit(self, unit_id: int) -> None:
        index = bisect.bisect_left(self._ready_units, self._order(unit_id), key=self._order)
        del self._ready_units[index]


def rows_of(plan: Plan) -> list[Row]:
    """The rows a plan takes, in order."""
    return [row for unit, count in plan for row in unit.ready[:count]]


def share(unit_bytes: int, unit_size: int, position: int) -> int:
    """The bytes of its group's payload that row ``position`` of ``unit_size`` counts (the first row
    takes the remainder, so a group's rows count exactly its payload)."""
    part = unit_bytes // unit_size
    return part + (unit_bytes - part * unit_size if position == 0 else 0)
