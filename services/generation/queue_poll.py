"""How vLLM's engine-core and worker processes wait for each other while they generate.

vLLM (0.32) hands every step between the engine-core process and its workers
through shared-memory ring buffers (``vllm/distributed/device_communicators/
shm_broadcast.py``). A reader that read within the last second waits for the next
message by spinning on ``sched_yield()``: while a model generates, the engine core
spins for the worker's output and the worker for the next step, each a full core
(``top`` shows the engine core busy through every generation, much of it in system
time). On a GPU host that core buys latency. On a CPU host the worker *is* the model: the
spinning engine core lands on the worker's core and on the cores the rest of the
pipeline needs (reference, reward, collector), and sched_yield gives way to them
only by turns. (On a host of at most 2 CPUs the service runs the model in the engine
core itself, with no worker and no such queue: ``GenerationEngine._worker_in_engine_core``.)
The sleep lifts end to end / plain in-process vLLM (``bench/pipeline.py --parts c``) and
async / sync (``--parts b``) on a 2-core host, and costs a lone engine (one with a spare core
to spin on) some throughput, less at 20 µs than at 100 µs — hence the default of 20. The
measurements: see the pipeline benchmark page (docs/benchmarks/pipeline.md, the 2026-11-26 runs of parts b and c).

:func:`install`, a ``vllm.general_plugins`` entry point (so it runs in every vLLM
process, the spawned engine core and workers included), replaces that yield with a
sleep of ``RLFLEET_VLLM_QUEUE_POLL_US`` microseconds when the variable is set and
positive. The generation service sets it from its ``queue_poll_us`` setting before it
builds its engine, so the processes it spawns inherit it; any other vLLM in the same
environment keeps its spin. Readers still check the buffer's written flag after
every sleep, so no message waits longer than one sleep (plus the timer's slack),
and nothing depends on vLLM's wake-up notifications (which a reader that never
spins can miss for up to 5 s).
"""

from __future__ import annotations

import logging
import os
import time

# Under vLLM's own logger: its handler is configured in every vLLM process (ours is not in the
# engine core or the workers), so each process that installs the sleep says so, tagged with its role.
logger = logging.getLogger("vllm.rlfleet_queue_poll")

ENV = "RLFLEET_VLLM_QUEUE_POLL_US"
"""Microseconds a vLLM message-queue reader sleeps between checks; unset or 0: vLLM's spin."""

CPU_DEFAULT_US = 20
"""``queue_poll_us`` on a CPU engine when the config leaves it unset."""


def resolve(configured: int | None, on_cpu: bool) -> int:
    """The poll interval to use: the configured one, else ``CPU_DEFAULT_US`` on CPU, else 0 (vLLM's spin)."""
    if configured is not None:
        return configured
    return CPU_DEFAULT_US if on_cpu else 0


def interval_from_env() -> int:
    """``RLFLEET_VLLM_QUEUE_POLL_US`` as an int; 0 when unset. ValueError names the variable if malformed."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return 0
    try:
        micros = int(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected a whole number of microseconds") from None
    if micros < 0:
        raise ValueError(f"{ENV}={raw!r}: must be >= 0")
    return micros


def install() -> bool:
    """``vllm.general_plugins`` entry point: sleep instead of spinning in vLLM's shared-memory
    queues when ``RLFLEET_VLLM_QUEUE_POLL_US`` asks for it. True if the sleep is now in place."""
    micros = interval_from_env()
    if micros == 0:
        return False
    from vllm.distributed.device_communicators import shm_broadcast

    current = getattr(shm_broadcast, "sched_yield", None)
    if getattr(current, "rlfleet_poll_us", None) == micros:
        return True  # already installed in this process (vLLM may load plugins more than once)
    if not callable(current):
        logger.warning("%s=%d ignored: this vLLM's shm_broadcast has no sched_yield to replace "
                       "(its queues keep their own wait)", ENV, micros)
        return False
    seconds = micros / 1e6

    def nap() -> None:
        time.sleep(seconds)

    nap.rlfleet_poll_us = micros  # type: ignore[attr-defined]
    shm_broadcast.sched_yield = nap
    logger.info("vLLM queue readers sleep %d us between checks instead of spinning (pid %d)", micros, os.getpid())
    return True
