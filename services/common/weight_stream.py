"""Receiving a streamed weight push: manifest first, then ordered chunks.

Shared by the generation service (which applies the push) and the collector
(which fans it out). Bytes land in a sink (the generation service's
shared-memory segment, which its vLLM worker maps) or nowhere (a relay only
validates); the checksum is updated as chunks arrive; nothing is applied
until the stream is complete and verified, so a cut-off or corrupted push
never half-applies.
"""

from __future__ import annotations

import hashlib
import time
import zlib
from dataclasses import dataclass, field

import torch

from rlfleet.choices import SWAP_MODE_NAMES
from rlfleet.services.common.errors import Aborted, FailedPrecondition, InvalidArgument, OutOfRange, ResourceExhausted
from rlfleet.v1 import weights_pb2
from rlfleet.wire import WireError, shm
from rlfleet.wire.dtypes import dtype_from_wire
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
    sink: memoryview | None = field(repr=False, default=None)
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
            try:
                dtype = dtype_from_wire(spec.dtype, f"{where}.dtype")
                numel = check_shape(list(spec.shape), f"{where}.shape")
            except WireError as err:
                raise InvalidArgument(f"{err} (tensor {spec.name!r})") from None
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
                   sizes=sizes, total_bytes=total, checksum_spec=manifest.checksum)
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


def open_offered_segment(manifest: weights_pb2.WeightManifest, total_bytes: int, where: str) -> shm.Segment:
    """Map the shm segment a manifest names: INVALID_ARGUMENT for a path that is not a segment's,
    FAILED_PRECONDITION "shm transport unavailable" (the sender falls back to grpc) if it is not here."""
    try:
        return shm.open_segment(manifest.shm.path, total_bytes)
    except ValueError as err:
        raise InvalidArgument(f"manifest.shm.path: {err}") from None
    except OSError as err:
        raise FailedPrecondition(f"{shm.SHM_UNAVAILABLE} {where}: {err}") from None
