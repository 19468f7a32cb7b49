"""Kills a service's process group once the actor that started it is gone, however it went, and removes
what the group leaves behind.

    python -m rlfleet.ray.reaper FD PGID [DIRECTORY]

``PR_SET_PDEATHSIG`` takes the service's own process when its actor dies, but not what the service
started in turn: a vLLM engine core and its workers outlive a SIGKILLed parent (reparented to init,
holding their memory). The actor starts this reaper beside each service process, holding the read end
of a pipe whose write end only the actor has: when the actor's process ends (SIGKILL included), the
pipe reads EOF and the reaper SIGKILLs the service's whole process group. It detaches itself first
(double fork), so nothing that kills the actor's direct children takes it along; it exits on its own
when the group is gone.

A graceful stop cleans up after itself; a SIGKILLed group leaves behind (``clean``):

- a vLLM engine's shared memory, ``/dev/shm/psm_*`` (Python's ``SharedMemory``: random names, nothing
  in them says whose). The group's are the segments its processes map or hold open: read from ``/proc``
  every ``SCAN_SECONDS`` while the group lives and once more just before the kill (a member that exits on
  its own first, an engine core on its parent's death, takes its maps along);
- rlfleet's own weight segments (``rlfleet-w-*``, a replica's kept weights): swept by their locks
  (``rlfleet.wire.shm.sweep_stale``: those no living process holds);
- its temporary files (a vLLM engine's ``vllm_dist_*`` file store, its IPC sockets): the actor points the
  process's ``TMPDIR`` into its node directory (``node_dir.py``), ``DIRECTORY`` here, removed with it.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import sys
import time
from pathlib import Path

POLL_SECONDS = 1.0
SCAN_SECONDS = 5.0
"""How often the group's shared-memory segments are read while it lives."""
EXIT_WAIT_SECONDS = 10.0
"""How long a SIGKILLed group may take to exit (and drop its locks) before its leftovers are removed."""
ACTOR_GRACE_SECONDS = 30.0
"""After the group ended on its own, how long the actor may take to go too (one signal for a host's or
a node's shutdown stops both): if it does, its directory is removed here."""
SHM_DIR = Path("/dev/shm")
ENGINE_SEGMENT = re.compile(r"^(psm_[0-9a-f]+|sem\.mp-[a-z0-9_]+)$")
"""Python ``SharedMemory`` names (what a vLLM engine's message queues are) and ``multiprocessing``'s
named semaphores (its locks and events: unlinked by their creator, or by its resource tracker, which a
killed group takes along)."""


def members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry))
    return found


def held_segments(pids: list[int]) -> set[Path]:
    """The engine segments (``psm_*`` and ``sem.mp-*`` in ``/dev/shm``) that processes ``pids`` map or
    hold open. Matched by inode, not by the name ``/proc`` shows: a named semaphore's creator maps the
    temporary file ``sem_open`` made and then linked to its name (``/dev/shm/sem.XXXXXX (deleted)``)."""
    shm_device = os.stat(SHM_DIR).st_dev
    inodes: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                inodes.update(int(line.split(None, 5)[4]) for line in maps if f" {SHM_DIR}/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):  # closed meanwhile
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"{SHM_DIR}/"):
                        target = os.stat(f"/proc/{pid}/fd/{fd}")
                        if target.st_dev == shm_device:
                            inodes.add(target.st_ino)
        except OSError:
            continue  # exited meanwhile
    if not inodes:
        return set()
    held = set()
    with os.scandir(SHM_DIR) as entries:
        for entry in entries:
            if ENGINE_SEGMENT.match(entry.name):
                with contextlib.suppress(OSError):  # unlinked meanwhile
                    if entry.inode() in inodes:
                        held.add(Path(entry.path))
    return held


ORPHAN_MIN_AGE_SECONDS = 1.0
"""A named semaphore younger than this is not judged orphaned (its creator may be scanned before it made it)."""


def orphaned_semaphores(since: float) -> set[Path]:
    """``multiprocessing``'s named semaphores (``sem.mp-*``) made since ``since`` (a group's start, wall
    clock) that no live process maps or holds open. Their creator was killed with its resource tracker
    before a scan of its group saw them (a group SIGKILLed moments after an engine made its locks).
    Nobody can use one again: a semaphore is opened by name only while its creator holds it."""
    judged_before = time.time() - ORPHAN_MIN_AGE_SECONDS
    candidates = set()
    for path in SHM_DIR.glob("sem.mp-*"):
        try:
            made = path.stat().st_ctime
        except OSError:
            continue  # unlinked meanwhile
        if since <= made <= judged_before:
            candidates.add(path)
    if not candidates:
        return candidates
    return candidates - held_segments([int(entry) for entry in os.listdir("/proc") if entry.isdigit()])


def clean(segments: set[Path], directory: str | Path | None, killed: bool, since: float | None = None) -> None:
    """After the group is gone: its engine segments, the named semaphores orphaned ``since`` its start
    (``orphaned_semaphores``), ``directory``, and if it was ``killed`` (no graceful stop released them)
    the weight segments nobody holds now."""
    if since is not None:
        segments = segments | orphaned_semaphores(since)
    for path in segments:
        path.unlink(missing_ok=True)
    if directory:
        from rlfleet.ray import node_dir

        node_dir.remove(directory)
    if killed:
        from rlfleet.wire.shm import sweep_stale  # imports torch: only once a group was killed

        sweep_stale()


def kill(pgid: int, known: set[Path]) -> set[Path]:
    """SIGKILL the group, wait for it to exit; its segments (``known`` and what it holds now)."""
    segments = known | held_segments(members(pgid))
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # gone, or (a zombie's group) none left we may signal
        pass
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    while members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return segments


def actor_gone(fd: int, timeout: float) -> bool:
    """The pipe's write end closed (the actor never writes to it: readable means EOF)."""
    readable, _, _ = select.select([fd], [], [], timeout)
    return bool(readable) and not os.read(fd, 1)


def watch(fd: int, pgid: int, directory: str | None = None) -> None:
    started = time.time()  # the first scan below sees what the group made before
    known: set[Path] = set()
    next_scan = 0.0
    while True:
        if time.monotonic() >= next_scan:  # (a zombie stays in the group: killpg(pgid, 0) alone never ends)
            pids = members(pgid)
            if not pids:
                break
            known |= held_segments(pids)
            next_scan = time.monotonic() + SCAN_SECONDS
        if actor_gone(fd, POLL_SECONDS):
            clean(kill(pgid, known), directory, killed=True, since=started)
            return
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            pass
    # The group ended before the actor: a graceful stop (vLLM removed its segments), or a crash (it did not).
    if actor_gone(fd, ACTOR_GRACE_SECONDS):  # the actor went too (a shutdown that signalled both)
        clean(known, directory, killed=False, since=started)
    else:  # the actor lives on (it restarts its process, or stops): it removes its own directory
        for path in known | orphaned_semaphores(started):
            path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    fd, pgid = int(args[0]), int(args[1])
    directory = args[2] if len(args) > 2 else None
    if os.fork():  # the first child returns at once (its parent reaps it); the grandchild is detached
        os._exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(fd, pgid, directory)


if __name__ == "__main__":
    main()
