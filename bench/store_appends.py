"""Trajectory store appends per second: PostgreSQL against SQLite.

    .venv/bin/python bench/store_appends.py [--rounds 5] [--appends 200] [--group-size 8] [--database-url URL]

Each round appends the same payloads (one GRPO group of ``--group-size`` trajectories per append, built by
``tests/trajectories.py``, each with its idempotency key as the collector sends them: one transaction each) to
a fresh ``TrajectoryStore`` on each backend, on its thread, without gRPC: a SQLite file in a temporary directory
(synchronous FULL) and a fresh schema of a PostgreSQL database (synchronous_commit on) - the one
``--database-url`` names, or a throwaway server on this machine (``tests/postgres.py``, loopback TCP) when it is
absent. Backends alternate within a round, so a noisy machine shifts both alike. The table shows each round's
rate; the last line is ``RESULT {json}`` with ``postgres_over_sqlite_appends``, the ratio of the medians.
``measure`` is what ``bench/fleet.py`` calls.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: run from anywhere

from rlfleet.services.trajectory.store import TrajectoryStore  # noqa: E402
from tests.trajectories import make_trajectories  # noqa: E402


def appends_per_second(location: str, payloads: list, schema: str = "rlfleet_bench") -> float:
    """Append every payload to a fresh store at ``location``; appends per second."""
    store = TrajectoryStore(location, capacity=sum(p.batch_size[0] for p in payloads), schema=schema)
    try:
        started = time.perf_counter()
        for n, payload in enumerate(payloads):
            store.append(payload, f"bench/{n}")
        return len(payloads) / (time.perf_counter() - started)
    finally:
        store.close()


def measure(database_url: str = "", rounds: int = 5, appends: int = 200, group_size: int = 8) -> dict:
    """Both backends side by side: {"sqlite_appends_per_s": [...], "postgres_appends_per_s": [...], medians,
    "postgres_over_sqlite_appends"}."""
    payloads = [make_trajectories([n] * group_size, first_id=n * group_size) for n in range(appends)]
    server = None
    if not database_url:
        from tests.postgres import PostgresServer

        server = PostgresServer().start()
        database_url = server.create_database("store_appends")
    workdir = Path(tempfile.mkdtemp(prefix="rlfleet-bench-store-"))
    rates: dict[str, list[float]] = {"sqlite": [], "postgres": []}
    try:
        for round_ in range(rounds):
            schema = f"rlfleet_bench_{os.getpid()}_{round_}"
            rates["sqlite"].append(appends_per_second(str(workdir / f"round-{round_}.sqlite3"), payloads))
            rates["postgres"].append(appends_per_second(database_url, payloads, schema))
            _drop_schema(database_url, schema)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if server is not None:
            server.stop()
    sqlite, postgres = statistics.median(rates["sqlite"]), statistics.median(rates["postgres"])
    return {"sqlite_appends_per_s": rates["sqlite"], "postgres_appends_per_s": rates["postgres"],
            "sqlite_median_appends_per_s": sqlite, "postgres_median_appends_per_s": postgres,
            "postgres_over_sqlite_appends": postgres / sqlite, "appends_per_round": appends,
            "trajectories_per_append": group_size, "bytes_per_append": len(payloads[0].SerializeToString())}


def _drop_schema(url: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--appends", type=int, default=200)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--database-url", default="", help="PostgreSQL to measure (default: a throwaway server)")
    ns = parser.parse_args()
    result = measure(ns.database_url, ns.rounds, ns.appends, ns.group_size)
    print(f"{ns.appends} appends of {ns.group_size} trajectories ({result['bytes_per_append']} bytes) per round")
    print(f"{'round':>5}  {'sqlite appends/s':>16}  {'postgres appends/s':>18}")
    for n, (sqlite, postgres) in enumerate(zip(result["sqlite_appends_per_s"], result["postgres_appends_per_s"])):
        print(f"{n:>5}  {sqlite:>16.0f}  {postgres:>18.0f}")
    medians = result["sqlite_median_appends_per_s"], result["postgres_median_appends_per_s"]
    print(f"{'median':>5}  {medians[0]:>16.0f}  {medians[1]:>18.0f}")
    print(f"postgres / sqlite: {result['postgres_over_sqlite_appends']:.2f}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
