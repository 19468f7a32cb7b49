"""The python tool's sandbox, call by call.

Calls/s, wall and CPU time per call, idle and with the cores busy.

    .venv/bin/python bench/sandbox.py [--calls 30] [--rounds 5] [--busy 2] [--concurrency 1]
                                      [--baseline OLD_SANDBOX_PY] [--calls-per-episode 3]

Needs root (the sandbox drops to uid 65534). Each call is ``sandbox.run(SNIPPET)`` (the snippet of
bench/pipeline.py part (d), its output checked every time) on one ``PythonSandbox`` per variant, as the
environment service shares one; ``--concurrency`` calls in flight.
Variants, alternated within each round (the order flips every round):

- ``current``: ``rlfleet.services.environment.sandbox.PythonSandbox``: a fresh sandbox per call (bwrap
  and an interpreter started and ended: the environment service with ``reuse_sandboxes: false``);
- ``pooled``: each call a sandbox of its own from the pool (``EpisodeSandboxes.run``: the one the last
  call left, reset after it; the environment service's default);
- ``baseline``: the same class from ``--baseline FILE``, another version of sandbox.py (to compare one
  against another side by side, e.g. ``git show REV:services/environment/sandbox.py > /tmp/old.py``);
- ``episode``: ``EpisodeSandbox`` (services/environment/episode_sandbox.py): one sandbox per episode of
  ``--calls-per-episode`` calls, a fresh process forked in it per call; closed after its last call
  (reset and parked, counted) and given to the next episode (``EpisodeSandboxes`` reuses it);
- ``episode-unreused``: the same, with every parked sandbox ended at once: each episode starts one
  (bwrap and the interpreter) and ends it, both counted;
- ``floor``: no sandbox: ``python3 -I -B -X utf8 -c SNIPPET`` as a plain child process (one interpreter).

Loads: idle (no load of ours: whatever else runs on the host still does), then ``--busy`` processes
spinning ``while True: pass`` (as vLLM holds the cores).
CPU is the whole call's: this process and every process the call starts, the sandbox's init and the
snippet included, counted by a cgroup of our own (cpuacct on cgroup v1, cpu.stat on v2; the spinners
stay outside it). Wall-clock time is per call, as the caller waits for it. Per (load, variant) the
median over rounds; ratios are taken per round (current / baseline), then the median.
The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable

from _environments import SNIPPET, SNIPPET_OUTPUT
from rlfleet.services.environment.episode_sandbox import EpisodeSandboxes
from rlfleet.services.environment.sandbox import PythonSandbox

Call = Callable[[], Awaitable[None]]


class CgroupCpu:
    """CPU nanoseconds used by this process and every process started after ``__enter__``, read from a
    cgroup of our own; descendants reparented away from us (a sandbox's init) are still counted."""

    def __init__(self) -> None:
        name = f"rlfleet-bench-sandbox-{os.getpid()}"
        if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):  # v2: a child of our own cgroup
            here = Path("/proc/self/cgroup").read_text().strip().rpartition("::")[2]
            self.home = Path("/sys/fs/cgroup") / here.lstrip("/")
            self.path, self.read = self.home / name, self._read_v2
        else:  # v1: the cpuacct hierarchy
            root = next(Path("/sys/fs/cgroup").glob("*cpuacct*"))
            here = next(line.rpartition(":")[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                        if "cpuacct" in line.split(":")[1].split(","))
            self.home = root / here.lstrip("/")
            self.path, self.read = root / name, self._read_v1

    def _read_v1(self) -> int:
        return int((self.path / "cpuacct.usage").read_text())

    def _read_v2(self) -> int:
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) * 1000

    def __enter__(self) -> "CgroupCpu":
        self.path.mkdir()
        (self.path / "cgroup.procs").write_text(str(os.getpid()))
        return self

    def __exit__(self, *exc) -> None:
        (self.home / "cgroup.procs").write_text(str(os.getpid()))
        for _ in range(50):  # the last call's processes may still be leaving
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def load_sandbox_class(path: str) -> type:
    """``PythonSandbox`` from another copy of sandbox.py, imported under a private name."""
    spec = importlib.util.spec_from_file_location("_baseline_sandbox", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.PythonSandbox


def sandbox_call(sandbox_class: type) -> Call:
    sandbox = sandbox_class()

    async def call() -> None:
        result = await sandbox.run(SNIPPET)
        if not result.ok or result.stdout != SNIPPET_OUTPUT:
            raise RuntimeError(f"the sandbox call failed: {result.error}: {result.stderr[-500:]}")

    return call


POOLS: list[EpisodeSandboxes] = []
"""The pools of the variants that reuse sandboxes: their parked sandboxes are ended at the bench's end."""


def pooled_call() -> Call:
    """Each call a sandbox of its own from the pool (``EpisodeSandboxes.run``, the environment service's
    default): the one the last call left, reset after it."""
    POOLS.append(EpisodeSandboxes(PythonSandbox()))
    return sandbox_call(lambda: POOLS[-1])


def episode_call(calls_per_episode: int, reuse: bool = True) -> Call:
    """Calls on per-episode sandboxes: each ``calls_per_episode`` calls share one, then it is closed
    (in the call that made the last one: its reset, or without ``reuse`` its teardown, is counted).
    With ``reuse`` the next episode gets the sandbox the last one closed, reset; without, the parked
    sandbox is ended at once (each episode starts and ends its own, as before sandboxes were reused)."""
    sandboxes = EpisodeSandboxes(PythonSandbox())
    POOLS.append(sandboxes)
    state = {"episode": None, "calls": 0}

    async def call() -> None:
        if state["episode"] is None:
            state["episode"], state["calls"] = sandboxes.episode(), 0
        episode = state["episode"]
        result = await episode.run(SNIPPET)
        state["calls"] += 1
        if state["calls"] == calls_per_episode:
            state["episode"] = None
            await episode.close()
            if not reuse:
                await sandboxes.close()
        if not result.ok or result.stdout != SNIPPET_OUTPUT:
            raise RuntimeError(f"the sandbox call failed: {result.error}: {result.stderr[-500:]}")

    return call


async def floor_call() -> None:
    process = await asyncio.create_subprocess_exec(
        "/usr/bin/python3", "-I", "-B", "-X", "utf8", "-c", SNIPPET, stdout=subprocess.PIPE)
    stdout, _ = await process.communicate()
    if process.returncode != 0 or stdout.decode() != SNIPPET_OUTPUT:
        raise RuntimeError(f"the floor's interpreter failed: {process.returncode}")


async def measure(call: Call, calls: int, concurrency: int, cpu: CgroupCpu) -> dict[str, float]:
    """``calls`` calls, ``concurrency`` at a time: calls/s, median wall ms and CPU ms per call."""
    walls: list[float] = []
    remaining = iter(range(calls))

    async def worker() -> None:
        for _ in remaining:
            started = time.perf_counter()
            await call()
            walls.append(time.perf_counter() - started)

    used, started = cpu.read(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds, used = time.perf_counter() - started, cpu.read() - used
    return {"calls_per_s": calls / seconds, "wall_ms": statistics.median(walls) * 1e3, "cpu_ms": used / calls / 1e6}


def spinners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


async def run_load(variants: dict[str, Call], ns: argparse.Namespace, cpu: CgroupCpu) -> dict[str, list[dict]]:
    """Every variant once per round (order flipped each round), after one warm-up call each."""
    for call in variants.values():
        await call()
    rounds: dict[str, list[dict]] = {name: [] for name in variants}
    for index in range(ns.rounds):
        order = list(variants) if index % 2 == 0 else list(reversed(variants))
        for name in order:
            rounds[name].append(await measure(variants[name], ns.calls, ns.concurrency, cpu))
    return rounds


def median_of(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def report(results: dict[str, dict[str, list[dict]]], ns: argparse.Namespace) -> dict:
    """Print the table; return the RESULT dict."""
    print(f"\n{ns.calls} calls per round, {ns.concurrency} in flight, medians of {ns.rounds} rounds\n")
    print("| load | variant | calls/s | wall ms per call | CPU ms per call | ratio (median of per-round ratios) |")
    print("|---|---|---:|---:|---:|---|")
    result: dict = {"calls": ns.calls, "rounds": ns.rounds, "concurrency": ns.concurrency}
    for load, rounds in results.items():
        for name, measured in rounds.items():
            row = {key: median_of(measured, key) for key in ("calls_per_s", "wall_ms", "cpu_ms")}
            comparison = ""
            against = {"current": "baseline", "pooled": "current", "episode": "current",
                       "episode-unreused": "current"}.get(name)
            if against in rounds:
                pairs = list(zip(rounds[against], measured))
                speedup = statistics.median(m["calls_per_s"] / b["calls_per_s"] for b, m in pairs)
                cpu_ratio = statistics.median(m["cpu_ms"] / b["cpu_ms"] for b, m in pairs)
                comparison = f"calls/s x{speedup:.2f}, CPU x{cpu_ratio:.2f} (vs {against})"
                key = {"current": f"{load}_", "episode": f"{load}_episode_"}.get(name, f"{load}_{name}_")
                result[f"{key}speedup"] = round(speedup, 3)
                result[f"{key}cpu_ratio"] = round(cpu_ratio, 3)
                result[f"{key}speedup_per_round"] = [round(m["calls_per_s"] / b["calls_per_s"], 3) for b, m in pairs]
            print(f"| {load} | {name} | {row['calls_per_s']:.1f} | {row['wall_ms']:.1f} | {row['cpu_ms']:.1f} "
                  f"| {comparison} |")
            for key, value in row.items():
                result[f"{load}_{name}_{key}"] = round(value, 2)
    return result


async def main(ns: argparse.Namespace) -> dict:
    variants: dict[str, Call] = {"current": sandbox_call(PythonSandbox)}
    if ns.baseline:
        variants["baseline"] = sandbox_call(load_sandbox_class(ns.baseline))
    variants["pooled"] = pooled_call()
    if ns.calls_per_episode:
        variants["episode"] = episode_call(ns.calls_per_episode)
        variants["episode-unreused"] = episode_call(ns.calls_per_episode, reuse=False)
    variants["floor"] = floor_call
    results: dict[str, dict[str, list[dict]]] = {}
    busy = spinners(ns.busy) if ns.busy else []  # started first: outside the measured cgroup
    try:
        for process in busy:
            os.kill(process.pid, signal.SIGSTOP)  # idle until the busy load
        with CgroupCpu() as cpu:
            results["idle"] = await run_load(variants, ns, cpu)
            if busy:
                for process in busy:
                    os.kill(process.pid, signal.SIGCONT)
                results[f"busy{ns.busy}"] = await run_load(variants, ns, cpu)
    finally:
        for process in busy:
            process.kill()
            process.wait()
        for pool in POOLS:
            await pool.close()
    return report(results, ns)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=30, help="calls per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--busy", type=int, default=2, help="spinning processes of the busy load (0: idle only)")
    parser.add_argument("--concurrency", type=int, default=1, help="calls in flight")
    parser.add_argument("--calls-per-episode", type=int, default=3,
                        help="calls per per-episode sandbox of the episode variant (0: leave it out)")
    parser.add_argument("--baseline", help="another sandbox.py to measure side by side with the current one")
    return parser.parse_args()


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/sandbox.py needs root: the sandbox drops each call to uid 65534")
    print("RESULT " + json.dumps(asyncio.run(main(parse_args()))))
