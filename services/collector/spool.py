"""The weight spool: the committed push kept, for re-syncing (or rolling back) replicas. Two kinds behind
one interface (``begin`` -> a write's ``copy`` / ``commit`` / ``discard``; ``manifest``, ``load_segment``),
so the fan-out does not know which:

The spool always holds a full copy: a delta push (``rlfleet.wire.weight_delta``) is spooled as the
committed version's bytes patched with its tensors (the copy made in the kernel, or in the database),
so a re-sync is always a full push. A LoRA adapter push (``WeightManifest.lora``) is spooled as it
is, beside the weights it sits on (the spooled full push it followed, kept with its bytes; none: the
checkpoint's): a re-sync then pushes those weights, then the adapter (``manifests``).

``FileSpool`` (the default, beside a SQLite ledger): ``manifest.pb`` names the spooled version;
``weights-<version>.bin`` holds its concatenated bytes. A push copies its segment into
``push-<version>.tmp`` beside the staging and fsyncs it; at the commit renames it to
``weights-<version>.bin``, then replaces ``manifest.pb`` atomically (both fsync'd with their directory),
then removes older bytes: a crash at any point leaves a manifest whose bytes exist. Leftover ``*.tmp``
files of a collector that died mid-push are removed at start.

``DatabaseSpool`` (with ``database_url``: a collector restarted on another node re-syncs from it): the
bytes are rows of ``spool_chunks`` (version, idx, data), ``SPOOL_CHUNK_BYTES`` each, written one by one
beside the staging; the manifest is the ``meta`` row ``spool_manifest``, which switches to the new
version in the very transaction that commits the version (``commits_with_version``); older versions'
chunks are deleted after. A crash at any point leaves a manifest whose chunks exist; chunks of another
version (a push cut off) are deleted at start. Read back chunk by chunk for a re-sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlfleet.services.common.database import Database
from rlfleet.services.common.files import write_atomically
from rlfleet.v1 import weights_pb2
from rlfleet.wire import shm, weight_delta

log = logging.getLogger("rlfleet.collector.spool")

SPOOL_CHUNK_BYTES = 4 << 20
"""Bytes per ``spool_chunks`` row: a few MiB, one statement (and one commit) each."""


def data_path(directory: Path, version: int) -> Path:
    return directory / f"weights-{version}.bin"


def adapter_base(spooled: list[weights_pb2.WeightManifest]) -> weights_pb2.WeightManifest | None:
    """The full push an adapter pushed now sits on, given what is spooled (``manifests()``): the spooled
    push if it is full, else the weights the spooled adapter sits on; None: the checkpoint's."""
    if not spooled:
        return None
    if not spooled[-1].HasField("lora"):
        return spooled[-1]
    return spooled[0] if len(spooled) == 2 else None


def _spooled_manifest(manifest: weights_pb2.WeightManifest,
                      base: weights_pb2.WeightManifest | None) -> weights_pb2.WeightManifest:
    """What the spool holds after ``manifest``: the push itself, or for a delta push, the full weights
    (``base``, the spooled version it patches) at its version."""
    if weight_delta.is_delta(manifest):
        return weight_delta.full_manifest(base, manifest)
    spooled = weights_pb2.WeightManifest()
    spooled.CopyFrom(manifest)
    spooled.ClearField("shm")  # the spool is read back as chunks or into a new segment
    return spooled


def _lower_priority() -> None:
    with contextlib.suppress(OSError):  # Linux: a thread's own nice value
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


# --- files ------------------------------------------------------------------------------------------
class FileSpoolWrite:
    """One push being spooled to a file."""

    def __init__(self, spool: "FileSpool", manifest: weights_pb2.WeightManifest,
                 spooled: list[weights_pb2.WeightManifest]):
        self.spool = spool
        self.directory = spool.directory
        self.base = spooled[-1] if spooled else None
        self.manifest = _spooled_manifest(manifest, self.base)
        self.delta = weight_delta.spans(manifest, self.base) if weight_delta.is_delta(manifest) else None
        self.adapter = manifest.HasField("lora")
        self.sits_on = adapter_base(spooled) if self.adapter else None
        self.tmp = self.directory / f"push-{manifest.version}.tmp"
        self._file = open(self.tmp, "wb")

    async def copy(self, segment: shm.Segment) -> None:
        """The segment's bytes (a delta's: the base's file patched with them), durable (a re-sync after a
        crash reads them), on the spool's thread."""
        loop = asyncio.get_running_loop()
        if self.adapter:  # what it sits on, named before the version can commit (ignored unless it does)
            await loop.run_in_executor(self.spool.thread, self.spool.name_base, self.sits_on)
        await loop.run_in_executor(self.spool.thread, self._copy if self.delta is None else self._patch, segment)
        await loop.run_in_executor(self.spool.thread, self._flush)

    def _patch(self, segment: shm.Segment) -> None:
        """The base version's file copied in the kernel, then the delta's tensors written over their spans."""
        out = self._file.fileno()
        with open(data_path(self.directory, self.base.version), "rb") as base:
            size, copied = self.base.total_bytes, 0
            while copied < size:
                n = os.copy_file_range(base.fileno(), out, size - copied, copied, copied)
                if n == 0:
                    raise OSError(f"the spooled version {self.base.version} ended after {copied} of {size} bytes")
                copied += n
        for span in self.delta:
            os.pwrite(out, segment.buffer[span.delta_offset:span.delta_offset + span.size], span.full_offset)

    def _copy(self, segment: shm.Segment) -> None:
        """Copy a segment's bytes in the kernel (sendfile: ~5x less CPU than a write() of its mapping here)."""
        out, sent = self._file.fileno(), 0
        while sent < segment.size:
            n = os.sendfile(out, segment.fileno(), sent, segment.size - sent)
            if n == 0:
                raise OSError(f"{segment.path} ended after {sent} of {segment.size} bytes")
            sent += n

    def _flush(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    async def commit(self) -> None:
        await asyncio.to_thread(self._commit)

    def _commit(self) -> None:
        self._file.close()
        data = data_path(self.directory, self.manifest.version)
        os.replace(self.tmp, data)
        write_atomically(self.directory / "manifest.pb", self.manifest.SerializeToString())
        keep = {data} | ({data_path(self.directory, self.sits_on.version)} if self.sits_on is not None else set())
        if not self.adapter:
            (self.directory / "base.pb").unlink(missing_ok=True)
        for old in self.directory.glob("weights-*.bin"):
            if old not in keep:
                old.unlink(missing_ok=True)

    async def discard(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.tmp.unlink(missing_ok=True)


class FileSpool:
    """The spool as files in ``directory`` (see the module doc)."""

    commits_with_version = False
    """Its manifest switches after the version committed (not in the same transaction)."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        for leftover in directory.glob("*.tmp"):
            log.info("removing %s left by an interrupted push", leftover)
            leftover.unlink(missing_ok=True)
        head = self._read("manifest.pb")
        if head is None or not head.HasField("lora"):  # named by an adapter push that did not commit
            (directory / "base.pb").unlink(missing_ok=True)
        # Background work: its thread yields the CPU to the replicas' apply.
        self.thread = ThreadPoolExecutor(1, "spool", initializer=_lower_priority)

    def begin(self, manifest: weights_pb2.WeightManifest,
              spooled: list[weights_pb2.WeightManifest] = ()) -> FileSpoolWrite:
        """A push's write, given what is spooled now (``manifests()``: what a delta patches, what an
        adapter sits on)."""
        return FileSpoolWrite(self, manifest, list(spooled))

    def _read(self, name: str) -> weights_pb2.WeightManifest | None:
        path = self.directory / name
        return weights_pb2.WeightManifest.FromString(path.read_bytes()) if path.exists() else None

    async def manifest(self) -> weights_pb2.WeightManifest | None:
        """The spooled push's manifest (the committed version's)."""
        return self._read("manifest.pb")

    async def manifests(self) -> list[weights_pb2.WeightManifest]:
        """What a re-sync pushes, in order: the spooled push, after the weights it sits on if an adapter."""
        head = self._read("manifest.pb")
        if head is None:
            return []
        base = self._read("base.pb") if head.HasField("lora") else None
        return [base, head] if base is not None else [head]

    def name_base(self, base: weights_pb2.WeightManifest | None) -> None:
        """An adapter push sits on ``base`` (None: the checkpoint's weights)."""
        if base is None:
            (self.directory / "base.pb").unlink(missing_ok=True)
        else:
            write_atomically(self.directory / "base.pb", base.SerializeToString())

    async def load_segment(self, manifest: weights_pb2.WeightManifest) -> shm.Segment:
        """The spooled bytes in a new shm segment (re-syncs use the same load path as pushes)."""
        return await asyncio.to_thread(self._load_segment, manifest)

    def _load_segment(self, manifest: weights_pb2.WeightManifest) -> shm.Segment:
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

    def close(self) -> None:
        self.thread.shutdown(wait=False)


# --- the database ---------------------------------------------------------------------------------
class DatabaseSpoolWrite:
    """One push being spooled to ``spool_chunks``."""

    def __init__(self, spool: "DatabaseSpool", manifest: weights_pb2.WeightManifest,
                 spooled: list[weights_pb2.WeightManifest]):
        self.spool = spool
        self.base = spooled[-1] if spooled else None
        self.manifest = _spooled_manifest(manifest, self.base)
        self.delta = weight_delta.spans(manifest, self.base) if weight_delta.is_delta(manifest) else None
        self.adapter = manifest.HasField("lora")
        self.sits_on = adapter_base(spooled) if self.adapter else None

    async def copy(self, segment: shm.Segment) -> None:
        """The segment's bytes as rows, one statement per chunk (other ledger work goes between them);
        each durable when written. A delta: the base version's rows copied in the database, then the
        chunks its tensors fall in rewritten."""
        version, ledger = self.manifest.version, self.spool.ledger
        await ledger.run(_delete_version, version)  # of an earlier try of this version
        if self.adapter:  # what it sits on, named before the version can commit (ignored unless it does)
            await ledger.run(_name_base, self.sits_on)
        if self.delta is not None:
            await ledger.run(_copy_version, self.base.version, version)
            await self._patch(segment)
            return
        for idx, start in enumerate(range(0, segment.size, SPOOL_CHUNK_BYTES)):
            await ledger.run(_write_chunk, version, idx, segment.buffer[start:start + SPOOL_CHUNK_BYTES])

    async def _patch(self, segment: shm.Segment) -> None:
        version, ledger = self.manifest.version, self.spool.ledger
        chunks: dict[int, list[tuple[int, int, int]]] = {}  # idx -> (start in chunk, delta offset, size)
        for span in self.delta:
            offset, end = span.full_offset, span.full_offset + span.size
            while offset < end:
                idx, start = divmod(offset, SPOOL_CHUNK_BYTES)
                size = min(end - offset, SPOOL_CHUNK_BYTES - start)
                chunks.setdefault(idx, []).append((start, span.delta_offset + offset - span.full_offset, size))
                offset += size
        for idx, parts in sorted(chunks.items()):
            data = await ledger.run(_read_chunk, version, idx)
            if data is None:
                raise OSError(f"the spool in the database lacks chunk {idx} of version {self.base.version}")
            data = bytearray(data)
            for start, delta_offset, size in parts:
                data[start:start + size] = segment.buffer[delta_offset:delta_offset + size]
            await ledger.run(_write_chunk, version, idx, memoryview(data))

    async def commit(self) -> None:
        """The manifest switched with the version (``commits_with_version``): delete the older versions."""
        await self.spool.ledger.run(_delete_others, self.manifest.version)

    async def discard(self) -> None:
        await self.spool.ledger.run(_delete_unless_current, self.manifest.version)


class DatabaseSpool:
    """The spool in the collector's database (``ledger``'s; see the module doc)."""

    commits_with_version = True
    """Its manifest switches in the transaction that commits the version (``PromptLedger.commit_version``)."""

    def __init__(self, ledger):
        self.ledger = ledger
        removed = ledger.run_now(_delete_not_current)
        if removed:
            log.info("removed %d spool chunks left by an interrupted push", removed)

    def begin(self, manifest: weights_pb2.WeightManifest,
              spooled: list[weights_pb2.WeightManifest] = ()) -> DatabaseSpoolWrite:
        """A push's write, given what is spooled now (``manifests()``: what a delta patches, what an
        adapter sits on)."""
        return DatabaseSpoolWrite(self, manifest, list(spooled))

    async def manifest(self) -> weights_pb2.WeightManifest | None:
        """The spooled push's manifest (the committed version's)."""
        return await self.ledger.run(_current_manifest)

    async def manifests(self) -> list[weights_pb2.WeightManifest]:
        """What a re-sync pushes, in order: the spooled push, after the weights it sits on if an adapter."""
        return await self.ledger.run(_manifests)

    async def load_segment(self, manifest: weights_pb2.WeightManifest) -> shm.Segment:
        """The spooled bytes in a new shm segment, read chunk by chunk."""
        size = manifest.total_bytes
        segment = shm.create_segment(size)
        try:
            offset = 0
            for idx in range((size + SPOOL_CHUNK_BYTES - 1) // SPOOL_CHUNK_BYTES):
                data = await self.ledger.run(_read_chunk, manifest.version, idx)
                if data is None or offset + len(data) > size:
                    break
                segment.buffer[offset:offset + len(data)] = data
                offset += len(data)
            if offset != size:
                raise OSError(f"the spool in the database holds {offset} bytes of version {manifest.version}, "
                              f"its manifest {size}")
            return segment
        except BaseException:
            segment.close()
            raise

    def close(self) -> None:
        pass  # the ledger owns the connection


def _current_manifest(db: Database, name: str = "spool_manifest") -> weights_pb2.WeightManifest | None:
    row = db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
    return weights_pb2.WeightManifest.FromString(bytes.fromhex(row[0])) if row else None


def _manifests(db: Database) -> list[weights_pb2.WeightManifest]:
    """(The ledger's one connection and thread: no other write comes between the two reads.)"""
    head = _current_manifest(db)
    if head is None:
        return []
    base = _current_manifest(db, "spool_base_manifest") if head.HasField("lora") else None
    return [base, head] if base is not None else [head]


def _kept_versions(db: Database) -> list[int]:
    """The versions whose chunks the spool keeps: the spooled push's, and the weights an adapter sits on."""
    return [m.version for m in _manifests(db)] or [-1]


def _name_base(db: Database, base: weights_pb2.WeightManifest | None) -> None:
    if base is None:
        db.execute("DELETE FROM meta WHERE name = 'spool_base_manifest'")
    else:
        db.execute("INSERT INTO meta (name, value) VALUES ('spool_base_manifest', ?) "
                   "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (base.SerializeToString().hex(),))


def _write_chunk(db: Database, version: int, idx: int, data: memoryview) -> None:
    db.execute("INSERT INTO spool_chunks (version, idx, data) VALUES (?, ?, ?) "
               "ON CONFLICT (version, idx) DO UPDATE SET data = excluded.data", (version, idx, data))


def _read_chunk(db: Database, version: int, idx: int) -> bytes | None:
    row = db.execute("SELECT data FROM spool_chunks WHERE version = ? AND idx = ?", (version, idx)).fetchone()
    return bytes(row[0]) if row else None


def _copy_version(db: Database, source: int, version: int) -> None:
    db.execute("INSERT INTO spool_chunks (version, idx, data) SELECT ?, idx, data FROM spool_chunks "
               "WHERE version = ?", (version, source))


def _delete_version(db: Database, version: int) -> None:
    db.execute("DELETE FROM spool_chunks WHERE version = ?", (version,))


def _delete_others(db: Database, version: int) -> None:
    """``version`` committed: every other version's chunks go, but those of the weights an adapter sits on."""
    with db.transaction():
        _delete_not_kept(db)


def _delete_not_kept(db: Database) -> int:
    kept = _kept_versions(db)
    head = _current_manifest(db)
    if head is None or not head.HasField("lora"):  # named by an adapter push that did not commit, or replaced
        db.execute("DELETE FROM meta WHERE name = 'spool_base_manifest'")
    marks = ", ".join("?" * len(kept))
    return db.execute(f"DELETE FROM spool_chunks WHERE version NOT IN ({marks})", tuple(kept)).rowcount


def _delete_unless_current(db: Database, version: int) -> None:
    """A push's chunks, unless its version is the spooled one (a commit whose reply was cut off may have
    landed)."""
    with db.transaction():
        current = _current_manifest(db)
        if current is None or current.version != version:
            _delete_version(db, version)


def _delete_not_current(db: Database) -> int:
    with db.transaction():
        return _delete_not_kept(db)


__all__ = ["DatabaseSpool", "FileSpool", "SPOOL_CHUNK_BYTES"]
