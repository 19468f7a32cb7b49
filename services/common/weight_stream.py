"""Receiving a streamed weight push: manifest first, then ordered chunks (then, two-phase, the commit).

Shared by the generation service (which applies the push) and the collector
(which fans it out): ``PushReceiver`` reads a push's messages in the protocol's
order (``rlfleet.wire.push_rules`` says what a manifest may be), ``WeightPush``
checks and places the bytes. Bytes land in a sink (the generation service's
shared-memory segment, which its vLLM worker maps) or nowhere (a relay only
validates); the checksum is updated as chunks arrive; nothing is applied
until the stream is complete and verified, so a cut-off or corrupted push
never half-applies.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import time
import zlib
from dataclasses import dataclass, field
from typing import AsyncIterable, AsyncIterator, Awaitable, Callable

import torch

from rlfleet.choices import SWAP_MODE_NAMES
from rlfleet.services.common.errors import Aborted, FailedPrecondition, InvalidArgument, OutOfRange, ResourceExhausted
from rlfleet.v1 import weights_pb2
from rlfleet.wire import shm
from rlfleet.wire.dtypes import dtype_from_wire
from rlfleet.wire.fingerprint import fingerprint, listed, of_manifest
from rlfleet.wire.tensor import check_shape

MAX_POLICY_VERSION = 2**63 - 1
"""The largest policy version: batches carry versions in int64 columns."""



class _Checksum:
    """Incremental crc32 or sha256 of the concatenated stream."""

    def __init__(self, spec: str):
        algo, _, expected = spec.partition(":")
        if algo not in ("crc32", "sha256") or not expected:
            raise InvalidArgument(f"manifest.checksum: expected 'crc32:<hex>' or 'sha256:<hex>', got {spec!r}")
        self.algo, self.expected = algo, expected.lower()
        self._crc = 0
        self._sha = hashlib.sha256() if algo == "sha256" else None

    def update(self, data: bytes) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return self._sha.hexdigest() if self._sha is not None else f"{self._crc:08x}"


@dataclass
class WeightPush:
    """A validated manifest plus the bytes received so far."""

    version: int
    mode: str
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    sizes: list[int]
    total_bytes: int
    checksum_spec: str
    fingerprints: list[int | None] = field(default_factory=list, repr=False)
    """Each tensor's fingerprint from the manifest (``rlfleet.wire.fingerprint``); None where unset."""
    sink: memoryview | None = field(repr=False, default=None)
    progress: Callable[[int], None] | None = field(repr=False, default=None)
    """Called with ``received`` after each chunk landed in the sink (a streamed apply's ``Watermark``)."""
    received: int = 0
    started_at: float = field(default_factory=time.monotonic)
    _checksum: _Checksum | None = field(default=None, repr=False)

    @classmethod
    def from_manifest(cls, manifest: weights_pb2.WeightManifest, max_bytes: int) -> "WeightPush":
        """Validate a manifest. Chunks are only checked (order, size, checksum)
        until ``attach_sink`` gives them a place to land."""
        if manifest.version > MAX_POLICY_VERSION:
            raise OutOfRange(f"manifest.version: {manifest.version} is beyond the largest policy version "
                             f"{MAX_POLICY_VERSION} (batches carry versions as int64)")
        names, dtypes, shapes, sizes = [], [], [], []
        seen: set[str] = set()
        for i, spec in enumerate(manifest.tensors):
            where = f"manifest.tensors[{i}]"
            if not spec.name:
                raise InvalidArgument(f"{where}.name is empty")
            if spec.name in seen:
                raise InvalidArgument(f"{where}.name {spec.name!r} appears twice")
            seen.add(spec.name)
            dtype = dtype_from_wire(spec.dtype, f"{where}.dtype (tensor {spec.name!r})")
            numel = check_shape(list(spec.shape), f"{where}.shape (tensor {spec.name!r})")
            names.append(spec.name)
            dtypes.append(dtype)
            shapes.append(tuple(spec.shape))
            sizes.append(numel * dtype.itemsize)
        if not names and not manifest.HasField("delta"):  # a delta may change nothing: the version moves
            raise InvalidArgument("manifest.tensors is empty")
        total = sum(sizes)
        if manifest.total_bytes != total:
            raise InvalidArgument(
                f"manifest.total_bytes is {manifest.total_bytes} but the tensors add up to {total}")
        if total > max_bytes:
            raise ResourceExhausted(f"weight push of {total} bytes exceeds the limit of {max_bytes}")
        mode = SWAP_MODE_NAMES.get(manifest.mode)
        if mode is None:
            raise InvalidArgument(f"manifest.mode: unknown update mode {manifest.mode}")
        push = cls(version=manifest.version, mode=mode, names=names, dtypes=dtypes, shapes=shapes,
                   sizes=sizes, total_bytes=total, checksum_spec=manifest.checksum,
                   fingerprints=of_manifest(manifest))
        push._checksum = _Checksum(manifest.checksum) if manifest.checksum else None
        return push

    def attach_sink(self, sink: memoryview) -> None:
        """Write received chunks into ``sink`` (exactly ``total_bytes`` long)."""
        if len(sink) != self.total_bytes:
            raise ValueError(f"sink holds {len(sink)} bytes, the push {self.total_bytes}")
        self.sink = sink

    @property
    def complete(self) -> bool:
        return self.received == self.total_bytes

    def add_chunk(self, chunk: weights_pb2.WeightChunk) -> None:
        """Copy one chunk into place; chunks must be contiguous and in order."""
        data = chunk.data
        if chunk.offset != self.received:
            raise InvalidArgument(
                f"chunk.offset is {chunk.offset}, expected {self.received} (chunks must be in order, no gaps)")
        end = self.received + len(data)
        if end > self.total_bytes:
            raise InvalidArgument(f"chunks exceed manifest.total_bytes ({end} > {self.total_bytes})")
        if self.sink is not None:
            self.sink[self.received:end] = data
        if self._checksum is not None:
            self._checksum.update(data)
        self.received = end
        if self.progress is not None:
            self.progress(end)

    def add_all(self, data: memoryview) -> None:
        """Take every byte at once (they already lie in a segment): only the checksum is computed."""
        if self.received or len(data) != self.total_bytes:
            raise InvalidArgument(f"expected all {self.total_bytes} bytes at once, got {len(data)} "
                                  f"after {self.received}")
        if self._checksum is not None:
            for start in range(0, len(data), 64 << 20):
                self._checksum.update(data[start:start + (64 << 20)])
        self.received = self.total_bytes

    def finish(self) -> None:
        """Verify completeness and checksum (ABORTED if the stream ended early)."""
        if self.received != self.total_bytes:
            raise Aborted(f"weight stream ended after {self.received} of {self.total_bytes} bytes; nothing applied")
        if self._checksum is not None and self._checksum.hexdigest() != self._checksum.expected:
            raise InvalidArgument(
                f"manifest.checksum mismatch: stream has {self._checksum.algo}:{self._checksum.hexdigest()}, "
                f"manifest says {self.checksum_spec}; nothing applied")


    def verify(self, flat: torch.Tensor) -> int:
        """Check each tensor's bytes in ``flat`` (the whole push as uint8, concatenated) against its
        fingerprint in the manifest; the number of tensors checked. INVALID_ARGUMENT naming the tensors
        that differ (corrupted in transit or in memory since they arrived): nothing may be applied."""
        todo = [(name, expected, shm.view_tensor(flat, offset, dtype, shape))
                for name, dtype, shape, offset, expected in zip(self.names, self.dtypes, self.shapes,
                                                                shm.tensor_offsets(self.sizes), self.fingerprints)
                if expected is not None]
        # numpy's sums let go of the GIL: the tensors are summed on every core.
        with concurrent.futures.ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1) or 1) as pool:
            found = list(pool.map(lambda item: fingerprint(item[2]), todo))
        checked, wrong = len(todo), []
        for (name, expected, _), got in zip(todo, found):
            if got != expected:
                wrong.append(f"{name} ({got:#018x}, the manifest says {expected:#018x})")
        if wrong:
            raise InvalidArgument(f"weight push of version {self.version}: the bytes of {len(wrong)} tensor(s) "
                                  f"do not match their fingerprints: {listed(wrong)}; nothing applied")
        return checked


async def payloads(requests: AsyncIterable) -> AsyncIterator[tuple[str, object]]:
    """A push's requests (``PushWeightsRequest``, ``UpdateWeightsRequest``: a ``payload`` oneof) as
    ``(kind, message)`` pairs."""
    async for request in requests:
        kind = request.WhichOneof("payload")
        if kind is None:
            raise InvalidArgument(f"empty {type(request).__name__}: set manifest or chunk")
        yield kind, getattr(request, kind)


class PushReceiver:
    """The receiving end of one push, in the protocol's order: ``manifest``, then ``chunks`` (grpc),
    then ``end`` (the collector: nothing may follow the last byte) or ``commit`` (a two-phase push at a
    replica). A message out of order is INVALID_ARGUMENT; a stream that ends before its last byte or its
    commit is ABORTED, nothing applied."""

    def __init__(self, messages: AsyncIterable[tuple[str, object]]):
        self._messages = messages.__aiter__()

    async def _next(self, where: str) -> tuple[str, object]:
        try:
            return await self._messages.__anext__()
        except StopAsyncIteration:
            raise Aborted(f"weight stream ended {where}; nothing applied") from None

    async def manifest(self) -> weights_pb2.WeightManifest:
        """The first message, the manifest, as a copy the receiver may change; whether the sender may send
        it is ``push_rules.check_manifest``'s (the collector's fan-out and a replica's stage check it)."""
        try:
            kind, message = await self._messages.__anext__()
        except StopAsyncIteration:
            raise InvalidArgument("empty push: the first message must be the manifest") from None
        if kind != "manifest":
            raise InvalidArgument("the first message of a push must be the manifest")
        manifest = weights_pb2.WeightManifest()
        manifest.CopyFrom(message)
        return manifest

    async def chunks(self, push: WeightPush, forward: Callable[[weights_pb2.WeightChunk], Awaitable[None]] | None
                     = None) -> None:
        """Every chunk of a grpc push into ``push`` (``forward``: awaited with each once it was checked),
        then ``push.finish()``: every byte is here and verified."""
        while not push.complete:
            kind, message = await self._next(f"after {push.received} of {push.total_bytes} bytes")
            if kind != "chunk":
                raise InvalidArgument(f"expected a chunk at byte {push.received}, got "
                                      + ("the manifest again: it must be the first message only"
                                         if kind == "manifest" else kind))
            push.add_chunk(message)
            if forward is not None:
                await forward(message)
        push.finish()

    async def end(self) -> None:
        """INVALID_ARGUMENT if anything follows the push's last byte."""
        try:
            kind, _ = await self._messages.__anext__()
        except StopAsyncIteration:
            return
        raise InvalidArgument(f"a {kind} after the push's last byte: a push is its manifest and its chunks")

    async def commit(self, version: int) -> None:
        """A two-phase push's commit, of the ``version`` staged."""
        kind, message = await self._next("before the commit")
        if kind != "commit" or message.version != version:
            raise InvalidArgument(f"expected the commit of version {version}; staged push discarded")


def open_offered_segment(manifest: weights_pb2.WeightManifest, total_bytes: int, where: str) -> shm.Segment:
    """Map the shm segment a manifest names: INVALID_ARGUMENT for a path that is not a segment's,
    FAILED_PRECONDITION "shm transport unavailable" (the sender falls back to grpc) if it is not here."""
    try:
        return shm.open_segment(manifest.shm.path, total_bytes)
    except ValueError as err:
        raise InvalidArgument(f"manifest.shm.path: {err}") from None
    except OSError as err:
        raise FailedPrecondition(f"{shm.SHM_UNAVAILABLE} {where}: {err}") from None
