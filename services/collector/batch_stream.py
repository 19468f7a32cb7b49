"""A trainer's batch stream through the collector: relayed to the trajectory service, sync mode's read
rules applied on the way.

A trainer needs only the collector's address: its StreamBatches is relayed to the trajectory service's.
In sync mode (``VersionGate.read_floor``) the relay

- opens the stream at the committed version, one batch at a time (``VersionGate.open_for_read``);
- does not hand over a batch holding a trajectory older than the latest push
  (``VersionGate.stale_at_read``): it generates the batch's prompts again and acks the batch upstream
  itself. The answer to that ack is the relay's own and is not forwarded.

The servicer adapts the upstream call to ``UpstreamStream`` (its gRPC errors already the collector's
domain errors), so nothing here knows gRPC.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterable, AsyncIterator, Protocol

from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.common.server import Service
from rlfleet.v1 import trajectory_pb2
from rlfleet.wire import decode_tensor


class UpstreamStream(Protocol):
    """The trajectory service's end of one StreamBatches call."""

    async def write(self, message: trajectory_pb2.StreamBatchesRequest, index: int | None = None) -> bool:
        """Send ``message``: the trainer's ``index``-th, or (None) one of the relay's own. False: the
        call had ended, and ``read`` raises how."""

    async def done_writing(self) -> None:
        """The trainer sends nothing more."""

    async def read(self) -> trajectory_pb2.StreamBatchesResponse | None:
        """The next response; None at the end of the stream. Its error status comes as an RlfleetError."""

    def cancel(self) -> None:
        """End the call (the trainer's stream ended)."""


class StaleGroups(Protocol):
    async def regenerate(self, prompt_ids: list[str], samples: int, why: str, group_ids: list[int]) -> None:
        """Generate again the prompts of stale groups deleted unread (``samples`` counted as discarded;
        ``group_ids``: the groups')."""


class BatchRelay:
    """One trainer's batch stream: the trainer's messages go upstream (its open rewritten in sync mode),
    the responses come back less stale batches and the answers to the relay's own acks."""

    def __init__(self, upstream: UpstreamStream, gate: VersionGate, stale: StaleGroups, service: Service):
        self.upstream = upstream
        self.gate = gate
        self.stale = stale
        """Where a stale batch's prompts are generated again (``Commits.regenerate``)."""
        self.service = service
        """The collector: a trainer's stream ends with the collector's failure."""
        self._own_acks: set[str] = set()  # lease ids the relay acked itself (stale batches)

    async def responses(self, requests: AsyncIterable[trajectory_pb2.StreamBatchesRequest],
                        ) -> AsyncIterator[trajectory_pb2.StreamBatchesResponse]:
        """Relay ``requests`` (the trainer's) upstream and yield what the trainer is to get, until the
        upstream ends the stream; raises the error that ends it first (the upstream's status, the
        trainer's bad message, the collector's failure)."""
        pumping = asyncio.create_task(self._pump(requests))
        failing = asyncio.ensure_future(self.service.failed.wait())
        try:
            while (response := await self._next(pumping, failing)) is not None:
                if await self._for_trainer(response):
                    yield response
        finally:
            pumping.cancel()
            failing.cancel()
            self.upstream.cancel()

    async def _pump(self, requests: AsyncIterable[trajectory_pb2.StreamBatchesRequest]) -> None:
        index = 0
        async for message in requests:
            if message.WhichOneof("kind") == "open":
                message.open.min_policy_version, message.open.prefetch = self.gate.open_for_read(
                    message.open.min_policy_version, message.open.prefetch)
            if not await self.upstream.write(message, index):
                return  # the upstream ended the call: read() says how
            index += 1
        await self.upstream.done_writing()

    async def _next(self, pumping: asyncio.Task, failing: asyncio.Future,
                    ) -> trajectory_pb2.StreamBatchesResponse | None:
        """The upstream's next response (None: it ended the stream), unless the trainer's messages or
        the collector failed first."""
        reading = asyncio.ensure_future(self.upstream.read())
        if not pumping.done():
            await asyncio.wait({reading, pumping, failing}, return_when=asyncio.FIRST_COMPLETED)
        # Checked whether or not it was awaited just now: the trainer's bad message may have come
        # while a batch was being yielded, and the upstream would then keep the stream open.
        refused = pumping.done() and not pumping.cancelled() and pumping.exception()
        if refused:
            reading.cancel()
            raise refused  # the trainer's message was bad (RlfleetError), or a bug of ours
        if not reading.done():
            await asyncio.wait({reading, failing}, return_when=asyncio.FIRST_COMPLETED)
        if failing.done():  # the collector failed: the trainer must hear why, not wait forever
            reading.cancel()
            self.service.check_working()
        return await reading

    async def _for_trainer(self, response: trajectory_pb2.StreamBatchesResponse) -> bool:
        """Whether ``response`` goes to the trainer: not an answer to the relay's own ack, nor a stale
        batch (dropped here)."""
        if response.HasField("settled"):
            if response.settled.lease_id in self._own_acks:
                self._own_acks.discard(response.settled.lease_id)
                return False
            return True
        if self._stale(response.batch):
            await self._drop(response)
            return False
        self.gate.note_read()
        return True

    def _stale(self, batch) -> bool:
        if self.gate.read_floor() is None:  # async mode: nothing goes stale at read, nothing to decode
            return False
        entry = batch.entries.get("policy_version_start")
        if entry is None or not entry.HasField("tensor"):
            return False
        versions = decode_tensor(entry.tensor)
        return versions.numel() > 0 and self.gate.stale_at_read(int(versions.min()))

    async def _drop(self, response: trajectory_pb2.StreamBatchesResponse) -> None:
        """A stale batch (a push landed after it was appended): delete it, generate its prompts again.
        Regenerated first: a crash in between leaves the batch buffered, not the prompts lost."""
        entry = response.batch.entries.get("prompt_id")
        prompt_ids = list(dict.fromkeys(entry.strings.values)) if entry is not None else []
        entry = response.batch.entries.get("group_id")
        group_ids = (decode_tensor(entry.tensor).tolist() if entry is not None and entry.HasField("tensor") else [])
        await self.stale.regenerate(prompt_ids, response.batch.batch_size[0], "stale batch at the proxy", group_ids)
        self._own_acks.add(response.lease_id)
        await self.upstream.write(trajectory_pb2.StreamBatchesRequest(
            ack=trajectory_pb2.AckBatch(lease_id=response.lease_id)))
