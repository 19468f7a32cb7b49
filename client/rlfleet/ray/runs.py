"""Which run a fleet's stateful services start in: a fresh one, or the one their durable state holds.

The collector and the trajectory store keep durable state (a state directory and a SQLite file under the
fleet's ``workdir``, or PostgreSQL), the reward service its KL controller's (``kl_state_path``, if set);
the others start empty (docs/concepts/runs.md). A plain ``up`` resumes that state: the collector's run
goes on at its committed version. ``Fleet.up(config, fresh=True)`` (``rlfleet-ray up --fresh``) starts a
new run: it leaves a marker in the registry for each stateful instance, the instance's actor passes
``--fresh true`` (the service's ``fresh`` setting: delete my state, then open it) to the first process it
starts while the marker is there, and takes the marker away once that process serves. Every later start finds no marker and resumes: the actor's own restart of the process, and Ray's
restart of the actor after a node loss, must never throw a run away. A fresh process that dies before it
serves leaves the marker for its successor (nothing of the new run can exist before it serves).
"""

from __future__ import annotations

from typing import Any

from rlfleet.ray.config import service_of

STATEFUL = ("collector", "trajectory", "reward")
"""The services with durable state, and a ``fresh`` setting."""
STATE_SETTINGS = {"collector": "state_dir", "trajectory": "db_path", "reward": "kl_state_path"}
"""Where each keeps its state without a ``database_url``."""


def request_fresh(registry, keys: list[str]) -> list[str]:
    """Mark ``keys``' stateful instances for a fresh start; the keys marked."""
    marked = [key for key in keys if service_of(key) in STATEFUL]
    for key in marked:
        registry.put("fresh", key, "requested")
    return marked


def start_args(registry, key: str) -> list[str]:
    """``["--fresh", "true"]`` while ``key`` is marked for a fresh start, else nothing (it resumes)."""
    return ["--fresh", "true"] if service_of(key) in STATEFUL and registry.get("fresh", key) else []


def started(registry, key: str) -> None:
    """``key``'s process serves: a fresh start, if it was one, is done."""
    if service_of(key) in STATEFUL:
        registry.delete("fresh", key)


def state_location(service: str, settings: dict[str, Any]) -> str:
    """Where ``service`` keeps its durable state, in words."""
    if settings.get("database_url"):
        return f"PostgreSQL schema {settings.get('database_schema', f'rlfleet_{service}')}"
    name = STATE_SETTINGS[service]
    if settings.get(name):
        return f"{name} {settings[name]}"
    if service == "reward":
        return "none (kl_state_path unset: the KL coefficient lives in memory)"
    return f"{name} (its default, relative to the actor's working directory: set it)"


def describe_start(services: dict[str, dict[str, Any]], fresh: bool) -> str:
    """What ``up`` says before it starts: a new run, or which state it resumes (``services``: each instance's
    settings by key, ``collector-exp-a`` for a run of a shared fleet)."""
    if fresh:
        return ("starting a fresh run: the durable state of the collector, the trajectory store and the reward "
                "service is deleted first")
    where = "; ".join(f"{key}: {state_location(service_of(key), settings)}" for key, settings in services.items()
                      if service_of(key) in STATEFUL)
    return f"resuming the durable state in it ({where}); `up --fresh` starts a new run instead"
