"""The prompt ledger: every admitted prompt, durable until it ends as a group or a dead letter; and the
rest of the collector's durable state beside it, in one database (``state_schema.py``): dead letters,
pass rates, the committed version, the mismatch breaker, and (PostgreSQL) the spooled weights.

The database is a SQLite file in the state directory (the default) or PostgreSQL (``database_url``),
through ``services/common/database.py``. A trainer's prompts are written here (one transaction, durable)
before SubmitPrompts answers; a dataset prompt is written as it is drawn, in the same
transaction as the dataset position that moves past it. A prompt's row is
deleted when its group is appended to the trajectory service, or moved to the
dead letters when it fails for good. In sync mode an appended group's row is
kept (marked with its version) for two more commits: if the group goes stale
unread (a push landed before the trainer read it), the collector drops it from
the trajectory service and generates its prompt again from this row. A restarted collector generates every row
still here, so nothing submitted is lost; and because a group's Append is keyed
by its row (``<prompt_id>#<seq>``), a group appended just before a crash is not
appended twice when its prompt is generated again.

A lost PostgreSQL connection fails the call that met it (``DatabaseUnavailable``: UNAVAILABLE naming the
database) and every later one, and is reported to ``on_lost``: the collector stops serving (NOT_SERVING
with the reason), as for any failed ledger write, and is restarted from the database, which rebuilds what
it keeps in memory (pending prompts, counts) as any restart does. A COMMIT cut off may have landed or
not; either way the restart sees it as it is, and the keyed Appends make a group generated again land once.

Every call runs on one dedicated thread (sqlite3 connections are thread-bound,
and fsyncs must not stall the event loop).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from rlfleet.rpc.records import PassRate, PromptFailure
from rlfleet.services.collector import state_schema
from rlfleet.services.collector.coalescer import Coalescer
from rlfleet.services.collector.filtering import GroupOutcome
from rlfleet.services.collector.prompt_item import PromptItem
from rlfleet.services.collector.run import Run, load as load_run
from rlfleet.services.common.database import Database, DatabaseUnavailable, chunks, open_database

T = TypeVar("T")
_UPSERT_META = ("INSERT INTO meta (name, value) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET value = excluded.value")


DeadLetter = PromptFailure
"""A prompt that failed for good: the SDK's record, ``PromptFailure`` on the wire."""


_STORED_FIELDS = tuple(f.name for f in dataclasses.fields(PromptItem) if f.name not in ("ledger_seq", "attempts"))


def _dump(item: PromptItem) -> str:
    return json.dumps({name: getattr(item, name) for name in _STORED_FIELDS})


def _load(raw: str, seq: int, attempts: int) -> PromptItem:
    return PromptItem(**json.loads(raw), ledger_seq=seq, attempts=attempts)


class PromptLedger:
    """The prompt table, the dead letters and the collector's other durable state, in one database (see
    the module doc): a SQLite file path (``:memory:``: nothing kept) or a ``postgresql://`` URL, its
    tables in ``schema``. ``state_dir``: where a SQLite ledger written before schema version 2 left the
    state files that are imported once (``state_schema.py``). ``on_lost(exc)``: told when the
    connection is lost (on the event loop)."""

    def __init__(self, location: str | Path, *, max_dead_letters: int = 10_000, schema: str = "rlfleet_collector",
                 state_dir: Path | None = None, lock_timeout_seconds: float = 10.0,
                 on_lost: Callable[[DatabaseUnavailable], None] | None = None):
        self.max_dead_letters = max_dead_letters
        self.on_lost = on_lost
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="prompt-ledger")
        try:
            self._db: Database = self._executor.submit(self._open, str(location), schema, state_dir,
                                                       lock_timeout_seconds).result()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise
        self.path = self._db.name
        """The database in messages: the file, or the URL less its password."""
        self._ends = Coalescer(self._end, split_on=lambda exc: False, name="ledger commit")
        """Group commit of ``done``: what queued while a transaction ran is the next one."""
        self.filtered_groups, self.filtered_samples = self._executor.submit(self._filtered_counts).result()
        """Groups (and their samples) dynamic sampling filtered, ever: committed with their prompts' ends."""
        self.recent: dict[str, tuple[int, int]] = self._executor.submit(self._recent_rates).result()
        """Each prompt key's latest group: (samples, passed), what the curriculum reads."""

    @staticmethod
    def _open(location: str, schema: str, state_dir: Path | None, lock_timeout_seconds: float) -> Database:
        # FULL: a committed prompt survives power loss.
        db = open_database(location, role="collector", schema=schema, lock_timeout_seconds=lock_timeout_seconds,
                           synchronous="FULL")
        try:
            state_schema.create(db, state_dir)
        except BaseException:
            db.close()
            raise
        return db

    @property
    def in_postgresql(self) -> bool:
        return self._db.dialect == "postgresql"

    async def _call(self, method: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, functools.partial(method, *args))
        except DatabaseUnavailable as lost:
            if self.on_lost is not None:
                self.on_lost(lost)
            raise

    async def run(self, method: Callable[..., T], *args: Any) -> T:
        """``method(database, *args)`` on the ledger's thread (what else keeps state in its database:
        the weight spool)."""
        return await self._call(method, self._db, *args)

    def run_now(self, method: Callable[..., T], *args: Any) -> T:
        """``run``, blocking the caller (at start, before the event loop matters)."""
        return self._executor.submit(method, self._db, *args).result()

    def close(self) -> None:
        self._executor.submit(self._db.close).result()
        self._executor.shutdown(wait=True)

    # --- state ----------------------------------------------------------------------------
    async def committed_version(self) -> int | None:
        """The committed policy version (None: nothing was ever committed)."""
        value = await self.meta("version")
        return int(value) if value is not None else None

    async def commit_version(self, version: int, spool_manifest: bytes | None = None) -> None:
        """Make ``version`` the committed one, durably; with ``spool_manifest``, the spooled push's
        manifest switches to it in the same transaction (its bytes were spooled before). OSError (or,
        the connection lost, ``DatabaseUnavailable``) when it is not recorded."""
        try:
            await self._call(self._commit_version, version, spool_manifest)
        except sqlite3.Error as err:  # a full disk: the caller treats it as the write it is
            raise OSError(f"{self.path}: {err}") from err

    def _commit_version(self, version: int, spool_manifest: bytes | None) -> None:
        with self._db.transaction():
            self._db.execute(_UPSERT_META, ("version", str(version)))
            if spool_manifest is not None:
                self._db.execute(_UPSERT_META, ("spool_manifest", spool_manifest.hex()))

    def open_run(self) -> Run:
        """The run this state belongs to; a state without one gets a new run, recorded (at start)."""
        return self._executor.submit(self._open_run).result()

    def _open_run(self) -> Run:
        with self._db.transaction():
            run, record = load_run(self._meta("run"), had_state=self._meta("version") is not None)
            if record is not None:
                self._db.execute(_UPSERT_META, ("run", record))
        return run

    async def meta(self, name: str) -> str | None:
        """The ``meta`` row ``name`` (``state_schema.META_KEYS``), None if absent."""
        return await self._call(self._meta, name)

    def _meta(self, name: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return row[0] if row else None

    async def set_meta(self, values: dict[str, str | None]) -> None:
        """Write (or, for None, delete) ``meta`` rows, in one transaction."""
        await self._call(self._set_meta, values)

    def _set_meta(self, values: dict[str, str | None]) -> None:
        with self._db.transaction():
            for name, value in values.items():
                if value is None:
                    self._db.execute("DELETE FROM meta WHERE name = ?", (name,))
                else:
                    self._db.execute(_UPSERT_META, (name, value))

    # --- prompts ------------------------------------------------------------------------
    async def add(self, items: list[PromptItem], position: dict[str, int] | None = None) -> list[PromptItem]:
        """Write ``items`` (and the dataset ``position`` past them) in one transaction; sets each
        new item's ``ledger_seq``. Returns the items added: one whose prompt_id is already pending
        is not added again (a retried SubmitPrompts)."""
        return await self._call(self._add, items, position)

    def _add(self, items: list[PromptItem], position: dict[str, int] | None) -> list[PromptItem]:
        added = []
        with self._db.transaction():
            for item in items:
                inserted = self._db.execute(
                    "INSERT INTO prompts (prompt_id, item) VALUES (?, ?) ON CONFLICT DO NOTHING RETURNING seq",
                    (item.prompt_id, _dump(item))).fetchall()
                if inserted:
                    added.append((item, inserted[0][0]))
            if position is not None:
                self._db.execute(_UPSERT_META, ("position", json.dumps(position)))
        for item, seq in added:  # committed: now the items are the rows
            item.ledger_seq, item.attempts = seq, 0
        return [item for item, _ in added]

    async def pending(self) -> list[PromptItem]:
        """Every prompt not yet ended, oldest first (what a restarted collector generates)."""
        return await self._call(self._pending)

    def _pending(self) -> list[PromptItem]:
        rows = self._db.execute(
            "SELECT seq, item, attempts FROM prompts WHERE appended_version IS NULL ORDER BY seq").fetchall()
        return [_load(raw, seq, attempts) for seq, raw, attempts in rows]

    async def position(self) -> dict[str, int] | None:
        value = await self.meta("position")
        return json.loads(value) if value is not None else None

    async def count(self) -> int:
        return await self._call(lambda: self._db.execute(
            "SELECT COUNT(*) FROM prompts WHERE appended_version IS NULL").fetchone()[0])

    async def done(self, item: PromptItem, retain_at_version: int | None = None,
                   outcome: GroupOutcome | None = None) -> None:
        """Its group was appended (or stored as filtered): the prompt has ended (its row kept, marked, if
        ``retain_at_version``), and ``outcome`` counts toward its pass rate and the filtered counts, in
        the same transaction: once per row. Durable when this returns; the ends that queued meanwhile
        share one transaction."""
        await self._ends.submit((item.ledger_seq, retain_at_version, outcome))

    async def _end(self, ends: list[tuple[int, int | None, GroupOutcome | None]]) -> list[None]:
        await self._call(self._done, ends)
        outcomes = [outcome for _, _, outcome in ends if outcome is not None]
        for outcome in outcomes:  # committed: now the counts in memory move
            self.recent[outcome.key] = (outcome.samples, outcome.passed)
            if outcome.filtered:
                self.filtered_groups += 1
                self.filtered_samples += outcome.samples
        return [None] * len(ends)

    def _done(self, ends: list[tuple[int, int | None, GroupOutcome | None]]) -> None:
        outcomes = [outcome for _, _, outcome in ends if outcome is not None]
        filtered = [outcome for outcome in outcomes if outcome.filtered]
        with self._db.transaction():
            self._db.executemany("DELETE FROM prompts WHERE seq = ?",
                                 [(seq,) for seq, version, _ in ends if version is None])
            self._db.executemany("UPDATE prompts SET appended_version = ? WHERE seq = ?",
                                 [(version, seq) for seq, version, _ in ends if version is not None])
            now = time.time()
            self._db.executemany(
                "INSERT INTO pass_rates VALUES (?, 1, ?, ?, ?, ?, ?, ?) ON CONFLICT (prompt_key) DO UPDATE SET "
                "groups = pass_rates.groups + 1, samples = pass_rates.samples + excluded.samples, "
                "passed = pass_rates.passed + excluded.passed, "
                "filtered_groups = pass_rates.filtered_groups + excluded.filtered_groups, "
                "recent_samples = excluded.samples, recent_passed = excluded.passed, updated_at = excluded.updated_at",
                [(o.key, o.samples, o.passed, int(o.filtered), o.samples, o.passed, now) for o in outcomes])
            if filtered:
                groups, samples = self._filtered_counts()
                self._db.execute(_UPSERT_META, ("filtered", json.dumps(
                    [groups + len(filtered), samples + sum(o.samples for o in filtered)])))

    def _filtered_counts(self) -> tuple[int, int]:
        row = self._db.execute("SELECT value FROM meta WHERE name = 'filtered'").fetchone()
        return tuple(json.loads(row[0])) if row else (0, 0)

    def _recent_rates(self) -> dict[str, tuple[int, int]]:
        return {key: (samples, passed) for key, samples, passed in
                self._db.execute("SELECT prompt_key, recent_samples, recent_passed FROM pass_rates")}

    async def pass_rates(self, keys: list[str], after: str, limit: int) -> tuple[list[PassRate], int]:
        """The pass rates of ``keys`` (those known), or without keys the first ``limit`` after ``after`` in
        key order; and how many prompt keys have one in all."""
        return await self._call(self._pass_rates, keys, after, limit)

    def _pass_rates(self, keys: list[str], after: str, limit: int) -> tuple[list[PassRate], int]:
        if keys:
            rows = [row for chunk in chunks(keys) for row in self._db.execute(
                f"SELECT * FROM pass_rates WHERE prompt_key IN ({','.join('?' * len(chunk))}) ORDER BY prompt_key",
                chunk)]
        else:
            rows = self._db.execute("SELECT * FROM pass_rates WHERE prompt_key > ? ORDER BY prompt_key LIMIT ?",
                                    (after, limit)).fetchall()
        total = self._db.execute("SELECT COUNT(*) FROM pass_rates").fetchone()[0]
        return [PassRate(*row) for row in rows], total

    async def regenerate(self, prompt_ids: list[str], replaceable: set[int] = frozenset()
                         ) -> tuple[list[PromptItem], list[str], list[int]]:
        """Make the rows of dropped groups pending again, each as a new row (so its next Append gets a
        new key): (the new items, the prompt ids with no such row, the seqs of pending rows replaced).

        A prompt's kept row (its group appended) is the usual case. A pending row among ``replaceable``
        had its group appended with the row's end not yet written: a commit between an Append and its
        confirmation, or an Append just before a restart whose row the restarted collector generates
        again (that Append finds the earlier group and would end the row). It is replaced too, and the
        late end of the old row finds no row."""
        return await self._call(self._regenerate, prompt_ids, replaceable)

    def _regenerate(self, prompt_ids: list[str], replaceable: set[int]
                    ) -> tuple[list[PromptItem], list[str], list[int]]:
        again, missing, replaced = [], [], []
        with self._db.transaction():
            for prompt_id in prompt_ids:
                row = self._db.execute("SELECT seq, item, attempts FROM prompts WHERE prompt_id = ? AND "
                                       "appended_version IS NOT NULL ORDER BY seq DESC LIMIT 1", (prompt_id,)).fetchone()
                if row is None:
                    row = self._db.execute("SELECT seq, item, attempts FROM prompts WHERE prompt_id = ? AND "
                                           "appended_version IS NULL", (prompt_id,)).fetchone()
                    if row is None or row[0] not in replaceable:
                        missing.append(prompt_id)
                        continue
                    replaced.append(row[0])
                seq, raw, attempts = row
                self._db.execute("DELETE FROM prompts WHERE seq = ?", (seq,))
                inserted = self._db.execute("INSERT INTO prompts (prompt_id, item, attempts) VALUES (?, ?, ?) "
                                            "ON CONFLICT DO NOTHING RETURNING seq", (prompt_id, raw, attempts)).fetchall()
                if inserted:  # else the trainer submitted it again meanwhile: already pending
                    again.append(_load(raw, inserted[0][0], attempts))
        return again, missing, replaced

    async def forget_appended(self, below_version: int) -> int:
        """Delete the kept rows of groups appended at a version below ``below_version``."""
        return await self._call(self._forget_appended, below_version)

    def _forget_appended(self, below_version: int) -> int:
        with self._db.transaction():
            return self._db.execute("DELETE FROM prompts WHERE appended_version < ?", (below_version,)).rowcount

    async def attempted(self, item: PromptItem) -> int:
        """Count a failed attempt (persisted: the budget survives restarts); returns the new count."""
        counted = await self._call(self._attempted, item.ledger_seq)
        item.attempts = counted if counted is not None else item.attempts + 1
        return item.attempts

    def _attempted(self, seq: int) -> int | None:
        with self._db.transaction():
            rows = self._db.execute("UPDATE prompts SET attempts = attempts + 1 WHERE seq = ? RETURNING attempts",
                                    (seq,)).fetchall()
        return rows[0][0] if rows else None  # None: the row was replaced (``regenerate``)

    # --- dead letters -------------------------------------------------------------------------
    async def dead(self, item: PromptItem, stage: str, code: str, error: str,
                   position: dict[str, int] | None = None) -> DeadLetter:
        """Move the prompt to the dead letters (keeping the newest ``max_dead_letters``); a dataset
        row that is not a prompt is written there directly, with the dataset ``position`` past it."""
        return await self._call(self._dead, item, stage, code, error, position)

    def _dead(self, item: PromptItem, stage: str, code: str, error: str,
              position: dict[str, int] | None) -> DeadLetter:
        now = time.time()
        with self._db.transaction():
            self._db.execute("DELETE FROM prompts WHERE seq = ?", (item.ledger_seq,))
            if position is not None:
                self._db.execute(_UPSERT_META, ("position", json.dumps(position)))
            seq = self._db.execute(
                "INSERT INTO dead_letters (prompt_id, item, stage, code, error, attempts, failed_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING seq",
                (item.prompt_id, _dump(item), stage, code, error, item.attempts, now)).fetchall()[0][0]
            self._db.execute("DELETE FROM dead_letters WHERE seq <= ?", (seq - self.max_dead_letters,))
        return DeadLetter(seq, item.prompt_id, stage, code, error, item.attempts, now)

    async def failures(self, after: int, limit: int) -> tuple[list[DeadLetter], int]:
        """Dead letters with seq > ``after``, oldest first, and how many there were in all."""
        return await self._call(self._failures, after, limit)

    def _failures(self, after: int, limit: int) -> tuple[list[DeadLetter], int]:
        rows = self._db.execute(
            "SELECT seq, prompt_id, stage, code, error, attempts, failed_at FROM dead_letters "
            "WHERE seq > ? ORDER BY seq LIMIT ?", (after, limit)).fetchall()
        return [DeadLetter(*row) for row in rows], self._db.last_id("dead_letters", "seq")
