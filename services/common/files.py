"""Durable file replacement: a reader sees the old file or the new one, never a part of one,
and an acknowledged write survives a crash or a power loss."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: str | os.PathLike[str], data: bytes | str, *, mode: int | None = None,
                     owner: tuple[int, int] | None = None) -> None:
    """Replace ``path`` with ``data`` (str is written as UTF-8).

    The bytes go to a temp file beside ``path`` (``<name>.<random>.tmp``, so concurrent
    writers never share one; a crash leaves at most that file behind), which is fsync'd,
    renamed over ``path``, and then the directory is fsync'd so the rename itself is durable.
    The file is mode 0600 unless ``mode`` says otherwise; ``owner`` (uid, gid) chowns it. Both
    are set before a byte is written: a secret is never readable by others, even briefly.
    """
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            if mode is not None:
                os.fchmod(file.fileno(), mode)  # not through the umask: exactly the mode asked for
            if owner is not None:
                os.fchown(file.fileno(), *owner)
            file.write(payload)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
