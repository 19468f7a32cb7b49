"""Up to 32 generation replicas (load generators) behind one collector.

    .venv/bin/python bench/fleet.py [--replicas 1,4,16,32] [--rounds 5] [--seconds 8] [--pushes 3]
    .venv/bin/python bench/fleet.py --only-update [--rounds 5] [--update-replicas 16]

The harness of ``bench/dataplane.py`` (real trajectory, reference, reward and collector services,
an SDK trainer process, per-process CPU, medians of rounds), with N generation replicas, each a
``bench/loadgen_generation.py`` LOAD GENERATOR (a real gRPC server answering at once with pre-made
samples; never a stand-in in tests). Every loadgen starts up front; the collector reads its
replicas from a JSON file this bench writes (``--generation-addresses-file``, re-read every
``--discovery-refresh-seconds``), as an autoscaler would. Four parts, one run (``--only-update``:
the fourth alone, a few minutes):

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
4. Update: fleet throughput while weights are pushed, a rolling update (``strategy="rolling"``: the
   collector drains and switches ``--rolling-max-unavailable 1`` replica at a time, admission open)
   against a pause-all one (``strategy="pause_all"``, ``mode="wait"``: every replica swaps at once,
   nothing admitted meanwhile). ``--update-replicas`` fresh loadgens replace the others, each with a
   replica's timing: ``--update-sample-seconds`` per Generate call, at most ``--update-max-running``
   at once (the rest queue), ``--update-swap-seconds`` to apply a push (its mode honoured as the real
   engine does), so that the replicas, not the collector, set the pace. Calibration first: a window
   with every replica, one with one replica fewer in the file, one with all again (replica-bound:
   N-1 of N give about (N-1)/N of the traj/s; the collector's cores). One push of each kind, not
   measured, sets the windows' length. Then ``--rounds`` rounds of: a steady window, one push, a
   steady window, the other push (which goes first alternates per round). A push's window runs from
   the push call's start to its return plus ``--update-tail`` s (the same for both: a rolling
   update's groups that ran on the new version are parked until it commits and delivered right
   after), then ``--update-gap`` s to settle; the steady window just before it lasts as long as that
   strategy's previous update window. Reported per strategy: the median over rounds of (update
   traj/s / steady traj/s), the push's seconds, and after each rolling push the collector's
   ``rolling_update``: the window two versions served, replicas switched of the total, pin
   violations (must be 0: a loud WARNING otherwise); also what of a window's work reached the
   trainer only in the gap after it (late).

The last line is ``RESULT {json}`` (``--only-update``: just the update keys).
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
        ids = [prompt_id for prompt_id in batch["prompt_id"] if prompt_id.startswith(self.prefix)]
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

    def start(self, loadgens: int, first: int, loadgen_args: list[str] = ()) -> None:
        """Upstream services and every loadgen, all SERVING; then the collector with ``first`` of them."""
        start_upstream(self.model_dir, self.workdir, self.ns, self.procs)
        self.pool = self.spawn(loadgens, loadgen_args)
        self.use(first)
        for proc in self.procs.values():
            proc.wait_ready(STARTUP_TIMEOUT_SECONDS)
        args = ["--generation-addresses-file", str(self.members_file),
                "--discovery-refresh-seconds", str(self.ns.discovery_refresh_seconds),
                "--replica-check-seconds", str(self.ns.replica_check_seconds),
                "--rolling-max-unavailable", "1",
                *pipeline_args(self.ns, self.procs, self.workdir), *common_args(self.ns),
                *extra_args(self.ns, "collector")]
        self.procs["collector"] = ServiceProcess("collector", args).start(self.workdir / "collector")
        self.procs["collector"].wait_ready(STARTUP_TIMEOUT_SECONDS)
        for key, proc in self.procs.items():
            log(f"{key:<10} SERVING on {proc.address} (pid {proc.process.pid})")

    def spawn(self, count: int, loadgen_args: list[str] = ()) -> list[LoadgenProcess]:
        """``count`` fresh loadgens, started in parallel, SERVING (not in the file yet)."""
        fresh = []
        for _ in range(count):
            name = f"loadgen-{len(self.started)}"
            self.started.append(LoadgenProcess("loadgen", ["--vocab-size", str(self.vocab), *loadgen_args]))
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

    def replace_pool(self, fresh: list[LoadgenProcess]) -> None:
        """``fresh`` (SERVING) become the pool and every one of them is named in the file; the loadgens
        of the old pool are stopped once the file no longer names them."""
        old, self.pool = self.pool, list(fresh)
        self.use(len(self.pool))
        time.sleep(2 * self.ns.discovery_refresh_seconds)  # the collector re-read the file: no new work there
        for proc in old:
            proc.stop()

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


# ---------------------------------------------------------------- part 4: rolling vs pause-all updates

STRATEGIES = ("rolling", "pause_all")


def update_loadgen_args(ns) -> list[str]:
    """A replica's timing for the update part's loadgens (see ``bench/loadgen_generation.py``)."""
    return ["--sample-seconds", str(ns.update_sample_seconds), "--max-running", str(ns.update_max_running),
            "--swap-seconds", str(ns.update_swap_seconds)]


class UpdateWatch(StatusPoller):
    """Polls the collector's GetStatus while a push runs: how many replicas were draining at once, which
    versions served, and the trajectories the trainer had by then."""

    def __init__(self, address: str, trainers: Trainers, period: float = 0.2):
        super().__init__(address, period, lambda reply: {
            "time": time.monotonic(), "received": trainers.received.value,
            "draining": sum(r.draining for r in reply.replicas),
            "versions": sorted({r.policy_version for r in reply.replicas if r.healthy}),
            "healthy": sum(r.healthy for r in reply.replicas)})

    def summary(self) -> dict:
        return {"max_draining": max((s["draining"] for s in self.samples), default=0),
                "max_versions_serving": max((len(s["versions"]) for s in self.samples), default=0),
                "min_healthy": min((s["healthy"] for s in self.samples), default=0)}


def update_meter(fleet: Fleet, trainers: Trainers) -> CpuMeter:
    meter = CpuMeter({})
    for key in ("collector", "reference", "reward", "trajectory"):
        meter.add(key, fleet.procs[key].process.pid)
    meter.trees["loadgen"] = [psutil.Process(proc.process.pid) for proc in fleet.pool]
    meter.trees["trainer"] = [psutil.Process(pid) for pid in trainers.pids]
    return meter


def steady(client, trainers: Trainers, meter: CpuMeter, seconds: float) -> dict:
    """One window of ``seconds`` with no push."""
    before = counters(client, trainers, meter)
    time.sleep(seconds)
    measured = window(before, counters(client, trainers, meter))
    trainers.check()
    return measured


def push_window(fleet: Fleet, client, trainers: Trainers, meter: CpuMeter, state, strategy: str, ns) -> dict:
    """One push of ``strategy`` measured from the call's start to its return plus ``--update-tail`` s; then
    ``--update-gap`` s for the pipeline to settle (what the trainer got in it is kept: ``late``)."""
    status_before = client.status()
    with UpdateWatch(fleet.procs["collector"].address, trainers) as watch:
        before = counters(client, trainers, meter)
        started = time.monotonic()
        result = client.push_weights(state, progress=False, strategy=strategy,
                                     mode="wait" if strategy == "pause_all" else "keep",
                                     timeout=ns.update_push_timeout)
        push_seconds = time.monotonic() - started
        at_return = trainers.received.value
        time.sleep(ns.update_tail)
        after = counters(client, trainers, meter)
    status = client.status()
    time.sleep(ns.update_gap)
    measured = window(before, after)
    measured["gap_trajectories"] = trainers.received.value - after["received"]
    replicas = len(fleet.members)
    if not result.all_applied or len(result.replicas) != replicas:
        raise RuntimeError(f"{strategy} push v{result.version}: {sum(r.applied for r in result.replicas)} of "
                           f"{replicas} replicas applied it: {result.replicas}")
    out = {"strategy": strategy, "version": result.version, "window": measured, "push_seconds": push_seconds,
           "server_seconds": result.server_seconds,
           "delivered_during_push": at_return - before["received"],
           "delivered_in_tail": after["received"] - at_return,
           "discarded_samples": status.discarded_samples - status_before.discarded_samples,
           "failed_prompts": status.failed_prompts - status_before.failed_prompts, **watch.summary()}
    if strategy == "rolling":
        rolling, previous = status.rolling_update, status_before.rolling_update
        if rolling is None or rolling.to_version != result.version:
            raise RuntimeError(f"GetStatus shows no rolling update to v{result.version}: {rolling}")
        out.update(window_seconds=rolling.window_seconds, replicas_switched=rolling.replicas_switched,
                   replicas_total=rolling.replicas_total, committed=rolling.committed,
                   pin_violations=rolling.pin_violations,
                   new_pin_violations=rolling.pin_violations - (previous.pin_violations if previous else 0),
                   new_pins_retired=rolling.pins_retired - (previous.pins_retired if previous else 0),
                   new_pinned_groups=rolling.pinned_groups - (previous.pinned_groups if previous else 0))
        if rolling.pin_violations or not rolling.committed or rolling.replicas_switched != rolling.replicas_total:
            log("WARNING " + "!" * 60)
            log(f"WARNING: rolling update to v{result.version}: pin_violations {rolling.pin_violations} (must be 0), "
                f"committed {rolling.committed}, switched {rolling.replicas_switched} of {rolling.replicas_total}")
            log("WARNING " + "!" * 60)
    return out


def calibrate(fleet: Fleet, client, trainers: Trainers, meter: CpuMeter, ns) -> dict:
    """Steady windows with every replica, with one fewer in the file, with every replica again."""
    n = len(fleet.pool)
    windows = []
    for replicas in (n, n - 1, n):
        fleet.use(replicas)
        wait_in_rotation(client, fleet.addresses())
        time.sleep(ns.update_warmup)
        windows.append(steady(client, trainers, meter, ns.update_calibration_seconds))
        log(f"update calibration: {replicas} replicas: {windows[-1]['traj_per_s']:.1f} traj/s, collector "
            f"{windows[-1]['cores']['collector']:.2f} cores, machine {windows[-1]['machine_cores']:.2f} cores")
    full = statistics.fmean(w["traj_per_s"] for w in (windows[0], windows[2]))
    return {"traj_per_s": full, "one_fewer_traj_per_s": windows[1]["traj_per_s"],
            "one_fewer_over_all": windows[1]["traj_per_s"] / full, "expected": (n - 1) / n,
            "collector_cores": max(windows[0]["cores"]["collector"], windows[2]["cores"]["collector"]),
            "collector_cpu_ms_per_traj": statistics.fmean(w["cpu_ms_per_traj"]["collector"] for w in windows),
            "loadgen_cores": statistics.fmean(w["cores"]["loadgen"] for w in windows),
            "machine_cores": statistics.fmean(w["machine_cores"] for w in windows)}


def update_part(fleet: Fleet, client, trainers: Trainers, state, ns) -> dict:
    """Calibration, one unmeasured push of each strategy, then ``ns.rounds`` rounds of steady window +
    push, alternating which strategy goes first."""
    if fleet.pool and "--sample-seconds" not in fleet.pool[0].args:  # after the other parts
        fresh = fleet.spawn(ns.update_replicas, update_loadgen_args(ns))
        fleet.members = fleet.members + fresh  # in rotation (re-synced) before the others leave
        fleet.write_members()
        wait_in_rotation(client, fleet.addresses())
        fleet.replace_pool(fresh)
    meter = update_meter(fleet, trainers)
    calibration = calibrate(fleet, client, trainers, meter, ns)
    lengths = {}
    for strategy in STRATEGIES:  # one-time costs out of the numbers; how long each window lasts
        taken = push_window(fleet, client, trainers, meter, state, strategy, ns)
        lengths[strategy] = taken["window"]["seconds"]
        log(f"update warm-up: {strategy} push {taken['push_seconds']:.2f} s, its window {lengths[strategy]:.1f} s")
    samples: dict[str, list[dict]] = {strategy: [] for strategy in STRATEGIES}
    for index in range(ns.rounds):
        for strategy in (STRATEGIES if index % 2 == 0 else STRATEGIES[::-1]):
            before = steady(client, trainers, meter, lengths[strategy])  # the previous push's gap is over
            taken = push_window(fleet, client, trainers, meter, state, strategy, ns)
            taken["steady"] = before
            taken["over_steady"] = taken["window"]["traj_per_s"] / before["traj_per_s"]
            taken["over_calibration"] = taken["window"]["traj_per_s"] / calibration["traj_per_s"]
            # Delivered in the gap beyond the steady rate: the window's work that reached the trainer after it
            # (a rolling update's parked groups, when their burst outlasts the tail).
            late = taken["window"]["gap_trajectories"] - before["traj_per_s"] * ns.update_gap
            taken["late_trajectories"] = late
            taken["with_late_over_steady"] = (taken["window"]["trajectories"] + max(late, 0.0)) / (
                before["traj_per_s"] * taken["window"]["seconds"])
            lengths[strategy] = taken["window"]["seconds"]
            samples[strategy].append(taken)
            extra = (f", window {taken['window_seconds']:.1f} s, switched {taken['replicas_switched']}/"
                     f"{taken['replicas_total']}, pin violations {taken['pin_violations']}, pinned groups "
                     f"+{taken['new_pinned_groups']}, pins retired +{taken['new_pins_retired']}"
                     if strategy == "rolling" else "")
            log(f"update round {index}: {strategy:<9} {taken['window']['traj_per_s']:.1f} traj/s over "
                f"{taken['window']['seconds']:.1f} s vs steady {before['traj_per_s']:.1f}: "
                f"{taken['over_steady']:.3f} (with what came late {taken['with_late_over_steady']:.3f}); push "
                f"{taken['push_seconds']:.2f} s, delivered {taken['delivered_during_push']} during it + "
                f"{taken['delivered_in_tail']} in the tail + {taken['late_trajectories']:+.0f} late, "
                f"{taken['discarded_samples']} samples discarded, max draining {taken['max_draining']}{extra}")
    return {"calibration": calibration, "samples": samples}


def update_rows(part: dict) -> dict[str, dict]:
    rows = {}
    for strategy, taken in part["samples"].items():
        ratios = [t["over_steady"] for t in taken]
        row = {"over_steady": statistics.median(ratios), "per_round": ratios,
               "over_calibration": statistics.median(t["over_calibration"] for t in taken),
               "with_late_over_steady": statistics.median(t["with_late_over_steady"] for t in taken),
               "update_traj_per_s": statistics.median(t["window"]["traj_per_s"] for t in taken),
               "steady_traj_per_s": statistics.median(t["steady"]["traj_per_s"] for t in taken),
               "push_seconds": statistics.median(t["push_seconds"] for t in taken),
               "window_length_seconds": statistics.median(t["window"]["seconds"] for t in taken),
               "tail_share": statistics.median(t["delivered_in_tail"] / max(t["window"]["trajectories"], 1)
                                               for t in taken),
               "discarded_samples": sum(t["discarded_samples"] for t in taken),
               "max_draining": max(t["max_draining"] for t in taken)}
        if strategy == "rolling":
            row.update(window_seconds=statistics.median(t["window_seconds"] for t in taken),
                       switched=[f"{t['replicas_switched']}/{t['replicas_total']}" for t in taken],
                       pin_violations=max(t["pin_violations"] for t in taken),
                       pins_retired=sum(t["new_pins_retired"] for t in taken),
                       pinned_groups=sum(t["new_pinned_groups"] for t in taken))
        rows[strategy] = row
    return rows


def update_report(part: dict, ns) -> dict:
    """Print the update part's table; its RESULT keys."""
    rows, cal = update_rows(part), part["calibration"]
    rolling, pause = rows["rolling"], rows["pause_all"]
    per_round = [r["over_steady"] / p["over_steady"]
                 for r, p in zip(part["samples"]["rolling"], part["samples"]["pause_all"])]
    n = ns.update_replicas
    print(f"\nfleet update | {n} loadgen replicas ({ns.update_sample_seconds:g} s per Generate call, at most "
          f"{ns.update_max_running} running each, a push applies in {ns.update_swap_seconds:g} s) behind one real "
          f"collector (--rolling-max-unavailable 1) | groups of {ns.group_size} x {ns.max_tokens} tokens | "
          f"{ns.rounds} rounds, tail {ns.update_tail:g} s | {psutil.cpu_count()} cores")
    print(f"  calibration: {n} replicas {cal['traj_per_s']:.1f} traj/s, {n - 1} replicas "
          f"{cal['one_fewer_traj_per_s']:.1f} traj/s = {cal['one_fewer_over_all']:.3f} of it (replica-bound: "
          f"{cal['expected']:.3f}); collector {cal['collector_cores']:.2f} cores at most "
          f"({cal['collector_cpu_ms_per_traj']:.2f} ms/traj), loadgens {cal['loadgen_cores']:.2f}, "
          f"machine {cal['machine_cores']:.2f} cores")
    header = (f"{'strategy':>9} | {'update/steady':>13} | {'per round':>32} | {'/calib.':>7} | {'+late':>5} | "
              f"{'update traj/s':>13} | {'steady traj/s':>13} | {'push s':>6} | {'in tail':>7} | "
              f"{'2-version window s':>18} | "
              f"{'switched':>8} | {'pin viol.':>9} | {'discarded':>9}")
    print(header)
    print("-" * len(header))
    for strategy, row in rows.items():
        window = f"{row['window_seconds']:.1f}" if strategy == "rolling" else "-"
        switched = ", ".join(sorted(set(row["switched"]))) if strategy == "rolling" else "-"
        violations = str(row["pin_violations"]) if strategy == "rolling" else "-"
        print(f"{strategy:>9} | {row['over_steady']:>13.3f} | {', '.join(f'{x:.2f}' for x in row['per_round']):>32} | "
              f"{row['over_calibration']:>7.3f} | {row['with_late_over_steady']:>5.2f} | {row['update_traj_per_s']:>13.1f} | {row['steady_traj_per_s']:>13.1f} | {row['push_seconds']:>6.2f} | "
              f"{row['tail_share']:>7.0%} | {window:>18} | {switched:>8} | {violations:>9} | "
              f"{row['discarded_samples']:>9}")
    print("update/steady = traj/s delivered to the trainer from the push call's start to its return + the tail, over "
          "the steady window just before (same length), median of rounds;\n/calib. = update traj/s over the "
          "calibration's traj/s with every replica (a steadier base); +late = update/steady counting also what was "
          "delivered\nin the --update-gap after the window beyond the steady rate (work of the window that reached "
          "the trainer late);\nin tail = the share of the update "
          "window's trajectories delivered after the push returned; 2-version window = GetStatus.rolling_update."
          "window_seconds (median);\nswitched = replicas_switched/replicas_total; pin viol. = pin_violations since "
          "the collector started; discarded = samples discarded during the update windows (all rounds).")
    print(f"  rolling / pause-all: {statistics.median(per_round):.3f} (median of the per-round ratios "
          f"{', '.join(f'{x:.2f}' for x in per_round)}); pinned groups {rolling['pinned_groups']}, pins retired "
          f"{rolling['pins_retired']}; at most {rolling['max_draining']} replica(s) draining at once")
    if rolling["pin_violations"]:
        print(f"  WARNING: {rolling['pin_violations']} pin violations: samples ran off their pinned version")
    return {"rolling_over_steady": rolling["over_steady"], "pause_all_over_steady": pause["over_steady"],
            "rolling_over_pause_all": statistics.median(per_round), "update_replicas": n,
            "rolling_window_seconds": rolling["window_seconds"], "pin_violations": rolling["pin_violations"],
            "rolling_push_seconds": rolling["push_seconds"], "pause_all_push_seconds": pause["push_seconds"],
            "rolling_over_steady_per_round": rolling["per_round"],
            "pause_all_over_steady_per_round": pause["per_round"],
            "rolling_tail_share": rolling["tail_share"], "pause_all_tail_share": pause["tail_share"],
            "rolling_over_calibration": rolling["over_calibration"],
            "pause_all_over_calibration": pause["over_calibration"],
            "rolling_with_late_over_steady": rolling["with_late_over_steady"],
            "pause_all_with_late_over_steady": pause["with_late_over_steady"],
            "update_steady_traj_per_s": cal["traj_per_s"],
            "update_one_fewer_replica_over_all": cal["one_fewer_over_all"],
            "update_collector_cores": cal["collector_cores"],
            "update_settings": {key: getattr(ns, key) for key in (
                "update_replicas", "update_sample_seconds", "update_max_running", "update_swap_seconds",
                "update_tail", "update_gap", "update_warmup", "update_calibration_seconds", "rounds")}}


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
    update = parser.add_argument_group("part 4, update: rolling vs pause-all weight updates")
    update.add_argument("--only-update", action="store_true",
                        help="run the update part alone (no scaling, leave or join parts)")
    update.add_argument("--update-replicas", type=int, default=16, help="loadgens of the update part")
    # Calibrated on a 2-core shared machine: 16 replicas x 2 running calls / 0.8 s x 4 samples = 160
    # traj/s, about a third of what the data plane sustains here with instant loadgens, so the replicas
    # are the ceiling (15 of them give ~15/16 of it) and the collector stays near 0.1 cores.
    update.add_argument("--update-sample-seconds", type=float, default=0.8,
                        help="the loadgens' --sample-seconds: service time of one Generate call")
    update.add_argument("--update-max-running", type=int, default=2,
                        help="the loadgens' --max-running: calls running at once per replica (the rest queue)")
    update.add_argument("--update-swap-seconds", type=float, default=0.5,
                        help="the loadgens' --swap-seconds: time a push takes to apply on a replica")
    update.add_argument("--update-tail", type=float, default=1.0,
                        help="seconds after a push returned still counted in its window (both strategies)")
    update.add_argument("--update-gap", type=float, default=2.0,
                        help="seconds after a push before the next steady window (the pipeline refills)")
    update.add_argument("--update-warmup", type=float, default=3.0,
                        help="seconds after the replicas are in rotation before a calibration window")
    update.add_argument("--update-calibration-seconds", type=float, default=12.0,
                        help="length of each calibration window (all replicas, one fewer, all)")
    update.add_argument("--update-push-timeout", type=float, default=600.0,
                        help="deadline of each push call, pause-all ones included (the SDK's default is 60 s, "
                             "390 s for a rolling push)")
    ns = parser.parse_args()
    ns.replicas = sorted({int(n) for n in (ns.replicas or ("4" if ns.ray else "1,4,16,32")).split(",")})
    if ns.batch_size % ns.group_size or ns.replicas[0] < 1 or ns.push_every:
        parser.error("--batch-size must be a multiple of --group-size, --replicas >= 1, no --push-every here")
    if ns.update_replicas < 2 or ns.update_sample_seconds <= 0:
        parser.error("--update-replicas >= 2 (one is taken out to calibrate), --update-sample-seconds > 0")
    if ns.only_update and ns.ray:
        parser.error("--only-update and --ray are separate runs")
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
    fleet, trainers, samples, parts = Fleet(model_dir, workdir, ns), None, None, {}
    try:
        if ns.only_update:
            fleet.start(ns.update_replicas, ns.update_replicas, update_loadgen_args(ns))
        else:
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
            if not ns.only_update:
                samples = run_rounds(fleet, client, trainers, state, ns)
                parts = {**leave(fleet, client, taps, ns), **join(fleet, client, trainers)}
            update = update_part(fleet, client, trainers, state, ns)
    finally:
        if trainers is not None:
            trainers.close()
        fleet.close()
    load = (load_start, os.getloadavg())
    result = {} if ns.only_update else report(step_rows(samples), parts, load, ns)
    result.update(update_report(update, ns))
    if ns.only_update:
        result.update(load_average_start_end=load, cpu_count=psutil.cpu_count())
    log(f"load average {load[0][0]:.1f} at the start, {load[1][0]:.1f} at the end")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
