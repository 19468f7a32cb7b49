"""The trajectory store's SQLite file: its schema and how it is opened (one owner, WAL)."""

from __future__ import annotations

import sqlite3

from rlfleet.services.trajectory import samples

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS trajectories (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- append order, never reused
    unit INTEGER NOT NULL,                  -- seq of the first row of its group
    group_id INTEGER NOT NULL,
    group_size INTEGER NOT NULL,            -- rows of the group when appended
    policy_version_start INTEGER NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 0,  -- times leased, > 0 means a redelivery
    data BLOB NOT NULL                      -- empty: the row is in its unit's payload (units),
                                            -- else (files written before units) the row, serialized
);
CREATE TABLE IF NOT EXISTS units (
    unit INTEGER PRIMARY KEY,               -- seq of its first row, its rows' seqs following in order
    data BLOB NOT NULL                      -- the group's rows, one serialized rlfleet.v1.TensorDict
);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key TEXT PRIMARY KEY,
    appended INTEGER NOT NULL
    -- filtered INTEGER NOT NULL DEFAULT 0: added by _migrate (files written before it lack it)
);
CREATE TABLE IF NOT EXISTS filtered (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- the filtered log: groups never delivered (dynamic sampling)
    key TEXT NOT NULL,                      -- its deduplication key
    group_id INTEGER NOT NULL,
    group_size INTEGER NOT NULL,
    policy_version_start INTEGER NOT NULL,
    filtered_at REAL NOT NULL,
    data BLOB NOT NULL                      -- the group's rows, one serialized rlfleet.v1.TensorDict
);
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


def connect(path: str, synchronous: str, lock_timeout_seconds: float) -> sqlite3.Connection:
    # Autocommit mode: transactions are explicit (BEGIN IMMEDIATE ... COMMIT).
    db = sqlite3.connect(path, isolation_level=None, timeout=lock_timeout_seconds)
    try:
        if path != ":memory:":
            # One process owns the file: a second service on the same path would
            # deliver the same rows twice. The lock dies with the process (SIGKILL too).
            db.execute("PRAGMA locking_mode = EXCLUSIVE")
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise RuntimeError(f"{path}: could not enable WAL journaling (got {mode!r})")
            # FULL fsyncs the WAL at every commit, so an acknowledged append survives
            # power loss and OS crashes too; NORMAL survives process crashes (SIGKILL)
            # only, but saves an fsync per append/lease/ack.
            db.execute(f"PRAGMA synchronous = {synchronous}")
            # Keep the WAL from staying at its high-water mark after large batches.
            db.execute("PRAGMA journal_size_limit = 67108864")
        db.execute("BEGIN IMMEDIATE")  # takes the (exclusive) lock now, not at the first append
        for statement in (SCHEMA_SQL + samples.SCHEMA_SQL).split(";"):
            if statement.strip():
                db.execute(statement)
        _migrate(db)
        db.execute("COMMIT")
    except sqlite3.OperationalError as exc:
        db.close()
        if "locked" in str(exc):
            raise RuntimeError(f"{path}: the trajectory database is in use by another process "
                               f"(waited {lock_timeout_seconds}s for its lock)") from exc
        raise
    return db


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a file written by an older version to the schema above (inside the opening transaction)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(idempotency_keys)")}
    if "filtered" not in columns:
        db.execute("ALTER TABLE idempotency_keys ADD COLUMN filtered INTEGER NOT NULL DEFAULT 0")

