"""The weight spool: the committed push on disk, for re-syncing (or rolling back) replicas.

``manifest.pb`` names the committed version; ``weights-<version>.bin`` holds
its concatenated bytes. A push copies its segment into ``push-<version>.tmp``
beside the staging and fsyncs it; at the commit renames it to
``weights-<version>.bin``, then replaces ``manifest.pb`` atomically (both
fsync'd with their directory), then removes older bytes: a crash at any point
leaves a manifest whose bytes exist. Leftover ``*.tmp`` files of a collector
that died mid-push are removed at start.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from rlfleet.services.common.files import write_atomically
from rlfleet.v1 import weights_pb2
from rlfleet.wire import shm

log = logging.getLogger("rlfleet.collector.spool")


def data_path(directory: Path, version: int) -> Path:
    return directory / f"weights-{version}.bin"


class SpoolWrite:
    """One push being spooled."""

    def __init__(self, directory: Path, manifest: weights_pb2.WeightManifest):
        self.directory = directory
        self.manifest = weights_pb2.WeightManifest()
        self.manifest.CopyFrom(manifest)
        self.manifest.ClearField("shm")  # the spool is read back as chunks or into a new segment
        self.tmp = directory / f"push-{manifest.version}.tmp"
        self._file = open(self.tmp, "wb")

    def copy(self, segment: shm.Segment) -> None:
        """Copy a segment's bytes in the kernel (sendfile: ~5x less CPU than a write() of its mapping here)."""
        out, sent = self._file.fileno(), 0
        while sent < segment.size:
            n = os.sendfile(out, segment.fileno(), sent, segment.size - sent)
            if n == 0:
                raise OSError(f"{segment.path} ended after {sent} of {segment.size} bytes")
            sent += n

    def flush(self) -> None:
        """Make the bytes durable (a re-sync after a crash reads them)."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def commit(self) -> None:
        self._file.close()
        data = data_path(self.directory, self.manifest.version)
        os.replace(self.tmp, data)
        write_atomically(self.directory / "manifest.pb", self.manifest.SerializeToString())
        for old in self.directory.glob("weights-*.bin"):
            if old != data:
                old.unlink(missing_ok=True)

    def discard(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.tmp.unlink(missing_ok=True)


class Spool:
    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        for leftover in directory.glob("*.tmp"):
            log.info("removing %s left by an interrupted push", leftover)
            leftover.unlink(missing_ok=True)

    def begin(self, manifest: weights_pb2.WeightManifest) -> SpoolWrite:
        return SpoolWrite(self.directory, manifest)

    def manifest(self) -> weights_pb2.WeightManifest | None:
        path = self.directory / "manifest.pb"
        return weights_pb2.WeightManifest.FromString(path.read_bytes()) if path.exists() else None

    def load_segment(self, manifest: weights_pb2.WeightManifest) -> shm.Segment:
        """The spooled bytes in a new shm segment (re-syncs use the same load path as pushes)."""
        size = manifest.total_bytes
        segment = shm.create_segment(size)
        try:
            with open(data_path(self.directory, manifest.version), "rb") as f:
                if f.readinto(segment.buffer) != size:
                    raise OSError("the spool is shorter than its manifest")
            return segment
        except BaseException:
            segment.close()
            raise
