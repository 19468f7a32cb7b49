"""A throwaway PostgreSQL server for tests and benchmarks: one per session, a fresh database per test.

It runs the machine's PostgreSQL binaries (Debian's ``postgresql`` package: ``scripts/bootstrap``
installs it) as an unprivileged user, since initdb and postgres refuse root: the cluster lives in a
directory of its own outside pytest's mode-700 tmp dirs, owned by that user. It listens on 127.0.0.1
(trust authentication: nothing else can reach it) at a free port; ``fsync`` stays on, as in
production, so a test that kills the server sees what a crash leaves.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from rlfleet.services.launch import free_port
from tests.leftovers import alive, process_tree
from tests.waiting import wait_for

START_TIMEOUT = 120.0
"""initdb plus a start (with crash recovery after a kill): seconds, minutes on a loaded CI machine."""
USER = "postgres"
"""The server runs as the user Debian's postgresql package creates (postgres refuses root). Not
``nobody``: uid 65534 is the python tool's sandbox user, and the sandbox tests check that no process of
that uid outlives them."""


def find_binaries() -> Path:
    """The directory of initdb and postgres, newest version first; AssertionError naming the fix if none."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name)
                   if Path(p).parent.parent.name.isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    if shutil.which("pg_config"):
        bindir = Path(subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True).stdout.strip())
        if (bindir / "initdb").exists():
            return bindir
    raise AssertionError("PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin/initdb, pg_config "
                         "--bindir): run scripts/bootstrap, which installs Debian's postgresql package")


class PostgresServer:
    """``start()`` (initdb the first time), ``create_database() -> url``, ``terminate(database)`` (cut the
    connections to it), ``kill()`` (SIGKILL, as a crash), ``stop()`` (and delete the cluster)."""

    def __init__(self):
        self.bindir = find_binaries()
        self.port = 0
        self.root: Path | None = None
        self.process: subprocess.Popen | None = None
        self._names = itertools.count()

    @property
    def admin_url(self) -> str:
        return self.url("postgres")

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> "PostgresServer":
        if self.root is None:
            self._initdb()
        self.port = self.port or free_port()
        log = open(self.root / "server.log", "ab")
        self.process = subprocess.Popen(
            self._as_user(str(self.bindir / "postgres"), "-D", str(self.root / "data"), "-p", str(self.port),
                          "-k", str(self.root), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=on",
                          "-c", "max_connections=200", "-c", "shared_buffers=32MB",
                          # its dynamic shared memory in the data directory (pg_dynshmem), not /dev/shm:
                          # a server the tests SIGKILL leaves none of it on the host
                          "-c", "dynamic_shared_memory_type=mmap"),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # its own group: kill() ends it whole
        log.close()
        wait_for(self._accepting, START_TIMEOUT, f"PostgreSQL to accept connections (log: {self.root}/server.log)")
        return self

    def create_database(self, name: str | None = None) -> str:
        """A new, empty database; returns its URL."""
        name = name or f"test_{os.getpid()}_{next(self._names)}"
        self.sql(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def sql(self, statement: str, params: tuple = (), database: str = "postgres") -> list[tuple]:
        """Run one statement as the superuser; its rows (empty if none)."""
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True, connect_timeout=10) as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

    def terminate(self, database: str) -> int:
        """Cut every connection to ``database`` (``pg_terminate_backend``); returns how many."""
        return len(self.sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                            "AND pid <> pg_backend_pid()", (database,)))

    def kill(self) -> None:
        """SIGKILL the server and every process of it at once, as a crash of its machine; ``start()`` brings it
        back (recovery). Every child of the postmaster (each backend, the checkpointer, ...) is a process
        group of its own (PostgreSQL's ``InitPostmasterChild`` calls setsid), so a kill of the postmaster's
        group alone left them running: a backend that had not yet noticed its postmaster's death went on
        answering its connection (a crash test saw a call succeed after the "crash")."""
        if self.process is not None and self.process.poll() is None:
            postmaster = self.process.pid
            os.kill(postmaster, signal.SIGSTOP)  # it forks no child while they are found
            processes = process_tree(postmaster)
            for pid in processes:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it just exited
            self.process.wait(START_TIMEOUT)
            # Until every one is gone, a new server refuses the data directory (its shared memory is in use).
            wait_for(lambda: not any(alive(pid) for pid in processes), START_TIMEOUT, "the killed server's processes")
        self.process = None

    def stop(self) -> None:
        """Immediate shutdown (SIGKILL after a timeout), then delete the cluster."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # immediate: no checkpoint for a cluster about to be deleted
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def _initdb(self) -> None:
        try:
            user = pwd.getpwnam(USER)
        except KeyError:
            raise AssertionError(f"no {USER!r} user to run PostgreSQL as: run scripts/bootstrap, which installs "
                                 "Debian's postgresql package (it creates the user)") from None
        self.root = Path(tempfile.mkdtemp(prefix="rlfleet-pg-"))
        os.chown(self.root, user.pw_uid, user.pw_gid)
        os.chmod(self.root, 0o700)
        subprocess.run(self._as_user(str(self.bindir / "initdb"), "-D", str(self.root / "data"), "-U", "postgres",
                                     "-A", "trust", "-E", "UTF8", "--locale=C", "--no-instructions"),
                       check=True, capture_output=True, timeout=START_TIMEOUT)

    def _as_user(self, *command: str) -> list[str]:
        if os.geteuid() != 0:
            return list(command)
        return ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", *command]

    def _accepting(self) -> bool:
        import psycopg

        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"PostgreSQL exited with code {self.process.returncode if self.process else None}; "
                               f"log: {(self.root / 'server.log').read_text()[-2000:]}")
        try:
            psycopg.connect(self.admin_url, connect_timeout=5).close()
        except psycopg.OperationalError:
            return False
        return True
