"""Kills a service's process group once the actor that started it is gone, however it went.

    python -m rlfleet.ray.reaper FD PGID

``PR_SET_PDEATHSIG`` takes the service's own process when its actor dies, but not what the service
started in turn: a vLLM engine core and its workers outlive a SIGKILLed parent (reparented to init,
holding their memory). The actor starts this reaper beside each service process, holding the read end
of a pipe whose write end only the actor has: when the actor's process ends (SIGKILL included), the
pipe reads EOF and the reaper SIGKILLs the service's whole process group. It detaches itself first
(double fork), so nothing that kills the actor's direct children takes it along; it exits on its own
when the group is gone.
"""

from __future__ import annotations

import os
import select
import signal
import sys

POLL_SECONDS = 1.0


def watch(fd: int, pgid: int) -> None:
    while True:
        readable, _, _ = select.select([fd], [], [], POLL_SECONDS)
        if readable and not os.read(fd, 1):  # EOF: the actor is gone
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return  # the group ended (a graceful stop): nothing left to guard
        except PermissionError:
            pass


def main(argv: list[str] | None = None) -> None:
    fd, pgid = (int(value) for value in (argv if argv is not None else sys.argv[1:]))
    if os.fork():  # the first child returns at once (its parent reaps it); the grandchild is detached
        os._exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(fd, pgid)


if __name__ == "__main__":
    main()
