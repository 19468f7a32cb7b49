"""The private directory a service actor keeps on its node: the credentials it was handed and its
process's temporary files.

    <tmp>/rlfleet-<fleet>-<key>/<actor pid>-<random>/credentials    keys, certificates, tokens (0600)
                                                   /tmp            the process's TMPDIR

The parent's path depends only on the fleet and the instance, so whatever comes next on a node finds
what came before it there: an actor that Ray started in place of one SIGKILLed with its node (on a host
that stays: a raylet that died, several nodes on one host) removes its predecessors' directories before
it writes its own. Its own goes with it: ``ServiceHost.stop()``, the actor's exit path, and the reaper
(``reaper.py``), which outlives the actor, once the actor's process is gone however it went. A host
that goes takes its directories along.

``TMPDIR`` is where a vLLM engine puts its ``torch.distributed`` file store (``vllm_dist_*``) and its
ZMQ IPC sockets, which a SIGKILLed engine never removes: inside this directory they go with it.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import tempfile
from pathlib import Path


def instance_root(fleet: str, key: str, base: str | None = None) -> Path:
    """``<tmp>/rlfleet-<fleet>-<key>``: the same path for every actor of this instance on this host."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"rlfleet-{fleet}-{key}")
    return Path(base or tempfile.gettempdir()) / name


def _private_directory(path: Path) -> None:
    """``path`` as a directory only this user reads (0700): made, or checked if it exists."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    # /tmp is shared: a path someone else made (or a symlink) must not receive our keys.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise PermissionError(f"{path} exists and is not a directory of this user: refusing to write keys there")
    os.chmod(path, 0o700)


class NodeDirectory:
    """This actor's directory on its node (``claim`` makes it)."""

    def __init__(self, path: Path):
        self.path = path
        self.credentials = path / "credentials"
        self.tmp = path / "tmp"

    @classmethod
    def claim(cls, fleet: str, key: str, base: str | None = None) -> "NodeDirectory":
        """A new directory for this actor under the instance's root, its predecessors' removed first."""
        root = instance_root(fleet, key, base)
        for _ in range(3):
            _private_directory(root)
            for predecessor in root.iterdir():  # one actor per instance at a time: these are leftovers
                shutil.rmtree(predecessor, ignore_errors=True)
            own = root / f"{os.getpid()}-{secrets.token_hex(4)}"
            try:
                own.mkdir(mode=0o700)
            except FileNotFoundError:
                continue  # a predecessor's reaper removed the (then empty) root meanwhile: make it again
            return cls(own)
        raise RuntimeError(f"could not make a directory under {root}")

    def write_credentials(self, files: dict[str, bytes] | None) -> Path | None:
        """The credentials' files, private (0600), in ``credentials/``; None without credentials."""
        if not files:
            return None
        self.credentials.mkdir(mode=0o700, exist_ok=True)
        for name, content in files.items():
            descriptor = os.open(self.credentials / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(content)
        return self.credentials

    def fresh_tmp(self) -> Path:
        """An empty ``tmp/`` for the next process (the previous process's files gone)."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(mode=0o700)
        return self.tmp

    def remove(self) -> None:
        remove(self.path)


def remove(path: str | Path) -> None:
    """An actor's directory and, if no other actor's is left beside it, the instance's root."""
    path = Path(path)
    shutil.rmtree(path, ignore_errors=True)
    try:
        path.parent.rmdir()
    except OSError:
        pass  # not empty (a successor's directory) or gone already
