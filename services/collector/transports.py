"""How a push's bytes reach one replica: the replica's two-phase UpdateWeights call.

Negotiated per replica and per push: a push whose bytes lie in a shm segment
is offered to each replica as that segment; a replica that cannot open it
(another host or IPC namespace) answers FAILED_PRECONDITION "shm transport
unavailable" and gets the same bytes as grpc chunks
read from the collector's mapping instead, within the same push. A grpc push
is forwarded chunk by chunk as the trainer's chunks arrive. Replicas known to
refuse our segments get a push relayed (``rlfleet.services.common.relay``):
their calls carry no bytes, the relay does, one copy through all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import grpc

from rlfleet.rpc.channel import ChannelSettings, StatusWatch, stream_error
from rlfleet.services.collector.metrics import WEIGHT_PUSH_SENT_BYTES
from rlfleet.services.collector.replicas import Replica
from rlfleet.services.common import tracing
from rlfleet.services.common.watermark import Watermark
from rlfleet.v1 import generation_pb2, weights_pb2
from rlfleet.wire import shm
from rlfleet.wire.shm import SHM_UNAVAILABLE
from rlfleet.wire.push_messages import DEFAULT_CHUNK_BYTES

_END = object()
QUEUE_CHUNKS = 8
"""Chunks buffered per replica: a slow replica holds back the trainer, never fills our memory."""


@dataclass
class ReplicaOutcome:
    address: str
    applied: bool
    error: str = ""
    code: str = ""
    """gRPC status name of the replica's error."""
    transport: str = ""
    stage_seconds: float = 0.0
    apply_seconds: float = 0.0
    sent_bytes: int = 0
    """Bytes the collector itself sent this replica."""


class SegmentChunks:
    """A segment's bytes as grpc chunk requests (the grpc fallback of a shm push, and re-syncs); of a segment
    still being written (``arriving``), each once its bytes are in (none after the writer gave up)."""

    def __init__(self, segment: shm.Segment, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 arriving: Watermark | None = None):
        self.segment, self.chunk_bytes, self.arriving = segment, chunk_bytes, arriving

    async def __aiter__(self):
        view = self.segment.buffer
        for offset in range(0, len(view), self.chunk_bytes):
            end = min(offset + self.chunk_bytes, len(view))
            if self.arriving is not None and not await self.arriving.until(end):
                return
            request = generation_pb2.UpdateWeightsRequest()
            request.chunk.offset = offset
            request.chunk.data = view[offset:end].tobytes()
            yield request


class ReplicaPush:
    """One replica's side of a push: stage (``wait_staged``), then ``commit``; ``cancel`` discards."""

    def __init__(self, replica: Replica, manifest: weights_pb2.WeightManifest, settings: ChannelSettings,
                 segment: shm.Segment | None, arriving: Watermark | None = None):
        self.replica, self.settings, self.segment = replica, settings, segment
        self.arriving = arriving
        """``segment`` is still being written: how far (offered with it; a grpc fallback follows it too)."""
        self.version = manifest.version
        self._manifest = manifest
        self.transport = ""
        self.started = time.monotonic()
        self.stage_seconds = self.apply_seconds = 0.0
        self.applied = False
        self.error, self.code = "", ""
        self.sent_bytes = 0
        """Chunk bytes put on this call (a relay's are counted by the relay)."""
        self._call = None
        self._queue: asyncio.Queue | None = None
        self._feeder: asyncio.Task | None = None
        self._stage_span = tracing.start_span("stage", {"rlfleet.replica": replica.address,
                                                        "rlfleet.policy_version": manifest.version})
        """Traced: from the call's opening to the replica's STAGED (the replica's UpdateWeights span is
        its child: the call opens under it, and spans the commit too)."""

    @classmethod
    def start(cls, replica: Replica, manifest: weights_pb2.WeightManifest, settings: ChannelSettings,
              segment: shm.Segment | None, arriving: Watermark | None = None) -> "ReplicaPush":
        """Open the call and send the manifest (and, for a segment over grpc, the chunks; an nccl
        manifest makes the replica join the trainer's broadcast). ``arriving``: ``segment`` is still being
        written, this watermark says how far (the replica follows it)."""
        push = cls(replica, manifest, settings, segment, arriving)
        push._open("shm" if segment is not None else manifest.WhichOneof("source") or "grpc")
        return push

    def _open(self, transport: str) -> None:
        self.transport = transport
        manifest = weights_pb2.WeightManifest()
        manifest.CopyFrom(self._manifest)
        manifest.two_phase = True
        if transport == "shm":
            manifest.shm.path = self.segment.path
            if self.arriving is not None:
                manifest.shm.watermark_path = self.arriving.segment.path
            manifest.ClearField("checksum")  # verified here; the replica maps the very same pages
        elif transport == "grpc":
            manifest.ClearField("shm")
        self._queue = asyncio.Queue(maxsize=QUEUE_CHUNKS)
        self._queue.put_nowait(generation_pb2.UpdateWeightsRequest(manifest=manifest))
        with tracing.using(self._stage_span):
            self._call = self.replica.stub.UpdateWeights(self._requests(self._queue), metadata=self.settings.metadata())
        self._watch = StatusWatch(self._call)  # keeps the replica's status over grpc.aio's write-race INTERNAL
        if transport == "grpc" and self.segment is not None:
            self._feeder = asyncio.ensure_future(self._feed(SegmentChunks(self.segment, arriving=self.arriving)))

    @staticmethod
    async def _requests(queue: asyncio.Queue):
        """One call's requests, from its own queue: a call replaced by a grpc fallback must not take the new
        call's first requests (its reader, still running, would send them into the cancelled call)."""
        while True:
            item = await queue.get()
            if item is _END:
                return
            yield item

    async def _feed(self, requests) -> None:
        async for request in requests:  # each chunk read once it is in the segment (``arriving``)
            if self._call.done():
                return
            await self._queue.put(request)
            self._sent(len(request.chunk.data))

    async def send_chunk(self, chunk: weights_pb2.WeightChunk) -> None:
        """Forward one trainer chunk (grpc pushes); a replica that already failed is skipped."""
        if self._call.done():
            return
        request = generation_pb2.UpdateWeightsRequest()
        request.chunk.CopyFrom(chunk)
        await self._queue.put(request)
        self._sent(len(chunk.data))

    def _sent(self, size: int) -> None:
        self.sent_bytes += size
        WEIGHT_PUSH_SENT_BYTES.labels(transport="grpc").inc(size)

    async def _read(self, expected: int) -> bool:
        try:
            reply = await self._call.read()
        except grpc.RpcError as exc:
            if not self.error:  # one ``fail`` set (it cancelled the call) stands
                error = await stream_error(self._call, exc, "UpdateWeights", self._watch)
                self.error, self.code = str(error), error.code
            return False
        if reply is grpc.aio.EOF:
            self.error, self.code = "replica ended the push early", "ABORTED"
            return False
        if reply.phase != expected:
            self.error, self.code = f"replica answered phase {reply.phase}, expected {expected}", "INTERNAL"
            return False
        return True

    async def wait_staged(self) -> bool:
        """True once the replica staged the push; a shm refusal falls back to grpc here."""
        ok = await self._read(weights_pb2.WEIGHT_PHASE_STAGED)
        if not ok and self.transport == "shm" and self.code == "FAILED_PRECONDITION" \
                and SHM_UNAVAILABLE in self.error:
            # Remembered only for a segment of ours, which cannot have gone: a trainer that cut
            # its push may have unlinked its own.
            if self.segment.owner:
                self.replica.shm_refused = True
            stage_span, self._stage_span = self._stage_span, None  # the stage goes on, over grpc
            self.cancel()
            self._stage_span = stage_span
            self.error = self.code = ""
            self._open("grpc")
            ok = await self._read(weights_pb2.WEIGHT_PHASE_STAGED)
        self.stage_seconds = time.monotonic() - self.started
        self._end_stage(self.error)
        if not ok:
            self.cancel()
        return ok

    def _end_stage(self, error: str = "") -> None:
        if self._stage_span is not None:
            self._stage_span.set_attribute("rlfleet.transport", self.transport)
            tracing.end(self._stage_span, error)
            self._stage_span = None

    async def commit(self) -> None:
        """Tell the replica to apply; ``applied`` tells the outcome."""
        committed = time.monotonic()
        with tracing.span("commit", {"rlfleet.replica": self.replica.address,
                                     "rlfleet.policy_version": self.version}) as span:
            await self._queue.put(generation_pb2.UpdateWeightsRequest(
                commit=weights_pb2.WeightCommit(version=self.version)))
            self.applied = await self._read(weights_pb2.WEIGHT_PHASE_APPLIED)
            if span is not None and not self.applied:
                span.set_status(tracing.Status(tracing.StatusCode.ERROR, self.error))
        self.apply_seconds = time.monotonic() - committed
        if self.applied:
            self.replica.policy_version = self.version
            await self._queue.put(_END)
        else:
            self.cancel()

    def fail(self, error: str, code: str) -> None:
        """Give up on this replica with ``error`` (its stage, if still waited for, fails with it)."""
        if not self.error:
            self.error, self.code = error, code
        self.cancel()

    def cancel(self) -> None:
        self._end_stage(self.error or "cancelled")
        if self._feeder is not None:
            self._feeder.cancel()
        if self._call is not None:
            self._call.cancel()
        if self._queue is not None:  # the call's reader ends (rather than waiting, pending, until collected)
            with contextlib.suppress(asyncio.QueueFull):
                self._queue.put_nowait(_END)

    def outcome(self) -> ReplicaOutcome:
        return ReplicaOutcome(self.replica.address, self.applied, self.error, self.code, self.transport,
                              self.stage_seconds, self.apply_seconds, self.sent_bytes)
