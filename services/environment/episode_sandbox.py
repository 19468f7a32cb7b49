"""A sandbox that stays up for one episode's python tool calls: one bwrap, a fresh process per call.

``PythonSandbox.run`` starts a fresh bwrap and a fresh interpreter for every call (~20 ms of CPU, on
the cores the generation engine needs). An ``EpisodeSandbox`` starts them once, at the episode's
first call: the interpreter inside (the zygote, ``sandboxed/zygote.py``) is the init of the
sandbox's pid namespace (bwrap ``--as-pid-1``), and for each call it forks a child that sets the
rlimits, writes ``snippet.py`` and runs it exactly as ``PythonSandbox``'s runner does. When that
child exits, the zygote kills every other process of the namespace (``kill(-1, SIGKILL)``: all but
itself), reaps them, empties the working directory (a tmpfs of ``max_disk_bytes``) and ``/tmp``, and
only then answers the host: no process and no file of a call outlives it, as with ``PythonSandbox``.
The per-call guarantees hold call by call: the same bwrap options (read-only system, no /etc, no
network, own pid/ipc/uts namespaces), uid 65534, the same rlimits set in the call's process before
the snippet's first line (RLIMIT_NPROC counts the zygote where ``PythonSandbox`` counts bwrap's
init: the same number of processes left to the snippet), the output caps, and the wall clock, kept
by the host.

**Shared between the calls of one episode, and nothing else**: the sandbox's namespaces and mounts
(empty between calls), the zygote (the parent of every call, pid 1; each call is a fresh fork of it,
which never runs model code: the modules it imported are already in ``sys.modules``, the hash
seed of ``str`` is the same in every call, and pids keep growing: the first call is pid 2 as in
``PythonSandbox``, later ones are not). Nothing a call does reaches the next: not its processes,
files or Python state, nor the zygote, which as the namespace's init receives no signal from inside
(SIGKILL and SIGSTOP included: the kernel drops them) and is not dumpable (no ptrace, no
``/proc/1/mem`` or ``/proc/1/fd``, no ``pidfd_getfd`` from a snippet). Episodes never share one.

Whatever is not a clean answer — the wall clock run out, a cancelled call, the zygote gone, a scratch
directory it could not empty — ends the whole sandbox (its pid namespace is ended, as
``PythonSandbox`` ends one per call) before ``run()`` returns or raises; the episode's next call
starts a new one. ``close()`` (the episode's end) ends it too. ``EpisodeSandboxes`` bounds how many
live at once: past ``max_live`` an episode's calls each get a fresh sandbox (``PythonSandbox.run``),
as they do without bwrap (``rlimits-only``: no pid namespace to keep).
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from typing import BinaryIO

from rlfleet.services.environment import sandboxed
from rlfleet.services.environment.sandbox import (
    GATE,
    SANDBOX_WORKDIR,
    PythonSandbox,
    SandboxUnavailable,
    ToolResult,
    bwrap_arguments,
    describe_failure,
    interpreter_command,
    sandbox_env,
    seccomp_filter_fd,
)
from rlfleet.services.environment.sandbox_process import (
    PIPE_GRACE_SECONDS,
    OutputPipe,
    end_namespace,
    readable,
    stop_tasks,
)

log = logging.getLogger(__name__)

_END_SECONDS = 5.0  # the kernel's kill of a pid namespace takes milliseconds


class EpisodeSandboxes:
    """Makes the per-episode sandboxes of one ``PythonSandbox`` (its limits and bwrap),
    at most ``max_live`` alive at once."""

    def __init__(self, sandbox: PythonSandbox, max_live: int = 64):
        if max_live < 1:
            raise ValueError(f"max_live must be >= 1, not {max_live}")
        self.sandbox = sandbox
        self.max_live = max_live
        self.live = 0

    def episode(self) -> EpisodeSandbox:
        """A sandbox for one episode's calls (started at its first call); ``close()`` it at the episode's end."""
        return EpisodeSandbox(self)


class EpisodeSandbox:
    """One episode's python tool calls; see the module docstring. Calls run one at a time."""

    def __init__(self, pool: EpisodeSandboxes):
        self.pool = pool
        self.limits = pool.sandbox.limits
        self._lock = asyncio.Lock()
        self._holds_slot = False
        self._process: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._info: BinaryIO | None = None
        self._zygote_stderr: int | None = None
        self._prestart: asyncio.Future | None = None
        self._closed = False
        self.started = 0
        """Sandboxes started for this episode (a new one after each that was ended early)."""

    def prestart(self) -> None:
        """Start the sandbox in the background (when the episode opens, say), so that its first call
        finds it up; a failure to start is the first call's to report."""
        if self._prestart is None and not self._closed:
            self._prestart = asyncio.ensure_future(self._start_once())
            self._prestart.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def run(self, code: str, stdin: str = "") -> ToolResult:
        """As ``PythonSandbox.run``: whatever the snippet does is in the result."""
        if self._closed:
            raise RuntimeError("this episode's sandbox is closed")
        async with self._lock:
            if not await self._start_if_needed():
                return await self.pool.sandbox.run(code, stdin)
            async with GATE.held():
                return await self._call(code, stdin)

    async def close(self) -> None:
        """End the sandbox (if one is up) and give its slot back; later calls are refused."""
        self._closed = True
        if self._prestart is not None and not self._prestart.done():
            self._prestart.cancel()
            await asyncio.wait({self._prestart})
        async with self._lock:
            await self._end()
            if self._holds_slot:
                self._holds_slot = False
                self.pool.live -= 1

    async def _start_once(self) -> None:
        async with self._lock:
            if not self._closed:
                await self._start_if_needed()

    async def _start_if_needed(self) -> bool:
        """Whether calls run here (False: each in a fresh sandbox: no bwrap, or no slot left)."""
        if await self.pool.sandbox.probe() != "bwrap" or not self._take_slot():
            return False
        if self._process is None:
            await self._start()
        return True

    def _take_slot(self) -> bool:
        if not self._holds_slot and self.pool.live < self.pool.max_live:
            self._holds_slot = True
            self.pool.live += 1
        return self._holds_slot

    async def _start(self) -> None:
        owner = self.pool.sandbox
        host_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._control = host_end
        host_end.setblocking(False)
        self._info = tempfile.TemporaryFile()
        stderr_read, stderr_write = os.pipe()
        self._zygote_stderr = stderr_read
        limits = self.limits
        # the zygote, then in each call's process the snippet runner (sandboxed/zygote.py)
        program = sandboxed.source("zygote", "snippet_runner")
        zygote = [*interpreter_command(owner.python, program, limits), str(zygote_end.fileno())]
        stdout_read, stdout_write = os.pipe()  # pipes, as a call's: sys.stdout is made over them
        seccomp_fd = None
        try:
            seccomp_fd = seccomp_filter_fd()
            options = bwrap_arguments(limits, self._info.fileno(), seccomp_fd)
            command, drop = owner.as_sandbox_user([owner.bwrap, "--as-pid-1", *options, "--", *zygote])
            with tempfile.TemporaryFile() as empty_stdin:
                self._process = subprocess.Popen(
                    command, stdin=empty_stdin, stdout=stdout_write, stderr=stderr_write,
                    pass_fds=(self._info.fileno(), zygote_end.fileno(), seccomp_fd), cwd="/",
                    env=sandbox_env(SANDBOX_WORKDIR), start_new_session=True, **drop)
        except (OSError, SandboxUnavailable) as error:
            await self._end()
            if isinstance(error, SandboxUnavailable):
                raise
            raise SandboxUnavailable(f"cannot start {owner.bwrap}: {error}") from error
        finally:
            for fd in (stdout_read, stdout_write, stderr_write, seccomp_fd):
                if fd is not None:
                    os.close(fd)
            zygote_end.close()
        self.started += 1

    async def _call(self, code: str, stdin: str) -> ToolResult:
        pipes = (OutputPipe(self.limits.max_output_bytes), OutputPipe(self.limits.max_output_bytes))
        readers: list[asyncio.Task] = []
        ended = True  # unless the zygote answers that it cleaned up
        timed_out = False
        status = -signal.SIGKILL
        with tempfile.TemporaryFile() as source, tempfile.TemporaryFile() as stdin_file:
            source.write(code.encode("utf-8", errors="surrogateescape"))
            source.seek(0)
            stdin_file.write(stdin.encode())
            stdin_file.seek(0)
            started = time.monotonic()
            try:
                try:
                    fds = [source.fileno(), stdin_file.fileno(), pipes[0].write_end, pipes[1].write_end]
                    self._control.sendmsg([b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                except OSError:  # the zygote is gone
                    answer = None
                else:
                    for pipe in pipes:
                        pipe.close_write_end()  # the call's processes hold the only copies: their end is EOF
                    readers = [asyncio.create_task(pipe.collect()) for pipe in pipes]
                    try:
                        answer = await asyncio.wait_for(self._answer(), self.limits.wall_seconds)
                    except asyncio.TimeoutError:
                        answer, timed_out = None, True
                wall_seconds = time.monotonic() - started
                if answer is not None:
                    status, emptied = answer
                    ended = not emptied
                if ended:
                    self._log_zygote_failure(answer, timed_out)
                    await self._end()
                if readers:
                    _, still_open = await asyncio.wait(readers, timeout=PIPE_GRACE_SECONDS)
                    if still_open:
                        log.warning("an output pipe stayed open after the call ended: a process escaped the sandbox")
            except BaseException:  # cancelled: nothing of the call may outlive it
                await asyncio.shield(self._end())
                raise
            finally:
                for pipe in pipes:
                    pipe.close()
                await stop_tasks(readers)
        exit_code = os.waitstatus_to_exitcode(status) if answer is not None else status
        error = describe_failure(exit_code, timed_out, pipes[1].tail, self.limits)
        if answer is None and not timed_out:
            error = "ended with its sandbox, which stopped answering"
        return ToolResult(ok=error is None, stdout=pipes[0].text("stdout"), stderr=pipes[1].text("stderr"),
                          exit_code=exit_code, error=error, wall_seconds=wall_seconds)

    async def _answer(self) -> tuple[int, bool] | None:
        """The zygote's answer to the call; None when it closed the socket (it is gone)."""
        loop = asyncio.get_running_loop()
        received = b""
        while not received.endswith(b"\n"):
            chunk = await loop.sock_recv(self._control, 64)
            if not chunk:
                return None
            received += chunk
        status, emptied = received.split()
        return int(status), emptied == b"1"

    def _log_zygote_failure(self, answer: tuple[int, bool] | None, timed_out: bool) -> None:
        if timed_out:
            return  # the snippet's doing, in the result
        if answer is not None:
            log.warning("the episode's sandbox could not empty its scratch directory or /tmp; it is ended")
            return
        os.set_blocking(self._zygote_stderr, False)
        try:
            said = os.read(self._zygote_stderr, 4096).decode(errors="replace").strip()
        except OSError:
            said = ""
        log.error("the episode's sandbox stopped answering%s", f": {said[-1000:]}" if said else "")

    async def _end(self) -> None:
        """End the sandbox: its pid namespace (every process in it, and with it the tmpfs of its working
        directory and /tmp), bwrap."""
        process, self._process = self._process, None
        if process is not None:
            exited = os.pidfd_open(process.pid)
            try:
                await end_namespace(self._info)
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await asyncio.wait_for(readable(exited), _END_SECONDS)
            finally:
                os.close(exited)
            process.wait()
        for closing in (self._control, self._info):
            if closing is not None:
                closing.close()
        self._control = self._info = None
        if self._zygote_stderr is not None:
            os.close(self._zygote_stderr)
            self._zygote_stderr = None
