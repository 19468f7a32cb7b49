"""What a Ray fleet leaves on this host, for the Ray tests (``test_ray.py``, ``test_ray_guide.py``).

Other processes on this host (other test sessions, other fleets) make and remove files in ``/tmp`` and
``/dev/shm`` at the same time, so the checks attribute before they judge: the fleet's node directories
by their names (``rlfleet-<fleet>-*``, ``client/rlfleet/ray/node_dir.py``), shared-memory segments by
the processes that held them (sampled while the fleet runs, from ``/proc``), and only entries made after
``Leftovers`` was created count.
"""

from __future__ import annotations

import fnmatch
import os
import tempfile
from pathlib import Path

import psutil

from tests.waiting import wait_for

SHM = Path("/dev/shm")


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs. A zombie has ended: it holds no port, memory or file, and
    reaping it is its parent's business (``init`` in a container, which may do so late or never)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a service process, its vLLM engine core and workers)."""
    try:
        return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def shm_held(pids: list[int]) -> set[Path]:
    """The ``/dev/shm`` files that processes ``pids`` map or hold open (unlinked ones left out)."""
    held: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                held.update(line.split(None, 5)[5].strip() for line in maps if f"{SHM}/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue  # exited meanwhile
    return {Path(path) for path in held if Path(path).parent == SHM}


def host_entries(ignored: tuple[str, ...] = ()) -> set[Path]:
    """The entries of ``/tmp`` and ``/dev/shm`` now, but those whose names match a pattern of ``ignored``."""
    return {path for directory in (Path(tempfile.gettempdir()), SHM) for path in directory.iterdir()
            if not any(fnmatch.fnmatch(path.name, pattern) for pattern in ignored)}


class Leftovers:
    """A snapshot of ``/tmp`` and ``/dev/shm`` now; ``sample`` the fleet's processes while it runs; after it
    stopped, ``found()`` lists what of it is still there."""

    def __init__(self, fleet_name: str):
        self.tmp = Path(tempfile.gettempdir())
        self.prefix = f"rlfleet-{fleet_name}-"
        self.before = host_entries()
        self.segments: set[Path] = set()
        self.engine_tmp_files: set[Path] = set()

    def sample(self, records: dict[str, dict]) -> None:
        """What the instances of ``records`` (registry records: their pids) hold now, and what their
        temporary directories hold (a vLLM engine's ``vllm_dist_*`` file store must land there)."""
        for record in records.values():
            self.segments |= shm_held(process_tree(record["pid"]))
        for directory in self.node_directories():
            self.engine_tmp_files |= set(directory.glob("*/tmp/vllm_dist_*"))

    def node_directories(self) -> list[Path]:
        return sorted(self.tmp.glob(f"{self.prefix}*"))

    def found(self) -> dict[str, list[str]]:
        """What the fleet left: its node directories (credentials, keys, temporary files), the segments its
        processes held that still exist (but those this test process holds itself, e.g. the SDK's), and
        any new ``/tmp`` entry of the old credentials layout."""
        new = host_entries() - self.before
        ours = shm_held([os.getpid()])
        return {name: sorted(map(str, paths)) for name, paths in {
            "node directories": self.node_directories(),
            "key files": [path for directory in self.node_directories() for path in directory.rglob("*.key")],
            "segments": [path for path in self.segments - ours if path.exists()],
            "engine temporary files": [path for path in self.engine_tmp_files if path.exists()],
            "credentials directories": [path for path in new if path.name.startswith("rlfleet-credentials-")],
        }.items() if paths}

    def assert_none_within(self, timeout: float) -> None:
        """``found()`` empty within ``timeout`` seconds (a reaper cleans up a moment after its actor went)."""
        try:
            wait_for(lambda: not self.found(), timeout, "nothing of the fleet left on the host", interval=0.5)
        except TimeoutError:
            raise AssertionError(f"the fleet left behind: {self.found()}") from None
