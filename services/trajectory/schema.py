"""The trajectory store's tables (SQLite's DDL; ``services/common/database.py`` translates it for
PostgreSQL) and the migrations that bring a database written by an older version up to them."""

from __future__ import annotations

from rlfleet.services.common.database import Database
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
    /* rowid */                             -- insertion order: the window forgets the oldest keys
    key TEXT PRIMARY KEY,
    appended INTEGER NOT NULL,
    filtered INTEGER NOT NULL DEFAULT 0     -- added by schema version 2
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
"""
# The meta table (name, value) holds the schema version (``Database.apply_schema``), the buffered rows'
# batch schema ('schema', JSON) and the filtered counts ('filtered', JSON [groups, trajectories]).


def _add_filtered_flag(db: Database) -> None:
    """Version 2: idempotency keys remember whether their group was stored as filtered."""
    if "filtered" not in db.columns("idempotency_keys"):
        db.ddl("ALTER TABLE idempotency_keys ADD COLUMN filtered INTEGER NOT NULL DEFAULT 0")


MIGRATIONS = (_add_filtered_flag,)
"""``MIGRATIONS[i]`` takes a database from schema version i + 1 to i + 2 (``Database.apply_schema``)."""
CURRENT_VERSION = len(MIGRATIONS) + 1


def create(db: Database) -> int:
    """Create the store's tables where missing and migrate an older database; returns the schema version."""
    return db.apply_schema(SCHEMA_SQL + samples.SCHEMA_SQL, MIGRATIONS)
