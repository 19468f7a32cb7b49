"""The fleet's config file (``rlfleet-ray up fleet.yaml``; ``Fleet.up(config)``).

    name: rlfleet                     # actor names and registry keys
    workdir: /tmp/rlfleet-ray         # each service's state and log in <workdir>/<key>
    credentials: ./credentials        # optional: TLS, mTLS and role tokens everywhere (relative: to this file)
    services:
      trajectory: {settings: {db_path: "{workdir}/trajectory/trajectories.db"}}
      reference:  {num_gpus: 1, settings: {model_path: /models/policy}}
      reward:     {settings: {tokenizer_path: /models/policy}}
      generation: {replicas: 4, placement: spread, num_gpus: 1, settings: {model: /models/policy}}
      collector:  {port: 50050, settings: {state_dir: "{workdir}/collector/state", mode: sync, group_size: 4}}

(``num_gpus: 0`` on a CPU-only cluster; docs/guides/ray.md has the whole story.)

A fleet that several runs share (docs/concepts/many-runs.md) lists them under ``runs``; the
``collector`` and ``trajectory`` entries are then each run's template, every run getting a collector
(``collector-<run>``, over the shared replicas, ``run_name`` its name) and a trajectory store
(``trajectory-<run>``) of its own, their durable state apart by ``{run}`` in its settings:

    runs:
      exp-a: {}
      exp-b: {share_weight: 2, port: 50061, settings: {players: {opponent: exp-a}}}
    services:
      trajectory: {settings: {db_path: "{workdir}/{key}/trajectories.db"}}
      generation: {settings: {model: /models/policy, max_runs: 8, max_lora_rank: 16}}
      collector:  {settings: {state_dir: "{workdir}/{key}/state"}}

(``rlfleet-ray runs add`` and ``runs end`` add and end runs while the fleet serves; a run with
``replicas: N`` trains full weights on N generation replicas of its own, placed by the fleet.)

A service's ``settings`` are its own config fields (the names of its ``--config`` file, its flags
without ``--`` and with ``_``), written to a ``--config`` file on the node that runs it; ``args`` are
extra flags and ``env`` extra environment variables, as for a process started by hand. ``{workdir}``
in a string setting is the fleet's workdir, ``{key}`` the instance (``generation-1``). The fleet sets
what only it can know: host, port, TLS files, the collector's upstream addresses and its replica
discovery (``ray+gcs://``). Ray's side per service: ``num_cpus``, ``num_gpus``, ``resources``,
``placement`` (``spread``: replicas on different nodes while there are nodes),
``max_restarts`` (-1: forever).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVICES = ("trajectory", "reference", "reward", "environment", "generation", "collector")
"""In start order: the collector last (it reads the others' addresses), generation replicas together."""
UPSTREAMS = {"trajectory": "trajectory_address", "reference": "reference_address", "reward": "reward_address",
             "environment": "environment_address"}
"""The collector's setting naming each upstream service."""


@dataclass
class ServiceSpec:
    """One service of the fleet (``replicas`` instances for generation)."""

    settings: dict[str, Any] = field(default_factory=dict)
    """The service's own config fields, written to its ``--config`` file."""
    args: list[str] = field(default_factory=list)
    """Extra command-line flags (they win over ``settings``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the process."""
    replicas: int = 1
    """Instances (generation only; others run one)."""
    num_cpus: float = 1.0
    """Ray CPUs the actor holds while the process runs."""
    num_gpus: float = 0.0
    """Ray GPUs the actor holds (CUDA_VISIBLE_DEVICES is set by Ray for the process)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources the actor holds (e.g. ``{"gpu_node": 1}`` to pin it to nodes that offer it)."""
    placement: str = "default"
    """``spread``: each instance on the live node that fits it (by its total resources) and runs the fewest
    instances of the service (a soft node affinity: a restart after that node is gone goes wherever the
    resources are; if that node has no free resources now, the instance waits for them there);
    ``default``: Ray's scheduling."""
    max_restarts: int = -1
    """Ray restarts of the actor after its node or process died (-1: forever; 0: never)."""
    port: int = 0
    """Fixed gRPC port (0: a free one each start). The collector's, for trainers outside the cluster."""
    start_timeout_seconds: float = 600.0
    """From process start to SERVING (a vLLM engine on a loaded host takes minutes)."""
    module: str | None = None
    """The module ``python -m`` runs instead of ``rlfleet.services.<name>`` (a custom build, a benchmark's
    load generator); it must take ``--host``, ``--port`` and ``--port-file`` (and ``--config`` when
    ``settings`` is not empty)."""


@dataclass
class RunSpec:
    """One run of a fleet that several runs share: its collector and trajectory store."""

    share_weight: float = 1.0
    """The run's weight in each replica's fair share (the collector's ``share_weight``)."""
    port: int = 0
    """Its collector's fixed gRPC port (0: a free one each start; ``rlfleet-ray address collector-<run>``)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Its collector's own settings over the ``collector`` template's (``players``, ``mode``, ...)."""
    replicas: int = 0
    """Generation replicas of its own, for a run that trains full weights (keys ``generation-<run>-<i>``,
    the ``generation`` template's settings and resources): its collector holds them as a fleet of one
    run does (full, delta, rolling pushes), and no other run reaches them. 0: the run shares the fleet's
    replicas (its policy a LoRA adapter on their base weights)."""

    @property
    def shared(self) -> bool:
        """Whether the run samples on the fleet's shared replicas (no replicas of its own)."""
        return self.replicas == 0


RUN_SERVICES = ("trajectory", "collector")
"""What each run of a shared fleet has of its own, in start order (keys ``<service>-<run>``)."""


def run_key(service: str, run: str) -> str:
    """The instance key of ``run``'s ``service`` (``collector-exp-a``)."""
    return f"{service}-{run}"


def replica_key(run: str, index: int) -> str:
    """The instance key of the ``index``-th generation replica ``run`` holds alone (``generation-exp-c-0``)."""
    return f"generation-{run}-{index}"


def service_of(key: str) -> str:
    """The service an instance key belongs to (``generation-1``, ``collector-exp-a``: ``generation``, ``collector``)."""
    return key.split("-", 1)[0]


@dataclass
class FleetConfig:
    """A fleet on one Ray cluster."""

    name: str = "rlfleet"
    """Actor names (``<name>/<key>`` in Ray namespace ``rlfleet``) and registry keys."""
    ray_address: str | None = None
    """What ``ray.init`` connects to when Ray is not initialised yet (None: ``auto``)."""
    workdir: str = "/tmp/rlfleet-ray"
    """Each service's state, logs and port file in ``<workdir>/<key>``, on the node running it (relative:
    to the config file's directory). Durable state that must survive a node (trajectory store, collector
    state) needs PostgreSQL (their ``database_url`` settings) or this on a shared volume."""
    credentials: str | None = None
    """A directory made by ``rlfleet.services.credentials`` (certificates must hold the nodes' IPs:
    ``--host``); read by the driver (``up``, ``scale``) and delivered to every actor, written there to a
    private directory that goes with the actor. Relative: to the config file's directory. None: plaintext."""
    bind_host: str = "0.0.0.0"
    """The interface every service binds (its address in the registry is the node's IP)."""
    services: dict[str, ServiceSpec] = field(default_factory=dict)
    runs: dict[str, RunSpec] | None = None
    """The runs that share the fleet's replicas, by name (None: the fleet holds one run, keys
    ``collector`` and ``trajectory``; a mapping, even empty: a shared fleet, ``runs add`` adds to it)."""

    @property
    def shared(self) -> bool:
        return self.runs is not None

    def __post_init__(self):
        unknown = set(self.services) - set(SERVICES)
        if unknown:
            raise ValueError(f"services: unknown {sorted(unknown)}; known: {list(SERVICES)}")
        for needed in ("trajectory", "reference", "reward", "generation", "collector"):
            if needed not in self.services:
                raise ValueError(f"services: {needed} is missing")
        for name, spec in self.services.items():
            if spec.placement not in ("default", "spread"):
                raise ValueError(f"services.{name}.placement: {spec.placement!r} is not default or spread")
            if spec.replicas < 0 or (name != "generation" and spec.replicas != 1):
                raise ValueError(f"services.{name}.replicas: only generation runs several (got {spec.replicas})")
        for run in self.runs or {}:
            self.check_run(run)

    def check_run(self, run: str) -> None:
        """ValueError naming what is wrong unless ``run`` may be (or is) one of this shared fleet's runs:
        a run name, within the replicas' ``max_runs``, its durable state apart from every other run's."""
        from rlfleet.ray.runs import state_location
        from rlfleet.services.common.run_ids import MAX_SHARE_WEIGHT, is_run_id

        if not self.shared:
            raise ValueError("this fleet holds one run (its config has no `runs`): a fleet that runs share "
                             "lists them under `runs` (docs/guides/ray.md)")
        if not is_run_id(run):
            raise ValueError(f"runs: {run!r} is not a run name: 1 to 128 characters of [A-Za-z0-9._-]")
        spec = self.runs.get(run, RunSpec())
        if not 0 < spec.share_weight <= MAX_SHARE_WEIGHT:
            raise ValueError(f"runs.{run}.share_weight: {spec.share_weight} is not in (0, {MAX_SHARE_WEIGHT:g}]")
        if spec.replicas < 0:
            raise ValueError(f"runs.{run}.replicas: {spec.replicas} is negative (0: the run shares the replicas)")
        max_runs = self.services["generation"].settings.get("max_runs", 0)
        names = set(self.runs) | {run}
        sharing = [name for name in names if self.runs.get(name, spec).shared]
        if spec.shared and len(sharing) > max_runs:
            raise ValueError(f"services.generation.settings.max_runs is {max_runs}: the replicas serve that many "
                             f"runs at once, and this fleet would have {len(sharing)}; raise it (and restart the "
                             "replicas), end a run first, or give this run replicas of its own (replicas: N)")
        for service in RUN_SERVICES:
            where = {other: state_location(service, self.run_settings(service, other)) for other in sorted(names)}
            same = [other for other in where if other != run and where[other] == where[run]]
            if same:
                raise ValueError(f"services.{service}.settings: runs {run} and {same[0]} would share their durable "
                                 f"state ({where[run]}): write {{run}} or {{key}} in it, e.g. "
                                 f"\"{{workdir}}/{{key}}/...\" or database_schema \"rlfleet_{service}_{{run}}\"")

    def run_settings(self, service: str, run: str) -> dict[str, Any]:
        """``run``'s ``service`` settings: the template's with ``{workdir}``, ``{key}`` and ``{run}`` filled in,
        the run's name, and for the collector the shared replicas, its weight and its own settings."""
        from rlfleet.ray.actor import substitute

        spec = (self.runs or {}).get(run, RunSpec())
        settings = {**self.services[service].settings, "run_name": run}
        if service == "collector":
            if spec.shared:
                settings.update(shared_replicas=True, share_weight=spec.share_weight)
            settings.update(spec.settings)
        return substitute(copy.deepcopy(settings), {"workdir": self.workdir, "key": run_key(service, run), "run": run})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FleetConfig":
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        if set(data) - known:
            raise ValueError(f"unknown fleet settings {sorted(set(data) - known)}; known: {sorted(known)}")
        services = {}
        if data.get("runs") is not None:
            run_fields = {f.name for f in dataclasses.fields(RunSpec)}
            runs = {}
            for run, spec in dict(data["runs"]).items():
                spec = dict(spec or {})
                if set(spec) - run_fields:
                    raise ValueError(f"runs.{run}: unknown {sorted(set(spec) - run_fields)}; known: {sorted(run_fields)}")
                runs[str(run)] = RunSpec(**spec)
            data["runs"] = runs
        spec_fields = {f.name for f in dataclasses.fields(ServiceSpec)}
        for name, spec in (data.pop("services", None) or {}).items():
            spec = dict(spec or {})
            if set(spec) - spec_fields:
                raise ValueError(f"services.{name}: unknown {sorted(set(spec) - spec_fields)}; known: {sorted(spec_fields)}")
            services[name] = ServiceSpec(**spec)
        return cls(**data, services=services)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(path: str | Path) -> FleetConfig:
    """A fleet config from a YAML (or JSON) file; its relative ``credentials`` and ``workdir`` are
    relative to the file's directory (made absolute here: the fleet's spec, which ``scale`` and ``down``
    read from the registry wherever they run, holds them so)."""
    import yaml

    path = Path(path)
    config = FleetConfig.from_dict(yaml.safe_load(path.read_text()) or {})
    base = path.resolve().parent
    if config.credentials:
        config.credentials = str(base / config.credentials)
    config.workdir = str(base / config.workdir)
    return config
