"""The collector's durable state as tables (SQLite's DDL; ``services/common/database.py`` translates it
for PostgreSQL) and the migrations that bring a database written by an older version up to them.

What lives where: ``prompts`` (the prompt ledger), ``dead_letters``, ``pass_rates``, ``spool_chunks``
(the committed weights, used with PostgreSQL only: ``spool.DatabaseSpool``) and ``meta`` (name, value),
which holds the schema version and the keys of ``META_KEYS``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rlfleet.services.common.database import Database
from rlfleet.services.common.files import fsync_directory

log = logging.getLogger("rlfleet.collector.state")

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS prompts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    prompt_id TEXT NOT NULL,
    item TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    appended_version INTEGER  -- NULL: pending, else its group was appended at this version (sync mode)
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
CREATE TABLE IF NOT EXISTS spool_chunks (
    version INTEGER NOT NULL,               -- the push's policy version
    idx INTEGER NOT NULL,                   -- its place in the push's bytes (SPOOL_CHUNK_BYTES each)
    data BLOB NOT NULL,
    PRIMARY KEY (version, idx)
);
"""

META_KEYS = {
    "position": "the dataset position past the last row drawn (JSON {epoch, index})",
    "filtered": "groups and samples dynamic sampling filtered, ever (JSON [groups, samples])",
    "version": "the committed policy version",
    "run": "the run this state belongs to (JSON {run_id, created_at}; ``run.py``), made with the state",
    "mismatch_breaker": "while the mismatch breaker is open: what it opened on (JSON {reason})",
    "mismatch_measured": "the mismatch measured per lag (JSON), with mismatch_kl_target",
    "spool_manifest": "PostgreSQL: the spooled push's manifest (hex of a serialized WeightManifest)",
    "spool_base_manifest": "PostgreSQL, while the spooled push is a LoRA adapter: the manifest of the weights it "
                           "sits on (hex; absent: the checkpoint's)",
}
"""The ``meta`` rows the collector keeps, besides the schema version."""

LEGACY_FILES = {"state.json": "version", "mismatch-breaker.json": "mismatch_breaker",
                "mismatch-measured.json": "mismatch_measured"}
"""State files of collectors before schema version 2, and the meta key each is imported into."""


def _import_state_files(state_dir: Path | None, imported: list[Path]):
    """Version 2: the committed version and the breaker's state move from files in the state directory
    (``LEGACY_FILES``) into ``meta``, in the migration's transaction; ``imported`` collects the files read,
    removed once it committed."""

    def migrate(db: Database) -> None:
        if state_dir is None:
            return
        for name, key in LEGACY_FILES.items():
            path = state_dir / name
            if not path.exists():
                continue
            value = path.read_text()
            if key == "version":
                value = str(int(json.loads(value)["version"]))
            else:
                json.loads(value)  # a torn file is refused here, not read back wrong later
            db.execute("INSERT INTO meta (name, value) VALUES (?, ?) "
                       "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (key, value))
            imported.append(path)
            log.info("imported %s into the collector database", path, extra={"key": key})
    return migrate


def create(db: Database, state_dir: Path | None = None) -> int:
    """Create the tables where missing and migrate an older database (importing the state files of
    ``state_dir`` into it: a SQLite ledger written before version 2); returns the schema version."""
    imported: list[Path] = []
    version = db.apply_schema(SCHEMA_SQL, (_import_state_files(state_dir, imported),))
    if imported:  # committed: the files are never read again
        for path in imported:
            path.unlink(missing_ok=True)
        fsync_directory(imported[0].parent)
    return version


CURRENT_VERSION = 2
"""Version 1: the ledger before versions were recorded (state in files); 2: the state in ``meta``."""
