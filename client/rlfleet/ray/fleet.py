"""``Fleet``: a fleet of rlfleet services as Ray actors, started, scaled, inspected and stopped from Python.

    from rlfleet.ray import Fleet, load_config

    fleet = Fleet.up(load_config("fleet.yaml"))        # every service SERVING, the collector last
    client = connect(fleet.address("collector"))       # a trainer outside the cluster: the SDK
    fleet.scale("generation", 4)                       # replicas join, re-synced before they serve
    fleet.down()

Each service instance is a detached, named actor (``<fleet>/<key>`` in Ray namespace ``rlfleet``) of
``ServiceHost`` (``actor.py``), so a fleet outlives the driver that started it and the CLI can find it
again (``Fleet.attach``). What the fleet was asked to be is stored next to the registry (``spec``).
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

from rlfleet.ray import runs
from rlfleet.ray.config import (RUN_SERVICES, UPSTREAMS, FleetConfig, RunSpec, ServiceSpec, replica_key, run_key,
                                service_of)
from rlfleet.registry import Registry, replica_group

log = logging.getLogger("rlfleet.ray")
NAMESPACE = "rlfleet"
CREDENTIAL_FILES = ("ca.pem", "tokens")
"""Besides every ``<service>.pem/.key`` and ``token-service``: what the services read (never ``ca.key``)."""


class FleetError(RuntimeError):
    """A fleet operation failed for a reason its message gives (a service's own error lines, a missing
    file): ``rlfleet-ray`` prints it without a traceback."""


def _ray():
    import ray

    return ray


def read_credentials(directory: str | Path) -> dict[str, bytes]:
    """The files of a credentials directory the services need (the CA's key stays behind)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FleetError(f"credentials: {directory} is not a directory here (the fleet's config names it; "
                         "up and scale read it where they run)")
    wanted = {path.name for path in directory.iterdir()
              if path.suffix in (".pem", ".key") or path.name in ("tokens", "token-service")}
    wanted.discard("ca.key")
    missing = [name for name in CREDENTIAL_FILES if name not in wanted]
    if missing:
        raise FleetError(f"credentials {directory}: {missing} missing (rlfleet.services.credentials makes them)")
    return {name: (directory / name).read_bytes() for name in sorted(wanted)}


def connect(ray_address: str | None = None) -> str:
    """``ray.init`` unless this process is connected already (a driver, a task, an actor); the GCS address."""
    ray = _ray()
    if not ray.is_initialized():
        # Not the actors' output: the services log to their own files, and a failed start is reported
        # once, by Fleet.up, rather than again as the actor's traceback streamed here.
        ray.init(address=ray_address or "auto", namespace=NAMESPACE, logging_level=logging.WARNING,
                 log_to_driver=False)
    return ray.get_runtime_context().gcs_address


class Fleet:
    """A running fleet (``up`` or ``attach``)."""

    def __init__(self, config: FleetConfig):
        self.config = config
        self.gcs_address = connect(config.ray_address)
        self.registry = Registry(self.gcs_address, config.name)
        self._credentials = None
        self._chosen: list[str] = []

    # -- lifecycle ----------------------------------------------------------------------------------

    @classmethod
    def up(cls, config: FleetConfig, fresh: bool = False) -> "Fleet":
        """Start every service (all but the collector together, then the collector once they serve);
        a fleet of the same name still running is stopped first. ``fresh``: the stateful services
        (collector, trajectory store, reward) delete their durable state at their first start (a new
        run); otherwise they resume it (``runs.py``). A service that refuses to start raises ``FleetError`` with its lines."""
        fleet = cls(config)
        fleet.down(quiet=True)
        settings = {key: fleet._actor_spec(key)["settings"] for name in config.services for key in fleet._keys(name)}
        log.info("fleet %s: %s", config.name, runs.describe_start(settings, fresh))
        fleet.registry.put_spec(config.to_dict())
        if fresh:
            runs.request_fresh(fleet.registry, [key for name in config.services for key in fleet._keys(name)])
        try:
            # Everything but the collectors at once (a vLLM engine's start overlaps the others'); the
            # collectors last: they read the others' addresses and probe the replicas at their start.
            for stage in (("trajectory", "reference", "reward", "environment", "generation"), ("collector",)):
                fleet._wait([fleet._launch(key) for name in stage if name in config.services
                             for key in fleet._keys(name)])
        except BaseException:
            fleet.down(quiet=True)
            raise
        return fleet

    @classmethod
    def attach(cls, name: str = "rlfleet", ray_address: str | None = None) -> "Fleet":
        """The fleet ``name`` that a driver (``rlfleet-ray up``) started on this cluster."""
        spec = Registry(connect(ray_address), name).spec()
        if spec is None:
            raise LookupError(f"no fleet named {name!r} on this cluster")
        return cls(FleetConfig.from_dict(spec))

    def down(self, quiet: bool = False) -> None:
        """Stop every instance (collector first, its process SIGTERMed), forget the fleet."""
        collector = self._existing("collector")
        self._stop(collector)  # first: it drives the others, and its trainers' streams end cleanly
        others = [key for name in ("generation", "environment", "reward", "reference", "trajectory")
                  for key in self._existing(name)]
        self._stop(others)  # together: a vLLM engine's shutdown takes seconds
        keys = collector + others
        if not quiet:
            log.info("fleet %s down (%d instances)", self.config.name, len(keys))
        self.registry.clear()

    # -- what a user asks -------------------------------------------------------------------------

    def address(self, key: str = "collector") -> str:
        """``host:port`` of ``key`` (``collector``, ``trajectory``, ``generation-0``...) now; it changes
        when the instance restarts on another node (the collector's port stays: ``port``)."""
        address = self.registry.address(key)
        if address is None:
            raise LookupError(f"{key} has no address now (starting, or its node is gone)")
        return address

    def status(self) -> dict[str, dict[str, Any]]:
        """Every instance's registry record (address, node, pid, starts) on a live node."""
        return self.registry.services()

    def status_of(self, name: str) -> dict[str, dict[str, Any]]:
        """The records of ``name``'s instances (``generation``: every replica)."""
        return {key: record for key, record in self.status().items() if record.get("service") == name}

    def collector_run(self, key: str = "collector"):
        """The run the collector ``key`` holds (its status' ``run``, the SDK's ``Run``: new, or resumed at
        which version); None where it cannot say (a collector older than run ids, or not reachable from here)."""
        from rlfleet.client import connect, credentials_from
        from rlfleet.rpc.errors import RlfleetClientError

        secrets = credentials_from(self.config.credentials, role="reader") if self.config.credentials else {}
        try:
            with connect(self.address(key), timeout=30, **secrets) as client:
                return getattr(client.status(), "run", None)
        except (RlfleetClientError, LookupError) as err:
            log.warning("the collector's run is not known here: %s", err)
            return None

    def actor(self, key: str):
        return _ray().get_actor(self._actor_name(key), namespace=NAMESPACE)

    def scale(self, name: str, replicas: int, timeout: float | None = None) -> list[str]:
        """Run ``replicas`` instances of ``name`` (generation): new ones start (SERVING before this returns;
        the collector re-syncs them before they get work), the highest-numbered go (out of the
        registry first, so the collector stops sending them work, then SIGTERMed). The keys running."""
        if name != "generation":
            raise ValueError(f"only generation scales (not {name})")
        current = self._existing(name, shared_only=True)
        spec = self.config.services[name]
        if replicas > len(current):
            self._wait([self._launch(f"{name}-{index}") for index in range(len(current), replicas)], timeout)
        self._stop(current[replicas:])
        spec.replicas = replicas
        self.registry.put_spec(self.config.to_dict())
        return self._existing(name)

    # -- the runs of a shared fleet -------------------------------------------------------------------

    def add_run(self, run: str, spec: RunSpec | None = None, fresh: bool = False,
                timeout: float | None = None) -> list[str]:
        """Start ``run``'s trajectory store (and the replicas it holds alone: ``spec.replicas``), then its
        collector (SERVING before this returns); the fleet serves its other runs on meanwhile. ``fresh``: a new run, its durable
        state deleted first; otherwise it resumes the state a run of that name left (``end_run`` keeps
        it). The keys started."""
        if self.config.shared and run in self.config.runs:
            raise ValueError(f"run {run} is in the fleet already ({self._run_keys(run)}); end it first")
        config = copy.deepcopy(self.config)
        config.runs = {**(config.runs or {}), run: spec or RunSpec()}
        config.check_run(run)
        self._check_run_credentials(run)
        self.config = config
        keys = self._run_keys(run)
        self.registry.put_spec(self.config.to_dict())
        if fresh:
            runs.request_fresh(self.registry, keys)
        try:  # the store and any replicas of its own first: the collector reads them at its start
            self._wait([self._launch(key) for key in keys[:-1]], timeout)
            self._wait([self._launch(keys[-1])], timeout)
        except BaseException:
            self.end_run(run, quiet=True)
            raise
        return keys

    def end_run(self, run: str, quiet: bool = False) -> dict[str, int]:
        """Stop ``run``'s collector, then its store (its durable state stays: ``add_run`` of the name
        resumes it), and end it on every replica (``EndRun``: its slot is freed, its adapters leave once
        its last request ends); the fleet's other runs are untouched. Each replica's calls of the run
        still running, by replica key."""
        if not self.config.shared or run not in self.config.runs:
            raise ValueError(f"no run {run} in fleet {self.config.name} (runs: {sorted(self.config.runs or {})})")
        keys = self._run_keys(run)
        self._stop(keys[-1:])  # the collector first: its trainers' streams end cleanly
        self._stop(keys[:-1])
        ended = self._end_on_replicas(run) if self.config.runs[run].shared else {}
        self.config.runs.pop(run)
        self.registry.put_spec(self.config.to_dict())
        if not quiet:
            log.info("run %s ended: %s stopped, its slot freed on %d replicas", run, ", ".join(keys), len(ended))
        return ended

    def collector_keys(self) -> list[str]:
        """``collector``, or each run's collector in a shared fleet."""
        return self._keys("collector")

    def runs(self) -> list[str]:
        """The runs of a shared fleet (none for a fleet of one run)."""
        return sorted(self.config.runs or {})

    def _run_keys(self, run: str) -> list[str]:
        """``run``'s instances in start order: its store, the replicas it holds alone (if any), its collector."""
        own = [replica_key(run, index) for index in range((self.config.runs or {}).get(run, RunSpec()).replicas)]
        return [run_key("trajectory", run), *own, run_key("collector", run)]

    def _instance(self, key: str) -> tuple[str, str | None]:
        """``key``'s service and the run it belongs to (None: the fleet's, shared by its runs)."""
        for run in (self.config.runs or {}) if self.config.shared else ():
            if key in self._run_keys(run):
                return service_of(key), run
        return service_of(key), None

    def _check_run_credentials(self, run: str) -> None:
        """With credentials: ``run``'s tokens are in them (its trainer's calls are refused otherwise)."""
        if self.config.credentials and not (Path(self.config.credentials) / f"token-trainer-{run}").exists():
            raise FleetError(f"credentials {self.config.credentials} hold nothing for run {run}: "
                             f"python -m rlfleet.services.credentials {self.config.credentials} --run {run} "
                             "adds its certificate and tokens")

    def _end_on_replicas(self, run: str) -> dict[str, int]:
        """``EndRun`` on each generation replica serving a run named ``run`` (as the service role)."""
        import grpc

        from rlfleet.rpc.channel import ChannelSettings
        from rlfleet.v1 import generation_pb2, generation_pb2_grpc

        settings = ChannelSettings(timeout=30)
        files = self._credential_files()
        if files:
            settings = ChannelSettings(timeout=30, tls=True, root_certificates=files["ca.pem"],
                                       certificate_chain=files["generation.pem"], private_key=files["generation.key"],
                                       auth_token=files["token-service"].decode().strip())
        ended = {}
        for key, record in self.status_of("generation").items():
            channel = (grpc.secure_channel(record["address"], settings.credentials(), options=settings.options())
                       if settings.tls else grpc.insecure_channel(record["address"], options=settings.options()))
            with channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                try:
                    served = stub.GetEngineStatus(generation_pb2.GetEngineStatusRequest(), timeout=30,
                                                  metadata=settings.metadata()).runs
                    for served_run in served:
                        if served_run.name == run:
                            ended[key] = stub.EndRun(generation_pb2.EndRunRequest(run_id=served_run.run_id),
                                                     timeout=30, metadata=settings.metadata()).requests_in_flight
                except grpc.RpcError as err:  # a replica going away takes the run's slot with it
                    log.warning("run %s not ended on %s: %s", run, key, err.details())
        return ended

    # -- internals -----------------------------------------------------------------------------------

    def _actor_name(self, key: str) -> str:
        return f"{self.config.name}/{key}"

    def _keys(self, name: str) -> list[str]:
        """The instance keys ``name`` has in the fleet's config (each replica's, those runs hold alone last;
        each run's in a shared fleet)."""
        runs = sorted(self.config.runs or {})
        if name == "generation":
            return [f"{name}-{index}" for index in range(self.config.services[name].replicas)] + [
                key for run in runs for key in self._run_keys(run) if service_of(key) == name]
        if self.config.shared and name in RUN_SERVICES:
            return [run_key(name, run) for run in runs]
        return [name]

    def _existing(self, name: str, shared_only: bool = False) -> list[str]:
        """Keys of ``name``'s instances that have an actor now: generation's shared replicas (those scaled
        beyond the config's count too) and, unless ``shared_only``, those runs hold alone."""
        if name != "generation":  # the config's, and any its registry still holds (an earlier fleet, other runs)
            candidates = sorted({*self._keys(name), *self.registry.services(name, alive_only=False)})
            return [key for key in candidates if self._has_actor(key)]
        count = self.config.services[name].replicas if name in self.config.services else 0
        keys = []
        for index in range(max(count, 64)):
            key = f"{name}-{index}"
            if self._has_actor(key):
                keys.append(key)
            elif index >= count:
                break
        if shared_only:
            return keys
        own = {*self._keys(name)[count:], *(key for key, record in self.registry.services(alive_only=False).items()
                                            if record.get("service", "").startswith(f"{name}@"))}
        return keys + [key for key in sorted(own) if self._has_actor(key)]

    def _has_actor(self, key: str) -> bool:
        try:
            _ray().get_actor(self._actor_name(key), namespace=NAMESPACE)
            return True
        except ValueError:
            return False

    def _actor_spec(self, key: str) -> dict[str, Any]:
        name, run = self._instance(key)
        spec: ServiceSpec = self.config.services[name]
        variables = {"workdir": self.config.workdir, "key": key}
        from rlfleet.ray.actor import substitute

        upstreams, port, extra = {}, spec.port, {}
        if name == "collector":
            upstreams = {setting: service for service, setting in UPSTREAMS.items()
                         if service in self.config.services}
        if run is not None and name in RUN_SERVICES:
            settings = self.config.run_settings(name, run)
            if name == "collector":
                upstreams["trajectory_address"] = run_key("trajectory", run)
                port = self.config.runs[run].port
                if not self.config.runs[run].shared:
                    extra["replicas_of"] = run
        else:
            settings = substitute(copy.deepcopy(spec.settings), variables)
            if run is not None:  # a replica the run holds alone: in the registry apart from the shared ones
                extra["group"] = replica_group(run)
        return {"fleet": self.config.name, "key": key, "service": name, "gcs_address": self.gcs_address,
                "workdir": self.config.workdir, "bind_host": self.config.bind_host, "port": port,
                "settings": settings,
                "args": substitute(list(spec.args), variables), "env": substitute(dict(spec.env), variables),
                "credentials": self._credential_files(), "upstreams": upstreams,
                "start_timeout_seconds": spec.start_timeout_seconds, "module": spec.module, **extra}

    def _credential_files(self) -> dict[str, bytes] | None:
        if self.config.credentials and self._credentials is None:
            self._credentials = read_credentials(self.config.credentials)
        return self._credentials

    def _launch(self, key: str):
        ray = _ray()
        from rlfleet.ray.actor import ServiceHost

        name = service_of(key)
        spec: ServiceSpec = self.config.services[name]
        options: dict[str, Any] = {
            "name": self._actor_name(key), "namespace": NAMESPACE, "lifetime": "detached",
            "num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus, "resources": dict(spec.resources),
            "max_restarts": spec.max_restarts, "max_task_retries": -1 if spec.max_restarts else 0,
        }
        if spec.placement == "spread":
            options["scheduling_strategy"] = self._spread(name, spec)
        actor = ray.remote(ServiceHost).options(**options).remote(self._actor_spec(key))
        return key, actor

    def _spread(self, name: str, spec: ServiceSpec):
        """The live node that fits ``spec`` and runs the fewest of ``name``'s instances (those just
        launched included), as a soft node affinity: a restart after that node is gone goes wherever
        the resources are. Ray's own SPREAD when no node fits now (an autoscaler may add one)."""
        ray = _ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        wanted = {"CPU": spec.num_cpus, "GPU": spec.num_gpus, **spec.resources}
        fitting = [node["NodeID"] for node in ray.nodes() if node["Alive"]
                   and all(node["Resources"].get(resource, 0) >= amount for resource, amount in wanted.items() if amount)]
        if not fitting:
            return "SPREAD"
        running = [record["node_id"] for record in self.status_of(name).values()] + self._chosen
        node = min(sorted(fitting), key=running.count)
        self._chosen.append(node)  # until _wait: the instances launched together spread among themselves
        return NodeAffinitySchedulingStrategy(node, soft=True)

    def _wait(self, launched: list, timeout: float | None = None) -> None:
        ray = _ray()
        started = time.monotonic()
        for key, actor in launched:
            budget = timeout if timeout is not None else self.config.services[service_of(key)].start_timeout_seconds
            try:
                record = ray.get(actor.info.remote(), timeout=max(1.0, budget - (time.monotonic() - started)))
            except ray.exceptions.GetTimeoutError:
                log_path = Path(self.config.workdir) / key / f"{service_of(key)}.log"
                raise FleetError(f"{key} did not serve within {budget:.0f} s (start_timeout_seconds); its log: "
                                 f"{log_path} on its node") from None
            except ray.exceptions.RayActorError as err:
                raise FleetError(self._start_failure(key, err)) from None
            log.info("%s SERVING at %s (node %s)", key, record["address"], record["node_id"][:8])
        self._chosen.clear()

    def _start_failure(self, key: str, err: Exception) -> str:
        """Why ``key``'s actor died starting: the error its start left in the registry (the service's own
        lines), else Ray's first line (the actor died before it could say)."""
        error = self.registry.get("error", key)
        if error:
            return f"{key} did not start: {error}"
        return f"{key}'s actor died before its service served: {str(err).strip().splitlines()[0]}"

    def _stop(self, keys: list[str]) -> None:
        """Stop ``keys`` together: their processes SIGTERMed, their records withdrawn, the actors killed."""
        ray = _ray()
        actors = {}
        for key in keys:
            try:
                actors[key] = ray.get_actor(self._actor_name(key), namespace=NAMESPACE)
            except ValueError:
                continue
        stopping = {key: actor.stop.remote() for key, actor in actors.items()}
        for key, ref in stopping.items():
            try:
                ray.get(ref, timeout=60)
            except Exception as exc:  # noqa: BLE001 - an actor that cannot stop gracefully is killed anyway
                log.warning("%s did not stop gracefully (%s): killing it", key, exc)
        for key, actor in actors.items():
            ray.kill(actor, no_restart=True)
            self.registry.forget(key)
