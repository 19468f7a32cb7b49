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
starts a new one. ``EpisodeSandboxes`` bounds how many live at once: past ``max_live`` an episode's
calls each get a fresh sandbox (``PythonSandbox.run``), as they do without bwrap (``rlimits-only``: no
pid namespace to keep).

**Reused, never shared.** ``close()`` (the episode's end) asks the zygote for a reset (the same one
as after every call: every other process of the namespace killed and reaped, the working directory
and /tmp emptied) and a check that it is clean (no process but the zygote in ``/proc``); answered
clean, the sandbox is parked in ``EpisodeSandboxes`` and the next episode's first call gets it
instead of starting bwrap and an interpreter (~40 ms of CPU); not answered clean, it is ended. So
what an episode shares with the episodes before it on the same sandbox is what its calls share with
each other (above), and no two episodes hold one at once. A parked sandbox is ended after
``idle_seconds`` unused, and all of them at the service's stop.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import BinaryIO

from rlfleet.services.environment import sandboxed
from rlfleet.services.environment.metrics import (EPISODE_SANDBOX_RESETS, EPISODE_SANDBOXES_REUSED,
                                                  EPISODE_SANDBOXES_STARTED, SANDBOX_CPU)
from rlfleet.services.environment.sandbox import (
    GATE,
    SANDBOX_WORKDIR,
    PythonSandbox,
    SandboxLimits,
    SandboxUnavailable,
    ToolResult,
    bwrap_arguments,
    describe_failure,
    interpreter_command,
    sandbox_env,
    seccomp_filter_fd,
)
from rlfleet.services.environment.sandbox_process import OutputPipe, end_namespace, readable, until_eof

log = logging.getLogger(__name__)

_END_SECONDS = 5.0  # the kernel's kill of a pid namespace takes milliseconds
_START_SECONDS = 60.0  # bwrap and an interpreter: ~40 ms of CPU, seconds on a host whose cores are all busy


def _process_cpu_seconds(pid: int) -> float:
    """A live process's own CPU (user and system, clock ticks) from /proc: bwrap's set-up of a sandbox."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sealed_file(name: str, data: bytes) -> int:
    """A file in memory holding ``data``, sealed (no write, no resize), at offset 0: a call's source or
    stdin, handed to the zygote (a memfd: no file in the host's /tmp, a third of a temporary file's CPU)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


class EpisodeSandboxes:
    """Makes the per-episode sandboxes of one ``PythonSandbox`` (its limits and bwrap), at most
    ``max_live`` alive at once, and keeps those that episodes closed cleanly for the next episodes:
    reused, never shared. A sandbox is parked only after its reset (``_Zygote.reset``: every process
    of its namespace killed, its scratch directory and /tmp emptied, then checked) answered that it is
    clean; one that does not is ended. A parked one is ended after ``idle_seconds`` unused."""

    def __init__(self, sandbox: PythonSandbox, max_live: int = 64, idle_seconds: float = 60.0, reuse: bool = True):
        if max_live < 1:
            raise ValueError(f"max_live must be >= 1, not {max_live}")
        self.sandbox = sandbox
        self.reuse = reuse
        """False: a closed episode's sandbox is ended, never parked (each episode starts its own)."""
        self.max_live = max_live
        self.idle_seconds = idle_seconds
        self.live = 0
        """Sandboxes alive: held by episodes, or parked (``idle``)."""
        self.idle: list[_Zygote] = []
        self.started = 0
        """Sandboxes started (bwrap and the zygote's interpreter)."""
        self.reused = 0
        """Episodes that got a parked sandbox instead of a new one."""
        self.reset_failures = 0
        """Sandboxes ended because their reset did not answer clean."""
        self._expiry: asyncio.TimerHandle | None = None

    def episode(self) -> EpisodeSandbox:
        """A sandbox for one episode's calls (started at its first call); ``close()`` it at the episode's end."""
        return EpisodeSandbox(self)

    async def run(self, code: str, stdin: str = "") -> ToolResult:
        """One call in a sandbox of its own for this call alone, as ``PythonSandbox.run``: a parked one
        (reset clean after its last call, as between episodes) or a new one, parked again after it;
        past ``max_live``, or without bwrap, a fresh sandbox (``PythonSandbox.run``)."""
        sandbox = self.episode()
        try:
            return await sandbox.run(code, stdin)
        finally:
            await sandbox.close()

    def _take(self) -> _Zygote | None:
        """A parked sandbox (its slot with it), the most recently parked first; None if none."""
        while self.idle:
            zygote = self.idle.pop()
            if zygote.alive():
                self.reused += 1
                EPISODE_SANDBOXES_REUSED.inc()
                return zygote
            self.live -= 1
            asyncio.ensure_future(zygote.end())
        return None

    async def _park(self, zygote: _Zygote) -> None:
        """An episode closed: keep its sandbox (and its slot) if it resets clean, else end it."""
        if self.reuse and (zygote.clean or await zygote.reset()):
            zygote.parked_at = time.monotonic()
            self.idle.append(zygote)
            self._expire_later()
            return
        if self.reuse:
            self.reset_failures += 1
            log.warning("an episode's sandbox did not reset clean; it is ended")
        await zygote.end()
        self.live -= 1

    def _expire_later(self) -> None:
        if self._expiry is None and self.idle:
            self._expiry = asyncio.get_running_loop().call_later(self.idle_seconds / 4, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        now = time.monotonic()
        expired = [zygote for zygote in self.idle if now - zygote.parked_at >= self.idle_seconds]
        for zygote in expired:
            self.idle.remove(zygote)
            self.live -= 1
            asyncio.ensure_future(zygote.end())
        self._expire_later()

    async def close(self) -> None:
        """End the parked sandboxes (the service's stop; episodes still open end theirs at their close)."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        idle, self.idle = self.idle, []
        self.live -= len(idle)
        await asyncio.gather(*(zygote.end() for zygote in idle))


class EpisodeSandbox:
    """One episode's python tool calls; see the module docstring. Calls run one at a time."""

    def __init__(self, pool: EpisodeSandboxes):
        self.pool = pool
        self.limits = pool.sandbox.limits
        self._lock = asyncio.Lock()
        self._holds_slot = False
        self._zygote: _Zygote | None = None
        self._prestart: asyncio.Future | None = None
        self._closed = False
        self.started = 0
        """Sandboxes this episode started or was given (a new one after each that was ended early)."""

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
                try:
                    result, clean = await self._zygote.call(code, stdin)
                except BaseException:  # cancelled: nothing of the call may outlive it
                    await asyncio.shield(self._end())
                    raise
                if not clean:
                    await self._end()
                return result

    async def close(self) -> None:
        """Park the sandbox for another episode (reset and checked clean) or end it; later calls are
        refused."""
        self._closed = True
        if self._prestart is not None and not self._prestart.done():
            self._prestart.cancel()
            await asyncio.wait({self._prestart})
        async with self._lock:
            zygote, self._zygote = self._zygote, None
            if zygote is not None:
                await asyncio.shield(self.pool._park(zygote))  # the slot goes with it
            elif self._holds_slot:
                self.pool.live -= 1
            self._holds_slot = False

    async def _start_once(self) -> None:
        async with self._lock:
            if not self._closed:
                await self._start_if_needed()

    async def _start_if_needed(self) -> bool:
        """Whether calls run here (False: each in a fresh sandbox: no bwrap, or no slot left)."""
        if self._zygote is not None:
            return True
        if await self.pool.sandbox.probe() != "bwrap":
            return False
        if not self._holds_slot:
            self._zygote = self.pool._take()
            if self._zygote is not None:
                self._holds_slot = True
                self.started += 1
                return True
            if self.pool.live >= self.pool.max_live:
                return False
            self._holds_slot = True
            self.pool.live += 1
        self._zygote = await _Zygote.start(self.pool.sandbox)
        self.pool.started += 1
        EPISODE_SANDBOXES_STARTED.inc()
        self.started += 1
        return True

    async def _end(self) -> None:
        """End the sandbox (the episode keeps its slot: its next call starts a new one)."""
        zygote, self._zygote = self._zygote, None
        if zygote is not None:
            await zygote.end()


@dataclass
class _Zygote:
    """One live sandbox: bwrap, the zygote (its namespace's init) and the control socket to it."""

    limits: SandboxLimits
    process: subprocess.Popen | None
    control: socket.socket | None
    info: BinaryIO | None
    stderr: int | None
    parked_at: float = 0.0
    cpu_seconds: float = 0.0
    """The CPU of the last call or reset inside the sandbox, as the zygote reported it."""
    clean: bool = False
    """Its last answer, a call's or a reset's (the same reset follows each call), said clean, and
    nothing ran in it since: parked as it is, without another reset."""

    @classmethod
    async def start(cls, owner: PythonSandbox) -> _Zygote:
        host_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        host_end.setblocking(False)
        info = tempfile.TemporaryFile()
        stderr_read, stderr_write = os.pipe()
        limits = owner.limits
        # the zygote, then in each call's process the snippet runner (sandboxed/zygote.py)
        program = sandboxed.source("zygote", "snippet_runner")
        zygote = [*interpreter_command(owner.python, program, limits), str(zygote_end.fileno())]
        stdout_read, stdout_write = os.pipe()  # pipes, as a call's: sys.stdout is made over them
        seccomp_fd = process = None
        try:
            seccomp_fd = seccomp_filter_fd()
            options = bwrap_arguments(limits, info.fileno(), seccomp_fd)
            command, drop = owner.as_sandbox_user([owner.bwrap, "--as-pid-1", *options, "--", *zygote])
            with tempfile.TemporaryFile() as empty_stdin:
                process = subprocess.Popen(
                    command, stdin=empty_stdin, stdout=stdout_write, stderr=stderr_write,
                    pass_fds=(info.fileno(), zygote_end.fileno(), seccomp_fd), cwd="/",
                    env=sandbox_env(SANDBOX_WORKDIR), start_new_session=True, **drop)
        except (OSError, SandboxUnavailable) as error:
            await cls(limits, process, host_end, info, stderr_read).end()
            if isinstance(error, SandboxUnavailable):
                raise
            raise SandboxUnavailable(f"cannot start {owner.bwrap}: {error}") from error
        finally:
            for fd in (stdout_read, stdout_write, stderr_write, seccomp_fd):
                if fd is not None:
                    os.close(fd)
            zygote_end.close()
        zygote = cls(limits, process, host_end, info, stderr_read)
        try:
            ready = await zygote._answer(_START_SECONDS)
        except asyncio.TimeoutError:
            ready = None
        except BaseException:  # cancelled: nothing of the sandbox may outlive it
            await asyncio.shield(zygote.end())
            raise
        if ready is None:
            said = zygote._said()
            await zygote.end()
            raise SandboxUnavailable(f"the sandbox's interpreter did not start{f': {said}' if said else ''}")
        SANDBOX_CPU.labels(step="start").observe(zygote.cpu_seconds + _process_cpu_seconds(process.pid))
        return zygote

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    async def call(self, code: str, stdin: str) -> tuple[ToolResult, bool]:
        """Run one call; the result, and whether the sandbox is clean after it (False: end it). The
        output pipes and the answer are read by the event loop's callbacks (``OutputPipe.watch``,
        ``_answer``): no task or stream per call, whose loop iterations were most of its host CPU."""
        pipes = (OutputPipe(self.limits.max_output_bytes), OutputPipe(self.limits.max_output_bytes))
        clean = self.clean = False  # unless the zygote answers that it cleaned up
        timed_out = False
        status = -signal.SIGKILL
        answer = None
        ends: list[asyncio.Future] = []
        try:
            source, stdin_file = sealed_file("snippet.py", code.encode("utf-8", errors="surrogateescape")), None
            try:
                stdin_file = sealed_file("stdin", stdin.encode())
                fds = [source, stdin_file, pipes[0].write_end, pipes[1].write_end]
                self.control.sendmsg([b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                sent = True
            except OSError:  # the zygote is gone
                sent = False
            finally:
                for fd in (source, stdin_file):
                    if fd is not None:
                        os.close(fd)
            started = time.monotonic()
            if sent:
                for pipe in pipes:
                    pipe.close_write_end()  # the call's processes hold the only copies: their end is EOF
                ends = [pipe.watch() for pipe in pipes]
                try:
                    answer = await self._answer(self.limits.wall_seconds)
                except asyncio.TimeoutError:
                    timed_out = True
            wall_seconds = time.monotonic() - started
            if answer is not None:
                status, clean = answer
                SANDBOX_CPU.labels(step="call").observe(self.cpu_seconds)
            if not clean:
                self._log_failure(answer, timed_out)
                await self.end()
            await until_eof(ends)
        finally:
            for pipe in pipes:
                pipe.close()
        self.clean = clean
        exit_code = os.waitstatus_to_exitcode(status) if answer is not None else status
        error = describe_failure(exit_code, timed_out, pipes[1].tail, self.limits)
        if answer is None and not timed_out:
            error = "ended with its sandbox, which stopped answering"
        return ToolResult(ok=error is None, stdout=pipes[0].text("stdout"), stderr=pipes[1].text("stderr"),
                          exit_code=exit_code, error=error, wall_seconds=wall_seconds), clean

    async def reset(self) -> bool:
        """Between episodes: the zygote kills every other process of its namespace, empties the scratch
        directory and /tmp, and checks that no process but itself is left; whether it answered so."""
        try:
            self.control.send(b"r")
            answer = await self._answer(_END_SECONDS)
        except (OSError, asyncio.TimeoutError):
            answer = None
        self.clean = clean = answer is not None and answer[1]
        if answer is not None:
            SANDBOX_CPU.labels(step="reset").observe(self.cpu_seconds)
        EPISODE_SANDBOX_RESETS.labels(outcome="clean" if clean else "failed").inc()
        return clean

    async def _answer(self, timeout: float) -> tuple[int, bool] | None:
        """The zygote's answer (wait status, clean); None when it closed the socket (it is gone);
        ``asyncio.TimeoutError`` past ``timeout`` seconds. The CPU it reports goes to ``cpu_seconds``."""
        loop = asyncio.get_running_loop()
        answered = loop.create_future()
        received = bytearray()
        control = self.control
        fd = control.fileno()

        def ready() -> None:
            try:
                chunk = control.recv(64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                chunk = b""
            received.extend(chunk)
            if (not chunk or received.endswith(b"\n")) and not answered.done():
                answered.set_result(bytes(received) if chunk else None)

        loop.add_reader(fd, ready)
        try:
            line = await asyncio.wait_for(answered, timeout)
        finally:
            loop.remove_reader(fd)
        if line is None:
            return None
        status, clean, cpu_us = line.split()
        self.cpu_seconds = int(cpu_us) / 1e6
        return int(status), clean == b"1"

    def _log_failure(self, answer: tuple[int, bool] | None, timed_out: bool) -> None:
        if timed_out:
            return  # the snippet's doing, in the result
        if answer is not None:
            log.warning("the episode's sandbox could not empty its scratch directory or /tmp; it is ended")
            return
        said = self._said()
        log.error("the episode's sandbox stopped answering%s", f": {said}" if said else "")

    def _said(self) -> str:
        """The end of what the zygote (or bwrap) wrote to stderr, when it stopped answering."""
        if self.stderr is None:
            return ""
        os.set_blocking(self.stderr, False)
        try:
            return os.read(self.stderr, 4096).decode(errors="replace").strip()[-1000:]
        except OSError:
            return ""

    async def end(self) -> None:
        """End the sandbox: its pid namespace (every process in it, and with it the tmpfs of its working
        directory and /tmp), bwrap. Idempotent."""
        process, self.process = self.process, None
        if process is not None:
            exited = os.pidfd_open(process.pid)
            try:
                await end_namespace(self.info)
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await asyncio.wait_for(readable(exited), _END_SECONDS)
            finally:
                os.close(exited)
            process.wait()
        for closing in (self.control, self.info):
            if closing is not None:
                closing.close()
        self.control = self.info = None
        if self.stderr is not None:
            os.close(self.stderr)
            self.stderr = None
