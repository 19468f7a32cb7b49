"""The sample log: what the policy sampled, kept for people to look at (the rollout viewer).

The buffer forgets a trajectory once a trainer acks it; the sample log keeps a copy of the first
``groups_per_version`` groups appended with each policy version (delivered or filtered), the newest
``max_groups`` groups in all, with a summary row per trajectory to filter on (version, score,
filtered). Per version it also counts everything appended — groups, trajectories, filtered groups,
score, KL, response length and staleness sums — for every version ever appended, so the charts
cover the whole run while the copies stay bounded.

Everything is written in the Append's own transaction (``record`` is called inside it), so the log
and its counts agree with the buffer across crashes and retried appends: a group skipped as a
duplicate is not recorded again. Reading never touches the buffer. Nothing here knows about gRPC.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from rlfleet.services.common.database import Database
from rlfleet.services.common.errors import InvalidArgument, NotFound
from rlfleet.v1 import tensor_pb2
from rlfleet.wire.rows import split_tensordict
from rlfleet.wire.tensor import numpy_view
from rlfleet.wire.tensordict import entry_at

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS sample_groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    data BLOB NOT NULL                      -- the group's rows, one serialized rlfleet.v1.TensorDict
);
CREATE TABLE IF NOT EXISTS samples (
    cursor INTEGER PRIMARY KEY AUTOINCREMENT,
    sample_group INTEGER NOT NULL,          -- its group's seq in sample_groups
    row INTEGER NOT NULL,                   -- its row in that group's payload
    trajectory_id TEXT NOT NULL,
    prompt_id TEXT NOT NULL,
    group_id INTEGER NOT NULL,
    sample_index INTEGER NOT NULL,
    version_start INTEGER NOT NULL,
    version_end INTEGER NOT NULL,
    score REAL,                             -- NULL: absent (or NaN)
    advantage REAL,
    kl_mean REAL,
    response_tokens INTEGER NOT NULL,
    turns INTEGER NOT NULL,
    filtered INTEGER NOT NULL,
    staleness INTEGER NOT NULL,             -- -1: not recorded
    appended_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_by_group ON samples (sample_group);
CREATE TABLE IF NOT EXISTS version_stats (
    version INTEGER PRIMARY KEY,
    groups INTEGER NOT NULL,
    trajectories INTEGER NOT NULL,
    filtered_groups INTEGER NOT NULL,
    logged_groups INTEGER NOT NULL,         -- groups of this version copied into sample_groups, ever
    score_sum REAL NOT NULL, score_count INTEGER NOT NULL,
    kl_sum REAL NOT NULL, kl_count INTEGER NOT NULL,
    tokens_sum INTEGER NOT NULL,
    staleness_sum INTEGER NOT NULL, staleness_count INTEGER NOT NULL, staleness_max INTEGER NOT NULL
);
"""

MAX_VERSIONS_PER_CALL = 10_000
MAX_SAMPLES_PER_CALL = 1_000


@dataclass(frozen=True)
class VersionStats:
    version: int
    groups: int
    trajectories: int
    filtered_groups: int
    mean_score: float
    mean_kl: float
    mean_response_tokens: float
    mean_staleness: float
    max_staleness: int


@dataclass(frozen=True)
class Summary:
    """One trajectory of the log, without its tensors (``SampleSummary`` on the wire)."""

    cursor: int
    trajectory_id: str
    prompt_id: str
    group_id: int
    sample_index: int
    policy_version_start: int
    policy_version_end: int
    score: float
    advantage: float
    kl_mean: float
    response_tokens: int
    turns: int
    filtered: bool
    staleness: int
    appended_at: float


@dataclass(frozen=True)
class NewGroup:
    """A group the Append stores now (not a duplicate): its rows in the request and its payload."""

    rows: Sequence[int]
    filtered: bool
    payload: bytes


@dataclass(frozen=True)
class Page:
    samples: list[Summary]
    next_cursor: int
    logged: int
    matching: int = 0
    """Trajectories the filters match, every page (``before_cursor`` aside)."""


class SampleLog:
    """The sample log of one store's database (the store's connection and thread)."""

    def __init__(self, db: Database, *, groups_per_version: int, max_groups: int,
                 clock: Callable[[], float]):
        self._db = db
        self._groups_per_version = groups_per_version
        self._max_groups = max_groups
        self._clock = clock

    def record(self, msg: tensor_pb2.TensorDict, groups: Sequence[NewGroup], committed_version: int | None) -> None:
        """Count ``groups`` (the new groups of the Append ``msg``) per version and copy the ones their
        version still has room for; call inside the Append's transaction."""
        if not groups:
            return
        columns = _columns(msg)
        now = self._clock()
        placed = [(group, rows, int(columns["version_start"][rows].min())) for group, rows in
                  ((group, list(group.rows)) for group in groups)]
        by_version: dict[int, list[tuple[NewGroup, list[int]]]] = {}
        for group, rows, version in placed:
            by_version.setdefault(version, []).append((group, rows))
        staleness = {version: max(committed_version - version, 0) if committed_version is not None else -1
                     for version in by_version}
        # One upsert per version, not per group; copies then in the Append's order, while there is room.
        room = {version: self._groups_per_version - self._count(version, members, columns, staleness[version])
                for version, members in by_version.items()}
        copied = False
        for group, rows, version in placed:
            if room[version] > 0:
                room[version] -= 1
                self._copy(group, version, rows, columns, staleness[version], now)
                copied = True
        if copied and self._max_groups > 0:
            oldest_kept = "(SELECT max(seq) FROM sample_groups) - ?"
            self._db.execute(f"DELETE FROM samples WHERE sample_group <= {oldest_kept}", (self._max_groups,))
            self._db.execute(f"DELETE FROM sample_groups WHERE seq <= {oldest_kept}", (self._max_groups,))

    def _count(self, version: int, members: list[tuple[NewGroup, list[int]]], columns: dict, staleness: int) -> int:
        """Add the groups ``members`` (of ``version``: each with its rows) to the version's counts; return
        how many groups of the version were logged before."""
        rows = [row for _, group_rows in members for row in group_rows]
        scores = _finite(columns["score"][rows])
        kls = _finite(columns["kl_mean"][rows])
        known, groups = staleness >= 0, len(members)
        return self._db.execute(
            "INSERT INTO version_stats AS v VALUES (?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (version) DO UPDATE SET groups = v.groups + excluded.groups, "
            "trajectories = v.trajectories + excluded.trajectories, "
            "filtered_groups = v.filtered_groups + excluded.filtered_groups, "
            "score_sum = v.score_sum + excluded.score_sum, score_count = v.score_count + excluded.score_count, "
            "kl_sum = v.kl_sum + excluded.kl_sum, kl_count = v.kl_count + excluded.kl_count, "
            "tokens_sum = v.tokens_sum + excluded.tokens_sum, "
            "staleness_sum = v.staleness_sum + excluded.staleness_sum, "
            "staleness_count = v.staleness_count + excluded.staleness_count, "
            "staleness_max = CASE WHEN excluded.staleness_max > v.staleness_max THEN excluded.staleness_max "
            "ELSE v.staleness_max END RETURNING logged_groups",
            (version, groups, len(rows), sum(group.filtered for group, _ in members), float(scores.sum()), len(scores),
             float(kls.sum()), len(kls), int(columns["response_tokens"][rows].sum()),
             staleness * groups if known else 0, groups * int(known), staleness if known else -1)).fetchone()[0]

    def _copy(self, group: NewGroup, version: int, rows: list[int], columns: dict, staleness: int,
              now: float) -> None:
        seq = self._db.execute("INSERT INTO sample_groups (data) VALUES (?) RETURNING seq",
                               (group.payload,)).fetchone()[0]
        self._db.executemany(
            "INSERT INTO samples (sample_group, row, trajectory_id, prompt_id, group_id, sample_index, version_start, "
            "version_end, score, advantage, kl_mean, response_tokens, turns, filtered, staleness, appended_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [(seq, position, columns["trajectory_id"][row], columns["prompt_id"][row], int(columns["group_id"][row]),
              int(columns["sample_index"][row]) if columns["has_sample_index"] else position,
              int(columns["version_start"][row]), int(columns["version_end"][row]),
              _real(columns["score"][row]), _real(columns["advantage"][row]), _real(columns["kl_mean"][row]),
              int(columns["response_tokens"][row]), int(columns["turns"][row]), int(group.filtered), staleness, now)
             for position, row in enumerate(rows)])
        self._db.execute("UPDATE version_stats SET logged_groups = logged_groups + 1 WHERE version = ?", (version,))

    def version_stats(self, min_version: int = 0, limit: int = 0) -> list[VersionStats]:
        if limit < 0 or limit > MAX_VERSIONS_PER_CALL:
            raise InvalidArgument(f"limit: {limit} is not in [0, {MAX_VERSIONS_PER_CALL}] (0 means 1000)")
        rows = self._db.execute(
            "SELECT version, groups, trajectories, filtered_groups, score_sum, score_count, kl_sum, kl_count, "
            "tokens_sum, staleness_sum, staleness_count, staleness_max FROM version_stats WHERE version >= ? "
            "ORDER BY version LIMIT ?", (min_version, limit or 1000)).fetchall()
        return [VersionStats(version, groups, trajectories, filtered, _mean(score_sum, score_count),
                             _mean(kl_sum, kl_count), _mean(tokens, trajectories),
                             _mean(staleness_sum, staleness_count), staleness_max)
                for (version, groups, trajectories, filtered, score_sum, score_count, kl_sum, kl_count, tokens,
                     staleness_sum, staleness_count, staleness_max) in rows]

    def list(self, *, min_version: int = 0, max_version: int | None = None, min_score: float | None = None,
             max_score: float | None = None, filtered: bool | None = None, limit: int = 0,
             before_cursor: int = 0) -> Page:
        if limit < 0 or limit > MAX_SAMPLES_PER_CALL:
            raise InvalidArgument(f"limit: {limit} is not in [0, {MAX_SAMPLES_PER_CALL}] (0 means 100)")
        for name, value in (("min_score", min_score), ("max_score", max_score)):
            if value is not None and math.isnan(value):
                raise InvalidArgument(f"{name}: NaN bounds nothing (leave it unset)")
        where, args = ["version_start >= ?"], [min_version]
        for clause, value in (("version_start <= ?", max_version), ("score >= ?", min_score),
                              ("score <= ?", max_score), ("filtered = ?", None if filtered is None else int(filtered))):
            if value is not None:
                where.append(clause)
                args.append(value)
        matching = self._db.execute(f"SELECT count(*) FROM samples WHERE {' AND '.join(where)}", args).fetchone()[0]
        if before_cursor:
            where.append("cursor < ?")
            args.append(before_cursor)
        count = limit or 100
        found = self._db.execute(f"SELECT {_SUMMARY_COLUMNS} FROM samples WHERE {' AND '.join(where)} "
                                 "ORDER BY cursor DESC LIMIT ?", (*args, count + 1)).fetchall()
        samples = [_summary(row) for row in found[:count]]
        logged = self._db.execute("SELECT count(*) FROM samples").fetchone()[0]
        return Page(samples, samples[-1].cursor if len(found) > count else 0, logged, matching)

    def get(self, cursor: int) -> tuple[Summary, tensor_pb2.TensorDict]:
        found = self._db.execute(f"SELECT {_SUMMARY_COLUMNS}, sample_group, row FROM samples WHERE cursor = ?",
                                 (cursor,)).fetchone()
        if found is None:
            raise NotFound(f"cursor: no trajectory {cursor} in the sample log (it keeps the newest groups only)")
        summary = _summary(found[:-2])
        payload = self._db.execute("SELECT data FROM sample_groups WHERE seq = ?", (found[-2],)).fetchone()[0]
        group = tensor_pb2.TensorDict.FromString(payload)
        return summary, split_tensordict(group, [1] * group.batch_size[0])[found[-1]]


_SUMMARY_COLUMNS = ("cursor, trajectory_id, prompt_id, group_id, sample_index, version_start, version_end, score, "
                    "advantage, kl_mean, response_tokens, turns, filtered, staleness, appended_at")


def _summary(row) -> Summary:
    (cursor, trajectory_id, prompt_id, group_id, sample_index, start, end, score, advantage, kl_mean, tokens, turns,
     filtered, staleness, appended_at) = row
    return Summary(cursor, trajectory_id, prompt_id, group_id, sample_index, start, end, _nan(score),
                   _nan(advantage), _nan(kl_mean), tokens, turns, bool(filtered), staleness, appended_at)


def _columns(msg: tensor_pb2.TensorDict) -> dict:
    """The per-row values the log keeps, read straight from the Append's message (no TensorDict built)."""
    size = msg.batch_size[0]
    versions = _numbers(msg, "policy_version_start", size, np.int64)
    return {
        "group_id": _numbers(msg, "group_id", size, np.int64),
        "version_start": versions,
        "version_end": _numbers(msg, "policy_version_end", size, np.int64, default=versions),
        "has_sample_index": entry_at(msg, "sample_index") is not None,
        "sample_index": _numbers(msg, "sample_index", size, np.int64, default=np.arange(size)),
        "score": _numbers(msg, "score", size, np.float64),
        "advantage": _numbers(msg, "advantage", size, np.float64),
        "kl_mean": _numbers(msg, "kl_mean", size, np.float64),
        "response_tokens": _lengths(msg, "tokens/response", size),
        "turns": np.maximum(_lengths(msg, "turns/policy_versions", size), 1),
        "trajectory_id": _strings(msg, "trajectory_id", size),
        "prompt_id": _strings(msg, "prompt_id", size),
    }


def _numbers(msg, key: str, size: int, dtype, default=None) -> np.ndarray:
    """The first value of each row of the tensor at ``key``; NaN (or ``default``) where there is none."""
    entry = entry_at(msg, key)
    values = numpy_view(entry.tensor) if entry is not None and entry.WhichOneof("kind") == "tensor" else None
    if values is None or values.size < size or size == 0:
        return default if default is not None else np.full(size, np.nan, dtype=dtype)
    return values.reshape(size, -1)[:, 0].astype(dtype)


def _lengths(msg, key: str, size: int) -> np.ndarray:
    entry = entry_at(msg, key)
    if entry is None or entry.WhichOneof("kind") != "ragged":
        return np.zeros(size, dtype=np.int64)
    return np.asarray(entry.ragged.lengths, dtype=np.int64)


def _strings(msg, key: str, size: int) -> list[str]:
    entry = entry_at(msg, key)
    if entry is None or entry.WhichOneof("kind") != "strings":
        return [""] * size
    return list(entry.strings.values)


def _finite(values: np.ndarray) -> np.ndarray:
    return values[np.isfinite(values)]


def _real(value) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _nan(value) -> float:
    return math.nan if value is None else float(value)


def _mean(total, count) -> float:
    return total / count if count else math.nan
