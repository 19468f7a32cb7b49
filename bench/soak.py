"""Load and soak: many trainers against the real suite.

Runs for a bounded time and reports errors, latency and RSS growth.

    .venv/bin/python bench/soak.py [--seconds 120] [--warmup 20] [--streams 64] [--processes 1]

Not part of the test run. The whole suite starts as processes on the tiny local model
(``start_suite``, as ``scripts/demo`` does), the collector in async mode with an unbounded
staleness so generation never waits for a push, short samples (``--max-tokens`` 16) and a small
prompt queue (``--max-queued-prompts``) so the queue fills during the warm-up and the rest of the
run sees it full: SubmitPrompts then answers RESOURCE_EXHAUSTED by design (backpressure, counted
apart from errors), and the collector's memory should have reached its steady state.

``--streams`` trainers run as asyncio tasks (split over ``--processes`` driver processes), each
with its own ``connect_async`` client: a batch stream (``client.batches``, explicit ``ack()`` after
a simulated step, the server's answer to every ack checked), a prompt submitter, and a poller of
``status()`` / ``buffer_stats()`` / ``policy_version()``. Trainer 0 also pushes the tiny model's
state dict every ``--push-every`` seconds (``mode="keep"``; the version must grow by one and every
replica apply it). Load runs for ``--warmup`` + ``--seconds``; latencies and throughput count only
after the warm-up, errors count over the whole run. The RSS of every service process tree (the vLLM
engine core under generation included) is sampled every ``--rss-every`` seconds; growth = last
sample / the sample at the end of the warm-up - 1, per tree, and the slope of a line fitted to the
samples after the warm-up. Each driver's event-loop lag is measured: if its p99 is large, the
driver, not the suite, is the bottleneck (use more ``--processes``).

Errors are typed SDK errors by RPC and status code, after the SDK's own retries; the attempts the
SDK retried (UNAVAILABLE / DEADLINE_EXCEEDED on unary calls) are counted too, as "retried". The
services' logs stay in the work directory (printed); their WARNING/ERROR lines are summarised. The
last line is ``RESULT {json}``. Every process started is stopped on exit, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from _common import CpuMeter
from _soak_load import ROOT, Plan, drive
from _soak_report import report

STARTUP_TIMEOUT_SECONDS = 300.0
"""How long each service may take to report SERVING (vLLM's engine takes ~30 s here, more on a busy machine)."""


def log(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- RSS of the services

def heap_rss(pid: int) -> int:
    """Resident bytes of the process's brk heap (``[heap]``: glibc malloc's main arena)."""
    in_heap = False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                in_heap = line.rstrip().endswith("[heap]")
            elif in_heap and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_of(proc: psutil.Process) -> tuple[int, int, int, int, int]:
    """(RSS, anonymous, file-backed, shared-memory, of the anonymous the brk heap) resident bytes."""
    fields = {}
    try:
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[name] = int(value.split()[0]) * 1024
        heap = heap_rss(proc.pid)
    except (FileNotFoundError, ProcessLookupError):
        raise psutil.NoSuchProcess(proc.pid) from None
    return (fields.get("VmRSS", 0), fields.get("RssAnon", 0), fields.get("RssFile", 0), fields.get("RssShmem", 0),
            heap)


class RssSampler:
    """RSS of each service's process tree (children looked up again at every sample), in a thread."""

    def __init__(self, roots: dict[str, int], period: float):
        self.roots, self.period = roots, period
        self.samples: list[tuple[float, dict[str, dict[str, tuple[int, ...]]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """Service -> {"name(pid)": ``memory_of``} over its tree."""
        out = {}
        for key, pid in self.roots.items():
            try:
                root = psutil.Process(pid)
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                out[key] = {}
                continue
            out[key] = {}
            for proc in tree:
                try:
                    out[key][f"{proc.name()}({proc.pid})"] = memory_of(proc)
                except psutil.NoSuchProcess:
                    pass
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self.sample()))
            self._stop.wait(self.period)

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.time(), self.sample()))


# ---------------------------------------------------------------- the run

def collector_args(ns) -> list[str]:
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": ns.max_tokens}
    return ["--mode=async", "--max-staleness=1000000", "--mismatch-kl-target=null", f"--group-size={ns.group_size}",
            f"--groups-per-step={ns.batch_size // ns.group_size}", f"--sampling={json.dumps(sampling)}",
            "--reward-fn=char_fraction", f"--max-submitted-prompts={ns.max_queued_prompts}"]


def machine_busy() -> float:
    """CPU seconds every process on the machine has used (all cores, not idle, not waiting for I/O)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def make_plans(address: str, model_file: Path, started: float, ns) -> list[Plan]:
    warmup_end = started + ns.warmup
    return [Plan(address=address, streams=list(range(part, ns.streams, ns.processes)), warmup_end=warmup_end,
                 end=warmup_end + ns.seconds, batch_size=ns.batch_size, step_seconds=ns.step_seconds,
                 prompts_per_submit=ns.prompts_per_submit, submit_interval=ns.submit_interval,
                 poll_interval=ns.poll_interval, push_every=ns.push_every,
                 model_file=str(model_file) if part == 0 and ns.push_every > 0 else None)
            for part in range(ns.processes)]


def run_load(procs: dict, model_dir: Path, ns) -> tuple[list[dict], list, dict, dict]:
    """Drive the load; returns the drivers' records, the RSS samples, the CPU seconds of the window and the
    collector's state at the end."""
    from rlfleet.client import connect

    address = procs["collector"].address
    roots = {key: proc.process.pid for key, proc in procs.items()}
    sampler = RssSampler(roots, ns.rss_every).start()
    meter = CpuMeter({})
    for key, pid in roots.items():
        meter.add(key, pid)
    plans = make_plans(address, model_dir / "model.safetensors", time.time(), ns)
    log(f"load: {ns.streams} trainers in {ns.processes} driver process(es), warm-up {ns.warmup:g} s, "
        f"then {ns.seconds:g} s measured")
    cpu: dict = {}
    cpu_timer = threading.Timer(ns.warmup, lambda: cpu.update(start=meter.snapshot(), machine=machine_busy()))
    cpu_timer.start()
    try:
        if ns.processes == 1:
            records = [drive(plans[0])]
        else:
            with multiprocessing.get_context("spawn").Pool(ns.processes) as pool:
                try:
                    records = pool.map_async(drive, plans).get(ns.warmup + ns.seconds + 300)
                except BaseException:
                    pool.terminate()
                    raise
        cpu["end"] = meter.snapshot()
        cpu["machine_end"] = machine_busy()
    finally:
        cpu_timer.cancel()
        sampler.stop()
    with connect(address) as client:
        status, stats = client.status(), client.buffer_stats()
        dead = client.failures(limit=5)
    cpu_window = CpuMeter.delta(cpu.get("start", {}), cpu["end"]) if "start" in cpu else {}
    cpu_window["machine"] = cpu["machine_end"] - cpu.get("machine", cpu["machine_end"])
    return records, sampler.samples, cpu_window, {"status": status, "stats": stats, "dead": dead,
                                          "warmup_end": plans[0].warmup_end}


# ---------------------------------------------------------------- main

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="measured load after the warm-up")
    parser.add_argument("--warmup", type=float, default=20.0, help="load before the RSS baseline is taken")
    parser.add_argument("--streams", type=int, default=64, help="concurrent trainers (stream + submitter + poller)")
    parser.add_argument("--processes", type=int, default=1, help="driver processes the trainers are split over")
    parser.add_argument("--batch-size", type=int, default=8, help="trajectories per batch (whole groups)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--step-seconds", type=float, default=0.5, help="simulated trainer step: uniform 0..this")
    parser.add_argument("--prompts-per-submit", type=int, default=4)
    parser.add_argument("--submit-interval", type=float, default=1.0, help="mean seconds between a trainer's submits")
    parser.add_argument("--poll-interval", type=float, default=2.0, help="mean seconds between a trainer's polls")
    parser.add_argument("--push-every", type=float, default=15.0, help="trainer 0's weight pushes (0: none)")
    parser.add_argument("--max-queued-prompts", type=int, default=256, help="the collector's --max-submitted-prompts")
    parser.add_argument("--rss-every", type=float, default=5.0)
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the tiny model, built in a cache dir")
    parser.add_argument("--workdir", type=Path, default=None, help="service logs and state (default: a new temp dir)")
    ns = parser.parse_args()
    if ns.batch_size % ns.group_size:
        parser.error("--batch-size must be a multiple of --group-size")
    if not 1 <= ns.processes <= ns.streams:
        parser.error("--processes must be between 1 and --streams")
    return ns


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    ns = parse_args()
    signal.signal(signal.SIGTERM, _interrupt)  # stop the suite on SIGTERM as on Ctrl-C
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.path.insert(0, str(ROOT))
    from rlfleet.services.models.tiny import build_tiny_model
    from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite

    model_dir = ns.model_dir or build_tiny_model(Path(tempfile.gettempdir()) / "rlfleet-bench-tiny-model")
    workdir = Path(ns.workdir or tempfile.mkdtemp(prefix="rlfleet-bench-soak-"))
    log(f"work directory (service logs): {workdir}")
    procs: dict = {}
    try:
        procs = start_suite(SuiteOptions(model_dir=model_dir, collector_args=collector_args(ns)), workdir,
                            timeout=STARTUP_TIMEOUT_SECONDS)
        records, samples, cpu, end_state = run_load(procs, model_dir, ns)
    finally:
        if procs:
            stop_suite(procs)
    result = report(records, samples, cpu, end_state, {key: proc.log_path for key, proc in procs.items()}, ns)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
