"""Session-wide fixtures shared by unit and integration tests, and how the test command's parallel
workers (pytest-xdist, ``--dist loadgroup``: scripts/test) share out the modules."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

# Before anything imports grpc. grpcio's fork support (on by default) runs gRPC's atfork handlers in a
# child forked with a ``preexec_fn`` (not vforked) while other threads are inside gRPC, and such a child
# can die before it execs (tests/unit/test_fork_while_grpc_is_busy.py). Ray starts its GCS server and
# raylets so: test_torchrl's ``ray.init`` once waited 30 s for a GCS server that had died before exec.
# The test processes never use gRPC in a forked child; the services they start inherit the setting (the
# environment service sets it itself).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

if "PYTEST_XDIST_WORKER" in os.environ and "RLFLEET_SHM_DIR" not in os.environ:
    # Each parallel worker its own shm directory, inherited by the services it starts (as two hosts have
    # two): tests count the weight segments a push leaves, which another worker's pushes must not add to.
    WORKER_SHM_DIR = Path("/dev/shm") / f"rlfleet-tests-{os.environ['PYTEST_XDIST_WORKER']}-{os.getpid()}"
    WORKER_SHM_DIR.mkdir()
    os.environ["RLFLEET_SHM_DIR"] = str(WORKER_SHM_DIR)
else:
    WORKER_SHM_DIR = None

from rlfleet.services.models.tiny import build_tiny_model  # noqa: E402 - after RLFLEET_SHM_DIR is set
from tests.postgres import PostgresServer  # noqa: E402

SHARED_WORKER = {
    "ray": ("tests/integration/test_ray_guide.py", "tests/integration/test_ray.py", "tests/integration/test_torchrl.py"),
    "secure": ("tests/integration/test_secure_suite.py", "tests/integration/test_secure_viewer.py"),
    "sandbox": tuple(f"tests/integration/test_{name}.py" for name in (
        "demo", "environment_service", "episode_sandbox", "episodes", "fuzz", "openenv_adapter", "sandbox",
        "sandbox_in_a_container", "tool_env", "verifiers_adapter")),
}
"""Modules that run one after another on one worker: those that start a Ray cluster (one at a time: each
cluster counts the host's cores as its own); those sharing the ``secure_suite`` fixture; and those whose
sandboxes run processes as uid 65534, because the sandbox tests count every such process on the host, and
RLIMIT_NPROC counts them all against one sandbox's bound."""
LONGEST_FIRST = ("ray", "sandbox", "tests/integration/test_runs.py",
                 "tests/integration/test_docs_site.py", "tests/integration/test_collector.py",
                 "tests/integration/test_chaos.py", "tests/integration/test_weight_sync.py")
"""The groups that take minutes (durations of the last clean-clone run), handed out first so that no
worker starts one while the other is finishing: the rest follow in collection order."""


def worker_group(path: str) -> str:
    """The unit of work a parallel worker takes whole: a module (its module-scoped suite starts once), or
    the group of ``SHARED_WORKER`` it belongs to."""
    return next((group for group, modules in SHARED_WORKER.items() if path in modules), path)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """The groups of ``LONGEST_FIRST`` first, each group's tests together, in collection order otherwise."""
    groups = {}
    for item in items:
        groups.setdefault(worker_group(item.nodeid.split("::")[0]), []).append(item)
    first = [group for group in LONGEST_FIRST if group in groups]
    items[:] = [item for group in [*first, *(g for g in groups if g not in first)] for item in groups[group]]


LEFTOVERS_IGNORED = ("pytest-of-*", "ray", "torchinductor_*", ".lark_cache_*", "uv-*.lock")
"""Not leftovers: pytest's own directory, Ray's session logs, torch's compile cache, lark's cache of a parsed
grammar and uv's lock of its environments cache (the verifiers tests' chat programs run under uv): caches
their tools keep on purpose, found again by the next run. A clean clone on a fresh machine showed the last two."""
LEFTOVER_WAIT_SECONDS = 60.0
"""How long the check waits for a leftover to go (a Ray reaper cleans up after its actor's exit)."""


def _entries() -> set[Path]:
    from tests.leftovers import host_entries

    return host_entries(LEFTOVERS_IGNORED + tuple(filter(None, os.environ.get("RLFLEET_LEFTOVERS_IGNORE", "").split(","))))


CHECK_LEFTOVERS = os.environ.get("RLFLEET_CHECK_LEFTOVERS") == "1" and "PYTEST_XDIST_WORKER" not in os.environ
"""With ``RLFLEET_CHECK_LEFTOVERS=1`` (``scripts/test``'s default) the run checks that it left nothing in /tmp or /dev/shm: every service
a test starts, stopped or SIGKILLed, takes its files along. In the controlling process, once every worker
is done; names in ``RLFLEET_LEFTOVERS_IGNORE`` (comma-separated patterns) are the host's own."""
ENTRIES_BEFORE = _entries() if CHECK_LEFTOVERS else set()


def pytest_sessionfinish(session, exitstatus):
    if WORKER_SHM_DIR is not None:
        shutil.rmtree(WORKER_SHM_DIR, ignore_errors=True)
    if CHECK_LEFTOVERS:
        deadline = time.monotonic() + LEFTOVER_WAIT_SECONDS
        while (left := _entries() - ENTRIES_BEFORE) and time.monotonic() < deadline:
            time.sleep(1.0)
        if left:
            names = sorted(str(path) for path in left)
            session.config.get_terminal_writer().line(
                f"LEFTOVERS: the run left {len(names)} new entries in /tmp and /dev/shm: "
                + " ".join(names[:50]), red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)  # defined by xdist: without it (-p no:xdist), nothing to schedule
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: each worker takes a whole ``worker_group`` at a time, in collection order.
    (xdist's own loadgroup reads ``xdist_group`` marks through a node id it rewrites, which pytest 9.2's
    node ids no longer allow.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkerGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid.split("::")[0])

    return ByWorkerGroup(config, log)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The deterministic tiny Qwen2 model + tokenizer, built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    """The tiny model's tokenizer (Hugging Face), loaded once per session."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))



@pytest.fixture(scope="session")
def postgres():
    """One PostgreSQL server for the session (``tests/postgres.py``): each test takes a fresh database
    with ``postgres.create_database()``. Fails, naming scripts/bootstrap, where the binaries are missing."""
    server = PostgresServer().start()
    yield server
    server.stop()
