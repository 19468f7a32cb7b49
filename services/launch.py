"""Start rlfleet services as real processes and wait for them to be healthy.

Used by the suite launcher (``rlfleet-suite``), the demo and the integration
tests. Each ``ServiceProcess`` tracks its own PID; stopping sends SIGTERM and
only escalates to SIGKILL for that PID after a timeout.

Nothing a service's processes leave is left once it stops, gracefully or killed: each gets a
``TMPDIR`` of its own (``private_tmp``: a vLLM engine's ``torch.distributed`` file store and its ZMQ
IPC sockets go there), removed once its process group is gone, and the shared-memory segments and
named semaphores its group held (``rlfleet.ray.reaper.held_segments``: read from ``/proc`` just
before the signal) are unlinked then too. A process that ended on its own and was never stopped
(a start that failed) has its ``TMPDIR`` removed when its ``ServiceProcess`` goes, at the latest when
the launcher's interpreter exits.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2

from rlfleet.services import healthcheck


_ALIVE: tuple[int, int] | None = None
"""This process's pipe to the reapers of the services it guards (``ServiceProcess.guard``): read end,
write end. Only this process holds the write end: its end is the reapers' EOF."""


def written_address(workdir: Path, name: str) -> str | None:
    """The loopback address service ``name`` wrote in ``workdir`` when it listened (``ServiceProcess.start``:
    ``<workdir>/<name>.port``), or None if it never did. It may have stopped since."""
    try:
        return f"127.0.0.1:{int((Path(workdir) / f'{name}.port').read_text())}"
    except (FileNotFoundError, ValueError):
        return None


IPC_PATH_MAX = 70
"""The longest ``TMPDIR`` a vLLM engine's IPC socket paths fit under: ``<TMPDIR>/<uuid4>`` within the
107 bytes of a unix socket's path."""


def private_tmp(workdir: Path) -> Path:
    """An empty directory for one process's temporary files: ``<workdir>/tmp`` when its path is short
    enough for IPC sockets (``IPC_PATH_MAX``), else ``tmp`` in a fresh ``rlfleet-tmp-*`` of the system's
    (removed with it: ``rlfleet.ray.node_dir.remove``)."""
    tmp = Path(workdir) / "tmp"
    if len(str(tmp.absolute())) > IPC_PATH_MAX:
        tmp = Path(tempfile.mkdtemp(prefix="rlfleet-tmp-")) / "tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    return tmp


def _remove_tmp_once_ended(process: subprocess.Popen, tmp: Path) -> None:
    """A ``ServiceProcess`` went (or the launcher exits) without stopping its process: its ``TMPDIR``
    goes if the process has ended (a live one's is its reaper's, or its next stop's)."""
    if process.poll() is not None:
        from rlfleet.ray import node_dir

        node_dir.remove(tmp)


def tmp_env(tmp: Path) -> dict[str, str]:
    """A process's environment for ``TMPDIR`` ``tmp``: torch's compile cache stays where it was (it
    would follow TMPDIR, and be compiled again by every process)."""
    env = {"TMPDIR": str(tmp)}
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    return env


def free_port() -> int:
    """A free loopback port (bound, read, released: the server that is given it binds it next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ServiceProcess:
    """One service process: ``python -m rlfleet.services.<name> <args>`` (or ``python -m <module>``)."""

    name: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    port: int | None = None
    metrics_port: int | None = None
    """Where it serves Prometheus metrics (``--metrics-port``), when the launcher chose one."""
    process: subprocess.Popen | None = None
    preexec_fn: Callable[[], None] | None = None
    """Run in the child before it starts (e.g. resource limits a fault test sets)."""
    health_credentials: grpc.ChannelCredentials | None = None
    """TLS credentials of the health checks, for a service that serves TLS (None: plaintext)."""
    module: str | None = None
    """The module ``python -m`` runs, for a service outside the package (the tests' echo service,
    ``tests.echo_service``, found from the working directory); None: ``rlfleet.services.<name>``."""
    _log_offset: int = field(default=0, init=False, repr=False)
    """Where this start's lines begin in the log (appended across starts)."""
    tmp: Path | None = field(default=None, init=False)
    """Its own ``TMPDIR`` (``private_tmp``), removed when it stops; None when ``env`` sets one."""
    _tmp_left: weakref.finalize | None = field(default=None, init=False, repr=False)
    """Removes ``tmp`` when this object goes (or the interpreter exits) if its process ended unstopped."""
    started_at: float | None = field(default=None, init=False)
    """When ``start`` ran it (wall clock): the named semaphores orphaned since are swept when it ends."""

    def start(self, workdir: Path | None = None) -> "ServiceProcess":
        workdir = Path(workdir or tempfile.mkdtemp(prefix=f"rlfleet-{self.name}-"))
        workdir.mkdir(parents=True, exist_ok=True)
        self._port_file = workdir / f"{self.name}.port"
        self._port_file.unlink(missing_ok=True)
        self.log_path = self.log_path or workdir / f"{self.name}.log"
        args = list(self.args)
        if "--port" not in args:
            args += ["--port", "0"]
        args += ["--port-file", str(self._port_file)]
        self._log = open(self.log_path, "ab")
        # A restarted service keeps its history in the log: log_tail reads this start's lines only.
        self._log_offset = self._log.tell()
        own = {}
        self._remove_tmp()  # a previous start's, whose process ended without stop()
        if "TMPDIR" not in self.env:
            self.tmp = private_tmp(workdir)
            own = tmp_env(self.tmp)
        self.started_at = time.time()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module or f"rlfleet.services.{self.name}", *args],
                stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **own, **self.env},
                start_new_session=True,  # a Ctrl-C in the launcher's terminal is handled by the launcher
                preexec_fn=self.preexec_fn,
            )
        except BaseException:
            self._remove_tmp()
            raise
        if self.tmp is not None:
            self._tmp_left = weakref.finalize(self, _remove_tmp_once_ended, self.process, self.tmp)
        return self

    def _remove_tmp(self) -> None:
        """This start's ``TMPDIR``, now: its process has ended (or never started)."""
        if self._tmp_left is not None:
            self._tmp_left.detach()
            self._tmp_left = None
        if self.tmp is not None:
            from rlfleet.ray import node_dir

            node_dir.remove(self.tmp)

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError(f"{self.name} has not reported its port yet")
        return f"127.0.0.1:{self.port}"

    def wait_listening(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while not self._port_file.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not listen within {timeout}s; log: {self.log_path}")
            time.sleep(0.05)
        self.port = int(self._port_file.read_text())
        return self.port

    def health(self, timeout: float = 2.0) -> int:
        """The health status enum of the whole server ("" service)."""
        return healthcheck.status(self.address, timeout=timeout, credentials=self.health_credentials)

    def wait_ready(self, timeout: float = 300.0) -> "ServiceProcess":
        """Block until health reports SERVING (the model is loaded)."""
        deadline = time.monotonic() + timeout
        self.wait_listening(timeout)
        while True:
            self._check_alive()
            try:
                if self.health() == health_pb2.HealthCheckResponse.SERVING:
                    return self
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not SERVING within {timeout}s; log: {self.log_path}")
            time.sleep(0.2)

    def _check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with code {self.process.returncode}; log tail:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines this start wrote to the log."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait, then SIGKILL this PID (and its process group) if needed; what the group
        left removed."""
        if self.process is None:
            return None
        segments = self._held_segments()
        if self.process.poll() is not None:
            self._reap_group(segments)
            self._log.close()
            return self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.wait()
        finally:
            self._reap_group(segments)
            self._log.close()

    def _held_segments(self) -> set[Path]:
        from rlfleet.ray import reaper

        return reaper.held_segments(reaper.members(self.process.pid))

    def _reap_group(self, segments: set[Path], killed: bool = False) -> None:
        """Children (e.g. a vLLM engine core) that outlived their parent are ours to clean up; then
        what the group left: ``segments`` and the process's own ``TMPDIR``, and if it was ``killed``,
        the rlfleet segments and directories in /dev/shm nobody holds now (``shm.sweep_stale``)."""
        from rlfleet.ray import reaper

        # The tmp's parent goes too when it is an empty rlfleet-tmp-* (node_dir.remove).
        reaper.clean(reaper.kill(self.process.pid, segments), self.tmp, killed=killed, since=self.started_at)
        self._remove_tmp()

    def guard(self, directory: Path | None = None) -> None:
        """A reaper (``rlfleet.ray.reaper``) beside the process: once this launcher's process ends,
        however it ends (SIGKILL included), the reaper SIGKILLs the service's process group (a vLLM
        engine core outlives its parent) and removes what the group left, ``directory`` with it (default:
        the process's own ``TMPDIR``). The launcher holds the write end of one pipe for its life, read by
        every reaper it starts."""
        global _ALIVE
        if _ALIVE is None:
            _ALIVE = os.pipe()
        directory = directory or self.tmp
        subprocess.run([sys.executable, "-m", "rlfleet.ray.reaper", str(_ALIVE[0]), str(self.process.pid),
                        *([str(directory)] if directory else [])],
                       pass_fds=(_ALIVE[0],), start_new_session=True, check=True, timeout=60)

    def kill(self) -> None:
        """SIGKILL the process group we started (vLLM engine children included); what it left removed."""
        if self.process is not None and self.process.poll() is None:
            segments = self._held_segments()
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
            self._reap_group(segments, killed=True)
