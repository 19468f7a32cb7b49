"""The prompt ledger: every admitted prompt, durable until it ends as a group or a dead letter.

A trainer's prompts are written here (one SQLite transaction, fsync'd) before
SubmitPrompts answers; a dataset prompt is written as it is drawn, in the same
transaction as the dataset position that moves past it. A prompt's row is
deleted when its group is appended to the trajectory service, or moved to the
dead letters when it fails for good. In sync mode an appended group's row is
kept (marked with its version) for two more commits: if the group goes stale
unread (a push landed before the trainer read it), the collector drops it from
the trajectory service and generates its prompt again from this row. A restarted collector generates every row
still here, so nothing submitted is lost; and because a group's Append is keyed
by its row (``<prompt_id>#<seq>``), a group appended just before a crash is not
appended twice when its prompt is generated again.

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

from rlfleet.client.results import PassRate
from rlfleet.services.collector.coalescer import Coalescer
from rlfleet.services.collector.filtering import GroupOutcome
from rlfleet.services.collector.prompt_item import PromptItem
from rlfleet.services.common.sqlite import chunks, transaction

T = TypeVar("T")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS prompts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    prompt_id TEXT NOT NULL,
    item TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    appended_version INTEGER  -- NULL: pending; else its group was appended at this version (sync mode)
);
CREATE UNIQUE INDEX IF NOT EXISTS pending_prompt_ids ON prompts (prompt_id) WHERE appended_version IS NULL;
CREATE INDEX IF NOT EXISTS appended_prompts ON prompts (prompt_id) WHERE appended_version IS NOT NULL;
CREATE TABLE IF NOT EXISTS dead_letters (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    prompt_id TEXT NOT NULL,
    item TEXT NOT NULL,
    stage TEXT NOT NULL,
    code TEXT NOT NULL,
    error TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    failed_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pass_rates (
    prompt_key TEXT PRIMARY KEY,
    groups INTEGER NOT NULL,
    samples INTEGER NOT NULL,
    passed INTEGER NOT NULL,
    filtered_groups INTEGER NOT NULL,
    recent_samples INTEGER NOT NULL,  -- the latest group's
    recent_passed INTEGER NOT NULL,
    updated_at REAL NOT NULL
);
"""


@dataclass(frozen=True)
class DeadLetter:
    """A prompt that failed for good (``PromptFailure`` on the wire)."""

    seq: int
    prompt_id: str
    stage: str
    code: str
    error: str
    attempts: int
    failed_at: float


_STORED_FIELDS = tuple(f.name for f in dataclasses.fields(PromptItem) if f.name not in ("ledger_seq", "attempts"))


def _dump(item: PromptItem) -> str:
    return json.dumps({name: getattr(item, name) for name in _STORED_FIELDS})


def _load(raw: str, seq: int, attempts: int) -> PromptItem:
    return PromptItem(**json.loads(raw), ledger_seq=seq, attempts=attempts)


class PromptLedger:
    """The prompt table and the dead letters, in one SQLite file (see the module doc)."""

    def __init__(self, path: str | Path, *, max_dead_letters: int = 10_000):
        self.path = str(path)
        self.max_dead_letters = max_dead_letters
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="prompt-ledger")
        self._db: sqlite3.Connection = self._executor.submit(self._open).result()
        self._ends = Coalescer(self._end, split_on=lambda exc: False, name="ledger commit")
        """Group commit of ``done``: what queued while a transaction ran is the next one."""
        self.filtered_groups, self.filtered_samples = self._executor.submit(self._filtered_counts).result()
        """Groups (and their samples) dynamic sampling filtered, ever: committed with their prompts' ends."""
        self.recent: dict[str, tuple[int, int]] = self._executor.submit(self._recent_rates).result()
        """Each prompt key's latest group: (samples, passed), what the curriculum reads."""

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # a committed prompt survives power loss
        db.executescript(_SCHEMA)
        return db

    async def _call(self, method: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(method, *args))

    def close(self) -> None:
        self._executor.submit(self._db.close).result()
        self._executor.shutdown(wait=True)

    # --- prompts ------------------------------------------------------------------------
    async def add(self, items: list[PromptItem], position: dict[str, int] | None = None) -> list[PromptItem]:
        """Write ``items`` (and the dataset ``position`` past them) in one transaction; sets each
        new item's ``ledger_seq``. Returns the items added: one whose prompt_id is already pending
        is not added again (a retried SubmitPrompts)."""
        return await self._call(self._add, items, position)

    def _add(self, items: list[PromptItem], position: dict[str, int] | None) -> list[PromptItem]:
        added = []
        with transaction(self._db):
            for item in items:
                cursor = self._db.execute("INSERT OR IGNORE INTO prompts (prompt_id, item) VALUES (?, ?)",
                                          (item.prompt_id, _dump(item)))
                if cursor.rowcount:
                    item.ledger_seq, item.attempts = cursor.lastrowid, 0
                    added.append(item)
            if position is not None:
                self._db.execute("INSERT OR REPLACE INTO meta VALUES ('position', ?)", (json.dumps(position),))
        return added

    async def pending(self) -> list[PromptItem]:
        """Every prompt not yet ended, oldest first (what a restarted collector generates)."""
        return await self._call(self._pending)

    def _pending(self) -> list[PromptItem]:
        rows = self._db.execute(
            "SELECT seq, item, attempts FROM prompts WHERE appended_version IS NULL ORDER BY seq").fetchall()
        return [_load(raw, seq, attempts) for seq, raw, attempts in rows]

    async def position(self) -> dict[str, int] | None:
        row = await self._call(lambda: self._db.execute("SELECT value FROM meta WHERE name = 'position'").fetchone())
        return json.loads(row[0]) if row else None

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
        with transaction(self._db):
            self._db.executemany("DELETE FROM prompts WHERE seq = ?",
                                 [(seq,) for seq, version, _ in ends if version is None])
            self._db.executemany("UPDATE prompts SET appended_version = ? WHERE seq = ?",
                                 [(version, seq) for seq, version, _ in ends if version is not None])
            now = time.time()
            self._db.executemany(
                "INSERT INTO pass_rates VALUES (?, 1, ?, ?, ?, ?, ?, ?) ON CONFLICT (prompt_key) DO UPDATE SET "
                "groups = groups + 1, samples = samples + excluded.samples, passed = passed + excluded.passed, "
                "filtered_groups = filtered_groups + excluded.filtered_groups, recent_samples = excluded.samples, "
                "recent_passed = excluded.passed, updated_at = excluded.updated_at",
                [(o.key, o.samples, o.passed, int(o.filtered), o.samples, o.passed, now) for o in outcomes])
            if filtered:
                groups, samples = self._filtered_counts()
                self._db.execute("INSERT OR REPLACE INTO meta VALUES ('filtered', ?)", (json.dumps(
                    [groups + len(filtered), samples + sum(o.samples for o in filtered)]),))

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

    async def regenerate(self, prompt_ids: list[str]) -> tuple[list[PromptItem], list[str]]:
        """Make the kept rows of appended groups pending again, each as a new row (so its next
        Append gets a new key): (the new items, the prompt ids with no kept row)."""
        return await self._call(self._regenerate, prompt_ids)

    def _regenerate(self, prompt_ids: list[str]) -> tuple[list[PromptItem], list[str]]:
        again, missing = [], []
        with transaction(self._db):
            for prompt_id in prompt_ids:
                row = self._db.execute("SELECT seq, item, attempts FROM prompts WHERE prompt_id = ? AND "
                                       "appended_version IS NOT NULL ORDER BY seq DESC LIMIT 1", (prompt_id,)).fetchone()
                if row is None:
                    missing.append(prompt_id)
                    continue
                seq, raw, attempts = row
                self._db.execute("DELETE FROM prompts WHERE seq = ?", (seq,))
                cursor = self._db.execute("INSERT OR IGNORE INTO prompts (prompt_id, item, attempts) VALUES (?, ?, ?)",
                                          (prompt_id, raw, attempts))
                if cursor.rowcount:  # else the trainer submitted it again meanwhile: already pending
                    again.append(_load(raw, cursor.lastrowid, attempts))
        return again, missing

    async def forget_appended(self, below_version: int) -> int:
        """Delete the kept rows of groups appended at a version below ``below_version``."""
        return await self._call(self._forget_appended, below_version)

    def _forget_appended(self, below_version: int) -> int:
        with transaction(self._db):
            return self._db.execute("DELETE FROM prompts WHERE appended_version < ?", (below_version,)).rowcount

    async def attempted(self, item: PromptItem) -> int:
        """Count a failed attempt (persisted: the budget survives restarts); returns the new count."""
        item.attempts = await self._call(self._attempted, item.ledger_seq)
        return item.attempts

    def _attempted(self, seq: int) -> int:
        with transaction(self._db):
            self._db.execute("UPDATE prompts SET attempts = attempts + 1 WHERE seq = ?", (seq,))
        return self._db.execute("SELECT attempts FROM prompts WHERE seq = ?", (seq,)).fetchone()[0]

    # --- dead letters -------------------------------------------------------------------------
    async def dead(self, item: PromptItem, stage: str, code: str, error: str,
                   position: dict[str, int] | None = None) -> DeadLetter:
        """Move the prompt to the dead letters (keeping the newest ``max_dead_letters``); a dataset
        row that is not a prompt is written there directly, with the dataset ``position`` past it."""
        return await self._call(self._dead, item, stage, code, error, position)

    def _dead(self, item: PromptItem, stage: str, code: str, error: str,
              position: dict[str, int] | None) -> DeadLetter:
        now = time.time()
        with transaction(self._db):
            self._db.execute("DELETE FROM prompts WHERE seq = ?", (item.ledger_seq,))
            if position is not None:
                self._db.execute("INSERT OR REPLACE INTO meta VALUES ('position', ?)", (json.dumps(position),))
            cursor = self._db.execute(
                "INSERT INTO dead_letters (prompt_id, item, stage, code, error, attempts, failed_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (item.prompt_id, _dump(item), stage, code, error, item.attempts, now))
            self._db.execute("DELETE FROM dead_letters WHERE seq <= ?", (cursor.lastrowid - self.max_dead_letters,))
        return DeadLetter(cursor.lastrowid, item.prompt_id, stage, code, error, item.attempts, now)

    async def failures(self, after: int, limit: int) -> tuple[list[DeadLetter], int]:
        """Dead letters with seq > ``after``, oldest first, and how many there were in all."""
        return await self._call(self._failures, after, limit)

    def _failures(self, after: int, limit: int) -> tuple[list[DeadLetter], int]:
        rows = self._db.execute(
            "SELECT seq, prompt_id, stage, code, error, attempts, failed_at FROM dead_letters "
            "WHERE seq > ? ORDER BY seq LIMIT ?", (after, limit)).fetchall()
        total = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'dead_letters'").fetchone()
        return [DeadLetter(*row) for row in rows], total[0] if total else 0
