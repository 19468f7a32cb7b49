"""Start rlfleet services as real processes and wait for them to be healthy.

Used by the suite launcher (``rlfleet-suite``), the demo and the integration
tests. Each ``ServiceProcess`` tracks its own PID; stopping sends SIGTERM and
only escalates to SIGKILL for that PID after a timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2

from rlfleet.services import healthcheck


def written_address(workdir: Path, name: str) -> str | None:
    """The loopback address service ``name`` wrote in ``workdir`` when it listened (``ServiceProcess.start``:
    ``<workdir>/<name>.port``), or None if it never did. It may have stopped since."""
    try:
        return f"127.0.0.1:{int((Path(workdir) / f'{name}.port').read_text())}"
    except (FileNotFoundError, ValueError):
        return None


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
        self.process = subprocess.Popen(
            [sys.executable, "-m", self.module or f"rlfleet.services.{self.name}", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
            start_new_session=True,  # a Ctrl-C in the launcher's terminal is handled by the launcher
            preexec_fn=self.preexec_fn,
        )
        return self

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
        """SIGTERM, wait, then SIGKILL this PID (and its process group) if needed."""
        if self.process is None:
            return None
        if self.process.poll() is not None:
            self._reap_group()
            self._log.close()
            return self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.wait()
        finally:
            self._reap_group()
            self._log.close()

    def _reap_group(self) -> None:
        # Children (e.g. a vLLM engine core) that outlived their parent are ours to clean up.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the process group we started (vLLM engine children included)."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
