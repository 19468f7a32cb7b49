"""Leased batches from ``TrajectoryService.StreamBatches`` (served at the collector's address).

The RPC is bidirectional: the client sends ``open``, then ``ack`` / ``nack``
messages on the same stream while the server delivers batches (at most
``prefetch`` un-acked at a time). ``Batch.ack()`` / ``nack()`` only queue a
message (no round trip), so they are plain methods on both the sync and the
async client and may be called from any thread. The server answers each one
on the stream; the answer is read with the next batch (it precedes the batch
the ack's slot lets through) or by ``close()``, and sets ``Batch.confirmed``:
True once the server applied it (an acked batch is then deleted for good),
False if it came too late (the lease expired and the batch went back for
redelivery: logged as a WARNING, and the stream goes on).

A stream that breaks after its first batch (UNAVAILABLE: the collector
restarted, the connection dropped) is reopened, with a WARNING, for up to
``reconnect_seconds``; batches it delivered and that were not acked are
delivered again. ``next()`` waits at most ``idle_timeout`` for a batch, then
raises ``DeadlineExceededError``: the SDK never blocks forever. Such an idle
stream is not reopened: it ends as ``close(ack_last=False)`` ends it, so the
acks already sent (with ``auto_ack``, that of the batch moved past) are
answered before the call ends, and that batch is not delivered again.

Delivery is at-least-once. With ``auto_ack`` a batch is acked when the next
one is requested (whether one comes or not), or when the stream is closed deliberately (``close()``, or
leaving its ``with`` block without an exception). A stream dropped without
``close()`` (``break`` out of a bare ``for``), or left by an exception, ends
without acking: its batch goes back to the buffer and is delivered again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import grpc
import torch

from rlfleet.rpc.channel import ChannelSettings, StatusWatch, backoff, stream_error
from rlfleet.rpc.errors import (CancelledError, DeadlineExceededError, FailedPreconditionError, InternalError,
                                   RlfleetClientError, from_rpc_error)
from rlfleet.v1 import trajectory_pb2
from rlfleet import wire  # its TensorDict codec (tensordict) loads on a batch's first use, not on import
from rlfleet.wire import Ragged, WireError

log = logging.getLogger("rlfleet.client")

METHOD = "StreamBatches"
CLOSE_TIMEOUT_SECONDS = 5.0
"""How long a clean close waits for the server to end the stream before cancelling it."""
DEFAULT_IDLE_TIMEOUT = 1800.0
"""How long ``next()`` waits for a batch before ``DeadlineExceededError`` (the SDK never blocks forever)."""
DEFAULT_RECONNECT_SECONDS = 300.0
"""How long a broken stream is reopened for (a collector restart takes seconds to a minute)."""


def broken(error: RlfleetClientError) -> bool:
    """The stream ended without the server refusing it, so it is reopened: a retryable error, or CANCELLED:
    a server that stops cancels the streams still open after its grace (a collector restarting, on a new
    node or with an upstream's new address), and its successor serves them."""
    return error.retryable or isinstance(error, CancelledError)


def _key(key: Any) -> Any:
    # "tokens/response" is the layout's spelling of the nested key ("tokens", "response").
    return tuple(key.split("/")) if isinstance(key, str) and "/" in key else key


class Batch:
    """One leased batch: the decoded TensorDict plus its lease.

    Ragged entries of ``td`` (token ids, per-token log-probs, masks, rewards) are
    jagged nested tensors; ``ragged``, ``padded`` and ``nested`` convert them.
    String entries (``prompt_id``, ``trajectory_id``, ``query``) are ``NonTensorStack``s
    in ``td``; ``batch[key]`` gives them as a plain ``list[str]``.
    Keys may be tuples or the layout's ``"tokens/response"`` spelling.
    """

    def __init__(self, td, lease_id: str, redelivered: bool, lease_expires_at: float, stream: "BatchStream"):
        self.td = td
        """The batch as a ``tensordict.TensorDict`` with batch size ``[B]``."""
        self.lease_id = lease_id
        self.redelivered = redelivered
        """True if this batch was delivered before (a lease expired or a reader left)."""
        self.lease_expires_at = lease_expires_at
        """Seconds since the epoch after which the server redelivers the batch unless acked."""
        self.settled: str | None = None
        """None until ``ack()`` ("ack") or ``nack()`` ("nack") is called (or auto-acked)."""
        self.confirmed: bool | None = None
        """The server's answer to ``settled``: None until it arrives, True if applied (an acked
        batch is deleted for good), False if not (``settle_error`` says why; the batch may be
        delivered again)."""
        self.settle_error: str = ""
        self._stream = stream

    def ack(self) -> None:
        """Mark the batch done: it is never delivered again. Idempotent; the first ack/nack wins."""
        self._settle("ack")

    def nack(self) -> None:
        """Give the batch back for immediate redelivery (to any reader). Idempotent; the first ack/nack wins."""
        self._settle("nack")

    def _settle(self, kind: str) -> None:
        if self.settled is not None:
            return
        if self._stream.closed:
            raise FailedPreconditionError(
                f"lease {self.lease_id}: the stream is closed, so the lease was released and the batch "
                f"will be delivered again", method=METHOD)
        self.settled = kind
        self._stream._unconfirmed[self.lease_id] = self
        self._stream._post(trajectory_pb2.StreamBatchesRequest(**{kind: {"lease_id": self.lease_id}}))

    def _confirm(self, settled: trajectory_pb2.Settled) -> None:
        self.confirmed = settled.applied
        self.settle_error = settled.reason
        if not settled.applied:
            log.warning("StreamBatches: the %s of lease %s was not applied (%s); the batch may be "
                        "delivered again", self.settled, self.lease_id, settled.reason)

    def __getitem__(self, key):
        """The entry at ``key``: a tensor, a jagged nested tensor (ragged), or a ``list[str]`` (strings)."""
        value = self.td.get(_key(key))
        strings = wire.string_list(value)
        return value if strings is None else strings

    def __len__(self) -> int:
        return int(self.td.batch_size[0])

    def ragged(self, key) -> Ragged:
        """A ragged entry as ``Ragged`` (flat values + lengths; ``to_list()`` gives per-sample views)."""
        return wire.get_ragged(self.td, _key(key))

    def padded(self, key, pad_value=0, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
        """A ragged entry as ``(padded [B, T, ...], bool mask [B, T])``; the mask comes from lengths."""
        return self.ragged(key).to_padded(pad_value=pad_value, side=side)

    def nested(self, key) -> torch.Tensor:
        """A ragged entry as a jagged nested tensor (``torch.nested``, layout=torch.jagged)."""
        value = self.td.get(_key(key))
        if isinstance(value, torch.Tensor) and value.is_nested:
            return value
        return self.ragged(key).to_nested()

    def __repr__(self) -> str:
        return (f"Batch(size={len(self)}, lease_id={self.lease_id!r}, redelivered={self.redelivered}, "
                f"keys={sorted(map(str, self.td.keys(include_nested=True, leaves_only=True)))})")


async def _requests(queue: asyncio.Queue):
    # None is the half-close: the server then releases whatever this reader holds.
    while (request := await queue.get()) is not None:
        yield request


class BatchStream:
    """Async iterator of ``Batch`` over one StreamBatches call (see the module doc).

    Use ``async with client.batches(...) as stream: async for batch in stream``,
    or call ``await stream.close()``. Opening is retried (bounded) on
    UNAVAILABLE / DEADLINE_EXCEEDED until the first batch arrives; after that
    every error ends the stream and is raised as a typed ``RlfleetClientError``.
    """

    def __init__(self, call_factory: Callable, settings: ChannelSettings, open_request: trajectory_pb2.OpenBatchStream,
                 *, auto_ack: bool, max_batches: int | None, idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
                 reconnect_seconds: float = DEFAULT_RECONNECT_SECONDS,
                 prepare: Callable[[], Awaitable[ChannelSettings]] | None = None):
        self._call_factory = call_factory
        self._settings = settings
        self._prepare = prepare
        """Awaited before the stream first opens: the client joins its run; the settings it returns are used."""
        self._open_request = open_request
        self._auto_ack = auto_ack
        self._max_batches = max_batches
        self._idle_timeout = idle_timeout
        self._reconnect_seconds = reconnect_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        self._call = None
        self._watch: StatusWatch | None = None
        self._last: Batch | None = None
        self._unconfirmed: dict[str, Batch] = {}  # settled, the server's answer not read yet
        self._delivered = 0
        self.closed = False

    # --- iteration ------------------------------------------------------------------------
    def __aiter__(self) -> "BatchStream":
        return self

    async def __anext__(self) -> Batch:
        batch = await self.next()
        if batch is None:
            raise StopAsyncIteration
        return batch

    async def next(self) -> Batch | None:
        """The next batch, or None once the stream has ended."""
        if self.closed:
            return None
        if self._auto_ack and self._last is not None:
            self._last.ack()
        if self._max_batches is not None and self._delivered >= self._max_batches:
            await self.close()
            return None
        try:
            reply = await self._next_reply()
        except BaseException:
            self._finish()
            raise
        if reply is None:
            self._finish()
            return None
        try:
            td = wire.decode_tensordict(reply.batch, "batch")
        except WireError as err:
            self._post(trajectory_pb2.StreamBatchesRequest(nack=trajectory_pb2.NackBatch(lease_id=reply.lease_id)))
            raise InternalError(f"malformed batch (lease {reply.lease_id}, nacked): {err}", method=METHOD) from None
        self._last = Batch(td, reply.lease_id, reply.redelivered, reply.lease_expires_at, self)
        self._delivered += 1
        return self._last

    async def _next_reply(self):
        """The next batch's reply within the idle bound, reopening a broken stream (not an idle one)."""
        try:
            if self._call is None:
                return await self._idle_bound(self._open())
            return await self._idle_bound(self._receive(), open_stream=True)
        except RlfleetClientError as error:
            if not broken(error) or self.closed or not self._delivered:
                raise
            log.warning("StreamBatches broke (%s); reopening for up to %.0f s (batches delivered and not acked "
                        "are delivered again)", error, self._reconnect_seconds)
            self._end_call()
            for batch in self._unconfirmed.values():  # their answers went down with the old stream
                batch.confirmed = False
                batch.settle_error = "the stream broke before the server answered; the batch may be delivered again"
            self._unconfirmed.clear()
            return await self._idle_bound(self._open(self._reconnect_seconds))

    async def _idle_bound(self, reading, *, open_stream: bool = False):
        """``reading`` (the next reply) within ``idle_timeout``; past it the stream is closed, then
        ``DeadlineExceededError`` raised. An ``open_stream`` ends as ``close()`` ends it: the acks and nacks
        already queued (with ``auto_ack``, the batch the caller moved past) reach the server and are answered
        first. A read timed out by cancelling it would cancel the call (grpc.aio does) under an ack still on
        its way, and that batch would be delivered again."""
        if self._idle_timeout is None:
            return await reading
        task = asyncio.ensure_future(reading)
        try:
            done, _ = await asyncio.wait({task}, timeout=self._idle_timeout)
            if done:
                return task.result()
            self.closed = True  # idle is not broken: never reopened
            if open_stream:
                await self._end_cleanly(task)
        finally:
            task.cancel()
        raise DeadlineExceededError(
            f"no batch within {self._idle_timeout:g} s (idle_timeout); the stream is closed. Is the "
            "collector generating? client.status() shows its pending prompts, stages and replicas", method=METHOD)

    async def _open(self, budget_seconds: float = 0.0):
        """Open the stream and read its first reply: retryable errors are retried, ``settings.retries``
        times or for ``budget_seconds``, whichever lasts longer."""
        if self._prepare is not None:
            self._settings, self._prepare = await self._prepare(), None
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + budget_seconds
        attempt = 0
        while True:
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            self._queue.put_nowait(trajectory_pb2.StreamBatchesRequest(open=self._open_request))
            # No deadline: the stream lives as long as training. Auth rides on the metadata.
            self._call = self._call_factory(_requests(self._queue), metadata=self._settings.metadata())
            self._watch = StatusWatch(self._call)
            try:
                return await self._receive()
            except RlfleetClientError as error:
                self._end_call()
                if not broken(error) or (attempt >= self._settings.retries and loop.time() >= give_up_at):
                    raise
            await asyncio.sleep(min(backoff(attempt, self._settings.backoff_seconds), 5.0))
            attempt += 1

    async def _receive(self):
        """The next delivered batch's reply, or None at the end of the stream; raises typed errors.
        Answers to acks and nacks read on the way are applied to their batches."""
        while True:
            try:
                reply = await self._call.read()
            except grpc.RpcError as exc:
                error = await stream_error(self._call, exc, METHOD, self._watch)
                raise error from None
            except asyncio.CancelledError:
                if self.closed:  # closed under us (client closed): end quietly
                    return None
                raise
            if reply is grpc.aio.EOF:
                return None
            if not reply.HasField("settled"):
                return reply
            self._settled(reply.settled)

    def _settled(self, settled: trajectory_pb2.Settled) -> None:
        batch = self._unconfirmed.pop(settled.lease_id, None)
        if batch is not None:
            batch._confirm(settled)

    # --- writing ---------------------------------------------------------------------------
    def _post(self, request: trajectory_pb2.StreamBatchesRequest | None) -> None:
        """Queue a request for the stream; safe from any thread."""
        if self._queue is None or self._loop is None or self._loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._queue.put_nowait(request)
        else:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, request)

    # --- closing ---------------------------------------------------------------------------
    async def close(self, *, ack_last: bool | None = None) -> None:
        """End the stream cleanly: ack the last batch (if ``auto_ack``, or ``ack_last=True``), half-close,
        and wait briefly for the server to release the rest (prefetched batches go back to the buffer).

        The server's answers to the last acks are read on the way (``Batch.confirmed``). Errors
        while closing are logged, not raised: an un-acked batch is then simply delivered again.
        """
        if self.closed:
            return
        if (self._auto_ack if ack_last is None else ack_last) and self._last is not None:
            self._last.ack()
        self.closed = True
        await self._end_cleanly()

    aclose = close

    async def _end_cleanly(self, reading: asyncio.Future | None = None) -> None:
        """Half-close, and read until the server ends the stream (``CLOSE_TIMEOUT_SECONDS`` at most): its
        answers to the last acks and nacks; ``reading``, a read in progress, first. Errors are logged."""
        call = self._call
        if call is None:
            return
        self._post(None)
        try:
            await asyncio.wait_for(self._drain(call, reading), CLOSE_TIMEOUT_SECONDS)
        except TimeoutError:
            log.warning("StreamBatches: the server did not end the stream within %.0f s; cancelling it",
                        CLOSE_TIMEOUT_SECONDS)
        except (grpc.RpcError, RlfleetClientError) as exc:
            log.warning("StreamBatches ended with an error while closing: %s",
                        from_rpc_error(exc, METHOD) if isinstance(exc, grpc.RpcError) else exc)
        finally:
            if not call.done():
                call.cancel()

    async def _drain(self, call, reading: asyncio.Future | None = None) -> None:
        if reading is not None:
            await reading  # its answers are applied; a batch it brings goes back to the buffer as the stream ends
        while (reply := await call.read()) is not grpc.aio.EOF:
            if reply.HasField("settled"):
                self._settled(reply.settled)
            # else a prefetched batch: the server releases it when the stream ends

    def _finish(self) -> None:
        self.closed = True
        self._end_call()

    def _end_call(self) -> None:
        """End the current call at once (the server releases this reader's leases); safe from any thread."""
        call, loop = self._call, self._loop
        if call is None or loop is None or loop.is_closed():
            return
        self._post(None)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            call.cancel()
        else:
            loop.call_soon_threadsafe(call.cancel)

    def abandon(self) -> None:
        """Close without acking and without waiting (used when the stream or its client goes away)."""
        if not self.closed:
            self._finish()

    async def __aenter__(self) -> "BatchStream":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.close(ack_last=False if exc_type is not None else None)

    def __del__(self):
        if not getattr(self, "closed", True):
            try:
                self.abandon()
            except RuntimeError:  # the loop went away during interpreter shutdown
                pass
