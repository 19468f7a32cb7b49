"""Throughput ceiling of the data plane, with a load generator in place of generation.

    .venv/bin/python bench/dataplane.py [--rounds 3] [--seconds 20] [--warmup 10] [--trainers 1]

The real trajectory, reference (the tiny local model, ``--reference-threads`` torch threads),
reward and collector services start as processes (``ServiceProcess``, as ``services/suite.py``
starts them); generation is ``bench/loadgen_generation.py``, a LOAD GENERATOR that answers every
``Generate`` at once with pre-made token ids and log-probs, so no engine limits the rest. Prompts
come from a JSONL dataset (the collector's ``--dataset-path``, cycled forever), GRPO groups of
``--group-size``, ``--max-tokens``-token responses, reward ``char_fraction``. The collector runs
async with an unbounded staleness and its in-flight limits raised (``--max-groups-in-flight`` and
friends; see their help), so queues form in front of the services: they, not the limits, set the pace.

``--trainers`` SDK trainers (each its own process: ``rlfleet.client.connect``, ``client.batches``,
an explicit ``ack()`` per batch, optionally a weight push every ``--push-every`` s) read as fast
as they can. Once the first batch arrived and the backlog the collector built meanwhile drained,
and after ``--warmup`` s more, ``--rounds`` windows of ``--seconds`` s each are measured: the
trajectories the trainers received per second (and the collector appended: equal in a steady
state), the longest wait for a batch, and the CPU time (user + system, whole process tree) of
every process, in ms per trajectory and in cores (CPU s / wall s). Medians over rounds.

Which service saturates first: the one with the most CPU per trajectory. Each service is one
asyncio process, so it tops out near one core: alone on enough cores it caps the data plane at
about 1000 / (its CPU ms per trajectory) traj/s. On a machine whose cores are all busy (``machine``
column: every process, other users' too), the machine's CPU is the ceiling before any one service.
The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from _common import CpuMeter
from pipeline import StatusPoller
from rlfleet.services.launch import ServiceProcess

LOADGEN = Path(__file__).resolve().with_name("loadgen_generation.py")
SERVICES = ("collector", "reward", "trajectory")
"""The data-plane services proper, summed in ``services_cpu_ms_per_traj``."""
KEYS = (*SERVICES, "reference", "loadgen", "trainer")
STARTUP_TIMEOUT_SECONDS = 300.0


def log(message: str) -> None:
    print(f"[dataplane] {message}", file=sys.stderr, flush=True)


class LoadgenProcess(ServiceProcess):
    """The load generator as a ``ServiceProcess`` (same port file, health wait and stop), started from
    ``bench/loadgen_generation.py`` instead of ``python -m rlfleet.services.<name>``."""

    def start(self, workdir: Path | None = None) -> "LoadgenProcess":
        workdir = Path(workdir or tempfile.mkdtemp(prefix="rlfleet-loadgen-"))
        workdir.mkdir(parents=True, exist_ok=True)
        self._port_file = workdir / "loadgen.port"
        self._port_file.unlink(missing_ok=True)
        self.log_path = self.log_path or workdir / "loadgen.log"
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, str(LOADGEN), *self.args, "--port", "0", "--port-file", str(self._port_file)],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}, start_new_session=True)
        return self


def write_dataset(path: Path, rows: int) -> Path:
    """A JSONL file of arithmetic prompts (the collector cycles through it forever)."""
    with path.open("w") as out:
        for i in range(rows):
            out.write(json.dumps({"id": f"q{i}", "prompt": f"what is {i} plus {2 * i + 1}?",
                                  "answer": str(3 * i + 1)}) + "\n")
    return path


def extra_args(ns, service: str) -> list[str]:
    """``--service-arg SERVICE:--flag=value`` entries for ``service``, as argv."""
    out = []
    for entry in ns.service_arg:
        name, _, flag = entry.partition(":")
        if name == service:
            out += flag.split("=", 1)
    return out


def collector_args(ns, backends: dict[str, ServiceProcess], workdir: Path) -> list[str]:
    return ["--generation-addresses", json.dumps([backends["loadgen"].address]),
            *pipeline_args(ns, backends, workdir)]


def pipeline_args(ns, backends: dict[str, ServiceProcess], workdir: Path) -> list[str]:
    """Every collector flag but its replicas: upstream addresses, dataset, async mode, raised limits."""
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": ns.max_tokens, "ignore_eos": True}
    return ["--reference-address", backends["reference"].address, "--reward-address", backends["reward"].address,
            "--trajectory-address", backends["trajectory"].address, "--state-dir", str(workdir / "collector-state"),
            "--dataset-path", str(write_dataset(workdir / "prompts.jsonl", 4096)), "--epochs", "0",
            "--mode", "async", "--max-staleness", "1000000", "--mismatch-kl-target", "null", "--group-size", str(ns.group_size),
            "--groups-per-step", str(ns.batch_size // ns.group_size), "--sampling", json.dumps(sampling),
            "--reward-fn", "char_fraction",
            # Far above the defaults (32/16/8): with an instant generator the limits would be the ceiling.
            "--max-groups-in-flight", str(ns.max_groups_in_flight),
            "--max-generations-in-flight", str(ns.max_generations_in_flight),
            "--max-scoring-in-flight", str(ns.max_scoring_in_flight)]


def common_args(ns) -> list[str]:
    return ["--log-format", "text", "--log-level", ns.log_level]


def start_upstream(model_dir: Path, workdir: Path, ns, procs: dict[str, ServiceProcess],
                   env: dict[str, str] | None = None) -> None:
    """Start trajectory, reference and reward into ``procs`` (not waited for: they load in parallel),
    each with ``env`` added to its environment."""
    plan = [("trajectory", ["--db-path", str(workdir / "trajectory" / "trajectories.db")]),
            ("reference", ["--model-path", str(model_dir), "--torch-threads", str(ns.reference_threads)]),
            ("reward", ["--tokenizer-path", str(model_dir)])]
    for name, args in plan:
        procs[name] = ServiceProcess(name, [*args, *common_args(ns), *extra_args(ns, name)],
                                     env=dict(env or {})).start(workdir / name)


def start_services(model_dir: Path, workdir: Path, ns) -> dict[str, ServiceProcess]:
    """trajectory, reference, reward, loadgen, then the collector; each SERVING before the next."""
    procs: dict[str, ServiceProcess] = {}
    common = common_args(ns)
    # Only the services run another checkout's code: the harness, loadgen and trainers stay this tree's.
    env = {"PYTHONPATH": str(ns.services_code)} if ns.services_code else {}
    try:
        start_upstream(model_dir, workdir, ns, procs, env)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        procs["loadgen"] = LoadgenProcess("loadgen", ["--vocab-size", str(vocab)]).start(workdir / "loadgen")
        for proc in procs.values():  # all start in parallel; the collector needs them SERVING
            proc.wait_ready(STARTUP_TIMEOUT_SECONDS)
        procs["collector"] = ServiceProcess("collector", [*collector_args(ns, procs, workdir), *common,
                                                          *extra_args(ns, "collector")],
                                            env=env).start(workdir / "collector")
        procs["collector"].wait_ready(STARTUP_TIMEOUT_SECONDS)
    except BaseException:
        stop_services(procs)
        raise
    for key, proc in procs.items():
        log(f"{key:<10} SERVING on {proc.address} (pid {proc.process.pid})")
    return procs


def stop_services(procs: dict[str, ServiceProcess]) -> None:
    """SIGTERM every service, the collector first."""
    for proc in reversed(list(procs.values())):
        proc.stop()


# ---------------------------------------------------------------- the trainers (processes of their own)

def trainer_main(address: str, batch_size: int, prefetch: int, push_every: float, model_file: str,
                 received, longest_wait, stop, tap=None) -> None:
    """One SDK trainer: read batches as fast as they come, ack each, count the trajectories in
    ``received`` and the longest wait for a batch in ``longest_wait`` (both shared); push the
    model's weights every ``push_every`` s (0: never). ``tap`` (picklable), if given, is called
    with each batch after its ack (another bench's hook, e.g. to record prompt ids)."""
    from rlfleet.client import connect

    state = None
    if push_every > 0:
        from safetensors.torch import load_file

        state = load_file(model_file)
    next_push = time.monotonic() + push_every
    # No idle timeout: the pipeline keeps producing until the trainers are stopped, so the batch
    # after ``stop`` is set arrives at once and the loop ends cleanly.
    with connect(address) as client:
        with client.batches(batch_size, auto_ack=False, prefetch=prefetch, consumer=f"dataplane-{os.getpid()}",
                            idle_timeout=None) as batches:
            asked = time.perf_counter()
            for batch in batches:
                if stop.is_set():
                    break
                waited, asked = time.perf_counter() - asked, time.perf_counter()
                batch.ack()
                if tap is not None:
                    tap(batch)
                with received.get_lock():
                    received.value += len(batch)
                with longest_wait.get_lock():
                    longest_wait.value = max(longest_wait.value, waited)
                if state is not None and time.monotonic() >= next_push:
                    client.push_weights(state, progress=False)
                    next_push = time.monotonic() + push_every


class Trainers:
    """``count`` trainer processes (spawned: no inherited gRPC state) sharing one counter."""

    def __init__(self, count: int, address: str, model_dir: Path, ns, tap=None):
        context = multiprocessing.get_context("spawn")
        self.received = context.Value("q", 0)
        self.longest_wait = context.Value("d", 0.0)
        self.stop = context.Event()
        self.processes = [context.Process(
            target=trainer_main, daemon=True,
            args=(address, ns.batch_size, ns.prefetch, ns.push_every if i == 0 else 0.0,
                  str(model_dir / "model.safetensors"), self.received, self.longest_wait, self.stop, tap))
            for i in range(count)]

    def start(self) -> "Trainers":
        for proc in self.processes:
            proc.start()
        return self

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.processes]

    def check(self) -> None:
        dead = [proc.exitcode for proc in self.processes if not proc.is_alive()]
        if dead:
            raise RuntimeError(f"a trainer process exited (codes {dead}); see the messages above")

    def close(self) -> None:
        self.stop.set()
        for proc in self.processes:
            proc.join(15)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


# ---------------------------------------------------------------- measuring

def machine_busy() -> float:
    """CPU seconds every process on the machine has used (not idle, not waiting for I/O)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def counters(client, trainers: Trainers, meter: CpuMeter) -> dict:
    """Everything a window is the difference of: clock, CPU per process tree, trajectories."""
    with trainers.longest_wait.get_lock():  # the longest wait of the window that ends here
        longest_wait, trainers.longest_wait.value = trainers.longest_wait.value, 0.0
    return {"time": time.perf_counter(), "cpu": meter.snapshot(), "machine": machine_busy(),
            "received": trainers.received.value, "appended": client.status().trajectories,
            "longest_wait": longest_wait}


def window(before: dict, after: dict) -> dict:
    """One measured window: rates, CPU ms per trajectory and cores per process tree."""
    wall = after["time"] - before["time"]
    received = after["received"] - before["received"]
    cpu = CpuMeter.delta(before["cpu"], after["cpu"])
    per_traj = {key: 1000 * cpu.get(key, 0.0) / max(received, 1) for key in KEYS}
    return {"seconds": wall, "trajectories": received, "traj_per_s": received / wall,
            "appended_per_s": (after["appended"] - before["appended"]) / wall,
            "longest_batch_wait_s": after["longest_wait"],
            "cpu_ms_per_traj": per_traj, "services_cpu_ms_per_traj": sum(per_traj[key] for key in SERVICES),
            "cores": {key: cpu.get(key, 0.0) / wall for key in KEYS},
            "machine_cores": (after["machine"] - before["machine"]) / wall}


def settle(client, trainers: Trainers, ns, period: float = 0.5) -> None:
    """Wait for the trainers' first batch, then for the backlog the collector built meanwhile (it
    draws dataset prompts from its start) to drain: a window that also drains a backlog would
    report more than the pipeline sustains. A trainer slower than the pipeline never drains it;
    then measuring starts after ``4 x --warmup`` s anyway (the trainer is the ceiling)."""
    started = time.monotonic()
    while trainers.received.value == 0:
        trainers.check()
        if time.monotonic() - started > STARTUP_TIMEOUT_SECONDS:
            raise TimeoutError(f"no batch reached a trainer within {STARTUP_TIMEOUT_SECONDS:g} s")
        time.sleep(period)
    log(f"first batch after {time.monotonic() - started:.1f} s; draining the backlog")
    drained = time.monotonic()
    while (ready := client.buffer_stats().ready) > 2 * ns.batch_size * ns.trainers:
        if time.monotonic() - drained > 4 * ns.warmup:
            log(f"WARNING: {ready} trajectories still buffered: the trainers are slower than the pipeline")
            return
        time.sleep(period)
    log(f"backlog drained in {time.monotonic() - drained:.1f} s")


def measure(procs: dict[str, ServiceProcess], trainers: Trainers, ns) -> tuple[list[dict], dict]:
    """Warm up, then ``ns.rounds`` windows of ``ns.seconds``; also the mean groups inside each stage."""
    from rlfleet.client import connect

    meter = CpuMeter({})
    for key, proc in procs.items():
        meter.add(key, proc.process.pid)
    meter.trees["trainer"] = [psutil.Process(pid) for pid in trainers.pids]
    rounds = []
    with connect(procs["collector"].address) as client:
        settle(client, trainers, ns)
        log(f"warm-up {ns.warmup:g} s")
        time.sleep(ns.warmup)
        trainers.check()
        with StatusPoller(procs["collector"].address, period=0.5) as poller:
            for index in range(ns.rounds):
                before = counters(client, trainers, meter)
                time.sleep(ns.seconds)
                rounds.append(window(before, counters(client, trainers, meter)))
                trainers.check()
                log(f"round {index}: {rounds[-1]['traj_per_s']:.0f} traj/s delivered, "
                    f"{rounds[-1]['appended_per_s']:.0f} appended/s, longest batch wait "
                    f"{rounds[-1]['longest_batch_wait_s']:.1f} s, "
                    f"cores {({k: round(v, 2) for k, v in rounds[-1]['cores'].items()})}")
        end = {"status": client.status(), "buffer": client.buffer_stats()}
    end["stages"] = poller.mean()
    return rounds, end


def medians(rounds: list[dict]) -> dict:
    """Per-round figures -> their medians (nested dicts key by key)."""
    def median_of(values):
        first = values[0]
        if isinstance(first, dict):
            return {key: median_of([v[key] for v in values]) for key in first}
        return statistics.median(values)
    return median_of(rounds)


# ---------------------------------------------------------------- report and main

def report(rounds: list[dict], end: dict, ns) -> dict:
    """Print the table; return the RESULT dict."""
    median = medians(rounds)
    cores = psutil.cpu_count() or 1
    print(f"\ndata-plane ceiling | loadgen generation, real collector/reference/reward/trajectory, {ns.trainers} SDK "
          f"trainer(s) | groups of {ns.group_size} x {ns.max_tokens} tokens, batches of {ns.batch_size} | "
          f"{ns.rounds} rounds x {ns.seconds:g} s after {ns.warmup:g} s warm-up | {cores} cores")
    header = f"{'round':>6} | {'traj/s':>7} | {'appended/s':>10} | {'max wait':>8} | " + \
        " | ".join(f"{k:>10}" for k in KEYS) + f" | {'c+r+t':>7} | {'machine':>7}"
    print("traj/s = delivered to the trainers; appended/s = appended by the collector; max wait = the longest "
          "a trainer waited for a batch.\nCPU ms per trajectory delivered, by process tree; machine = cores busy "
          "(every process on the machine, others' too)")
    print(header)
    print("-" * len(header))
    for label, row in [*((str(i), r) for i, r in enumerate(rounds)), ("median", median)]:
        print(f"{label:>6} | {row['traj_per_s']:>7.0f} | {row['appended_per_s']:>10.0f} | "
              f"{row['longest_batch_wait_s']:>7.1f}s | "
              + " | ".join(f"{row['cpu_ms_per_traj'][k]:>8.2f}ms" for k in KEYS)
              + f" | {row['services_cpu_ms_per_traj']:>5.2f}ms | {row['machine_cores']:>7.2f}")
    print(f"{'cores':>6} | {'':>7} | {'':>10} | {'':>8} | " + " | ".join(f"{median['cores'][k]:>10.2f}" for k in KEYS)
          + f" | {sum(median['cores'][k] for k in SERVICES):>7.2f} | {median['machine_cores']:>7.2f}")
    busiest = max(KEYS, key=lambda k: median["cpu_ms_per_traj"][k])
    alone = 1000 / max(median["cpu_ms_per_traj"][busiest], 1e-9)
    stages = "  ".join(f"{name} {value:.1f}" for name, value in end["stages"].items())
    status, buffer = end["status"], end["buffer"]
    print(f"  mean groups inside each collector stage: {stages}")
    print(f"  end state: {status.trajectories} appended, buffer ready {buffer.ready} / leased {buffer.leased}, "
          f"failed prompts {status.failed_prompts}, discarded samples {status.discarded_samples}, "
          f"policy version {status.policy_version}")
    print(f"  in flight: {sum(end['stages'].values()):.1f} groups on average (limit {ns.max_groups_in_flight}); "
          f"a queue in front of a stage means that stage, not the limit, sets the pace")
    print(f"  saturates first: {busiest}, the most CPU per trajectory ({median['cores'][busiest]:.2f} cores here; "
          f"an asyncio service tops out near 1 core, so alone on enough cores at ~{alone:.0f} traj/s); "
          f"the machine was {median['machine_cores'] / cores:.0%} busy")
    return {"ceiling_traj_per_s": median["traj_per_s"],
            "services_cpu_ms_per_traj": median["services_cpu_ms_per_traj"],
            "cpu_ms_per_traj": median["cpu_ms_per_traj"], "cores": median["cores"],
            "machine_cores": median["machine_cores"], "saturates_first": busiest,
            "saturates_first_at_one_core_traj_per_s": alone,
            "appended_per_s": median["appended_per_s"],
            "per_round_traj_per_s": [r["traj_per_s"] for r in rounds],
            "per_round_appended_per_s": [r["appended_per_s"] for r in rounds],
            "per_round_longest_batch_wait_s": [r["longest_batch_wait_s"] for r in rounds],
            "per_round_services_cpu_ms_per_traj": [r["services_cpu_ms_per_traj"] for r in rounds],
            "stages": end["stages"], "failed_prompts": status.failed_prompts,
            "settings": {key: getattr(ns, key) for key in (
                "group_size", "max_tokens", "batch_size", "trainers", "prefetch", "rounds", "seconds", "warmup",
                "reference_threads", "max_groups_in_flight", "max_generations_in_flight",
                "max_scoring_in_flight", "push_every", "service_arg")}, "cpu_count": cores}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The harness's flags (shared with ``bench/fleet.py``)."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of one measured window")
    parser.add_argument("--warmup", type=float, default=10.0, help="after the backlog drained")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64, help="response length (the loadgen's answers)")
    parser.add_argument("--batch-size", type=int, default=32, help="trajectories per trainer batch (whole groups)")
    parser.add_argument("--trainers", type=int, default=1, help="SDK trainer processes")
    parser.add_argument("--prefetch", type=int, default=2, help="batches each stream delivers ahead of acks")
    parser.add_argument("--push-every", type=float, default=0.0, help="trainer 0 pushes weights every S s (0: never)")
    parser.add_argument("--reference-threads", type=int, default=1, help="the reference service's --torch-threads")
    # 2x the collector's default group bound and no separate generation/scoring bound below it: queues
    # form in front of reference and reward (they set the pace, not the limits). Far higher bounds
    # (>~100 groups) queue that many Appends on the trajectory store's one owner thread, ahead of
    # the trainers' lease/ack calls, and batch delivery stalls for seconds (measured here).
    parser.add_argument("--max-groups-in-flight", type=int, default=64, help="collector default: 32")
    parser.add_argument("--max-generations-in-flight", type=int, default=64, help="collector default: 16")
    parser.add_argument("--max-scoring-in-flight", type=int, default=64, help="collector default: 32")
    parser.add_argument("--service-arg", action="append", default=[], metavar="SERVICE:--FLAG=VALUE",
                        help="extra flag for one service, e.g. trajectory:--synchronous=NORMAL (repeatable)")
    parser.add_argument("--log-level", default="WARNING", help="the services' log level")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the tiny model, built in a cache dir")
    parser.add_argument("--workdir", type=Path, default=None, help="service logs and state (default: a temp dir)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--services-code", type=Path, default=None, metavar="DIR",
                        help="run the services with DIR first on their PYTHONPATH (a directory holding another "
                             "checkout's rlfleet package, as bench/dataplane_versus.py makes); the harness, the "
                             "load generator and the trainers stay this tree's")
    ns = parser.parse_args()
    if ns.batch_size % ns.group_size:
        parser.error("--batch-size must be a multiple of --group-size")
    return ns


def main() -> None:
    ns = parse_args()
    from rlfleet.services.models.tiny import build_tiny_model

    model_dir = ns.model_dir or build_tiny_model(Path(tempfile.gettempdir()) / "rlfleet-bench-tiny-model")
    workdir = Path(ns.workdir or tempfile.mkdtemp(prefix="rlfleet-bench-dataplane-"))
    log(f"work directory (service logs): {workdir}")
    procs = start_services(model_dir, workdir, ns)
    trainers = None
    try:
        trainers = Trainers(ns.trainers, procs["collector"].address, model_dir, ns).start()
        rounds, end = measure(procs, trainers, ns)
    finally:
        if trainers is not None:
            trainers.close()
        stop_services(procs)
    print("RESULT " + json.dumps(report(rounds, end, ns)))


if __name__ == "__main__":
    main()
