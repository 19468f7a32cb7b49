"""Fixtures that start real service processes and track their own PIDs."""

from __future__ import annotations

import pytest

from rlfleet.services.launch import ServiceProcess


@pytest.fixture
def start_service(tmp_path):
    """Start ``python -m rlfleet.services.<name>``; every process is stopped at teardown."""
    started: list[ServiceProcess] = []

    def start(name: str, *args: str, env: dict[str, str] | None = None) -> ServiceProcess:
        proc = ServiceProcess(name, list(args), env=env or {})
        proc.start(tmp_path / f"{name}-{len(started)}")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
