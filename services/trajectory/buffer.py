"""Async facade over ``TrajectoryStore``: one owner thread, waiting readers, lease expiry.

Every store call runs on one dedicated thread (database connections are
thread-bound, and one thread also serializes the store: concurrent readers get
disjoint batches without locks). The event loop only waits. A reader stream
waits until a whole batch is ready and it has a free prefetch slot; any change
(append, ack, nack, release, expiry) wakes the waiters. Every ack and nack is
answered on the stream by a ``Settlement`` (applied or not), queued before the
slot it frees can carry the next batch.

Because the executor runs calls in submission order, releasing a stream's
leases when it ends also releases a lease whose call was still in flight when
the stream was cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import time
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Coroutine, Literal, Sequence, TypeVar

from rlfleet.services.common import tracing
from rlfleet.services.common.errors import InvalidArgument, NotFound, Unavailable
from rlfleet.services.trajectory.buffer_metrics import Occupancy
from rlfleet.services.trajectory.samples import SampleLog
from rlfleet.services.trajectory.store import AppendResult, Delivery, Dropped, Stats, TrajectoryStore
from rlfleet.services.trajectory.traces import GroupTraces
from rlfleet.v1 import tensor_pb2

log = logging.getLogger("rlfleet.trajectory.buffer")
T = TypeVar("T")

#: A reader's command after ``open``: ("ack" | "nack", lease_id).
Command = tuple[Literal["ack", "nack"], str]

OUTBOX_SIZE = 16
"""Messages a reader stream queues ahead of gRPC's writes; beyond it the stream stops reading the
reader's commands (flow control: a reader that acks without reading cannot grow memory)."""


@dataclass(frozen=True)
class Settlement:
    """The answer to one ack or nack (``StreamBatchesResponse.settled``)."""

    lease_id: str
    nack: bool
    applied: bool
    """False: nothing changed (the lease is not a live lease of this stream); ``reason`` says why."""
    trajectories: int = 0
    reason: str = ""


@dataclass(frozen=True)
class ReaderOptions:
    """What a trainer asks for when it opens a batch stream (see ``OpenBatchStream``)."""

    batch_size: int
    whole_groups: bool = False
    min_policy_version: int = 0
    lease_seconds: float = 0.0
    """0 means the buffer's default."""
    prefetch: int = 0
    """Batches delivered ahead of acks; 0 means 1. A batch holds its slot until the reader acks
    or nacks it, even after its lease expired: a slow reader is not handed its own batch again."""
    consumer: str = ""

    def check(self) -> None:
        if self.batch_size <= 0:
            raise InvalidArgument(f"open.batch_size: must be > 0, got {self.batch_size}")
        if not math.isfinite(self.lease_seconds) or self.lease_seconds < 0:
            raise InvalidArgument(f"open.lease_seconds: must be a finite number >= 0, got {self.lease_seconds}")
        if self.prefetch < 0:
            raise InvalidArgument(f"open.prefetch: must be >= 0, got {self.prefetch}")


TRAINER, APPENDS, LAST = 0, 1, 2
"""Store-thread priorities: a trainer's lease, ack or nack (and everything else) before queued appends."""


class StoreThread:
    """The one thread every store call runs on (a SQLite connection is bound to its thread), taking
    calls by priority, then in order: a trainer's lease or ack never waits behind a burst of
    appends for a batch that is already there (it did: 13.8 s with 1,960 trajectories ready)."""

    def __init__(self):
        self._calls: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._run, name="trajectory-store", daemon=True)
        self._thread.start()

    def submit(self, priority: int, function: Callable[[], T]) -> Future:
        future: Future = Future()
        self._calls.put((priority, next(self._order), function, future))
        return future

    def _run(self) -> None:
        while True:
            _, _, function, future = self._calls.get()
            if function is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Run what was submitted, then end the thread."""
        self._calls.put((LAST, next(self._order), None, None))
        self._thread.join()


class TrajectoryBuffer:
    """The trajectory store, usable from the event loop."""

    def __init__(self, open_store: Callable[[], TrajectoryStore], default_lease_seconds: float,
                 spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task]):
        """``spawn(coroutine, name)`` runs lease expiry in the background: the service's ``supervise``,
        so that expiry that dies (leased batches never redelivered) fails the service."""
        self._open_store = open_store
        self._default_lease_seconds = default_lease_seconds
        self._spawn = spawn
        self._executor: StoreThread | None = None
        self._store: TrajectoryStore | None = None
        self._changed = asyncio.Event()  # replaced on every notify: waiters hold the old one
        self._lease_added = asyncio.Event()
        self._expiry_wakes_at: float | None = None
        """When lease expiry next looks (``time.time()``; inf: when a lease is added), None while it
        looks: only a lease expiring before then need wake it (``_lease_added``)."""
        self._reader_ids = itertools.count(1)
        self._expiry: asyncio.Task | None = None
        self.traces = GroupTraces()
        """Each group's trace, for the lease and ack spans (tracing on)."""

    # --- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self._executor = StoreThread()
        self._store = await asyncio.wrap_future(self._executor.submit(TRAINER, self._open_store))
        self._expiry = self._spawn(self._expire_leases(), "the lease expiry")

    @property
    def database(self) -> str:
        """The store's database (file path, or URL less its password); empty until started."""
        return self._store.path if self._store is not None else ""

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            # Its error, if it died, was reported when it happened (``spawn``): stop goes on.
            await asyncio.gather(self._expiry, return_exceptions=True)
        if self._executor is not None:
            if self._store is not None:
                store, self._store = self._store, None  # later calls: Unavailable; queued ones still run
                await asyncio.wrap_future(self._executor.submit(APPENDS, store.close))
            await asyncio.to_thread(self._executor.shutdown)
            self._executor = None

    async def _call(self, method: Callable[..., T], *args, priority: int = TRAINER, **kwargs) -> T:
        """Run ``TrajectoryStore.<method>(store, ...)`` on the store thread."""
        if self._store is None or self._executor is None:
            raise Unavailable("the trajectory store is not open (starting or shutting down)")
        store = self._store
        reconnects = store.reconnects
        try:
            return await asyncio.wrap_future(self._executor.submit(
                priority, functools.partial(method, store, *args, **kwargs)))
        finally:
            if store.reconnects != reconnects:  # the index was rebuilt: dropped leases' rows are ready again
                self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- unary operations -----------------------------------------------------------------
    async def append(self, trajectories: tensor_pb2.TensorDict, idempotency_key: str = "",
                     group_keys: Sequence[str] = (), filtered_groups: Sequence[bool] = (),
                     committed_version: int | None = None, trace_contexts: Sequence[str] = ()) -> AppendResult:
        self.traces.appended(trajectories, trace_contexts)  # checked before anything is stored
        result = await self._call(TrajectoryStore.append, trajectories, idempotency_key, group_keys,
                                  filtered_groups, committed_version, priority=APPENDS)
        if result.appended:
            self._notify()
        return result

    async def stats(self) -> Stats:
        return await self._call(TrajectoryStore.stats)

    def occupancy(self) -> Occupancy | None:
        """What the buffer holds now, against its capacities (None while the store is not open). Read
        off the store thread, for a scrape that must not queue behind appends: each count is one int
        the store thread writes whole, so a read may mix two moments but never tears a value."""
        store = self._store
        if store is None:
            return None
        index = store.index
        return Occupancy(ready=index.ready, leased=index.leased, capacity=store.capacity, bytes=index.bytes,
                         capacity_bytes=store.capacity_bytes)

    async def read_samples(self, read: Callable[[SampleLog], T]) -> T:
        """``read(store.samples)`` on the store's thread, after the trainers' calls and the appends
        already queued (the viewer's reads never hold a trainer up)."""
        return await self._call(TrajectoryStore.read_samples, read, priority=APPENDS)

    async def drop_stale(self, below_policy_version: int) -> Dropped:
        # Nothing to notify: dropping makes no batch ready (readers' filters skip these rows anyway).
        return await self._call(TrajectoryStore.drop_stale, below_policy_version)

    # --- reader streams ---------------------------------------------------------------------
    async def stream(self, options: ReaderOptions,
                     commands: AsyncIterator[Command]) -> AsyncIterator[Delivery | Settlement]:
        """Deliver batches to one reader, and answer its acks and nacks, until its commands end;
        then release what it holds.

        ``commands`` carries the reader's acks and nacks; when it ends (the
        client half-closed) the stream answers what it received and ends. Errors
        in either direction end the stream, and whatever the reader still holds
        goes back to ready.
        """
        options.check()
        if self._store is None:
            raise Unavailable("the trajectory store is not open (starting or shutting down)")
        if options.batch_size > self._store.capacity:
            raise InvalidArgument(f"open.batch_size: {options.batch_size} exceeds the buffer's capacity "
                                  f"of {self._store.capacity}; no batch could ever be delivered")
        owner = f"{options.consumer or 'reader'}#{next(self._reader_ids)}"
        leases: set[str] = set()  # delivered to this reader, not yet acked or nacked
        log.info("reader opened", extra={"reader": owner, "batch_size": options.batch_size,
                                         "whole_groups": options.whole_groups})
        outbox: asyncio.Queue[Delivery | Settlement] = asyncio.Queue(OUTBOX_SIZE)
        deliver = asyncio.create_task(self._deliver(owner, leases, options, outbox))
        pump = asyncio.create_task(self._apply_commands(owner, leases, commands, outbox))
        take: asyncio.Task | None = None
        try:
            while True:
                take = asyncio.create_task(outbox.get())
                await asyncio.wait({take, pump, deliver}, return_when=asyncio.FIRST_COMPLETED)
                if take.done():
                    yield take.result()
                    continue
                take.cancel()
                if deliver.done():
                    deliver.result()  # the store's error
                deliver.cancel()
                pump.result()  # the reader's error, if any; else it half-closed
                while not outbox.empty():  # answer what it sent; undelivered batches are released below
                    if isinstance(message := outbox.get_nowait(), Settlement):
                        yield message
                return
        finally:
            for task in (take, deliver, pump):
                if task is not None:
                    task.cancel()
            self.traces.forget_leases(list(leases))
            released = await self._release_owner(owner)
            log.info("reader closed", extra={"reader": owner, "released": released})

    async def _deliver(self, owner: str, leases: set[str], options: ReaderOptions,
                       outbox: asyncio.Queue) -> None:
        while True:
            await outbox.put(await self._next_batch(owner, leases, options))

    async def _next_batch(self, owner: str, leases: set[str], options: ReaderOptions) -> Delivery:
        lease_seconds = options.lease_seconds or self._default_lease_seconds
        prefetch = options.prefetch or 1
        while True:
            changed = self._changed  # taken before looking: a change after this wakes us
            if len(leases) < prefetch:
                started = tracing.now_ns()
                delivery = await self._call(
                    TrajectoryStore.lease, owner, options.batch_size, lease_seconds=lease_seconds,
                    whole_groups=options.whole_groups, min_policy_version=options.min_policy_version)
                if delivery is not None:
                    self.traces.leased(delivery.lease_id, delivery.batch, started, owner)
                    leases.add(delivery.lease_id)
                    if self._expiry_wakes_at is None or delivery.expires_at < self._expiry_wakes_at:
                        self._lease_added.set()  # else it looks in time anyway: no call on the store thread
                    return delivery
            await changed.wait()

    async def _apply_commands(self, owner: str, leases: set[str], commands: AsyncIterator[Command],
                              outbox: asyncio.Queue) -> None:
        async for kind, lease_id in commands:
            nack = kind == "nack"
            started = tracing.now_ns()
            try:
                count = await self._call(TrajectoryStore.nack if nack else TrajectoryStore.ack, owner, lease_id)
                settled = Settlement(lease_id, nack, applied=True, trajectories=count)
            except NotFound as err:
                settled = Settlement(lease_id, nack, applied=False, reason=str(err))
                log.info("%s of a lease that is not live", kind, extra={"reader": owner, "lease": lease_id})
            self.traces.settled(lease_id, kind, started, settled.applied)
            await outbox.put(settled)  # before the slot is freed: the answer precedes the next batch
            leases.discard(lease_id)
            self._notify()

    async def _release_owner(self, owner: str) -> int:
        # Shielded: a second cancellation must not skip the notify, and the release
        # itself runs on the store thread whatever happens to this task.
        loop = asyncio.get_running_loop()
        if self._executor is None or self._store is None:
            return 0
        store = self._store
        future = asyncio.wrap_future(self._executor.submit(TRAINER, functools.partial(store.release_owner, owner)),
                                     loop=loop)
        future.add_done_callback(lambda f: self._notify() if not f.cancelled() and not f.exception() else None)
        return await asyncio.shield(future)

    # --- lease expiry -------------------------------------------------------------------------
    async def _expire_leases(self) -> None:
        # An error ends it: leased batches would never be redelivered, so the service fails (``spawn``).
        while True:
            self._lease_added.clear()  # before expire(): a lease added meanwhile re-arms us
            self._expiry_wakes_at = None
            expired, next_expiry = await self._call(TrajectoryStore.expire)
            self._expiry_wakes_at = math.inf if next_expiry is None else next_expiry
            if expired:
                self.traces.forget_leases([lease_id for lease_id, _ in expired])
                log.info("leases expired", extra={"leases": [lease_id for lease_id, _ in expired]})
                self._notify()
            timeout = None if next_expiry is None else max(0.0, next_expiry - time.time()) + 0.001
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._lease_added.wait(), timeout)
