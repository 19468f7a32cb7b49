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
from rlfleet.ray.config import UPSTREAMS, FleetConfig, ServiceSpec
from rlfleet.registry import Registry

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
        from rlfleet.ray.actor import substitute

        settings = {name: substitute(spec.settings, {"workdir": config.workdir, "key": name})
                    for name, spec in config.services.items()}
        log.info("fleet %s: %s", config.name, runs.describe_start(settings, fresh))
        fleet.registry.put_spec(config.to_dict())
        if fresh:
            runs.request_fresh(fleet.registry, list(config.services))
        try:
            # Everything but the collector at once (a vLLM engine's start overlaps the others'); the
            # collector last: it reads their addresses and probes the replicas at its start.
            for stage in (("trajectory", "reference", "reward", "environment", "generation"), ("collector",)):
                fleet._wait([fleet._launch(name, index) for name in stage if name in config.services
                             for index in range(config.services[name].replicas)])
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

    def collector_run(self):
        """The run the collector holds (its status' ``run``, the SDK's ``Run``: new, or resumed at which
        version); None where it cannot say (a collector older than run ids, or not reachable from here)."""
        from rlfleet.client import connect, credentials_from
        from rlfleet.rpc.errors import RlfleetClientError

        secrets = credentials_from(self.config.credentials, role="reader") if self.config.credentials else {}
        try:
            with connect(self.address("collector"), timeout=30, **secrets) as client:
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
        current = self._existing(name)
        spec = self.config.services[name]
        if replicas > len(current):
            self._wait([self._launch(name, index) for index in range(len(current), replicas)], timeout)
        self._stop(current[replicas:])
        spec.replicas = replicas
        self.registry.put_spec(self.config.to_dict())
        return self._existing(name)

    # -- internals -----------------------------------------------------------------------------------

    def _actor_name(self, key: str) -> str:
        return f"{self.config.name}/{key}"

    def _existing(self, name: str) -> list[str]:
        """Keys of ``name``'s instances that have an actor now."""
        ray = _ray()
        keys = []
        count = self.config.services[name].replicas if name in self.config.services else 0
        candidates = [f"{name}-{index}" for index in range(max(count, 64))] if name == "generation" else [name]
        for key in candidates:
            try:
                ray.get_actor(self._actor_name(key), namespace=NAMESPACE)
                keys.append(key)
            except ValueError:
                if name == "generation" and int(key.rsplit("-", 1)[1]) >= count:
                    break
        return keys

    def _actor_spec(self, name: str, key: str) -> dict[str, Any]:
        spec: ServiceSpec = self.config.services[name]
        variables = {"workdir": self.config.workdir, "key": key}
        from rlfleet.ray.actor import substitute

        upstreams = {}
        if name == "collector":
            upstreams = {setting: service for service, setting in UPSTREAMS.items()
                         if service in self.config.services}
        return {"fleet": self.config.name, "key": key, "service": name, "gcs_address": self.gcs_address,
                "workdir": self.config.workdir, "bind_host": self.config.bind_host, "port": spec.port,
                "settings": substitute(copy.deepcopy(spec.settings), variables),
                "args": substitute(list(spec.args), variables), "env": substitute(dict(spec.env), variables),
                "credentials": self._credential_files(), "upstreams": upstreams,
                "start_timeout_seconds": spec.start_timeout_seconds, "module": spec.module}

    def _credential_files(self) -> dict[str, bytes] | None:
        if self.config.credentials and self._credentials is None:
            self._credentials = read_credentials(self.config.credentials)
        return self._credentials

    def _launch(self, name: str, index: int):
        ray = _ray()
        from rlfleet.ray.actor import ServiceHost

        spec: ServiceSpec = self.config.services[name]
        key = f"{name}-{index}" if name == "generation" else name
        options: dict[str, Any] = {
            "name": self._actor_name(key), "namespace": NAMESPACE, "lifetime": "detached",
            "num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus, "resources": dict(spec.resources),
            "max_restarts": spec.max_restarts, "max_task_retries": -1 if spec.max_restarts else 0,
        }
        if spec.placement == "spread":
            options["scheduling_strategy"] = self._spread(name, spec)
        actor = ray.remote(ServiceHost).options(**options).remote(self._actor_spec(name, key))
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
            budget = timeout if timeout is not None else self.config.services[key.split("-")[0]].start_timeout_seconds
            try:
                record = ray.get(actor.info.remote(), timeout=max(1.0, budget - (time.monotonic() - started)))
            except ray.exceptions.GetTimeoutError:
                log_path = Path(self.config.workdir) / key / f"{key.split('-')[0]}.log"
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
