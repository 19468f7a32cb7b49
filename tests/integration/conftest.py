"""Fixtures that start real service processes and track their own PIDs, the suite that several
modules share, and the fuzz modules' log."""

from __future__ import annotations

from typing import Callable

import grpc
import pytest

from rlfleet.services.launch import ServiceProcess
from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite
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


SECURE_SUITE_COLLECTOR_ARGS = ["--group-size", "2", "--groups-per-step", "2", "--mode", "sync",
                               "--dynamic-sampling", "true", "--sampling", '{"temperature": 1.0, "max_tokens": 12}']
"""Sync mode (every group read at its own version) with dynamic sampling (groups of constant scores
filtered): what the rollout viewer's test needs to show; the security tests only need some run."""

_LAST_USERS: dict[str, pytest.Item] = {}
"""Session fixture shared by some modules -> the last test using it (it is stopped after that test)."""
_STOPS: dict[str, Callable[[], None]] = {}


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        for name in ("secure_suite",):
            if name in getattr(item, "fixturenames", ()):
                _LAST_USERS[name] = item


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop a shared suite once its last test ran, not at the end of the session: the modules between
    and after its users run without its processes."""
    for name, last in _LAST_USERS.items():
        if item is last and name in _STOPS:
            _STOPS.pop(name)()


@pytest.fixture(scope="session")
def secure_suite(tiny_model_dir, tmp_path_factory):
    """The whole suite with TLS, client certificates (mTLS) and role tokens everywhere, as real
    processes: ``(processes, credentials directory)``. Shared by the security tests
    (test_secure_suite.py) and the rollout viewer's (test_secure_viewer.py, which runs next): one
    start of the suite for both."""
    workdir = tmp_path_factory.mktemp("secure-suite")
    procs = start_suite(SuiteOptions(model_dir=tiny_model_dir, secure=True, environments={},
                                     collector_args=SECURE_SUITE_COLLECTOR_ARGS), workdir)
    stopped = False

    def stop() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            stop_suite(procs)

    _STOPS["secure_suite"] = stop
    yield procs, workdir / "credentials"
    _STOPS.pop("secure_suite", None)
    stop()


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
