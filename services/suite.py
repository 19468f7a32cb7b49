"""Start the whole suite locally as processes (the embedded default).

    rlfleet-suite --model-dir ~/.cache/rlfleet/tiny-model            # run until Ctrl-C
    rlfleet-suite --check                                            # start, report health, stop

Builds the tiny local model when ``--model-dir`` holds none. Services are
started in dependency order and each must report SERVING before the next.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from rlfleet.services.launch import ServiceProcess

DEFAULT_MODEL_DIR = Path(os.environ.get("RLFLEET_HOME", Path.home() / ".cache" / "rlfleet")) / "tiny-model"


def suite_processes(model_dir: Path) -> list[ServiceProcess]:
    """The services of the embedded default, in start order."""
    del model_dir  # the model-serving services join here as they land
    return [ServiceProcess("echo", ["--log-format", "text"])]


def start_suite(model_dir: Path, workdir: Path, timeout: float = 600.0) -> list[ServiceProcess]:
    """Start every service and wait until all are SERVING (stopping all on failure)."""
    procs: list[ServiceProcess] = []
    try:
        for proc in suite_processes(model_dir):
            started = time.monotonic()
            print(f"[suite] starting {proc.name} ...", file=sys.stderr, flush=True)
            proc.start(workdir / proc.name)
            procs.append(proc)
            proc.wait_ready(timeout)
            print(f"[suite] {proc.name:<11} SERVING on {proc.address} "
                  f"({time.monotonic() - started:.1f}s)", file=sys.stderr, flush=True)
    except BaseException:
        stop_suite(procs)
        raise
    return procs


def stop_suite(procs: list[ServiceProcess]) -> None:
    for proc in reversed(procs):
        code = proc.stop()
        print(f"[suite] {proc.name:<11} stopped (exit code {code})", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Start the rlfleet suite locally as processes.")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                        help="model directory; the tiny local model is built here if missing")
    parser.add_argument("--workdir", type=Path, default=Path("runs") / "suite",
                        help="logs and port files of the services")
    parser.add_argument("--check", action="store_true", help="start, report health, stop")
    ns = parser.parse_args(argv)

    from rlfleet.services.models.tiny import build_tiny_model

    print(f"[suite] model: {build_tiny_model(ns.model_dir)}", file=sys.stderr, flush=True)
    procs = start_suite(ns.model_dir, ns.workdir)
    try:
        for proc in procs:
            print(f"{proc.name}\t{proc.address}\tSERVING")
        if not ns.check:
            stop = threading.Event()
            signal.signal(signal.SIGTERM, lambda *_: stop.set())
            signal.signal(signal.SIGINT, lambda *_: stop.set())
            print("[suite] running; Ctrl-C stops it", file=sys.stderr, flush=True)
            stop.wait()
    finally:
        stop_suite(procs)


if __name__ == "__main__":
    main()
