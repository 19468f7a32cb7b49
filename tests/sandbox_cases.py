"""What the sandbox tests share: their limits, how they see the sandbox's processes, the escapes they
run (tests/integration/test_sandbox.py against a fresh sandbox per call, test_episode_sandbox.py
against an episode's), and the snippets a sandbox must run as ``python snippet.py`` would
(tests/unit/test_sandbox_runner.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable, Iterator

from rlfleet.services.environment.sandbox import SANDBOX_UID, SandboxLimits, ToolResult
from tests.waiting import wait_for_async

LIMITS = SandboxLimits(cpu_seconds=2, wall_seconds=5, max_processes=16, max_file_bytes=2**20, max_output_bytes=1024)
REPOSITORY = Path(__file__).resolve().parents[1]


def sandbox_processes() -> list[int]:
    """Pids of the live (not zombie) processes whose real uid is the sandbox's."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines())
        except OSError:  # exited while we looked
            continue
        if int(fields["Uid"].split()[0]) == SANDBOX_UID and not fields["State"].strip().startswith("Z"):
            pids.append(int(status.parent.name))
    return pids


def sandbox_files(name: str) -> list[Path]:
    """``name`` in the working directory of a live sandbox, seen from the host: the directory is a
    tmpfs in the sandbox's mount namespace, reached through a sandbox process's ``/proc/PID/root``."""
    return [path for pid in sandbox_processes() if (path := Path(f"/proc/{pid}/root/sandbox/{name}")).exists()]


@contextlib.contextmanager
def own_scratch_root(prefix: str) -> Iterator[str]:
    """A scratch root of our own to watch; pytest's tmp_path is mode 0700, closed to uid 65534."""
    root = tempfile.mkdtemp(prefix=prefix)
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root)


MEMORY_BOMBS = {"one-huge-allocation": "x = bytearray(2**34)\n",
                "growing-list": "chunks = []\nwhile True:\n    chunks.append(bytearray(2**20))\n"}

# Every process forks until refused, then sleeps holding its slot; the first one reports.
FORK_BOMB = (
    "import os, time\n"
    "first = os.getpid()\n"
    "while True:\n"
    "    try:\n"
    "        os.fork()\n"
    "    except OSError as error:\n"
    "        if os.getpid() == first:\n"
    "            processes = sum(name.isdigit() for name in os.listdir('/proc'))\n"
    "            print(type(error).__name__, processes)\n"
    "            break\n"
    "        time.sleep(1000)\n"
)

def check_fork_bomb_stopped(result: ToolResult) -> None:
    """``FORK_BOMB``'s first process was refused a fork once its processes filled the limit."""
    assert result.ok, result
    refusal, processes = result.stdout.split()
    assert refusal == "BlockingIOError"
    assert LIMITS.max_processes // 2 < int(processes) <= LIMITS.max_processes


# The daemon (double fork, setsid) holds the write end of a FIFO in the working directory.
DAEMON = (
    "import os, time\n"
    "os.mkfifo('fifo')\n"
    "ready_read, ready_write = os.pipe()\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        held = os.open('fifo', os.O_WRONLY)  # until the test opens the other end\n"
    "        os.write(ready_write, b'ready')\n"
    "        time.sleep(1000)\n"
    "    os._exit(0)\n"
    "print('daemon', os.read(ready_read, 5).decode())\n"
)


async def run_daemon(run: Callable[[str], Awaitable[ToolResult]]) -> tuple[ToolResult, bool]:
    """``DAEMON`` run by ``run``: its result, and whether the FIFO read end-of-file as soon as ``run``
    returned (the daemon was dead by then)."""
    call = asyncio.create_task(run(DAEMON))
    fifo = await wait_for_async(lambda: sandbox_files("fifo"), timeout=5, what="the FIFO")
    reader = os.open(fifo[0], os.O_RDONLY | os.O_NONBLOCK)
    try:
        result = await call
        end_of_file = os.read(reader, 1) == b""  # BlockingIOError while the daemon lives
    finally:
        os.close(reader)
    return result, end_of_file


async def cancel_a_running_call(run: Callable[[str], Awaitable[ToolResult]]) -> float:
    """Start a call that sleeps, cancel it once it runs; returns the seconds the cancelled call took to end."""
    call = asyncio.create_task(run("import time\nopen('started', 'w').close()\ntime.sleep(100)\n"))
    await wait_for_async(lambda: sandbox_files("started"), timeout=5, what="the snippet to start")
    cancelled_at = time.monotonic()
    call.cancel()
    try:
        await call
    except asyncio.CancelledError:
        return time.monotonic() - cancelled_at
    raise AssertionError("the cancelled call ended without CancelledError")


# Writes 1 MiB files until the disk is full; prints how many it wrote before the error it stopped at.
FILL_THE_DISK = (
    "import os\n"
    "written = 0\n"
    "try:\n"
    "    for index in range(64):\n"
    "        with open(f'part-{index}', 'wb') as part:\n"
    "            part.write(b'x' * 2**20)\n"
    "        written += 1\n"
    "finally:\n"
    "    print(written, sorted(os.listdir('.'))[:2])\n"
)

# The seccomp filter's refusals, and what it must leave working (glibc falls back from clone3 to clone).
NESTED_USER_NAMESPACE = (
    "import ctypes, os, subprocess, threading\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def errno_of(result):\n"
    "    return os.strerror(ctypes.get_errno()) if result == -1 else 'ALLOWED'\n"
    "print('unshare', errno_of(libc.unshare(0x10000000)))\n"  # CLONE_NEWUSER
    "print('clone3', errno_of(libc.syscall(435, 0, 0)))\n"
    "print('setns', errno_of(libc.setns(0, 0)))\n"
    "thread = threading.Thread(target=print, args=('thread runs',))\n"
    "thread.start(); thread.join()\n"
    "print(subprocess.run(['/usr/bin/python3', '-c', 'print(\"child runs\")'], capture_output=True, text=True).stdout, end='')\n"
)
NESTED_USER_NAMESPACE_REFUSED = ("unshare Operation not permitted\nclone3 Function not implemented\n"
                                 "setns Operation not permitted\nthread runs\nchild runs\n")


# Reads outside the working directory and writes to the read-only system: five DENIED lines.
FILES = (
    "import os\n"
    f"for path in ['/etc/passwd', '/root', {str(REPOSITORY)!r}]:\n"
    "    try:\n"
    "        print(path, 'READ', open(path).read() if os.path.isfile(path) else os.listdir(path))\n"
    "    except OSError as error:\n"
    "        print(path, 'DENIED', type(error).__name__)\n"
    "for path in ['/usr/planted', '/planted']:\n"
    "    try:\n"
    "        open(path, 'w')\n"
    "        print(path, 'WRITTEN')\n"
    "    except OSError as error:\n"
    "        print(path, 'DENIED', type(error).__name__)\n"
)


def connect_to(port: int) -> str:
    """A snippet that connects to a loopback port and prints CONNECTED or the error's type."""
    return ("import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
            "    print('CONNECTED')\n"
            "except OSError as error:\n"
            "    print(type(error).__name__)\n")


# --- the runner's parity with `python snippet.py` ---------------------------------------------------------
STDIN = "line one\nline two\n"


def without_addresses(text: str) -> str:
    """A snippet's output with the object addresses a repr shows masked: two interpreters differ there."""
    return re.sub(r" at 0x[0-9a-f]+>", " at ADDRESS>", text)


SNIPPETS = {
    "print": 'print("hi")',
    "unterminated output is flushed": 'import sys; sys.stdout.write("partial")',
    "traceback": "def f():\n    return 1 / 0\nf()\n",
    "syntax error": "def (\n",
    "indentation error": "if True:\nprint(1)\n",
    "sys.exit code": "import sys; print('a'); sys.exit(3)",
    "sys.exit message": "import sys; sys.exit('bye now')",
    "exit() from site": "print('x'); exit(4)",
    "raise SystemExit": "raise SystemExit",
    "KeyboardInterrupt": "raise KeyboardInterrupt",
    "os._exit": "import os; print('flushed', flush=True); os._exit(5)",
    "stdin": "import sys; print(sys.stdin.readline().upper(), input())",
    "chained": "try:\n    {}['k']\nexcept KeyError as e:\n    raise ValueError('bad') from e\n",
    "context": "try:\n    1/0\nexcept ZeroDivisionError:\n    undefined_name\n",
    "exception group and note": "e = ValueError('v')\ne.add_note('a note')\n"
                                "raise ExceptionGroup('eg', [e, TypeError(2)])\n",
    "output then exception": "print('buffered', end='')\nraise RuntimeError('late')\n",
    "thread exception": "import threading\nt = threading.Thread(target=lambda: 1/0)\n"
                        "t.start(); t.join(); print('ok')\n",
    "atexit": "import atexit\natexit.register(lambda: print('at exit'))\nprint('body')\n",
    "script globals": "import sys\nprint(__name__, sorted(globals()), sys.argv, __file__.endswith('/snippet.py'))\n",
    "__main__ is the snippet": "import __main__, pickle\nclass A:\n    x = 5\n"
                               "print(__main__.A is A, pickle.loads(pickle.dumps(A())).x)\n",
    "snippet's excepthook": "import sys\nsys.excepthook = lambda kind, *_: print('hooked', kind.__name__)\n"
                            "raise RuntimeError\n",
    "warnings": "import warnings\nwarnings.warn('careful')\nprint('done')\n",
    "coding cookie": "# -*- coding: latin-1 -*-\nprint('\\xe9')\n",
    # the runner's fast exit keeps the interpreter's own: finalizers, cycles, threads, replaced streams
    "__del__ at exit": "class A:\n    def __del__(self):\n        print('finalized')\na = A()\nprint('body')\n",
    "cycle with __del__": "class A:\n    def __del__(self):\n        print('cycle finalized')\n"
                          "a = A(); a.me = a\ndel a\nprint('body')\n",
    "replaced stdout": "import io, sys\nprint('a')\nsys.stdout = io.StringIO()\nprint('lost')\n",
    "closed stdout": "import sys\nprint('a')\nsys.stdout.close()\n",
    "non-daemon thread": "import threading, time\n"
                         "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
                         "print('body')\n",
    "atexit raises": "import atexit\natexit.register(lambda: 1/0)\nprint('body')\n",
    "atexit after thread": "import atexit, threading, time\natexit.register(lambda: print('at exit'))\n"
                           "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n",
    "unflushed file": "f = open('out.txt', 'w')\nf.write('kept')\nprint(open('out.txt').read() == '')\n",
    "stdout fails to flush": "import sys\nsys.stdout = open('/dev/full', 'w')\nprint('x')\n",
    "stderr buffered": "import sys\nsys.stderr.write('err no newline')\nprint('out', end='')\n",
}
