"""A Prometheus that scrapes the local suite: ``rlfleet-suite --prometheus`` and the dashboard test.

The suite started with metrics (``SuiteOptions.metrics``) writes every service's /metrics address to
``WORKDIR/prometheus/targets.json`` (Prometheus's file discovery: ``job`` is the service's name, the
``service`` label its key in the suite, e.g. ``generation-0``); ``Prometheus`` writes a configuration
that reads that file, runs the ``prometheus`` binary on it (Debian's package, installed by
``scripts/bootstrap``) with its data in ``WORKDIR/prometheus/data``, and queries it over its HTTP API.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from rlfleet.services.common.files import write_atomically

TARGETS = "targets.json"


class PrometheusError(RuntimeError):
    """Prometheus answered a query with an error (its message), or is not installed."""


def write_targets(directory: Path, targets: dict[str, tuple[str, int]]) -> Path:
    """``directory/targets.json`` for Prometheus's file discovery: {suite key: (service name, metrics
    port)} on loopback. Replaced whole (Prometheus reads it again whenever it changes)."""
    directory.mkdir(parents=True, exist_ok=True)
    groups = [{"targets": [f"127.0.0.1:{port}"], "labels": {"job": name, "service": key}}
              for key, (name, port) in targets.items()]
    path = directory / TARGETS
    write_atomically(path, json.dumps(groups, indent=1) + "\n", mode=0o644)
    return path


class Prometheus:
    """``prometheus`` scraping the targets in ``directory`` (``write_targets``) every
    ``scrape_interval`` seconds, on ``127.0.0.1:port``."""

    def __init__(self, directory: Path, port: int, scrape_interval: float = 5.0, binary: str | None = None):
        self.directory = Path(directory)
        self.port = port
        self.scrape_interval = scrape_interval
        self.binary = binary or os.environ.get("RLFLEET_PROMETHEUS") or shutil.which("prometheus")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> Path:
        """The configuration: one job whose targets (and their ``job`` labels) come from targets.json."""
        seconds = f"{round(self.scrape_interval * 1000)}ms"  # Prometheus durations take no fractions
        config = {"global": {"scrape_interval": seconds, "evaluation_interval": seconds},
                  "scrape_configs": [{"job_name": "rlfleet", "scrape_timeout": seconds,
                                      "file_sd_configs": [{"files": [str(self.directory.resolve() / TARGETS)],
                                                           "refresh_interval": seconds}]}]}
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / "prometheus.yml"
        path.write_text(json.dumps(config, indent=1) + "\n")  # JSON is YAML
        return path

    def start(self, timeout: float = 60.0) -> "Prometheus":
        """Start it and wait until it reports ready."""
        if not self.binary:
            raise PrometheusError("prometheus is not installed: scripts/bootstrap installs Debian's package "
                                  "(apt-get install prometheus), or set RLFLEET_PROMETHEUS to the binary")
        config = self.config()
        self._log = open(self.directory / "prometheus.log", "ab")
        self.process = subprocess.Popen(
            [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.process.poll() is not None:
                log = (self.directory / "prometheus.log").read_text(errors="replace").splitlines()
                raise PrometheusError(f"prometheus exited with code {self.process.returncode}: "
                                      f"{log[-1] if log else ''} (log: {self.directory / 'prometheus.log'})")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"prometheus not ready within {timeout}s; log: {self.directory / 'prometheus.log'}")
            time.sleep(0.2)
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _get(self, path: str, **params: str):
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as error:  # a bad query: 400 with the error in the body
            answer = json.load(error)
        if answer.get("status") != "success":
            raise PrometheusError(f"{answer.get('errorType')}: {answer.get('error')}")
        return answer["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector ``expr`` evaluates to now: [{"metric": {labels}, "value": [time, "value"]}]."""
        data = self._get("/api/v1/query", query=expr)
        if data["resultType"] != "vector":
            raise PrometheusError(f"{expr!r} is a {data['resultType']}, not an instant vector")
        return data["result"]

    def targets(self) -> list[dict]:
        """The active targets: their labels, ``health`` (up, down, unknown) and ``lastError``."""
        return self._get("/api/v1/targets", state="active")["activeTargets"]

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        self.process = None
