"""``bench/fleet.py --ray``: the same fleet as plain processes and as Ray actors, side by side.

    .venv/bin/python bench/fleet.py --ray [--replicas 4] [--rounds 5] [--seconds 8]

Two fleets with the same services and settings: trajectory, reference, reward, the collector, and
``--replicas`` (the largest of the list) ``bench/loadgen_generation.py`` load generators; one started as
processes by this bench (``bench/fleet.py``'s ``Fleet``: the collector reads a replica file), one by
``rlfleet.ray.Fleet`` on a local Ray cluster of three nodes (``ray.cluster_utils``: the head and two
worker nodes, the loadgens spread over the workers, the collector reading them from the Ray registry).
Each has its own SDK trainer process(es). Both start up front, then the rounds alternate: in each
round each fleet in turn (the order flips every round) runs a window of ``--seconds`` s while every
process of the other fleet (trainers included) is stopped (SIGSTOP), so the two never share the cores.
Ray's own daemons (GCS, raylets) run throughout: their cost lands on both sides' machine load alike.

Reported: trajectories/s delivered to the trainers per fleet (medians over rounds), CPU ms per
trajectory per process, and ``ray_over_processes``, the median of the per-round ratios; then, the
fleets down, ``bench/store_appends.py``'s ``postgres_over_sqlite_appends`` (the trajectory store's
appends per second on PostgreSQL over SQLite). The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from _common import CpuMeter
from dataplane import STARTUP_TIMEOUT_SECONDS, Trainers, counters, pipeline_args, settle, window

BENCH = Path(__file__).resolve().parent
ADDRESS_FLAGS = {"--reference-address", "--reward-address", "--trajectory-address", "--state-dir"}


def log(message: str) -> None:
    print(f"[fleet --ray] {message}", file=sys.stderr, flush=True)


def collector_flags(ns, workdir: Path) -> list[str]:
    """The bench's collector flags without the upstream addresses and state dir (the Ray fleet sets those)."""
    placeholder = type("Placeholder", (), {"address": "-"})()
    flags = pipeline_args(ns, {"reference": placeholder, "reward": placeholder, "trajectory": placeholder}, workdir)
    kept, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in ADDRESS_FLAGS:
            skip = True
        else:
            kept.append(flag)
    return kept


def ray_config(model_dir: Path, workdir: Path, ns, replicas: int):
    from rlfleet.ray import FleetConfig

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    log_args = ["--log-format", "text", "--log-level", ns.log_level]
    return FleetConfig.from_dict({"name": "bench", "workdir": str(workdir), "services": {
        "trajectory": {"num_cpus": 0, "args": ["--db-path", "{workdir}/trajectory/trajectories.db", *log_args]},
        "reference": {"num_cpus": 0, "args": ["--model-path", str(model_dir), "--torch-threads",
                                              str(ns.reference_threads), *log_args]},
        "reward": {"num_cpus": 0, "args": ["--tokenizer-path", str(model_dir), *log_args]},
        # The loadgen takes no --config: its flags as args; found as a module from bench/.
        "generation": {"replicas": replicas, "placement": "spread", "num_cpus": 0, "resources": {"worker": 1},
                       "module": "loadgen_generation", "env": {"PYTHONPATH": str(BENCH)},
                       "args": ["--vocab-size", str(vocab)]},
        "collector": {"num_cpus": 0, "args": [*collector_flags(ns, workdir), "--state-dir",
                                              "{workdir}/collector/state", "--discovery-refresh-seconds",
                                              str(ns.discovery_refresh_seconds), "--replica-check-seconds",
                                              str(ns.replica_check_seconds), *log_args]},
    }})


class Side:
    """One fleet as measured: its collector's client, its trainers, its processes (for CPU and SIGSTOP)."""

    def __init__(self, name: str, address: str, pids: dict[str, list[int]], trainers: Trainers):
        from rlfleet.client import connect

        self.name, self.trainers = name, trainers
        self.client = connect(address)
        self.meter = CpuMeter({})
        for key, roots in pids.items():
            self.meter.trees[key] = [psutil.Process(pid) for pid in roots]
        self.meter.trees["trainer"] = [psutil.Process(pid) for pid in trainers.pids]

    def processes(self) -> list[psutil.Process]:
        found = []
        for roots in self.meter.trees.values():
            for root in roots:
                try:
                    found += [root, *root.children(recursive=True)]
                except psutil.NoSuchProcess:
                    pass
        return found

    def signal(self, number: int) -> None:
        for process in self.processes():
            try:
                os.kill(process.pid, number)
            except ProcessLookupError:
                pass

    def measure(self, ns) -> dict:
        self.signal(signal.SIGCONT)
        time.sleep(ns.step_warmup)
        before = counters(self.client, self.trainers, self.meter)
        time.sleep(ns.seconds)
        measured = window(before, counters(self.client, self.trainers, self.meter))
        self.trainers.check()
        self.signal(signal.SIGSTOP)
        log(f"{self.name:<9} {measured['traj_per_s']:7.0f} traj/s, collector "
            f"{measured['cpu_ms_per_traj']['collector']:.2f} ms/traj, machine {measured['machine_cores']:.2f} cores")
        return measured


def start_processes(model_dir: Path, workdir: Path, ns, replicas: int, fleet_class):
    fleet = fleet_class(model_dir, workdir, ns)
    fleet.start(replicas, replicas)
    pids = {key: [fleet.procs[key].process.pid] for key in ("collector", "reference", "reward", "trajectory")}
    pids["loadgen"] = [proc.process.pid for proc in fleet.pool]
    return fleet, fleet.procs["collector"].address, pids


def start_ray(model_dir: Path, workdir: Path, ns, replicas: int):
    import ray
    from ray.cluster_utils import Cluster

    from rlfleet.ray import Fleet

    workdir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2, resources={"worker": replicas})
        ray.init(address=cluster.address, logging_level="WARNING")
        fleet = Fleet.up(ray_config(model_dir, workdir, ns, replicas))
    except BaseException:
        ray.shutdown()
        cluster.shutdown()
        raise
    records = fleet.status()
    nodes = {record["node_id"] for key, record in records.items() if key.startswith("generation")}
    log(f"Ray fleet up on {len(ray.nodes())} nodes; the {replicas} loadgens on {len(nodes)} worker nodes")
    pids = {key: [records[key]["pid"]] for key in ("collector", "reference", "reward", "trajectory")}
    pids["loadgen"] = [record["pid"] for key, record in records.items() if key.startswith("generation")]
    return cluster, fleet, fleet.address("collector"), pids


def store_ratio(ns) -> dict:
    """bench/store_appends.py's ``measure`` (PostgreSQL against SQLite appends), after the fleets are down."""
    import store_appends

    log("trajectory store appends: PostgreSQL against SQLite (bench/store_appends.py)")
    result = store_appends.measure(rounds=ns.rounds)
    return {"postgres_over_sqlite_appends": result["postgres_over_sqlite_appends"], "store_appends": result}


def run(ns, fleet_class) -> None:
    from safetensors.torch import load_file  # noqa: F401 - the trainers load the model file themselves

    from rlfleet.services.models.tiny import build_tiny_model

    replicas = ns.replicas[-1]
    model_dir = ns.model_dir or build_tiny_model(Path(tempfile.gettempdir()) / "rlfleet-bench-tiny-model")
    workdir = Path(ns.workdir or tempfile.mkdtemp(prefix="rlfleet-bench-ray-"))
    load_start = os.getloadavg()
    log(f"work directory: {workdir}; {replicas} loadgen replicas per fleet; load average {load_start[0]:.1f}")
    processes = cluster = ray_fleet = None
    sides: list[Side] = []
    trainers: list[Trainers] = []
    try:
        processes, address, pids = start_processes(model_dir, workdir / "processes", ns, replicas, fleet_class)
        trainers.append(Trainers(ns.trainers, address, model_dir, ns).start())
        sides.append(Side("processes", address, pids, trainers[-1]))
        cluster, ray_fleet, address, pids = start_ray(model_dir, workdir / "ray", ns, replicas)
        trainers.append(Trainers(ns.trainers, address, model_dir, ns).start())
        sides.append(Side("ray", address, pids, trainers[-1]))
        for side in sides:  # each settles alone
            other = sides[1 - sides.index(side)]
            other.signal(signal.SIGSTOP)
            side.signal(signal.SIGCONT)
            settle(side.client, side.trainers, ns)
            time.sleep(ns.warmup)
        sides[1].signal(signal.SIGSTOP)
        rounds: dict[str, list[dict]] = {"processes": [], "ray": []}
        for index in range(ns.rounds):
            for side in (sides if index % 2 == 0 else sides[::-1]):
                rounds[side.name].append(side.measure(ns))
    finally:
        for side in sides:
            side.signal(signal.SIGCONT)
        for trainer in trainers:
            trainer.close()
        for side in sides:
            side.client.close()
        if ray_fleet is not None:
            ray_fleet.down()
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()
        if processes is not None:
            processes.close()
    report(rounds, replicas, (load_start, os.getloadavg()), store_ratio(ns), ns)


def report(rounds: dict[str, list[dict]], replicas: int, load: tuple, store: dict, ns) -> None:
    ratios = [r["traj_per_s"] / p["traj_per_s"] for p, r in zip(rounds["processes"], rounds["ray"])]
    rows = {name: {"traj_per_s": statistics.median(w["traj_per_s"] for w in windows),
                   "per_round_traj_per_s": [w["traj_per_s"] for w in windows],
                   "collector_cpu_ms_per_traj": statistics.median(w["cpu_ms_per_traj"]["collector"] for w in windows),
                   "all_cpu_ms_per_traj": statistics.median(sum(w["cpu_ms_per_traj"].values()) for w in windows),
                   "machine_cores": statistics.median(w["machine_cores"] for w in windows)}
            for name, windows in rounds.items()}
    print(f"\nfleet --ray | the same fleet ({replicas} loadgen replicas, reference, reward, trajectory, collector, "
          f"{ns.trainers} SDK trainer(s)) as processes and as Ray actors on a local 3-node cluster | "
          f"{ns.rounds} rounds x {ns.seconds:g} s per fleet, the other fleet stopped | {psutil.cpu_count()} cores")
    header = f"{'fleet':>9} | {'traj/s':>7} | {'per round':>30} | {'coll ms/traj':>12} | {'all ms':>6} | {'machine':>7}"
    print(header)
    print("-" * len(header))
    for name, row in rows.items():
        per_round = ", ".join(f"{x:.0f}" for x in row["per_round_traj_per_s"])
        print(f"{name:>9} | {row['traj_per_s']:>7.0f} | {per_round:>30} | {row['collector_cpu_ms_per_traj']:>10.2f}ms"
              f" | {row['all_cpu_ms_per_traj']:>6.2f} | {row['machine_cores']:>7.2f}")
    ratio = statistics.median(ratios)
    print(f"ray / processes: {ratio:.3f} (median of the per-round ratios {', '.join(f'{x:.3f}' for x in ratios)})")
    print(f"trajectory store appends, postgres / sqlite: {store['postgres_over_sqlite_appends']:.2f} "
          f"(medians of {ns.rounds} rounds, bench/store_appends.py)")
    result = {"ray_over_processes": ratio, "ray_over_processes_per_round": ratios, "replicas": replicas,
              "fleets": rows, **store, "load_average_start_end": load,
              "cpu_count": psutil.cpu_count(),
              "settings": {key: getattr(ns, key) for key in ("rounds", "seconds", "warmup", "step_warmup",
                                                              "group_size", "max_tokens", "batch_size", "trainers")}}
    print("RESULT " + json.dumps(result))
