"""Up to 32 generation replicas (load generators) behind one collector.

    .venv/bin/python bench/fleet.py [--replicas 1,4,16,32] [--rounds 5] [--seconds 8] [--pushes 3]

The harness of ``bench/dataplane.py`` (real trajectory, reference, reward and collector services,
an SDK trainer process, per-process CPU, medians of rounds), with N generation replicas, each a
``bench/loadgen_generation.py`` LOAD GENERATOR (a real gRPC server answering at once with pre-made
samples; never a stand-in in tests). Every loadgen starts up front; the collector reads its
replicas from a JSON file this bench writes (``--generation-addresses-file``, re-read every
``--discovery-refresh-seconds``), as an autoscaler would. Three parts, one run:

1. Scaling. ``--rounds`` rounds over the steps of ``--replicas`` (ascending, then descending, so a
   drift in the machine's load hits every step alike). A step writes its first N loadgens into
   the file, waits until Status shows exactly them in rotation (added ones are re-synced to the
   committed weights first: the "join" time), ``--step-warmup`` s, then one window of ``--seconds``
   s: trajectories/s delivered to the trainer, CPU ms per trajectory and cores per process tree,
   how the replicas shared the work (their CPU); then ``--pushes`` weight pushes of the tiny model
   (the SDK's ``push_weights``, transport ``auto``) to all N while the pipeline runs. Per step:
   medians over rounds, and ratios to the first step as the median of per-round ratios. One push
   before the rounds, not measured, keeps one-time setup (spool, segments) out of the first step.
2. A replica leaving mid-run, every replica in the file: ``--leave-prompts`` prompts are submitted
   (they go ahead of the dataset); the first loadgen (least-loaded's ties go to it) is frozen
   (SIGSTOP) until Status shows samples in flight on it (an instant generator rarely holds any),
   then SIGKILLed and dropped from the file. Reported: the submitted prompts' trajectories that
   never reached the trainer (must be 0), dead letters meanwhile (must be 0), the seconds until
   Status shows it out of rotation and until it is gone from the list. Then a fresh loadgen (at
   version 0) is named in the file: the seconds until Status shows it in rotation at the committed
   version, its re-sync from the spool included.
3. Where the collector saturates: the step after which traj/s stops growing (the next step adds
   under ``--growth``), and what is at its ceiling there: one process at ~1 core, or the machine.

The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import queue
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from _common import CpuMeter, summarize
from dataplane import (STARTUP_TIMEOUT_SECONDS, LoadgenProcess, Trainers, add_arguments, common_args,
                       counters, extra_args, medians, pipeline_args, settle, start_upstream, stop_services, window)
from pipeline import StatusPoller
from rlfleet.services.launch import ServiceProcess

LEAVE_PREFIX = "leave-"
POLL_SECONDS = 0.05
MEMBERSHIP_TIMEOUT_SECONDS = 180.0


def log(message: str) -> None:
    print(f"[fleet] {message}", file=sys.stderr, flush=True)


class PromptTap:
    """Called in the trainer process with each batch: the prompt ids starting with ``prefix`` go to
    ``out`` (one id per trajectory)."""

    def __init__(self, out, prefix: str):
        self.out, self.prefix = out, prefix

    def __call__(self, batch) -> None:
        ids = [prompt_id for prompt_id in batch["prompt_id"].tolist() if prompt_id.startswith(self.prefix)]
        if ids:
            self.out.put(ids)


class Fleet:
    """The services, the loadgens and the replica file the collector reads."""

    def __init__(self, model_dir: Path, workdir: Path, ns):
        self.model_dir, self.workdir, self.ns = model_dir, workdir, ns
        self.procs: dict[str, ServiceProcess] = {}
        self.pool: list[LoadgenProcess] = []
        """The loadgens alive, in order: a step of n replicas puts the first n in the file."""
        self.members: list[LoadgenProcess] = []
        """The replicas in the file now."""
        self.started: list[LoadgenProcess] = []
        self.members_file = workdir / "replicas.json"
        self.vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    def start(self, loadgens: int, first: int) -> None:
        """Upstream services and every loadgen, all SERVING; then the collector with ``first`` of them."""
        start_upstream(self.model_dir, self.workdir, self.ns, self.procs)
        self.pool = self.spawn(loadgens)
        self.use(first)
        for proc in self.procs.values():
            proc.wait_ready(STARTUP_TIMEOUT_SECONDS)
        args = ["--generation-addresses-file", str(self.members_file),
                "--discovery-refresh-seconds", str(self.ns.discovery_refresh_seconds),
                "--replica-check-seconds", str(self.ns.replica_check_seconds),
                *pipeline_args(self.ns, self.procs, self.workdir), *common_args(self.ns),
                *extra_args(self.ns, "collector")]
        self.procs["collector"] = ServiceProcess("collector", args).start(self.workdir / "collector")
        self.procs["collector"].wait_ready(STARTUP_TIMEOUT_SECONDS)
        for key, proc in self.procs.items():
            log(f"{key:<10} SERVING on {proc.address} (pid {proc.process.pid})")

    def spawn(self, count: int) -> list[LoadgenProcess]:
        """``count`` fresh loadgens, started in parallel, SERVING (not in the file yet)."""
        fresh = []
        for _ in range(count):
            name = f"loadgen-{len(self.started)}"
            self.started.append(LoadgenProcess("loadgen", ["--vocab-size", str(self.vocab)]))
            fresh.append(self.started[-1].start(self.workdir / name))  # stopped at the end whatever happens
        started = time.monotonic()
        for proc in fresh:
            proc.wait_ready(STARTUP_TIMEOUT_SECONDS)
        log(f"{count} loadgen(s) SERVING after {time.monotonic() - started:.1f} s")
        return fresh

    def use(self, replicas: int) -> None:
        """The first ``replicas`` loadgens in the file."""
        self.members = self.pool[:replicas]
        self.write_members()

    def kill(self, victim: LoadgenProcess) -> None:
        """SIGKILL ``victim``, then drop it from the file (a pod dies, its endpoint goes)."""
        victim.kill()
        self.pool.remove(victim)
        self.members.remove(victim)
        self.write_members()

    def add(self) -> LoadgenProcess:
        """A fresh loadgen, SERVING, then named in the file."""
        fresh = self.spawn(1)[0]
        self.pool.append(fresh)
        self.members.append(fresh)
        self.write_members()
        return fresh

    def addresses(self) -> set[str]:
        return {proc.address for proc in self.members}

    def write_members(self) -> None:
        """The file the collector re-reads, replaced atomically (a reader never sees half of it)."""
        tmp = self.members_file.with_suffix(".tmp")
        tmp.write_text(json.dumps([proc.address for proc in self.members]))
        os.replace(tmp, self.members_file)

    def close(self) -> None:
        """The collector first (it drives the rest), then the loadgens, then the upstream services."""
        if "collector" in self.procs:
            self.procs.pop("collector").stop()
        for proc in self.started:
            proc.stop()
        stop_services(self.procs)


# ---------------------------------------------------------------- membership as Status shows it

def wait_in_rotation(client, addresses: set[str], timeout: float = MEMBERSHIP_TIMEOUT_SECONDS) -> float:
    """Seconds until Status lists exactly ``addresses``, all healthy at the committed version."""
    started = time.monotonic()
    while True:
        status = client.status()
        listed = {r.address for r in status.replicas}
        ready = {r.address for r in status.replicas if r.healthy and r.policy_version == status.policy_version}
        if listed == addresses == ready:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"after {timeout:g} s Status lists {len(listed)} replicas, {len(ready)} in rotation "
                               f"at v{status.policy_version}; expected {len(addresses)}")
        time.sleep(POLL_SECONDS)


def replica(status, address: str):
    return next((r for r in status.replicas if r.address == address), None)


# ---------------------------------------------------------------- part 1: rounds of steps

def make_meter(fleet: Fleet, trainers: Trainers) -> CpuMeter:
    """CPU per process tree, dataplane.py's keys; "loadgen" is every loadgen (idle ones cost ~0)."""
    meter = CpuMeter({})
    for key in ("collector", "reference", "reward", "trajectory"):
        meter.add(key, fleet.procs[key].process.pid)
    meter.trees["loadgen"] = [psutil.Process(proc.process.pid) for proc in fleet.pool]
    meter.trees["trainer"] = [psutil.Process(pid) for pid in trainers.pids]
    meter.trees["bench"] = [psutil.Process()]  # this process (Status polls, pushes): not "others"
    return meter


def loadgen_cpu(fleet: Fleet) -> dict[str, float]:
    return CpuMeter({proc.address: [psutil.Process(proc.process.pid)] for proc in fleet.members}).snapshot()


def pushes(client, state, replicas: int, ns) -> dict:
    """``ns.pushes`` pushes of ``state`` to every replica while the pipeline runs."""
    results = []
    for _ in range(ns.pushes):
        time.sleep(ns.push_gap)  # a push waits for the previous one's spool fsync: not what is measured here
        result = client.push_weights(state, progress=False)
        if not result.all_applied or len(result.replicas) != replicas:
            raise RuntimeError(f"push v{result.version}: {sum(r.applied for r in result.replicas)} of "
                               f"{replicas} replicas applied it: {result.replicas}")
        results.append(result)
    return {"seconds": [r.seconds for r in results], "server_seconds": [r.server_seconds for r in results],
            "slowest_stage_seconds": [max(x.stage_seconds for x in r.replicas) for r in results],
            "slowest_apply_seconds": [max(x.apply_seconds for x in r.replicas) for r in results],
            "transport": f"trainer {results[0].transport}, replicas {results[0].replica_transport}",
            "bytes": results[0].bytes}


def sample(fleet: Fleet, client, trainers: Trainers, meter: CpuMeter, state, replicas: int, ns) -> dict:
    """One step of one round: the file set to ``replicas``, the wait for Status to show them in
    rotation, ``--step-warmup`` s, one window of ``--seconds`` s, then the pushes."""
    added = replicas - len(fleet.members)
    fleet.use(replicas)
    rotation = wait_in_rotation(client, fleet.addresses())
    time.sleep(ns.step_warmup)
    with StatusPoller(fleet.procs["collector"].address, period=0.5) as poller:
        shares_before, before = loadgen_cpu(fleet), counters(client, trainers, meter)
        time.sleep(ns.seconds)
        after = counters(client, trainers, meter)
    measured = window(before, after)
    measured["stages"] = poller.mean()
    ours = sum(measured["cores"].values()) + (after["cpu"]["bench"] - before["cpu"]["bench"]) / measured["seconds"]
    measured["others_cores"] = measured["machine_cores"] - ours  # other users' processes on the machine
    shares = CpuMeter.delta(shares_before, loadgen_cpu(fleet))
    trainers.check()
    push = pushes(client, state, replicas, ns)
    busiest = max(shares.values()) / (sum(shares.values()) or 1e-9)
    log(f"{replicas:>3} replicas ({added:+d}, in rotation after {rotation:.2f} s): {measured['traj_per_s']:.0f} "
        f"traj/s, collector {measured['cpu_ms_per_traj']['collector']:.2f} ms/traj, cores "
        f"{({k: round(v, 2) for k, v in measured['cores'].items()})}, machine {measured['machine_cores']:.2f} (others "
        f"{measured['others_cores']:.2f}), "
        f"busiest replica {busiest:.0%}; pushes {', '.join(f'{s:.3f}' for s in push['seconds'])} s (collector "
        f"{', '.join(f'{s:.3f}' for s in push['server_seconds'])} s)")
    return {"window": measured, "join_seconds": rotation if added > 0 else None, "busiest_replica_share": busiest,
            "push": push}


def run_rounds(fleet: Fleet, client, trainers: Trainers, state, ns) -> dict[int, list[dict]]:
    """``ns.rounds`` rounds over the steps, ascending then descending (drift in the machine's load
    hits every step alike); each step's samples, by replica count."""
    meter = make_meter(fleet, trainers)
    samples: dict[int, list[dict]] = {replicas: [] for replicas in ns.replicas}
    for index in range(ns.rounds):
        log(f"round {index}")
        for replicas in (ns.replicas if index % 2 == 0 else ns.replicas[::-1]):
            samples[replicas].append(sample(fleet, client, trainers, meter, state, replicas, ns))
    return samples


def step_rows(samples: dict[int, list[dict]]) -> list[dict]:
    """Per step: medians over rounds, and the medians of the per-round ratios to the first step."""
    base = samples[min(samples)]
    rows = []
    for replicas, taken in samples.items():
        row = {"replicas": replicas, **medians([s["window"] for s in taken])}
        row["per_round_traj_per_s"] = [s["window"]["traj_per_s"] for s in taken]
        row["ours_cpu_ms_per_traj"] = sum(row["cpu_ms_per_traj"].values())
        traj = summarize([b["window"]["traj_per_s"] for b in base], row["per_round_traj_per_s"])
        row["traj_ratio"], row["traj_ratio_quartiles"] = traj["ratio"], (traj["low"], traj["high"])
        row["per_push_seconds"] = [x for s in taken for x in s["push"]["seconds"]]
        row["push_seconds"] = statistics.median(row["per_push_seconds"])
        row["push_ratio"] = summarize([statistics.median(b["push"]["seconds"]) for b in base],
                                      [statistics.median(s["push"]["seconds"]) for s in taken])["ratio"]
        for part in ("server_seconds", "slowest_stage_seconds", "slowest_apply_seconds"):
            row[f"push_{part}"] = statistics.median(x for s in taken for x in s["push"][part])
        row["push_transport"], row["push_bytes"] = taken[0]["push"]["transport"], taken[0]["push"]["bytes"]
        joins = [s["join_seconds"] for s in taken if s["join_seconds"] is not None]
        row["join_seconds"] = statistics.median(joins) if joins else None
        row["busiest_replica_share"] = statistics.median(s["busiest_replica_share"] for s in taken)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- a replica leaves, another joins

def freeze_until_busy(client, victim: LoadgenProcess, timeout: float = 10.0) -> int:
    """SIGSTOP ``victim`` and wait until Status shows samples in flight on it (calls routed there
    now hang): its SIGKILL then cuts work in flight. Returns those samples (0: none came in time)."""
    os.kill(victim.process.pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = replica(client.status(), victim.address)
        if found is not None and found.in_flight > 0:
            return found.in_flight
        time.sleep(POLL_SECONDS)
    return 0


def watch_leave(client, address: str, timeout: float = 60.0) -> tuple[float, float]:
    """Seconds until Status shows ``address`` out of rotation, and until it is gone from the list."""
    started, out_of_rotation = time.monotonic(), None
    while time.monotonic() - started < timeout:
        found = replica(client.status(), address)
        now = time.monotonic() - started
        if out_of_rotation is None and (found is None or not found.healthy):
            out_of_rotation = now
        if found is None:
            return out_of_rotation, now
        time.sleep(POLL_SECONDS)
    raise TimeoutError(f"{address} still listed by Status {timeout:g} s after it was killed and dropped")


def delivered(taps: "queue.Queue", prompt_ids: list[str], group_size: int, timeout: float) -> collections.Counter:
    """Trajectories the trainer received per submitted prompt id, read until each has its whole
    group or ``timeout`` s."""
    counts: collections.Counter = collections.Counter()
    missing = set(prompt_ids)
    deadline = time.monotonic() + timeout
    while missing and time.monotonic() < deadline:
        try:
            counts.update(taps.get(timeout=1.0))
        except queue.Empty:
            continue
        missing = {p for p in missing if counts[p] < group_size}
    return counts


def leave(fleet: Fleet, client, taps, ns) -> dict:
    """Every replica in rotation, submitted prompts in flight: one loadgen SIGKILLed and dropped."""
    fleet.use(len(fleet.pool))
    wait_in_rotation(client, fleet.addresses())
    failed_before = client.status().failed_prompts
    prompt_ids = [f"{LEAVE_PREFIX}{i}" for i in range(ns.leave_prompts)]
    client.submit_prompts([{"prompt": f"what is {i} plus 1?", "prompt_id": prompt_id, "ground_truth": str(i + 1)}
                           for i, prompt_id in enumerate(prompt_ids)])
    victim = fleet.members[0]  # the first replica wins least-loaded's ties: it has the most work
    in_flight = freeze_until_busy(client, victim)
    fleet.kill(victim)
    out_of_rotation, gone = watch_leave(client, victim.address)
    log(f"leave: {in_flight} samples in flight on {victim.address} at the SIGKILL; out of rotation after "
        f"{out_of_rotation:.2f} s, gone from Status after {gone:.2f} s")
    counts = delivered(taps, prompt_ids, ns.group_size, ns.leave_timeout)
    lost = sum(max(0, ns.group_size - counts[p]) for p in prompt_ids)
    duplicated = sum(max(0, counts[p] - ns.group_size) for p in prompt_ids)
    dead_letters = client.status().failed_prompts - failed_before
    log(f"leave: {lost} of {ns.group_size * len(prompt_ids)} submitted trajectories lost, {duplicated} "
        f"delivered twice, {dead_letters} dead letters")
    return {"leave_lost_trajectories": lost, "leave_duplicated_trajectories": duplicated,
            "leave_dead_letters": dead_letters, "leave_submitted_trajectories": ns.group_size * len(prompt_ids),
            "leave_in_flight_at_kill": in_flight, "leave_out_of_rotation_seconds": out_of_rotation,
            "leave_detected_seconds": gone}


def join(fleet: Fleet, client, trainers: Trainers) -> dict:
    """A fresh loadgen (at version 0) named in the file: seconds until it is in rotation, re-synced."""
    fresh = fleet.add()
    seconds = wait_in_rotation(client, fleet.addresses())
    version = client.policy_version
    trainers.check()
    log(f"join: {fresh.address} in rotation at v{version} {seconds:.2f} s after the file named it")
    return {"join_in_rotation_seconds": seconds, "join_resynced_to_version": version}


# ---------------------------------------------------------------- where it saturates; the report

def saturation(rows: list[dict], ns) -> tuple[dict, str, str]:
    """The step after which traj/s stops growing, who is the ceiling there, and the sentence."""
    at = rows[-1]
    for row, following in zip(rows, rows[1:]):
        if following["traj_ratio"] < (1 + ns.growth) * row["traj_ratio"]:
            at = row
            break
    cpus = psutil.cpu_count() or 1
    cores = at["cores"]
    busiest = max(cores, key=cores.get)
    if at["machine_cores"] >= 0.9 * cpus:
        who = "machine"
        why = (f"the machine's {cpus} cores are {at['machine_cores'] / cpus:.0%} busy ({at['others_cores']:.2f} cores "
               f"of it other users' processes) while the busiest process, the {busiest}, uses "
               f"{cores[busiest]:.2f} cores")
    elif cores[busiest] >= 0.85:
        who = busiest
        why = f"the {busiest} is at {cores[busiest]:.2f} cores (one asyncio process: ~1 core is its ceiling)"
    else:  # then the stage the groups in flight wait in sets the pace
        stages = at["stages"]
        who = max(stages, key=stages.get)
        why = (f"no process is at a core (the busiest, the {busiest}, uses {cores[busiest]:.2f}; the machine is "
               f"{at['machine_cores'] / cpus:.0%} busy, {at['others_cores']:.2f} cores of it others') and of the "
               f"{sum(stages.values()):.0f} groups in flight (limit {ns.max_groups_in_flight}) {stages[who]:.0f} "
               f"are in the {who} stage: the {who} service sets the pace on its share of the contended cores")
    if at is rows[-1] and len(rows) > 1:
        where = f"traj/s still grows at the last step, {at['replicas']} replicas ({at['traj_per_s']:.0f} traj/s)"
    else:
        following = rows[rows.index(at) + 1] if at is not rows[-1] else None
        where = (f"traj/s stops growing after {at['replicas']} replica(s) ({at['traj_per_s']:.0f} traj/s"
                 + (f"; {following['replicas']} replicas: {following['traj_ratio'] / at['traj_ratio']:.2f}x of it)"
                    if following else ")"))
    return at, who, f"{where}: {why}. {cpu_costs(rows, cpus)}"


def cpu_costs(rows: list[dict], cpus: int) -> str:
    """What CPU per trajectory (unlike traj/s, little moved by other users' load) says of the ceilings."""
    first, last = rows[0], rows[-1]
    collector = [row["cpu_ms_per_traj"]["collector"] for row in (first, last)]
    per_traj = last["cpu_ms_per_traj"]
    costliest = max(per_traj, key=per_traj.get)
    others = [row["others_cores"] for row in rows]
    confounded = (f" Other users' load moved by {max(others) - min(others):.2f} cores between the steps: the traj/s "
                  f"ratios are confounded by it, the CPU per trajectory is not." if max(others) - min(others) > 0.3
                  else "")
    return (f"CPU per trajectory: the collector's {collector[0]:.2f} ms with {first['replicas']} replica(s), "
            f"{collector[1]:.2f} ms with {last['replicas']} ({collector[1] / collector[0] - 1:+.0%}): alone on a core "
            f"it would cap at ~{1000 / collector[0]:.0f} and ~{1000 / collector[1]:.0f} traj/s; the {costliest} costs "
            f"the most ({per_traj[costliest]:.2f} ms: ~{1000 / per_traj[costliest]:.0f} traj/s on a core), so it "
            f"reaches a core first; this bench's processes together take {last['ours_cpu_ms_per_traj']:.2f} ms with "
            f"{last['replicas']} replicas: the {cpus} cores cap at ~{cpus * 1000 / last['ours_cpu_ms_per_traj']:.0f} "
            f"traj/s.{confounded}")


def print_table(rows: list[dict], ns) -> None:
    print(f"\nfleet | loadgen replicas behind one real collector (reference, reward, trajectory real), {ns.trainers} "
          f"SDK trainer(s) | groups of {ns.group_size} x {ns.max_tokens} tokens, batches of {ns.batch_size} | "
          f"{ns.rounds} rounds (steps ascending, then descending) x {ns.seconds:g} s per step after "
          f"{ns.step_warmup:g} s, {ns.pushes} pushes per step and round | {psutil.cpu_count()} cores")
    header = (f"{'replicas':>8} | {'traj/s':>7} | {'vs 1 [quartiles]':>17} | {'coll ms/traj':>12} | {'all ms':>6} | "
              f"{'coll cores':>10} | {'ref cores':>9} | {'in ref':>6} | {'loadgens':>8} | {'machine':>7} | "
              f"{'others':>6} | {'busiest':>7} | {'join s':>6} | {'push s':>7} | {'push vs 1':>9}")
    print(header)
    print("-" * len(header))
    for row in rows:
        low, high = row["traj_ratio_quartiles"]
        join = f"{row['join_seconds']:.2f}" if row["join_seconds"] is not None else "-"
        print(f"{row['replicas']:>8} | {row['traj_per_s']:>7.0f} | {row['traj_ratio']:>5.2f} [{low:.2f}-{high:.2f}] | "
              f"{row['cpu_ms_per_traj']['collector']:>10.2f}ms | {row['ours_cpu_ms_per_traj']:>6.2f} | "
              f"{row['cores']['collector']:>10.2f} | {row['cores']['reference']:>9.2f} | "
              f"{row['stages']['reference']:>6.1f} | "
              f"{row['cores']['loadgen']:>8.2f} | {row['machine_cores']:>7.2f} | {row['others_cores']:>6.2f} | "
              f"{row['busiest_replica_share']:>7.0%} | {join:>6} | {row['push_seconds']:>7.3f} | "
              f"{row['push_ratio']:>9.2f}")
    print("traj/s = delivered to the trainer (median of rounds); vs 1 = median of the per-round ratios to the first "
          "step; coll = the collector; all ms = CPU ms per trajectory\nof this bench's services, loadgens and trainer "
          "together; cores = CPU s per wall s; in ref = groups inside the collector's reference stage (mean);\n"
          "loadgens = all loadgens' cores together; machine = cores busy on the whole machine; others = of those, not "
          "this bench's processes;\nbusiest = the busiest replica's share of the loadgens' CPU; join s = file written "
          "-> Status shows the added replicas in rotation (re-synced), median of\nthe rounds that grew to the step; "
          "push s = median SDK push_weights wall time to all replicas.")


def report(rows: list[dict], parts: dict, load: tuple, ns) -> dict:
    print_table(rows, ns)
    at, who, sentence = saturation(rows, ns)
    print(f"  pushes: {rows[-1]['push_transport']}, {rows[-1]['push_bytes'] / 1e6:.1f} MB")
    print(f"  leave: {parts['leave_lost_trajectories']} of {parts['leave_submitted_trajectories']} submitted "
          f"trajectories lost, {parts['leave_dead_letters']} dead letters, {parts['leave_in_flight_at_kill']} "
          f"samples in flight on the killed replica; out of rotation {parts['leave_out_of_rotation_seconds']:.2f} s, "
          f"gone from Status {parts['leave_detected_seconds']:.2f} s (discovery every "
          f"{ns.discovery_refresh_seconds:g} s)")
    print(f"  join: a fresh replica in rotation {parts['join_in_rotation_seconds']:.2f} s after the file named it "
          f"(re-synced to v{parts['join_resynced_to_version']}; replica checks every {ns.replica_check_seconds:g} s)")
    print(f"  saturates: {sentence}")
    by = {str(row["replicas"]): row for row in rows}
    return {"traj_per_s_by_replicas": {k: r["traj_per_s"] for k, r in by.items()},
            "traj_per_s_ratio_by_replicas": {k: r["traj_ratio"] for k, r in by.items()},
            "push_seconds_by_replicas": {k: r["push_seconds"] for k, r in by.items()},
            "push_ratio_by_replicas": {k: r["push_ratio"] for k, r in by.items()},
            "collector_cpu_ms_per_traj_by_replicas": {k: r["cpu_ms_per_traj"]["collector"] for k, r in by.items()},
            "collector_cores_by_replicas": {k: r["cores"]["collector"] for k, r in by.items()},
            "all_cpu_ms_per_traj_by_replicas": {k: r["ours_cpu_ms_per_traj"] for k, r in by.items()},
            "collector_alone_traj_per_s_by_replicas": {k: 1000 / r["cpu_ms_per_traj"]["collector"]
                                                       for k, r in by.items()},
            "reference_cores_by_replicas": {k: r["cores"]["reference"] for k, r in by.items()},
            "machine_cores_by_replicas": {k: r["machine_cores"] for k, r in by.items()},
            "others_cores_by_replicas": {k: r["others_cores"] for k, r in by.items()},
            "join_seconds_by_replicas": {k: r["join_seconds"] for k, r in by.items()},
            "busiest_replica_share_by_replicas": {k: r["busiest_replica_share"] for k, r in by.items()},
            "groups_in_stages_by_replicas": {k: r["stages"] for k, r in by.items()},
            **parts, "saturates_at_replicas": at["replicas"], "saturates_first": who, "saturation": sentence,
            "steps": rows, "load_average_start_end": load, "cpu_count": psutil.cpu_count(),
            "settings": {key: getattr(ns, key) for key in (
                "replicas", "rounds", "seconds", "warmup", "step_warmup", "pushes", "push_gap", "group_size",
                "max_tokens", "batch_size", "trainers", "leave_prompts", "discovery_refresh_seconds",
                "replica_check_seconds", "max_groups_in_flight", "max_generations_in_flight",
                "max_scoring_in_flight", "service_arg")}}


# ---------------------------------------------------------------- main

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    # Short windows, more rounds: other users' load on a shared machine moves in bursts of minutes.
    parser.set_defaults(rounds=5, seconds=8.0)
    parser.add_argument("--replicas", default=None,
                        help="replica counts of the steps (default 1,4,16,32; with --ray one count, default 4)")
    parser.add_argument("--ray", action="store_true",
                        help="the same fleet as processes and as Ray actors on a local 3-node Ray cluster, "
                             "side by side (bench/_ray_fleet.py): ray_over_processes")
    parser.add_argument("--step-warmup", type=float, default=2.0, help="after a step's replicas are in rotation")
    parser.add_argument("--pushes", type=int, default=3, help="weight pushes per step and round")
    parser.add_argument("--push-gap", type=float, default=0.5, help="seconds before each push")
    parser.add_argument("--leave-prompts", type=int, default=256, help="prompts submitted around the replica's kill")
    parser.add_argument("--leave-timeout", type=float, default=180.0, help="wait for their groups at most this")
    parser.add_argument("--discovery-refresh-seconds", type=float, default=1.0, help="the collector's (default 10)")
    parser.add_argument("--replica-check-seconds", type=float, default=2.0, help="the collector's (default 2)")
    parser.add_argument("--growth", type=float, default=0.10,
                        help="traj/s 'stops growing' when the next step adds less than this fraction")
    ns = parser.parse_args()
    ns.replicas = sorted({int(n) for n in (ns.replicas or ("4" if ns.ray else "1,4,16,32")).split(",")})
    if ns.batch_size % ns.group_size or ns.replicas[0] < 1 or ns.push_every:
        parser.error("--batch-size must be a multiple of --group-size, --replicas >= 1, no --push-every here")
    return ns


def main() -> None:
    ns = parse_args()
    if ns.ray:
        import _ray_fleet as ray_fleet

        ray_fleet.run(ns, Fleet)
        return
    from safetensors.torch import load_file

    from rlfleet.client import connect
    from rlfleet.services.models.tiny import build_tiny_model

    model_dir = ns.model_dir or build_tiny_model(Path(tempfile.gettempdir()) / "rlfleet-bench-tiny-model")
    workdir = Path(ns.workdir or tempfile.mkdtemp(prefix="rlfleet-bench-fleet-"))
    load_start = os.getloadavg()
    log(f"work directory (service logs): {workdir}; load average {load_start[0]:.1f}, "
        f"{psutil.virtual_memory().available >> 20} MiB available ({ns.replicas[-1]} loadgens take ~250 MiB each)")
    fleet, trainers = Fleet(model_dir, workdir, ns), None
    try:
        fleet.start(ns.replicas[-1], ns.replicas[0])
        taps = multiprocessing.get_context("spawn").Queue()
        trainers = Trainers(ns.trainers, fleet.procs["collector"].address, model_dir, ns,
                            tap=PromptTap(taps, LEAVE_PREFIX)).start()
        with connect(fleet.procs["collector"].address) as client:
            settle(client, trainers, ns)
            log(f"warm-up {ns.warmup:g} s and one push")
            time.sleep(ns.warmup)
            state = load_file(str(model_dir / "model.safetensors"))
            client.push_weights(state, progress=False)  # one-time setup (spool, segments) out of the numbers
            samples = run_rounds(fleet, client, trainers, state, ns)
            parts = {**leave(fleet, client, taps, ns), **join(fleet, client, trainers)}
    finally:
        if trainers is not None:
            trainers.close()
        fleet.close()
    print("RESULT " + json.dumps(report(step_rows(samples), parts, (load_start, os.getloadavg()), ns)))


if __name__ == "__main__":
    main()
