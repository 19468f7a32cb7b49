"""Weight fan-out: one trainer push streamed to every generation replica.

Chunks are forwarded to all replicas as they arrive (pipelined, not
store-and-forward) and spooled to disk for re-syncing replicas later. The
version commits only when the trainer's stream completed and verified and at
least one replica applied it; replicas that failed leave the rotation until
re-synced. If the trainer's stream breaks, every replica call is cancelled
before its end, so no replica applies anything.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import grpc

from rlfleet.client.errors import from_rpc_error
from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.replicas import Replica, ReplicaPool
from rlfleet.services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from rlfleet.services.common.weight_stream import WeightPush
from rlfleet.v1 import generation_pb2, weights_pb2

log = logging.getLogger("rlfleet.collector.fanout")
_END = object()


@dataclass
class ReplicaOutcome:
    address: str
    applied: bool
    error: str = ""
    code: str = ""
    """gRPC status name of the replica's error."""


@dataclass
class PushOutcome:
    version: int
    replicas: list[ReplicaOutcome]
    received_bytes: int
    seconds: float


class _ReplicaStream:
    """One replica's UpdateWeights call, fed from a bounded queue."""

    def __init__(self, replica: Replica, metadata, queue_chunks: int = 8):
        self.replica = replica
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=queue_chunks)
        self.call = replica.stub.UpdateWeights(self._requests(), metadata=metadata)
        self.failed: str | None = None

    async def _requests(self):
        while True:
            item = await self.queue.get()
            if item is _END:
                return
            yield item

    async def send(self, request: generation_pb2.UpdateWeightsRequest) -> None:
        if self.failed is None and not self.call.done():
            await self.queue.put(request)
        elif self.failed is None:
            self.failed = "replica ended the push early"

    async def finish(self) -> ReplicaOutcome:
        if self.failed is not None:
            self.call.cancel()
            return ReplicaOutcome(self.replica.address, False, self.failed, "ABORTED")
        await self.queue.put(_END)
        try:
            reply = await self.call
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, "UpdateWeights")
            return ReplicaOutcome(self.replica.address, False, str(error), error.code)
        self.replica.policy_version = reply.version
        return ReplicaOutcome(self.replica.address, True)

    def cancel(self) -> None:
        self.call.cancel()


class WeightFanout:
    """Receives pushes from the trainer, fans them out, keeps the spool for re-syncs."""

    def __init__(self, pool: ReplicaPool, gate: VersionGate, spool_dir: Path, max_push_bytes: int,
                 on_commit=None):
        self.pool = pool
        self.gate = gate
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.max_push_bytes = max_push_bytes
        self.on_commit = on_commit
        self._lock = asyncio.Lock()  # one push at a time: versions are monotone

    async def push(self, messages: AsyncIterator[tuple[str, object]]) -> PushOutcome:
        """``messages`` yields ("manifest", WeightManifest) then ("chunk", WeightChunk)."""
        async with self._lock:
            return await self._push(messages)

    async def _push(self, messages: AsyncIterator[tuple[str, object]]) -> PushOutcome:
        started = time.monotonic()
        iterator = messages.__aiter__()
        try:
            kind, manifest = await iterator.__anext__()
        except StopAsyncIteration:
            raise InvalidArgument("empty push: the first message must be the manifest") from None
        if kind != "manifest":
            raise InvalidArgument("the first message of a push must be the manifest")
        manifest = weights_pb2.WeightManifest.FromString(manifest.SerializeToString())
        if manifest.version == 0:
            manifest.version = self.gate.version + 1
        if manifest.version <= self.gate.version:
            raise FailedPrecondition(
                f"weights version {manifest.version} is not newer than current {self.gate.version}")
        push = WeightPush.from_manifest(manifest, self.max_push_bytes, keep_bytes=False)
        replicas = self.pool.require_any()
        streams = [_ReplicaStream(r, self.pool.settings.metadata()) for r in replicas]
        spool_tmp = self.spool_dir / f"push-{manifest.version}.tmp"
        spool = open(spool_tmp, "wb")
        try:
            first = generation_pb2.UpdateWeightsRequest(manifest=manifest)
            await asyncio.gather(*(s.send(first) for s in streams))
            async for kind, message in iterator:
                if kind != "chunk":
                    raise InvalidArgument("manifest sent twice: it must be the first message only")
                push.add_chunk(message)
                spool.write(message.data)
                request = generation_pb2.UpdateWeightsRequest(chunk=message)
                await asyncio.gather(*(s.send(request) for s in streams))
            push.finish()
        except BaseException:
            for s in streams:
                s.cancel()
            spool.close()
            spool_tmp.unlink(missing_ok=True)
            raise
        spool.flush()
        os.fsync(spool.fileno())
        spool.close()

        await self.gate.begin_push()
        committed = None
        try:
            outcomes = await asyncio.gather(*(s.finish() for s in streams))
            if not any(o.applied for o in outcomes):
                spool_tmp.unlink(missing_ok=True)
                errors = "; ".join(f"{o.address}: {o.error}" for o in outcomes)
                codes = {o.code for o in outcomes}
                # The same client error everywhere is the pusher's fault: replicas stay in rotation.
                if codes == {"FAILED_PRECONDITION"}:
                    raise FailedPrecondition(f"no replica applied version {manifest.version}: {errors}")
                if codes == {"INVALID_ARGUMENT"}:
                    raise InvalidArgument(f"no replica applied version {manifest.version}: {outcomes[0].error}")
            for stream, outcome in zip(streams, outcomes):
                if not outcome.applied:
                    await self.pool.mark_failed(stream.replica, outcome.error)
            if not any(o.applied for o in outcomes):
                raise Unavailable(f"no replica applied version {manifest.version}: {errors}")
            self._commit_spool(manifest, spool_tmp)
            committed = manifest.version
        finally:
            await self.gate.end_push(committed)
        if self.on_commit is not None:
            self.on_commit(committed)
        log.info("weights committed", extra={"version": committed, "bytes": push.received,
                                             "applied": sum(o.applied for o in outcomes)})
        return PushOutcome(committed, list(outcomes), push.received, time.monotonic() - started)

    # --- spool and re-sync ---------------------------------------------------
    def _commit_spool(self, manifest: weights_pb2.WeightManifest, data_tmp: Path) -> None:
        manifest_tmp = self.spool_dir / "manifest.tmp"
        manifest_tmp.write_bytes(manifest.SerializeToString())
        os.replace(data_tmp, self.spool_dir / "weights.bin")
        os.replace(manifest_tmp, self.spool_dir / "manifest.pb")

    def spooled_manifest(self) -> weights_pb2.WeightManifest | None:
        path = self.spool_dir / "manifest.pb"
        return weights_pb2.WeightManifest.FromString(path.read_bytes()) if path.exists() else None

    async def resync(self, replica: Replica, chunk_bytes: int = 1 << 20) -> bool:
        """Stream the committed weights to a replica that fell behind."""
        manifest = self.spooled_manifest()
        if manifest is None:
            return False
        async with self._lock:
            manifest.version = self.gate.version
            manifest.mode = weights_pb2.UPDATE_MODE_ABORT

            async def requests():
                yield generation_pb2.UpdateWeightsRequest(manifest=manifest)
                offset = 0
                with open(self.spool_dir / "weights.bin", "rb") as f:
                    while data := f.read(chunk_bytes):
                        yield generation_pb2.UpdateWeightsRequest(
                            chunk=weights_pb2.WeightChunk(offset=offset, data=data))
                        offset += len(data)

            try:
                reply = await replica.stub.UpdateWeights(requests(), metadata=self.pool.settings.metadata(),
                                                         timeout=600)
            except grpc.RpcError as exc:
                log.warning("re-sync of %s failed: %s", replica.address, exc.details())
                return False
            replica.policy_version = reply.version
            log.info("replica %s re-synced to version %d", replica.address, reply.version)
            return True
