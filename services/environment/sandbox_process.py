"""The life of a sandboxed process, as the one-call sandbox (``sandbox.py``) and the per-episode one
(``episode_sandbox.py``) both live it: its output read with a cap, its end awaited by pidfd, its pid
namespace ended, the readers stopped. Knows nothing of limits, bwrap's options or the programs run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from typing import BinaryIO

log = logging.getLogger(__name__)

PIPE_GRACE_SECONDS = 2.0
"""After the call's end, how long an output pipe may stay open (a process that escaped the sandbox)."""
_READ_CHUNK = 64 * 1024
_TAIL_BYTES = 1024  # kept from the end of stderr whatever the cap: the exception line is there
_NAMESPACE_END_SECONDS = 5.0  # the kernel's kill of a pid namespace takes milliseconds


class OutputPipe:
    """One output stream of the snippet: keeps the first ``cap`` bytes and the last ``_TAIL_BYTES``,
    counts and drops the rest, so a flood costs reading time, never memory."""

    def __init__(self, cap: int):
        self.cap = cap
        self.kept = bytearray()
        self.tail = b""
        self.total = 0
        self._read_end: int | None
        self.write_end: int | None
        self._read_end, self.write_end = os.pipe()
        self._loop: asyncio.AbstractEventLoop | None = None

    def close_write_end(self) -> None:
        if self.write_end is not None:
            os.close(self.write_end)
            self.write_end = None

    def close(self) -> None:
        """Close what ``collect()`` has not taken over (``watch()``'s reader with it)."""
        self.close_write_end()
        if self._read_end is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._read_end)
            os.close(self._read_end)
            self._read_end = None

    def watch(self) -> asyncio.Future:
        """Read the pipe from the event loop's own callback as it becomes readable (no task, no stream:
        a call in an episode's sandbox is a few loop iterations); the future is done at EOF."""
        loop = self._loop = asyncio.get_running_loop()
        ended = loop.create_future()
        fd = self._read_end
        os.set_blocking(fd, False)

        def ready() -> None:
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                return
            if chunk:
                self._keep(chunk)
                return
            self.close()
            ended.set_result(None)

        loop.add_reader(fd, ready)
        return ended

    async def collect(self) -> None:
        """Read until EOF (every holder of the write end has exited)."""
        reader = asyncio.StreamReader()
        pipe = os.fdopen(self._read_end, "rb", buffering=0)
        self._read_end = None
        loop = asyncio.get_running_loop()
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        try:
            while chunk := await reader.read(_READ_CHUNK):
                self._keep(chunk)
        finally:
            transport.close()

    def _keep(self, chunk: bytes) -> None:
        self.kept += chunk[: max(0, self.cap - len(self.kept))]
        self.tail = (self.tail + chunk)[-_TAIL_BYTES:]
        self.total += len(chunk)

    def text(self, name: str) -> str:
        text = self.kept.decode("utf-8", errors="replace")
        cut = self.total - len(self.kept)
        if cut:
            text += f"\n[... {name} truncated: {cut} of {self.total} bytes cut, the limit is {self.cap} bytes]\n"
        return text


async def end_namespace(bwrap_info: BinaryIO) -> None:
    """End the sandbox's pid namespace and wait until it has. bwrap returns as soon as the snippet's
    main process exits; the namespace's init follows a moment later (``--die-with-parent``), the
    kernel killing every other process in the namespace first. Done here, nothing of the call
    outlives ``run()``: no daemon, no process still writing into the scratch directory."""
    bwrap_info.seek(0)
    try:
        info = json.loads(bwrap_info.read() or "null")
    except ValueError:  # killed while writing it: the namespace was still being set up
        info = None
    if info is None:
        return  # bwrap ended before it made a namespace
    init = info["child-pid"]
    try:
        pidfd = os.pidfd_open(init)
    except ProcessLookupError:
        return  # ended and reaped already
    try:
        try:  # the pid may name another process only if the init was reaped and its pid reused
            ours = os.readlink(f"/proc/{init}/ns/pid") == f"pid:[{info['pid-namespace']}]"
        except OSError:
            ours = False  # a zombie: ended already
        if ours:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass  # reaped since
        await asyncio.wait_for(readable(pidfd), _NAMESPACE_END_SECONDS)
    except asyncio.TimeoutError:
        log.error("the sandbox's pid namespace (init pid %d) lives on %g s after SIGKILL", init, _NAMESPACE_END_SECONDS)
    finally:
        os.close(pidfd)


async def readable(fd: int) -> None:
    """Wait until ``fd`` is readable (a pidfd: the process has ended)."""
    loop = asyncio.get_running_loop()
    is_readable = loop.create_future()
    loop.add_reader(fd, lambda: is_readable.done() or is_readable.set_result(None))
    try:
        await is_readable
    finally:
        loop.remove_reader(fd)


async def until_eof(ends: list[asyncio.Future]) -> None:
    """After the call's end: its output pipes' ends (``watch`` futures or ``collect`` tasks), waited for
    ``PIPE_GRACE_SECONDS`` at most; one still open means a process escaped the sandbox (logged)."""
    if ends and not all(end.done() for end in ends):
        _, still_open = await asyncio.wait(ends, timeout=PIPE_GRACE_SECONDS)
        if still_open:
            log.warning("an output pipe stayed open after the call ended: a process escaped the sandbox")


async def stop_tasks(tasks: list[asyncio.Task]) -> None:
    """Cancel what is still running, wait for all, re-raise a failure of any."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled():
            task.result()
