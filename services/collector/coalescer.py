"""Many groups, one call: what queued while a call was in flight goes out together in the next.

The reference, reward and trajectory services (and the prompt ledger) take any number of groups
per call, and each call costs both sides a fixed share of CPU (the RPC, the request's decoding,
the service's Python around its vectorized work, a transaction), so a collector that waits for
them sends the groups that queued in the meantime as one call. Nothing waits on purpose: when the service keeps up, each call carries
one group, as before. Each caller still gets its own group's answer, or its own error: a
call refused for something one group carries (``split_on``) is made again group by group, so
that only that group fails (a dead letter names its own prompt, not its neighbours').

Traced (``tracing``), each call is a span in the trace of the first group it carries, linked both
ways with the spans the other groups wait in.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generic, Sequence, TypeVar

from rlfleet.services.common import tracing

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class _Waiting(Generic[Item, Result]):
    item: Item
    size: int
    future: asyncio.Future
    span: Any = None
    """The submitter's current span (None untraced): the call's span links to it."""


class Coalescer(Generic[Item, Result]):
    """``await submit(item)`` -> its result from ``call(items)``, a list of one result per item in
    order. At most ``concurrency`` calls are in flight; each takes what queued, up to
    ``max_items`` items and ``max_bytes`` of their ``size`` (an item larger than that goes alone)."""

    def __init__(self, call: Callable[[list[Item]], Awaitable[Sequence[Result]]], *,
                 split_on: Callable[[BaseException], bool], max_items: int = 64, max_bytes: int = 8 << 20,
                 concurrency: int = 1, name: str = "call"):
        if max_items < 1 or max_bytes < 1 or concurrency < 1:
            raise ValueError("max_items, max_bytes and concurrency must be >= 1")
        self._call = call
        self._name = name
        """The span name of a call (traced)."""
        self._split_on = split_on
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._slots = asyncio.Semaphore(concurrency)
        self._queue: collections.deque[_Waiting] = collections.deque()
        self.calls = 0
        """Calls made (a split call counts each of its single calls too)."""
        self.items = 0
        """Items answered."""

    async def submit(self, item: Item, size: int = 0) -> Result:
        waiting = _Waiting(item, size, asyncio.get_running_loop().create_future(), tracing.current())
        self._queue.append(waiting)
        async with self._slots:
            if self._queue:  # not taken by a call that started while this one waited for its slot
                await self._send(self._take())
        return await waiting.future

    def _take(self) -> list[_Waiting]:
        taken, size = [], 0
        while self._queue and len(taken) < self._max_items:
            if taken and size + self._queue[0].size > self._max_bytes:
                break
            waiting = self._queue.popleft()
            taken.append(waiting)
            size += waiting.size
        return taken

    async def _send(self, batch: list[_Waiting]) -> None:
        try:
            try:
                self.calls += 1
                with tracing.shared_call(self._name, [w.span for w in batch]):
                    results = await self._call([w.item for w in batch])
            except Exception as exc:  # noqa: BLE001 - handed to each caller, who classifies it
                if len(batch) == 1 or not self._split_on(exc):
                    for waiting in batch:
                        _settle(waiting.future, exception=exc)
                    return
                for waiting in batch:  # refused for what one of them carries: find which, alone
                    await self._send([waiting])
                return
            if len(results) != len(batch):  # a bug of `call`: every caller must hear of it
                raise AssertionError(f"{len(results)} results for {len(batch)} items")
            self.items += len(batch)
            for waiting, result in zip(batch, results):
                _settle(waiting.future, result=result)
        except BaseException as exc:  # cancelled, or the bug above: no caller may wait forever
            for waiting in batch:
                if isinstance(exc, Exception):
                    _settle(waiting.future, exception=exc)
                elif not waiting.future.done():
                    # Cancelled (the collector stopping): cancel theirs. A CancelledError set as an
                    # exception on a future whose waiter is gone is logged "never retrieved" at exit.
                    waiting.future.cancel()
            raise


def _settle(future: asyncio.Future, *, result=None, exception: BaseException | None = None) -> None:
    if future.done():
        return
    if exception is not None:
        future.set_exception(exception)
    else:
        future.set_result(result)
