"""SQLite in autocommit mode with explicit transactions, as the collector's ledger and the
trajectory store use it."""

from __future__ import annotations

import sqlite3
from contextlib import contextmanager
from typing import Iterable, Iterator, Sequence, TypeVar

T = TypeVar("T")
SQL_CHUNK = 500
"""Bound on "?" placeholders per statement."""


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` (the write lock now, not at the first write) ... ``COMMIT``, or ``ROLLBACK``
    on any exception (re-raised). ``db`` must be in autocommit mode (``isolation_level=None``)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def chunks(items: Sequence[T]) -> Iterable[Sequence[T]]:
    """``items`` in slices of at most ``SQL_CHUNK``: one ``IN (?, ...)`` statement each."""
    for start in range(0, len(items), SQL_CHUNK):
        yield items[start:start + SQL_CHUNK]
