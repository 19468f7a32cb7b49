"""The database a service keeps its state in: a SQLite file (the embedded default) or PostgreSQL (a
``postgresql://`` URL), behind one connection type. Every difference between the two lives here.

Callers write their SQL once, in what both dialects accept: ``?`` placeholders, ``ON CONFLICT``,
``RETURNING`` (never ``lastrowid``), ``INSERT ... ON CONFLICT DO NOTHING`` (never ``INSERT OR
IGNORE``), columns qualified by their table in an ``ON CONFLICT DO UPDATE``, blobs as parameters (never
``x''``). Their DDL is SQLite's, translated here for PostgreSQL (``_POSTGRES_DDL``): AUTOINCREMENT keys
become identity columns, INTEGER BIGINT, REAL DOUBLE PRECISION, BLOB BYTEA, and a table marked
``/* rowid */`` gets a real ``rowid`` identity column (SQLite's is implicit).

One owner at a time: SQLite locks its file (EXCLUSIVE locking mode) for the life of the connection;
PostgreSQL holds a session-level advisory lock keyed on the schema, so several services can share
one database in schemas of their own. Either way a second instance is refused at open, after waiting
``lock_timeout_seconds`` for a previous one to exit.

Connection loss (PostgreSQL only): a statement, or a transaction's COMMIT, whose connection fails
raises ``DatabaseUnavailable`` (gRPC UNAVAILABLE, naming the database) and marks the database
``lost``. PostgreSQL rolls back a transaction cut mid-way; a COMMIT cut off may or may not have landed,
so whoever keeps state derived from the database in memory rebuilds it after ``reconnect`` (which
takes the advisory lock again, and refuses if another instance took it meanwhile). Nothing retries
behind the caller's back.
"""

from __future__ import annotations

import logging
import re
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Iterator, Literal, Sequence
from urllib.parse import urlsplit, urlunsplit

from pydantic import AfterValidator

from rlfleet.services.common.errors import Unavailable
from rlfleet.services.common.sqlite import chunks, transaction as sqlite_transaction

__all__ = ["Database", "DatabaseUnavailable", "DatabaseUrl", "SchemaName", "check_schema_name", "check_url", "chunks",
           "open_database", "purge_database", "redact"]

log = logging.getLogger("rlfleet.database")

POSTGRES_SCHEMES = ("postgresql", "postgres")
"""URL schemes that select PostgreSQL; an empty URL means SQLite at a file path."""
SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
"""A PostgreSQL schema name as the configs take it: a lower-case identifier that needs no quoting."""
LOCK_POLL_SECONDS = 0.1
DEFAULT_PARAMETERS = {"connect_timeout": "10", "keepalives": "1", "keepalives_idle": "30",
                      "keepalives_interval": "10", "keepalives_count": "3"}
"""libpq parameters a URL may override: a dead server or a cut network is noticed in about a minute, not
at TCP's default of hours."""

Dialect = Literal["sqlite", "postgresql"]


class DatabaseUnavailable(Unavailable):
    """The database could not be reached, or this instance no longer owns it: the operation is not
    applied, except that a COMMIT cut off may have landed (see the module doc)."""


def check_url(url: str) -> str:
    """``url`` if it selects a database this module opens (empty: SQLite), else ValueError saying why."""
    if not url:
        return url
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in POSTGRES_SCHEMES:
        raise ValueError(f"{redact(url)}: unknown scheme {scheme + '://' if scheme else '(none)'}; "
                         "give postgresql://user@host:port/dbname, or leave it empty for SQLite at db_path")
    if not urlsplit(url).path.strip("/"):
        raise ValueError(f"{redact(url)}: names no database; give postgresql://user@host:port/dbname")
    return url


def check_schema_name(name: str) -> str:
    if not SCHEMA_NAME.fullmatch(name):
        raise ValueError(f"{name!r}: a schema name is a lower-case identifier: a-z, 0-9 and _, not starting with "
                         "a digit, at most 63 characters")
    return name


DatabaseUrl = Annotated[str, AfterValidator(check_url)]
"""A config's ``database_url``: empty (SQLite) or a PostgreSQL URL naming a database; refused at start otherwise."""
SchemaName = Annotated[str, AfterValidator(check_schema_name)]
"""A config's ``database_schema``: a PostgreSQL schema name that needs no quoting."""


def redact(url: str) -> str:
    """``url`` without its password, fit for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


def purge_database(location: str, *, role: str, schema: str = "", lock_timeout_seconds: float = 10.0) -> list[str]:
    """Drop the tables a service keeps at ``location`` (``fresh``): opened as that service opens it, so a
    database another instance still owns is refused (``open_database``'s lock), never emptied under it.
    A SQLite file that does not exist is left absent. Returns the tables dropped."""
    if "://" not in location and (location == ":memory:" or not Path(location).exists()):
        return []
    db = open_database(location, role=role, schema=schema, lock_timeout_seconds=lock_timeout_seconds)
    try:
        return db.drop_tables()
    finally:
        db.close()


def open_database(location: str, *, role: str, schema: str = "", lock_timeout_seconds: float = 10.0,
                  synchronous: Literal["FULL", "NORMAL"] = "FULL") -> "Database":
    """Open and own the database at ``location``: a ``postgresql://`` URL (its tables in ``schema``) or a
    SQLite file path (``:memory:``: nothing kept). ``role`` names the service in messages ("trajectory":
    "the trajectory database") and in PostgreSQL's ``application_name``. ``synchronous``: FULL makes a
    commit survive a crash of the machine (SQLite ``synchronous=FULL``, PostgreSQL
    ``synchronous_commit=on``), NORMAL only a crash of the service."""
    if "://" in location:
        check_url(location)
        check_schema_name(schema)
        return Database("postgresql", location, role, schema, lock_timeout_seconds, synchronous)
    return Database("sqlite", location, role, "", lock_timeout_seconds, synchronous)


class Database:
    """A connection in autocommit mode with explicit ``transaction()``s; SQL in the common dialect (see
    the module doc). Not thread-safe: one thread owns it (sqlite3 connections are bound to theirs)."""

    def __init__(self, dialect: Dialect, location: str, role: str, schema: str, lock_timeout_seconds: float,
                 synchronous: Literal["FULL", "NORMAL"]):
        self.dialect = dialect
        self.name = redact(location) if dialect == "postgresql" else location
        """The database in messages: the file path, or the URL less its password."""
        self.what = f"{role} database"
        self.schema = schema
        self.lost = False
        """The connection failed: ``reconnect`` before the next statement."""
        self._location = location
        self._role = role
        self._lock_timeout_seconds = lock_timeout_seconds
        self._synchronous = synchronous
        self._conn: Any = None
        if dialect == "sqlite":
            self._conn = self._open_sqlite()
        else:
            self._conn = self._open_postgres(at_start=True)

    # --- statements -------------------------------------------------------------------
    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """Run one statement; returns its cursor (``fetchone``, ``fetchall``, iteration)."""
        if self.dialect == "sqlite":
            return self._conn.execute(sql, params)
        with self._guard():
            return self._conn.execute(_postgres_sql(sql), tuple(params), prepare=None)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        if self.dialect == "sqlite":
            self._conn.executemany(sql, rows)
            return
        rows = [tuple(row) for row in rows]
        if rows:
            with self._guard(), self._conn.cursor() as cursor:
                cursor.executemany(_postgres_sql(sql), rows)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """``BEGIN`` (SQLite: ``IMMEDIATE``) ... ``COMMIT``, or ``ROLLBACK`` on any exception (re-raised).
        A connection lost on the way raises ``DatabaseUnavailable``; lost at COMMIT, the transaction may
        have committed or not."""
        if self.dialect == "sqlite":
            with sqlite_transaction(self._conn):
                yield
            return
        self.execute("BEGIN")
        try:
            yield
        except BaseException:
            if not self.lost:
                self._rollback()
            raise
        self.execute("COMMIT")

    def _rollback(self) -> None:
        import psycopg

        try:
            self._conn.execute("ROLLBACK")
        except psycopg.Error:
            # The original error is the one to report; PostgreSQL rolls back what a lost connection left.
            self.lost = self.lost or self._conn.broken or self._conn.closed

    def ddl(self, statement: str) -> None:
        """Run one DDL statement written in SQLite's types (translated for PostgreSQL)."""
        self.execute(_postgres_ddl(statement) if self.dialect == "postgresql" else statement)

    def columns(self, table: str) -> set[str]:
        """The column names of ``table`` (empty if there is no such table)."""
        if self.dialect == "sqlite":
            return {row[1] for row in self.execute(f"PRAGMA table_info({table})")}
        return {row[0] for row in self.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() "
            "AND table_name = ?", (table,))}

    def tables(self) -> set[str]:
        if self.dialect == "sqlite":
            return {row[0] for row in self.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return {row[0] for row in self.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()")}

    def drop_tables(self) -> list[str]:
        """Drop every table of this database (SQLite) or of this schema (PostgreSQL), in one transaction:
        what a service keeps goes, a new run starts (a service's ``fresh`` setting). Other schemas, and
        SQLite's own tables, stay. Returns the tables dropped."""
        dropped = sorted(name for name in self.tables() if not name.startswith("sqlite_"))
        with self.transaction():
            for name in dropped:
                self.execute(f'DROP TABLE IF EXISTS "{name}"' + (" CASCADE" if self.dialect == "postgresql" else ""))
        return dropped

    def last_id(self, table: str, column: str) -> int:
        """The highest value the AUTOINCREMENT ``column`` of ``table`` ever took (0: none), deleted rows
        included: ids are never reused. Rows inserted with explicit ids must ``claim_ids`` them."""
        if self.dialect == "sqlite":
            row = self.execute("SELECT seq FROM sqlite_sequence WHERE name = ?", (table,)).fetchone()
            return row[0] if row else 0
        return self.execute("SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence(?, ?)::regclass), 0)",
                            (table, column)).fetchone()[0]

    def claim_ids(self, table: str, column: str, last: int) -> None:
        """Record that ids up to ``last`` were inserted explicitly into ``column`` (SQLite does so by
        itself). PostgreSQL's sequences are not transactional: a rolled-back claim leaves a gap, never
        a reuse."""
        if self.dialect == "postgresql":
            self.execute("SELECT setval(pg_get_serial_sequence(?, ?), ?)", (table, column, last))

    # --- schema -------------------------------------------------------------------------
    def apply_schema(self, ddl: str, migrations: Sequence[Callable[["Database"], None]] = ()) -> int:
        """Create what ``ddl`` declares (SQLite's DDL, ``CREATE ... IF NOT EXISTS``) and bring a database
        written by an older version up to date, in one transaction; returns the schema version.

        The version is the ``schema_version`` row of the ``meta`` table (name, value: created here). The
        current one is ``len(migrations) + 1``; ``migrations[i]`` takes a database from version ``i + 1`` to
        ``i + 2``, after ``ddl`` created the tables it lacked. A database with tables but no version row
        was written before versions were recorded: version 1 (each step checks what it changes, so such a
        database may be at any version). A newer database than this code knows is refused."""
        current = len(migrations) + 1
        with self.transaction():
            fresh = not self.tables()
            for statement in (_META_DDL + ddl).split(";"):
                if statement.strip():
                    self.ddl(statement)
            row = self.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
            version = current if fresh else int(row[0]) if row else 1
            if version > current:
                raise RuntimeError(f"{self.name}: the {self.what} has schema version {version}, written by a newer "
                                   f"rlfleet; this one knows versions up to {current}")
            for step in range(version, current):
                log.info("migrating the %s", self.what, extra={"database": self.name, "to_version": step + 1})
                migrations[step - 1](self)
            self.execute("INSERT INTO meta (name, value) VALUES ('schema_version', ?) "
                         "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (str(current),))
        return current

    # --- connection -------------------------------------------------------------------
    def reconnect(self) -> None:
        """After a loss: a new connection, owning the database again (DatabaseUnavailable if it cannot)."""
        if self.dialect == "sqlite":
            return
        self._close_quietly()
        self._conn = self._open_postgres(at_start=False)
        self.lost = False
        log.warning("reconnected to the %s", self.what, extra={"database": self.name})

    def close(self) -> None:
        if self.dialect == "sqlite":
            self._conn.close()
        else:
            self._close_quietly()

    def _close_quietly(self) -> None:
        import psycopg

        try:
            self._conn.close()
        except psycopg.Error:
            pass  # already gone: the server dropped it (and its lock)

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """psycopg errors of a failed connection as ``DatabaseUnavailable``; other errors as they are."""
        import psycopg

        if self.lost:
            raise DatabaseUnavailable(f"{self.what} unreachable: {self.name}: the connection was lost (reconnect)")
        try:
            yield
        except psycopg.Error as err:
            if self._conn.broken or self._conn.closed:
                self.lost = True
                raise DatabaseUnavailable(f"{self.what} unreachable: {self.name}: {err}".strip()) from err
            raise

    def _open_sqlite(self) -> sqlite3.Connection:
        path = self._location
        # Autocommit mode: transactions are explicit (BEGIN IMMEDIATE ... COMMIT).
        db = sqlite3.connect(path, isolation_level=None, timeout=self._lock_timeout_seconds)
        try:
            if path != ":memory:":
                # One process owns the file: a second service on the same path would
                # deliver the same rows twice. The lock dies with the process (SIGKILL too).
                db.execute("PRAGMA locking_mode = EXCLUSIVE")
                mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if mode.lower() != "wal":
                    raise RuntimeError(f"{path}: could not enable WAL journaling (got {mode!r})")
                # FULL fsyncs the WAL at every commit, so an acknowledged write survives
                # power loss and OS crashes too; NORMAL survives process crashes (SIGKILL)
                # only, but saves an fsync per commit.
                db.execute(f"PRAGMA synchronous = {self._synchronous}")
                # Keep the WAL from staying at its high-water mark after large batches.
                db.execute("PRAGMA journal_size_limit = 67108864")
            with sqlite_transaction(db):  # takes the (exclusive) lock now, held until the connection closes
                pass
        except sqlite3.OperationalError as exc:
            db.close()
            if "locked" in str(exc):
                raise RuntimeError(f"{path}: the {self.what} is in use by another process "
                                   f"(waited {self._lock_timeout_seconds}s for its lock)") from exc
            raise
        return db

    def _open_postgres(self, at_start: bool) -> Any:
        import psycopg
        from psycopg import sql
        from psycopg.conninfo import conninfo_to_dict

        given = conninfo_to_dict(self._location)
        options = {key: value for key, value in DEFAULT_PARAMETERS.items() if key not in given}
        options.setdefault("application_name", given.get("application_name", f"rlfleet-{self._role}"))
        try:
            conn = psycopg.connect(self._location, autocommit=True, **options)
        except psycopg.OperationalError as err:
            raise DatabaseUnavailable(f"{self.what} unreachable: {self.name}: {err}".strip()) from err
        try:
            if not self._try_lock(conn):
                if at_start:
                    raise RuntimeError(
                        f"{self.name} (schema {self.schema}): the {self.what} is in use by another process (waited "
                        f"{self._lock_timeout_seconds}s for its advisory lock); one instance owns a schema at a time")
                raise DatabaseUnavailable(
                    f"{self.what} {self.name} (schema {self.schema}) is now owned by another instance: it took the "
                    "advisory lock while this one's connection was lost, so this one serves nothing from it")
            if not conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (self.schema,)).fetchone():
                # Only when missing: a role without CREATE on the database may own an existing schema.
                conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema)))
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
            # on: a commit is flushed to the server's WAL before it returns (survives a crash of the
            # machine); off: it survives a crash of this service, not of the server's machine.
            conn.execute(f"SET synchronous_commit = {'on' if self._synchronous == 'FULL' else 'off'}")
        except psycopg.Error as err:
            conn.close()
            raise DatabaseUnavailable(f"{self.what} unreachable: {self.name}: {err}".strip()) from err
        except BaseException:
            conn.close()
            raise
        return conn

    def _try_lock(self, conn: Any) -> bool:
        """Take the session-level advisory lock of the schema, waiting up to the lock timeout."""
        deadline = time.monotonic() + self._lock_timeout_seconds
        key = f"rlfleet:{self.schema}"
        while True:
            if conn.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (key,)).fetchone()[0]:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(LOCK_POLL_SECONDS)


_META_DDL = """
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,                  -- schema_version, and what the service keeps there
    value TEXT NOT NULL
);
"""

_POSTGRES_DDL = (
    (re.compile(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b"), "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"),
    (re.compile(r"/\* rowid \*/"), "rowid BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,"),
    (re.compile(r"\bINTEGER\b"), "BIGINT"),
    (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),
    (re.compile(r"\bBLOB\b"), "BYTEA"),
)
"""SQLite DDL -> PostgreSQL DDL, in order. Integers are 64-bit in SQLite: BIGINT keeps every value."""


def _postgres_ddl(statement: str) -> str:
    for pattern, replacement in _POSTGRES_DDL:
        statement = pattern.sub(replacement, statement)
    return statement


_SQL_CACHE: dict[str, str] = {}


def _postgres_sql(statement: str) -> str:
    """``?`` placeholders as psycopg's ``%s`` (a literal ``%`` doubled). The SQL of this project puts no
    ``?`` inside string literals."""
    translated = _SQL_CACHE.get(statement)
    if translated is None:
        translated = _SQL_CACHE[statement] = statement.replace("%", "%%").replace("?", "%s")
    return translated
