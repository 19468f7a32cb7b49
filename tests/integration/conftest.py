"""Fixtures that start real service processes and track their own PIDs, and the fuzz modules' log."""

from __future__ import annotations

import grpc
import pytest

from rlfleet.services.launch import ServiceProcess
from tests import echo_service
from tests.integration.fuzzing import FuzzLog

# Services only the tests run, outside the installed package: name -> the module python -m runs.
TEST_SERVICES = {"echo": echo_service.MODULE}


@pytest.fixture
def start_service(tmp_path):
    """Start ``python -m rlfleet.services.<name>`` (a name of ``TEST_SERVICES``: its module); every
    process is stopped at teardown."""
    started: list[ServiceProcess] = []

    def start(name: str, *args: str, env: dict[str, str] | None = None) -> ServiceProcess:
        proc = ServiceProcess(name, list(args), env=env or {}, module=TEST_SERVICES.get(name))
        proc.start(tmp_path / f"{name}-{len(started)}")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture(scope="module")
def fuzz_log(request, tmp_path_factory):
    """The fuzz outcomes of one module: printed at its end and written to ``fuzz-summary.json``."""
    log = FuzzLog()
    yield log
    table = log.write(tmp_path_factory.mktemp("fuzz") / "fuzz-summary.json")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown by a plain `pytest -q` run, passing or not
        print("\n" + table)


@pytest.fixture(scope="module")
def channel(suite):
    """A plaintext channel to the collector of the module's ``suite`` fixture."""
    with grpc.insecure_channel(suite["collector"].address) as channel:
        yield channel
