"""A service process skips its last garbage collection at exit (``server.exit_without_collecting``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import atexit, functools, os, sys
    from rlfleet.services.common import server

    class Noted:
        def __init__(self, name):  # bound now: module globals may be gone when __del__ runs at exit
            self.say = functools.partial(os.write, 2, f"finalized {name}\\n".encode())
        def __del__(self):
            self.say()

    cycle = Noted("cycle")
    cycle.itself = cycle  # finalized only by a garbage collection
    if sys.argv[1] == "frozen":
        atexit.register(server.exit_without_collecting)
""")


def finalized(mode: str) -> str:
    return subprocess.run([sys.executable, "-c", PROGRAM, mode], check=True, timeout=120, capture_output=True,
                          text=True).stderr


def test_the_exit_collection_is_skipped():
    assert "finalized cycle" in finalized("plain")  # the control: the exit's collection finalizes the cycle
    assert "finalized cycle" not in finalized("frozen")
