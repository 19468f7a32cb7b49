"""The load of ``bench/soak.py``: trainers as asyncio tasks, each with its own SDK client.

A trainer is a batch stream (explicit acks, the server's answer to each checked), a prompt submitter
and a poller; trainer 0 also pushes weights. ``drive(plan)`` runs the trainers of one driver process
and returns what they saw as plain data (it crosses process boundaries).
"""

from __future__ import annotations

import asyncio
import collections
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil

ROOT = Path(__file__).resolve().parents[1]
BACKPRESSURE = "RESOURCE_EXHAUSTED"
RETRIED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
UNARY_RPCS = ("SubmitPrompts", "GetStatus", "GetStats", "GetPolicyVersion", "PushWeights")
MAX_NOTES = 20


# ---------------------------------------------------------------- what a driver records

@dataclass
class Record:
    """Everything one driver process saw (plain data: it crosses process boundaries)."""

    latencies: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: collections.defaultdict(list))
    """RPC -> (wall time at the end, seconds)."""
    errors: collections.Counter = field(default_factory=collections.Counter)
    """"RPC CODE" -> count, after the SDK's retries."""
    retried: collections.Counter = field(default_factory=collections.Counter)
    """"RPC CODE" -> failed attempts of the codes the SDK retries (UNAVAILABLE, DEADLINE_EXCEEDED)."""
    batches: list[tuple[float, int, int]] = field(default_factory=list)
    """(wall time, stream index, trajectories) per batch received."""
    submitted: list[tuple[float, int]] = field(default_factory=list)
    """(wall time, prompts) per accepted SubmitPrompts."""
    acks: collections.Counter = field(default_factory=collections.Counter)
    """"confirmed" / "refused" / "unanswered" acks, and "redelivered" batches."""
    pushes: list[dict] = field(default_factory=list)
    buffer: list[tuple[float, int, int, int]] = field(default_factory=list)
    """(wall time, ready, leased, the collector's pending prompts) as the pollers saw them."""
    loop_lag: list[float] = field(default_factory=list)
    driver: dict = field(default_factory=dict)
    """This driver process: CPU seconds and RSS over the measured window."""
    notes: list[str] = field(default_factory=list)
    """The first ``MAX_NOTES`` unexpected errors, in words."""

    def note(self, text: str) -> None:
        if len(self.notes) < MAX_NOTES:
            self.notes.append(text)

    def plain(self) -> dict:
        return {"latencies": dict(self.latencies), "errors": dict(self.errors), "retried": dict(self.retried),
                "batches": self.batches, "submitted": self.submitted, "acks": dict(self.acks),
                "pushes": self.pushes, "buffer": self.buffer, "loop_lag": self.loop_lag, "driver": self.driver,
                "notes": self.notes}


async def timed(record: Record, rpc: str, call):
    """Await ``call``; its latency on success, its typed error otherwise (then None is returned)."""
    from rlfleet.client import RlfleetClientError

    started = time.perf_counter()
    try:
        result = await call
    except RlfleetClientError as error:
        record.errors[f"{rpc} {error.code}"] += 1
        if error.code != BACKPRESSURE:
            record.note(f"{rpc} {error.code}: {error.details[:300]}")
        return None
    record.latencies[rpc].append((time.time(), time.perf_counter() - started))
    return result


class _CountingStub:
    """Wraps a generated stub: counts the failed attempts of unary calls, which the SDK may retry."""

    def __init__(self, stub, record: Record):
        self._stub, self._record = stub, record

    def __getattr__(self, name):
        method = getattr(self._stub, name)
        if name not in UNARY_RPCS or name == "PushWeights":  # streams: the SDK reports them itself
            return method
        record = self._record

        async def call(*args, **kwargs):
            try:
                return await method(*args, **kwargs)
            except grpc.RpcError as exc:
                if exc.code() in RETRIED_CODES:
                    record.retried[f"{name} {exc.code().name}"] += 1
                raise
        return call


def count_attempts(client, record: Record) -> None:
    # Reads the SDK's private stubs (bench only): without it, retried UNAVAILABLEs would be invisible.
    client._stubs()
    if hasattr(client, "_collector") and hasattr(client, "_trajectory"):
        client._collector = _CountingStub(client._collector, record)
        client._trajectory = _CountingStub(client._trajectory, record)


# ---------------------------------------------------------------- one trainer

@dataclass(frozen=True)
class Plan:
    """What every driver needs to know (picklable)."""

    address: str
    streams: list[int]
    warmup_end: float
    end: float
    batch_size: int
    step_seconds: float
    prompts_per_submit: int
    submit_interval: float
    poll_interval: float
    push_every: float
    model_file: str | None
    """Set in the driver that runs trainer 0 (the pusher)."""


ACK_GRACE_SECONDS = 5.0
"""At the end of the run, how long a stream waits for the answers to its last acks before it is cut."""


class AckWatcher:
    """Acked batches until the server's answer arrives (``Batch.confirmed``): counts the answers and
    their latency, polled every ``period`` s (one task for all streams)."""

    def __init__(self, record: Record, period: float = 0.1):
        self.record, self.period = record, period
        self.pending: dict[int, list[tuple[object, float]]] = collections.defaultdict(list)

    def add(self, index: int, batch) -> None:
        self.pending[index].append((batch, time.perf_counter()))

    def scan(self) -> None:
        for index, acks in self.pending.items():
            left = []
            for batch, acked_at in acks:
                if batch.confirmed is None:
                    left.append((batch, acked_at))
                    continue
                self.record.latencies["ack answer"].append((time.time(), time.perf_counter() - acked_at))
                if batch.confirmed:
                    self.record.acks["confirmed"] += 1
                else:
                    self.record.acks["refused"] += 1
                    self.record.note(f"ack of {batch.lease_id} refused: {batch.settle_error}")
            acks[:] = left

    async def run(self, end: float) -> None:
        while time.time() < end + ACK_GRACE_SECONDS + 1:
            self.scan()
            await asyncio.sleep(self.period)
        self.scan()
        self.record.acks["unanswered"] += sum(len(acks) for acks in self.pending.values())

    async def answered(self, index: int, grace: float) -> None:
        """Wait until stream ``index`` has no ack without an answer, at most ``grace`` s."""
        give_up = time.perf_counter() + grace
        while self.pending.get(index) and any(b.confirmed is None for b, _ in self.pending[index]):
            if time.perf_counter() > give_up:
                return
            await asyncio.sleep(self.period)


async def next_batch(stream, index: int, plan: Plan, acks: AckWatcher):
    """The stream's next batch, or None when the run ended first (the stream is then cut, after the
    answers to its acks arrived or ``ACK_GRACE_SECONDS``)."""
    reading = asyncio.ensure_future(stream.next())
    done, _ = await asyncio.wait({reading}, timeout=max(0.0, plan.end - time.time()))
    if not done:
        await acks.answered(index, ACK_GRACE_SECONDS)
        if not reading.done():
            reading.cancel()
            await asyncio.wait({reading})
            return None
    return reading.result()


async def stream_batches(client, index: int, plan: Plan, record: Record, acks: AckWatcher) -> None:
    """Read, 'train on', ack; reopen after an error."""
    from rlfleet.client import RlfleetClientError

    while time.time() < plan.end:
        async with client.batches(plan.batch_size, consumer=f"soak-{index}", auto_ack=False,
                                  idle_timeout=120.0) as stream:
            while time.time() < plan.end:
                asked = time.perf_counter()
                try:
                    batch = await next_batch(stream, index, plan, acks)
                except RlfleetClientError as error:
                    record.errors[f"StreamBatches {error.code}"] += 1
                    record.note(f"stream {index}: {error.code}: {error.details[:300]}")
                    break
                if batch is None:
                    if time.time() < plan.end:
                        record.errors["StreamBatches ENDED"] += 1
                    break
                record.latencies["batch wait"].append((time.time(), time.perf_counter() - asked))
                record.batches.append((time.time(), index, len(batch)))
                record.acks["redelivered"] += batch.redelivered
                batch.padded("tokens/full")  # touch the data as a trainer would
                await asyncio.sleep(random.uniform(0, plan.step_seconds))
                batch.ack()
                acks.add(index, batch)
        await acks.answered(index, ACK_GRACE_SECONDS)  # close() read the last answers
        if time.time() < plan.end:
            await asyncio.sleep(1.0)


async def submit_prompts(client, index: int, plan: Plan, record: Record) -> None:
    """Submit small lots of prompts; back off on RESOURCE_EXHAUSTED (the queue is full)."""
    serial = 0
    while time.time() < plan.end:
        lot = [{"prompt": f"what is {index} plus {serial + i}?", "prompt_id": f"soak-{index}-{serial + i}"}
               for i in range(plan.prompts_per_submit)]
        ids = await timed(record, "SubmitPrompts", client.submit_prompts(lot))
        if ids is not None:
            serial += len(lot)
            record.submitted.append((time.time(), len(ids)))
        await asyncio.sleep(random.uniform(0.5, 1.5) * plan.submit_interval)


async def poll(client, plan: Plan, record: Record) -> None:
    await asyncio.sleep(random.uniform(0, plan.poll_interval))
    while time.time() < plan.end:
        status = await timed(record, "GetStatus", client.status())
        stats = await timed(record, "GetStats", client.buffer_stats())
        if status is not None and stats is not None:
            record.buffer.append((time.time(), stats.ready, stats.leased, status.pending_prompts))
        await timed(record, "GetPolicyVersion", client.policy_version())
        await asyncio.sleep(random.uniform(0.5, 1.5) * plan.poll_interval)


async def push_weights(client, plan: Plan, record: Record) -> None:
    """Push the tiny model's own weights every ``push_every`` s; the version must grow by exactly one."""
    from safetensors.torch import load_file

    state = load_file(plan.model_file)
    while True:
        await asyncio.sleep(plan.push_every)
        if time.time() >= plan.end - 2:
            return
        before = await timed(record, "GetPolicyVersion", client.policy_version())
        started = time.time()
        result = await timed(record, "PushWeights", client.push_weights(state, progress=False))
        if result is None:
            continue
        record.pushes.append({"version": result.version, "start": started, "end": time.time(),
                              "seconds": result.seconds, "server_seconds": result.server_seconds,
                              "stage_seconds": max(r.stage_seconds for r in result.replicas),
                              "apply_seconds": max(r.apply_seconds for r in result.replicas),
                              "transport": result.transport, "all_applied": result.all_applied})
        if not result.all_applied:
            record.errors["PushWeights NOT_ALL_APPLIED"] += 1
        if before is not None and result.version != before + 1:
            record.errors["PushWeights VERSION_JUMP"] += 1
            record.note(f"push: version {before} -> {result.version}")


async def trainer(index: int, plan: Plan, record: Record, acks: AckWatcher) -> None:
    from rlfleet.client import connect_async

    async with connect_async(plan.address) as client:
        count_attempts(client, record)
        tasks = [stream_batches(client, index, plan, record, acks), submit_prompts(client, index, plan, record),
                 poll(client, plan, record)]
        if index == 0 and plan.model_file:
            tasks.append(push_weights(client, plan, record))
        await asyncio.gather(*tasks)


async def measure_loop_lag(plan: Plan, record: Record, period: float = 0.1) -> None:
    """The event loop's lateness on a ``period`` sleep; this process's CPU and RSS over the window."""
    me = psutil.Process()
    while time.time() < plan.end:
        started = time.perf_counter()
        await asyncio.sleep(period)
        if time.time() >= plan.warmup_end:
            if not record.driver:
                record.driver = {"cpu_start": time.process_time(), "rss_start": me.memory_info().rss,
                                 "wall_start": time.time()}
            record.loop_lag.append(time.perf_counter() - started - period)
    if record.driver:
        record.driver.update(cpu_end=time.process_time(), rss_end=me.memory_info().rss, wall_end=time.time())


async def drive_async(plan: Plan) -> dict:
    record = Record()
    acks = AckWatcher(record)
    await asyncio.gather(measure_loop_lag(plan, record), acks.run(plan.end),
                         *(trainer(i, plan, record, acks) for i in plan.streams))
    return record.plain()


def drive(plan: Plan) -> dict:
    """A driver process's entry (also run in-process when ``--processes 1``)."""
    sys.path.insert(0, str(ROOT))
    return asyncio.run(drive_async(plan))
