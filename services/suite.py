"""Start the whole suite locally as processes (the embedded default).

    rlfleet-suite --model-dir ~/.cache/rlfleet/tiny-model            # run until Ctrl-C
    rlfleet-suite --check                                            # start, report health, stop
    rlfleet-suite --view                                             # the rollout viewer on the last run
    rlfleet-suite --prometheus                                       # and a Prometheus scraping every service
    rlfleet-suite --secure --then "python train.py --credentials {credentials} ..."   # TLS, mTLS, roles

Builds the tiny local model when ``--model-dir`` holds none. The services the collector calls start
at once (none calls another); the collector starts once every one of them reports SERVING.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.services import healthcheck
from rlfleet.services.launch import ServiceProcess, free_port, written_address
from rlfleet.services.prometheus import Prometheus, write_targets

DEFAULT_MODEL_DIR = Path(os.environ.get("RLFLEET_HOME", Path.home() / ".cache" / "rlfleet")) / "tiny-model"


@dataclass
class SuiteOptions:
    """What the embedded default runs (every field maps onto a service flag)."""

    model_dir: Path = DEFAULT_MODEL_DIR
    generation_replicas: int = 1
    kv_cache_bytes: int = 256 << 20
    max_model_len: int = 1024
    trajectory_db: str | None = None
    trajectory_args: list[str] = field(default_factory=list)
    collector_args: list[str] = field(default_factory=list)
    run_collector_args: dict[str, list[str]] = field(default_factory=dict)
    """More flags for one run's collector, by run name (``run_names``): e.g. its ``players``."""
    reward_args: list[str] = field(default_factory=list)
    generation_args: list[str] = field(default_factory=list)
    environments: dict[str, str] | None = None
    """Start the environment service with these environments registered (name -> import path; the
    built-in ``tool_calling`` is always there) and point the collector at it; None: no environment service."""
    environment_args: list[str] = field(default_factory=list)
    environment_env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the environment service (e.g. PYTHONPATH for the import paths)."""
    log_format: str = "text"
    guarded: bool = False
    """Each service gets a reaper that takes its process group and files along once the suite's own
    process ends, however it ends (``ServiceProcess.guard``): ``rlfleet-suite`` sets it."""
    reference_threads: int = 1
    """The reference model's torch threads: vLLM's engine owns the CPU of a small host."""
    fresh: bool = False
    """Start a new run: the trajectory store and the collector delete the state a previous run left in the
    work directory (their ``fresh`` setting). Off: they resume it."""
    metrics: bool = False
    """Every service serves Prometheus metrics on a free loopback port (``ServiceProcess.metrics_port``),
    listed for Prometheus's file discovery in ``WORKDIR/prometheus/targets.json`` (``rlfleet.services.prometheus``).
    Off: no metrics endpoint."""
    secure: bool = False
    """Every service serves TLS and requires client certificates (mTLS) and role tokens; the CA, the
    certificates and the tokens are made in ``WORKDIR/credentials`` (``rlfleet.services.credentials``:
    a trainer uses ``ca.pem``, ``trainer.pem``/``.key`` and ``token-trainer``). Off: plaintext on loopback."""
    runs: int = 1
    """Runs sharing the generation replicas (docs/concepts/many-runs.md), each with a trajectory store and a
    collector of its own (``shared_replicas``): keys ``trajectory`` and ``collector`` for the first,
    ``trajectory-1`` and ``collector-1`` for the second, and so on. With more than one, the replicas get
    ``max_runs`` (and ``max_lora_rank`` 8 unless ``generation_args`` sets one). The runs are named r0,
    r1, ... (``run_names``); with ``secure``, each run's trainer has credentials acting for it alone
    (``trainer-<run>.pem``/``.key``, ``token-trainer-<run>``: ``credentials_from(DIR, run=...)``)."""

    def __post_init__(self) -> None:
        if self.runs < 1:
            raise ValueError(f"runs must be at least 1, got {self.runs}")
        unknown = sorted(set(self.run_collector_args) - set(self.run_names()))
        if unknown:
            raise ValueError(f"run_collector_args: no run named {unknown[0]!r} (the runs: "
                             f"{', '.join(self.run_names()) or 'one, unnamed'})")

    def run_keys(self, service: str) -> list[str]:
        """The keys of ``service`` (trajectory or collector) for each run, the first run's first."""
        return [service if i == 0 else f"{service}-{i}" for i in range(self.runs)]

    def run_names(self) -> list[str]:
        """Each run's name (``run_name`` of its collector and trajectory store; its credentials name it):
        r0, r1, ... where runs share the fleet, none for one run."""
        return [f"r{i}" for i in range(self.runs)] if self.runs > 1 else []

    def run_name_args(self, index: int) -> list[str]:
        names = self.run_names()
        return ["--run-name", names[index]] if names else []

    def own_collector_args(self, index: int) -> list[str]:
        """Run ``index``'s collector's own flags: its name and ``run_collector_args``."""
        names = self.run_names()
        return [*self.run_name_args(index), *(self.run_collector_args.get(names[index], []) if names else [])]

    def shared_generation_args(self) -> list[str]:
        """What the replicas need to be shared between ``runs`` runs (nothing for one)."""
        if self.runs == 1:
            return []
        lora = [] if any(arg.startswith("--max-lora-rank") for arg in self.generation_args) else ["--max-lora-rank", "8"]
        return ["--max-runs", str(self.runs), *lora]


def secure_args(credentials: Path, name: str) -> list[str]:
    """The flags that make service ``name`` serve TLS with its certificate, require client
    certificates from the CA, and check role tokens."""
    return ["--tls-cert-file", str(credentials / f"{name}.pem"), "--tls-key-file", str(credentials / f"{name}.key"),
            "--tls-client-ca-file", str(credentials / "ca.pem"), "--auth-tokens-file", str(credentials / "tokens")]


class _Launcher:
    """Starts the suite's services one by one into ``procs`` (each in ``WORKDIR/<key>``, with the suite's
    log format, TLS and metrics flags) and waits for them to serve."""

    def __init__(self, options: SuiteOptions, workdir: Path, timeout: float):
        self.options, self.workdir, self.timeout = options, workdir, timeout
        self.procs: dict[str, ServiceProcess] = {}
        self.started: dict[str, float] = {}
        self.credentials: Path | None = None
        if options.secure:
            from rlfleet.services.credentials import make_credentials

            self.credentials = make_credentials(workdir / "credentials", runs=options.run_names())

    def launch(self, key: str, name: str, args: list[str], env: dict[str, str] | None = None) -> ServiceProcess:
        self.started[key] = time.monotonic()
        print(f"[suite] starting {key} ...", file=sys.stderr, flush=True)
        proc = ServiceProcess(name, [*args, "--log-format", self.options.log_format], env=env or {})
        if self.credentials is not None:
            proc.args += secure_args(self.credentials, name)
            proc.health_credentials = _own_credentials(self.credentials, name)
        if self.options.metrics:
            proc.metrics_port = free_port()
            proc.args += ["--metrics-port", str(proc.metrics_port)]
        proc.start(self.workdir / key)
        if self.options.guarded:
            proc.guard()
        self.procs[key] = proc
        if self.options.metrics:
            write_targets(self.workdir / "prometheus", {k: (p.name, p.metrics_port) for k, p in self.procs.items()})
        return proc

    def wait(self, keys: list[str]) -> None:
        for key in keys:
            proc = self.procs[key]
            proc.wait_ready(max(1.0, self.timeout - (time.monotonic() - self.started[key])))
            print(f"[suite] {key:<13} SERVING on {proc.address} ({time.monotonic() - self.started[key]:.1f}s)",
                  file=sys.stderr, flush=True)


def start_suite(options: SuiteOptions, workdir: Path, timeout: float = 900.0,
                without_collector: bool = False, store_only: bool = False) -> dict[str, ServiceProcess]:
    """Start every service: the collector's upstream services at once, then, once all of them report
    SERVING, the collector (all stopped on failure); ``store_only``: the trajectory service alone (on the
    work directory's store, for looking at a run)."""
    launcher = _Launcher(options, Path(workdir), timeout)
    try:
        _launch_upstream(launcher, store_only)
        launcher.wait(list(launcher.procs))
        if not (store_only or without_collector):
            launcher.wait(_launch_collector(launcher))
    except BaseException:
        stop_suite(launcher.procs)
        raise
    return launcher.procs


def _launch_upstream(launcher: _Launcher, store_only: bool) -> None:
    """The trajectory service, then (unless ``store_only``) the generation replicas, reference, reward and
    environment services, without waiting for them."""
    options, workdir = launcher.options, launcher.workdir
    model, fresh = str(options.model_dir), (["--fresh", "true"] if options.fresh else [])
    for i, key in enumerate(options.run_keys("trajectory")):
        db = options.trajectory_db if i == 0 and options.trajectory_db else str(workdir / key / "trajectories.db")
        launcher.launch(key, "trajectory", ["--db-path", db, *fresh, *options.run_name_args(i),
                                            *options.trajectory_args])
    if store_only:
        return
    # vLLM's engines take longest to start: first, so the small services start beside them.
    for i in range(options.generation_replicas):
        launcher.launch(f"generation-{i}", "generation",
                        ["--model", model, "--kv-cache-memory-bytes", str(options.kv_cache_bytes),
                         "--max-model-len", str(options.max_model_len), *options.shared_generation_args(),
                         *options.generation_args])
    launcher.launch("reference", "reference", ["--model-path", model, "--torch-threads", str(options.reference_threads)])
    launcher.launch("reward", "reward", ["--tokenizer-path", model, *options.reward_args])
    if options.environments is not None:
        launcher.launch("environment", "environment", ["--tokenizer-path", model, *options.environment_args],
                        env={"RLFLEET_ENVIRONMENT_ENVIRONMENTS": json.dumps(options.environments),
                             **options.environment_env})


def _launch_collector(launcher: _Launcher) -> list[str]:
    """The collector of each run, on the upstream services' addresses (its own trajectory store); their keys."""
    options, procs, credentials = launcher.options, launcher.procs, launcher.credentials
    replicas = [procs[f"generation-{i}"].address for i in range(options.generation_replicas)]
    upstream = ["--environment-address", procs["environment"].address] if "environment" in procs else []
    shared = ["--shared-replicas", "true"] if options.runs > 1 else []
    keys = options.run_keys("collector")
    for i, (key, store) in enumerate(zip(keys, options.run_keys("trajectory"))):
        launcher.launch(key, "collector", [
            "--generation-addresses", json.dumps(replicas),
            "--reference-address", procs["reference"].address, "--reward-address", procs["reward"].address,
            "--trajectory-address", procs[store].address, "--state-dir", str(launcher.workdir / key),
            *(["--fresh", "true"] if options.fresh else []), *upstream, *shared,
            *(upstream_args(credentials) if credentials else ()), *options.collector_args,
            *options.own_collector_args(i)])
    return keys


def upstream_args(credentials: Path) -> list[str]:
    """The collector's flags for calling its upstream services with a credentials directory's files
    (``rlfleet.services.credentials``): mTLS as ``collector`` and the services' token. The suite and the
    Ray fleet's actors start the collector with them."""
    from rlfleet.services.credentials import upstream_files

    return [arg for setting, path in upstream_files(credentials, "collector", "service").items()
            for arg in (f"--{setting.replace('_', '-')}", path)]


def _own_credentials(credentials: Path, name: str):
    """The suite's health checks of service ``name`` present that service's own certificate (mTLS)."""
    return healthcheck.tls_credentials(str(credentials / "ca.pem"), str(credentials / f"{name}.pem"),
                                       str(credentials / f"{name}.key"))


def describe_run(collector: str, workdir: Path, secure: bool) -> str:
    """Which run the collector holds: a new one, or the one the work directory's state resumed."""
    run = asyncio.run(_collector_run(collector, workdir / "credentials" if secure else None))
    if not run.resumed:
        return run.describe()
    return (f"{run.describe()}, from the state in {workdir} (--fresh starts a new run; a trainer resumes "
            f"this one with run {run})")


async def _collector_run(collector: str, credentials: Path | None):
    """The run the collector holds, from its ``GetStatus`` (with the suite's trainer credentials if secure)."""
    from rlfleet.rpc.channel import ChannelSettings, aio_channel, call_with_retry, credentials_from
    from rlfleet.rpc.records import Run
    from rlfleet.v1 import collector_pb2, collector_pb2_grpc

    settings = ChannelSettings(tls=True, **credentials_from(credentials)) if credentials else ChannelSettings()
    async with aio_channel(collector, settings) as channel:
        reply = await call_with_retry(collector_pb2_grpc.CollectorServiceStub(channel).GetStatus,
                                      collector_pb2.GetStatusRequest(), method="GetStatus", settings=settings)
    return Run.from_proto(reply.run)


def start_view(workdir: Path, model_dir: Path, port: int = 8265, timeout: float = 300.0
               ) -> dict[str, ServiceProcess]:
    """The rollout viewer on the run in ``workdir``: the suite's trajectory service if it still answers,
    else one started on the work directory's store; then ``rlfleet-viewer --suite-dir WORKDIR``, which
    finds the services (and a secure suite's credentials) there."""
    workdir = Path(workdir)
    credentials = workdir / "credentials"
    secure = (credentials / "ca.pem").exists()
    procs: dict[str, ServiceProcess] = {}
    running = written_address(workdir / "trajectory", "trajectory")
    health = _own_credentials(credentials, "trajectory") if secure else None
    if running is None or not _serving(running, health):
        if not (workdir / "trajectory").is_dir():
            raise SystemExit(f"rlfleet-suite --view: {workdir} holds no run (no trajectory/); run the suite or "
                             f"scripts/demo first, or give its --workdir")
        procs = start_suite(SuiteOptions(model_dir=model_dir, secure=secure), workdir, timeout, store_only=True)
    viewer = ServiceProcess("viewer", ["--suite-dir", str(workdir), "--tokenizer", str(model_dir), "--port", str(port),
                                       "--log-format", "text"])
    try:
        viewer.start(workdir / "viewer")
        viewer.wait_listening(timeout)
    except BaseException:
        viewer.stop()
        stop_suite(procs)
        raise
    procs["viewer"] = viewer
    return procs


def _serving(address: str, credentials) -> bool:
    import grpc

    try:
        return healthcheck.check(address, timeout=2.0, credentials=credentials) == "SERVING"
    except grpc.RpcError:  # nothing listens there any more
        return False


def stop_suite(procs: dict[str, ServiceProcess]) -> None:
    """SIGTERM the collector and wait for it, then every other service at once."""
    def stop(key: str, proc: ServiceProcess) -> None:
        code = proc.stop()
        print(f"[suite] {key:<13} stopped (exit code {code})", file=sys.stderr, flush=True)

    collectors = [key for key in procs if key == "collector" or key.startswith("collector-")]
    for key in collectors:
        stop(key, procs[key])
    threads = [threading.Thread(target=stop, args=item, daemon=True) for item in procs.items()
               if item[0] not in collectors]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Start the rlfleet suite locally as processes.")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                        help="model directory; the tiny local model is built here if missing")
    parser.add_argument("--workdir", type=Path, default=Path("runs") / "suite",
                        help="logs, port files, trajectory log and collector state")
    parser.add_argument("--generation-replicas", type=int, default=1)
    parser.add_argument("--collector-arg", action="append", default=[],
                        help="extra collector flag, e.g. --collector-arg=--mode=sync (repeatable)")
    parser.add_argument("--generation-arg", action="append", default=[],
                        help="extra flag of every generation replica, e.g. --generation-arg=--max-lora-rank=8 "
                             "(repeatable)")
    parser.add_argument("--with-environment", action="store_true",
                        help="also start the environment service (multi-turn episodes) and point the collector at it")
    parser.add_argument("--environment", action="append", default=[], metavar="NAME=MODULE:CLASS",
                        help="register an environment with the environment service (repeatable; implies "
                             "--with-environment; the built-in tool_calling is always there)")
    parser.add_argument("--secure", action="store_true",
                        help="TLS, client certificates and role tokens everywhere; credentials made in "
                             "WORKDIR/credentials ({credentials} in --then)")
    parser.add_argument("--fresh", action="store_true",
                        help="start a new run: delete the trajectories and collector state a previous run left in "
                             "WORKDIR (default: resume that run; a trainer starting a new run is refused by it)")
    parser.add_argument("--prometheus", action="store_true",
                        help="every service serves metrics, and a Prometheus (Debian's package; scripts/bootstrap "
                             "installs it) scrapes them on --prometheus-port, its data in WORKDIR/prometheus")
    parser.add_argument("--prometheus-port", type=int, default=9090, help="Prometheus's port with --prometheus")
    parser.add_argument("--runs", type=int, default=1,
                        help="runs sharing the generation replicas, each with its own trajectory store and collector "
                             "(collector, collector-1, ...; docs/concepts/many-runs.md)")
    parser.add_argument("--run-collector-arg", action="append", default=[], metavar="RUN:FLAG",
                        help="extra flag of one run's collector (runs r0, r1, ... with --runs), e.g. "
                             "--run-collector-arg='r0:--players={\"opponent\": \"r1\"}' (repeatable)")
    parser.add_argument("--check", action="store_true", help="start, report health, stop")
    parser.add_argument("--view", action="store_true",
                        help="look at the run in WORKDIR: the rollout viewer, with the trajectory service on its "
                             "store if the suite is not running; Ctrl-C stops it")
    parser.add_argument("--viewer-port", type=int, default=8265, help="the viewer's port with --view (0: a free one)")
    parser.add_argument("--then", default=None,
                        help="command to run once the suite is up ({collector}, {collectors} (every run's, "
                             "comma-separated), {model_dir} and {credentials} are filled in); "
                             "the suite stops when it exits and its exit code is returned")
    return parser


def main(argv: list[str] | None = None) -> None:
    ns = _parser().parse_args(argv)
    from rlfleet.services.models.tiny import build_tiny_model

    print(f"[suite] model: {build_tiny_model(ns.model_dir)}", file=sys.stderr, flush=True)
    if ns.view:
        _view(ns)
        return
    environments = dict(spec.split("=", 1) for spec in ns.environment) if ns.environment else None
    if ns.with_environment and environments is None:
        environments = {}
    options = SuiteOptions(model_dir=ns.model_dir, generation_replicas=ns.generation_replicas,
                           collector_args=ns.collector_arg, generation_args=ns.generation_arg,
                           environments=environments, secure=ns.secure, fresh=ns.fresh, metrics=ns.prometheus,
                           runs=ns.runs, run_collector_args=_run_collector_args(ns.run_collector_arg),
                           guarded=True)
    procs = start_suite(options, ns.workdir)
    prometheus = None
    try:
        for key, proc in procs.items():
            print(f"{key}\t{proc.address}\tSERVING")
        if ns.prometheus:
            prometheus = Prometheus(ns.workdir / "prometheus", ns.prometheus_port).start()
            print(f"[suite] Prometheus scraping every service: {prometheus.url} (deploy/grafana/rlfleet.json is "
                  f"the dashboard)", file=sys.stderr, flush=True)
        for key in options.run_keys("collector"):
            print(f"[suite] {key}: {describe_run(procs[key].address, ns.workdir, ns.secure)}", file=sys.stderr,
                  flush=True)
        exit_code = _serve(ns, procs["collector"].address,
                           ",".join(procs[key].address for key in options.run_keys("collector")))
    finally:
        if prometheus is not None:
            prometheus.stop()
        stop_suite(procs)
    sys.exit(exit_code)


def _view(ns: argparse.Namespace) -> None:
    """``--view``: the rollout viewer on the run in the work directory, until Ctrl-C."""
    procs = start_view(ns.workdir, ns.model_dir, ns.viewer_port)
    try:
        print(f"[suite] rollout viewer of the run in {ns.workdir}: http://127.0.0.1:{procs['viewer'].port} "
              f"(Ctrl-C stops it)", file=sys.stderr, flush=True)
        _wait_for_a_signal()
    finally:
        stop_suite(procs)


def _run_collector_args(specs: list[str]) -> dict[str, list[str]]:
    """``RUN:FLAG`` specs -> run -> flags."""
    flags: dict[str, list[str]] = {}
    for spec in specs:
        run, colon, flag = spec.partition(":")
        if not colon or not flag:
            raise SystemExit(f"rlfleet-suite: --run-collector-arg {spec!r}: expected RUN:FLAG, e.g. r0:--share-weight=2")
        flags.setdefault(run, []).append(flag)
    return flags


def _serve(ns: argparse.Namespace, collector: str, collectors: str) -> int:
    """Once the suite serves: run ``--then`` (its exit code), or return at once (``--check``), or wait for
    Ctrl-C (0). ``collectors``: every run's collector, comma-separated."""
    if ns.then:
        command = shlex.split(ns.then.format(collector=collector, collectors=collectors, model_dir=ns.model_dir,
                                             credentials=ns.workdir / "credentials"))
        print(f"[suite] running: {' '.join(command)}", file=sys.stderr, flush=True)
        return subprocess.call(command)
    if not ns.check:
        print(f"[suite] running; collector at {collector}; Ctrl-C stops it", file=sys.stderr, flush=True)
        _wait_for_a_signal()
    return 0


def _wait_for_a_signal() -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()


if __name__ == "__main__":
    main()
