"""Shared-memory segments for weight pushes: one file under ``/dev/shm`` per push.

A segment holds a push's tensors concatenated in manifest order (the same
layout as the grpc chunk stream), so every receiver loads from it the same
way. Whoever creates or opens a segment holds a shared ``flock`` on it for as
long as it uses it; the kernel drops the lock when the process dies, however
it dies. ``sweep_stale`` unlinks segments nobody holds any more, so a killed
trainer or service never leaves memory behind: the SDK sweeps before every
shm push, the generation service and the collector at start and periodically.
A directory there of a process's own (``HeldDirectory``: a replica's LoRA
adapters) is held the same way and swept with them.

Names carry 128 random bits, so a receiver that finds the file is on the same
host and IPC namespace as the writer (that is the whole negotiation); paths
from requests are accepted only in exactly that form.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import mmap
import os
import re
import time
import uuid
import warnings
from typing import Sequence

import torch

SHM_DIR = os.environ.get("RLFLEET_SHM_DIR", "/dev/shm")
PREFIX = "rlfleet-w-"
_NAME = re.compile(r"^rlfleet-w-[0-9a-f]{32}$")
SHM_UNAVAILABLE = "shm transport unavailable"
"""Start of the FAILED_PRECONDITION message of a receiver that cannot open a segment: the sender falls back to grpc."""
_DIRECTORY_NAME = re.compile(r"^rlfleet-lora-[a-z0-9_]+$")
"""``HeldDirectory`` names (``tempfile.mkdtemp`` with the prefix ``rlfleet-lora-``)."""
SWEEP_MIN_AGE_SECONDS = 5.0
"""A segment younger than this is never swept (its creator may not hold its lock yet)."""


class SegmentUnavailable(OSError):
    """The segment cannot be opened here (another host or IPC namespace, or gone)."""


class Segment:
    """A mapped segment; ``close()`` unmaps it, releases the lock and unlinks it if we own it."""

    def __init__(self, path: str, fd: int, size: int, writable: bool, owner: bool, populate: bool = False):
        self.path, self.size, self.owner = path, size, owner
        self._fd = fd
        # populate: map every page table entry now, in one call, rather than fault page by page
        # (a reader about to read it all: ~4x cheaper here).
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        # An empty file cannot be mapped (an empty delta push): a private page stands in for it.
        self._map = mmap.mmap(fd, size, flags, mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)) if size \
            else mmap.mmap(-1, 1)
        self._full = memoryview(self._map)
        self.fd_path = f"/proc/{os.getpid()}/fd/{fd}"
        """Opens this very file while we hold it, even once unlinked (our child processes use it)."""
        self.buffer = self._full[:size]
        """The segment's bytes (valid until ``close``)."""

    def fileno(self) -> int:
        return self._fd

    def claim(self) -> bool:
        """True if no other process holds this segment (we still hold it, shared) and it is still
        the file under its name: its pages may then be rewritten. False otherwise (close it)."""
        try:
            # Converting our shared lock is not atomic: a sweep may slip in and unlink the name.
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        try:
            return os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            return False

    def as_uint8(self) -> torch.Tensor:
        """The whole segment as a flat uint8 tensor (a view, no copy)."""
        if self.size == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            # read-only maps: torch warns that the view is not writable; loaders only read it
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(self._map, dtype=torch.uint8, count=self.size)

    def close(self, unlink: bool | None = None) -> None:
        """Unmap and unlock; unlink when ``unlink`` (default: when we created it)."""
        if self._fd < 0:
            return
        if unlink if unlink is not None else self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.buffer.release()
        self._full.release()
        # Never munmap explicitly: tensors viewing the pages (torch.frombuffer) keep a reference
        # to the map, not a buffer export, and would dangle. The map (and its duplicated fd,
        # which holds the lock) goes when the last view does.
        self._map = None
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def create_segment(size: int, directory: str | None = None) -> Segment:
    """A new, locked, writable segment of ``size`` bytes (OSError ENOSPC if the shm directory is full).

    Callers validate ``size`` first (the generation service against its checkpoint)."""
    directory = directory or SHM_DIR
    path = os.path.join(directory, f"{PREFIX}{uuid.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if size:
            # Reserve the pages now: a full tmpfs then fails here with ENOSPC instead of
            # killing the writer with SIGBUS halfway through the copy.
            os.posix_fallocate(fd, 0, size)
        return Segment(path, fd, size, writable=True, owner=True)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise


class SegmentCache:
    """The last segment a writer filled, kept to be filled again by its next push of the same size.

    A new segment costs its pages' allocation, zeroing, first-touch faults and freeing (~1.3 s
    per GB of CPU here); a kept one costs only the copy. It is reused only once no reader holds
    it any more (``Segment.claim``), otherwise a new one is made and the old name unlinked (its
    readers keep their mapping). It stays in the shm directory between pushes; ``close`` (or the
    process's death, through the sweep) removes it."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory
        self._kept: Segment | None = None

    def take(self, size: int) -> Segment:
        """A segment of ``size`` bytes that nobody else holds: the kept one if possible, else a new one."""
        kept, self._kept = self._kept, None
        if kept is not None:
            if kept.size == size and kept.claim():
                return kept
            kept.close()
        return create_segment(size, self.directory)

    def keep(self, segment: Segment) -> None:
        """Keep ``segment`` (ours) for the next ``take`` instead of closing it."""
        if self._kept is not None and self._kept is not segment:
            self._kept.close()
        self._kept = segment

    def close(self) -> None:
        if self._kept is not None:
            self._kept.close()
            self._kept = None


def check_path(path: str, directory: str | None = None) -> str:
    """``path`` if it names a segment in the shm directory. ValueError if it names no segment at
    all; SegmentUnavailable for a segment's name in another directory (a sender configured with
    another shm directory: not here). Nothing outside the shm directory is ever opened."""
    directory = directory or SHM_DIR
    if not _NAME.match(os.path.basename(path)) or not os.path.isabs(path) or ".." in path.split(os.sep):
        raise ValueError(f"not an rlfleet shm segment path: {path!r} (expected {directory}/{PREFIX}<32 hex>)")
    if os.path.dirname(path) != directory.rstrip("/"):
        raise SegmentUnavailable(errno.ENOENT, f"{path} is not in this host's shm directory {directory}")
    return path


def open_segment(path: str, size: int, directory: str | None = None, trusted: bool = False,
                 populate: bool = False, writable: bool = False) -> Segment:
    """Map an existing segment (read-only unless ``writable``), holding its lock while mapped.

    SegmentUnavailable if it does not exist here or its size is not ``size``. Paths
    from requests must name a segment; ``trusted`` (a holder's ``fd_path``) skips that."""
    if not trusted:
        check_path(path, directory)
    try:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except OSError as err:
        raise SegmentUnavailable(err.errno, f"cannot open {path}: {err.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        actual = os.fstat(fd).st_size
        if actual != size:
            raise SegmentUnavailable(errno.EINVAL, f"{path} holds {actual} bytes, the manifest says {size}")
        return Segment(path, fd, size, writable=writable, owner=False, populate=populate)
    except BaseException:
        os.close(fd)
        raise


def sweep_stale(directory: str | None = None, min_age_seconds: float = SWEEP_MIN_AGE_SECONDS) -> list[str]:
    """Unlink segments (and remove ``HeldDirectory``s) older than ``min_age_seconds`` that no process
    holds; returns their paths."""
    directory = directory or SHM_DIR
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        if _DIRECTORY_NAME.match(name):
            if _sweep_directory(path, now, min_age_seconds):
                removed.append(path)
            continue
        if not _NAME.match(name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime < min_age_seconds:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # someone uses it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
        finally:
            os.close(fd)
    return removed


class HeldDirectory:
    """A directory of this process's own in the shm directory (``prefix``: ``rlfleet-lora-``), held with a
    shared ``flock`` until ``close`` removes it; ``sweep_stale`` removes it once its process is gone
    however it went (SIGKILL included)."""

    def __init__(self, prefix: str, directory: str | None = None):
        import tempfile

        self.path = tempfile.mkdtemp(prefix=prefix, dir=directory or SHM_DIR)
        if not _DIRECTORY_NAME.match(os.path.basename(self.path)):
            os.rmdir(self.path)
            raise ValueError(f"{prefix!r} is not a prefix sweep_stale knows")
        self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def close(self) -> None:
        """Remove the directory and everything in it."""
        import shutil

        if self._fd is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._fd)
            self._fd = None


def _sweep_directory(path: str, now: float, min_age_seconds: float) -> bool:
    """Remove a ``HeldDirectory`` older than ``min_age_seconds`` that no process holds."""
    import shutil

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        if now - os.fstat(fd).st_ctime < min_age_seconds:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its process lives
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def list_segments(directory: str | None = None) -> list[str]:
    """Paths of every rlfleet segment in the shm directory (tests, diagnostics)."""
    directory = directory or SHM_DIR
    try:
        return sorted(os.path.join(directory, n) for n in os.listdir(directory) if _NAME.match(n))
    except OSError:
        return []


def tensor_offsets(sizes: Sequence[int]) -> list[int]:
    """Byte offset of each tensor in the concatenated layout."""
    offsets, offset = [], 0
    for size in sizes:
        offsets.append(offset)
        offset += size
    return offsets


def write_tensors(segment: Segment, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``tensors`` into the segment, concatenated in order (one copy each, device -> host included).

    Host tensors are copied with one plain memcpy each (numpy), not torch's ``copy_``: torch fans a
    copy of more than a few hundred KB out over its intra-op threads, and the call then waits for
    every one of them to get a core. On a busy host that is most of the push: 1.8 MB took ~120 ms
    with 2 threads on 2 loaded cores and ~1 ms with one, every push (the threads sleep between
    pushes). A copy is memory-bound; more threads do not make it faster. The trainer's own torch
    threads are left as they are."""
    flat = segment.as_uint8()
    offset = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if size:
            if offset + size > segment.size:
                raise ValueError(f"tensors hold more than the segment's {segment.size} bytes")
            source = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            if source.device.type == "cpu":
                flat[offset:offset + size].numpy()[:] = source.numpy()
            else:  # device -> host straight into the segment
                flat[offset:offset + size].copy_(source)
        offset += size
    if offset != segment.size:
        raise ValueError(f"tensors hold {offset} bytes, the segment {segment.size}")


def view_tensor(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor viewing ``flat`` (uint8) at ``offset``; copied only when the offset is misaligned."""
    size = math.prod(shape) * dtype.itemsize
    raw = flat[offset:offset + size]
    if size == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if offset % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(tuple(shape))
