"""The Grafana dashboard's queries, as the dashboard tests read them (the unit test of its metric names,
the integration test that evaluates them in a real Prometheus)."""

from __future__ import annotations

import re
import time
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "rlfleet.json"


def panels(items: list[dict]):
    """Every panel of ``items``, those in collapsed rows included."""
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))  # a collapsed row holds its panels


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable's ``label_values``/query."""
    found = [(f"panel {panel.get('id')} {panel.get('title')!r}", target["expr"])
             for panel in panels(dashboard.get("panels", []))
             for target in panel.get("targets", []) if target.get("expr")]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        selector = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query)
        found.append((f"variable {variable.get('name')!r}", selector.group(1) if selector else query))
    return found


def as_grafana_runs_it(expr: str, rate_interval: str) -> str:
    """``expr`` with the dashboard's variables as Grafana fills them with every job and instance
    selected ("All": ``.*``) and ``$__rate_interval`` as ``rate_interval``."""
    expr = re.sub(r"\$(?:\{job\}|job\b)|\$(?:\{instance\}|instance\b)", ".*", expr)
    return re.sub(r"\$(?:\{__rate_interval\}|__rate_interval\b)", rate_interval, expr)


EVENT_PANELS = ("Trajectory buffer full", "RPC errors per second by code", "RPC error ratio by method",
                "Tool call error fraction", "Train/inference mismatch")
"""Panels of what a healthy run may never have (a full buffer, failed RPCs, failed tool calls) or a
trainer may never report (its measured mismatch: the demo's on-policy trainer has no lag to report): no
series until one happens. The integration test provokes each; scripts/compose-smoke lets them be empty."""


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.dashboard PROMETHEUS_URL``: every dashboard query evaluated there, a line each;
    exit 1 if one returns no series, those of ``EVENT_PANELS`` aside (scripts/compose-smoke)."""
    import argparse
    import json
    import urllib.parse

    from rlfleet.services.prometheus import Prometheus

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("url")
    parser.add_argument("--rate-interval", default="5m")
    parser.add_argument("--wait-seconds", type=float, default=0.0,
                        help="ask again this long for queries without series: a rate() needs two scrapes of a "
                             "series, and one that first appeared just now (the last step's tool calls) has one")
    ns = parser.parse_args(argv)
    address = urllib.parse.urlsplit(ns.url)
    prometheus = Prometheus(Path("."), address.port or 9090)
    asked = queries(json.loads(DASHBOARD.read_text()))
    events = [any(f"'{title}" in where for title in EVENT_PANELS) for where, _ in asked]
    results: dict[int, list] = {}
    deadline = time.monotonic() + ns.wait_seconds
    while True:
        for index, (_, expr) in enumerate(asked):
            if not results.get(index):
                results[index] = prometheus.query(as_grafana_runs_it(expr, ns.rate_interval))
        missing = sum(not results[i] and not event for i, event in enumerate(events))
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    for index, ((where, expr), event) in enumerate(zip(asked, events)):
        result = results[index]
        verdict = f"{len(result)} series" if result else ("no series (no such event)" if event else "NO SERIES")
        print(f"[dashboard] {verdict:<26} {where}: {expr[:100]}")
    print(f"[dashboard] {missing} queries without series (events aside)")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
