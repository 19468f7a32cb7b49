"""Config of the trajectory service."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfleet.services.common.config import ServiceConfig
from rlfleet.services.common.database import DatabaseUrl, SchemaName


class TrajectoryConfig(ServiceConfig):
    """The trajectory service: a durable, bounded buffer of finished trajectories."""

    service_name = "trajectory"

    port: int = Field(50054, ge=0, le=65535)
    """gRPC port; 0 picks a free port (written to ``port_file``)."""
    db_path: str = "trajectories.sqlite3"
    """SQLite file holding the buffered trajectories (relative paths resolve against the working
    directory: put it on a persistent volume). ``:memory:`` keeps nothing across restarts. Unused when
    ``database_url`` is set."""
    database_url: DatabaseUrl = ""
    """Empty: the store is the SQLite file ``db_path``. ``postgresql://user@host:port/dbname`` (any libpq
    URL parameter allowed, e.g. ``?sslmode=require``): the store is in that PostgreSQL database, in the schema
    ``database_schema``, for a buffer that outlives its node (docs/guides/postgresql.md). A lost connection
    makes calls UNAVAILABLE until it is back; nothing acknowledged is lost."""
    database_schema: SchemaName = "rlfleet_trajectory"
    """PostgreSQL schema holding the store's tables (created if missing), so several stores can share one
    database; one service owns a schema at a time (an advisory lock). Unused with SQLite."""
    fresh: bool = False
    """Start a new run: delete every trajectory, lease, sample and counter the store keeps (its tables in
    ``db_path`` or the PostgreSQL schema) before opening it. Off: keep them (a restart resumes). A start-once
    switch, given with the collector's ``fresh`` (``rlfleet-suite --fresh``, ``rlfleet-ray up --fresh``)."""
    capacity: int = Field(100_000, gt=0)
    """Most trajectories buffered at once (ready + leased). An Append that does not fit is
    RESOURCE_EXHAUSTED and stores nothing: backpressure on the collector."""
    capacity_bytes: int = Field(8 << 30, gt=0)
    """Most bytes buffered at once (ready + leased), counted as the serialized size of each stored
    group of trajectories (the database file is somewhat larger); default 8 GiB. Bounds the disk use that
    ``capacity`` alone cannot when trajectories are long. An Append that does not fit is
    RESOURCE_EXHAUSTED and stores nothing, like ``capacity``."""
    default_lease_seconds: float = Field(300.0, gt=0)
    """How long a delivered batch stays leased when the reader does not ask for a lease time;
    un-acked after that, it is delivered again. Set it above a trainer step."""
    synchronous: Literal["FULL", "NORMAL"] = "FULL"
    """SQLite ``synchronous`` mode (WAL journal). FULL: an acknowledged append survives power loss
    (one fsync per commit). NORMAL: it survives a crash of the service but not of the machine. With
    PostgreSQL, FULL is ``synchronous_commit=on`` and NORMAL ``off`` (survives a crash of the service,
    not of the database server's machine)."""
    batch_schema: bool = True
    """Refuse an Append holding a key that is not in the batch schema (docs/batch-schema.md), or
    one whose kind, dtype or trailing dims differ from it (INVALID_ARGUMENT naming the key); keys
    may be left out, except the required group_id and policy_version_start. False stores any
    layout (the first append fixes it while rows are buffered)."""
    idempotency_window: int = Field(100_000, gt=0)
    """How many of the most recent Append idempotency keys are remembered (and deduplicated)."""
    max_filtered_groups: int = Field(10_000, gt=0)
    """Groups kept in the filtered log (Append's filtered_groups: never delivered), the newest; the
    count of all ever filtered is kept regardless."""
    sample_groups_per_version: int = Field(8, ge=0)
    """The sample log (what the rollout viewer shows): groups of each policy version copied there as
    they are appended (delivered or filtered), in the Append's transaction; 0 copies none. Per-version
    statistics (GetVersionStats) are counted for every group regardless."""
    max_sample_groups: int = Field(2_000, ge=0)
    """Groups the sample log keeps, the newest; 0 keeps every one copied (unbounded: not for long runs)."""
    lock_timeout_seconds: float = Field(10.0, ge=0)
    """At start (and on reconnecting to PostgreSQL), how long to wait for the database lock held by a
    previous instance that is still exiting; the file (or the PostgreSQL schema, by an advisory lock) is
    locked for the life of the process so two services never share it."""
