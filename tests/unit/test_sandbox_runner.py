"""The sandbox's snippet runner against a plain ``python snippet.py``: a snippet must not see the difference.

The runner (``snippet_command``) runs here without bwrap or a uid drop, in a temporary directory, with
the test's own interpreter on both sides; the sandbox itself is tests/integration/test_sandbox.py.
"""

from __future__ import annotations

import resource
import signal
import subprocess
import sys

import pytest

from rlfleet.services.environment.sandbox import SNIPPET_NAME, SandboxLimits, snippet_command
from tests.sandbox_cases import SNIPPETS, STDIN, without_addresses

LIMITS = SandboxLimits(cpu_seconds=3, memory_bytes=1024 * 2**20, max_processes=4096, max_file_bytes=2**20,
                       max_open_files=50)


def run(command: list[str], directory) -> tuple[int, str, str]:
    done = subprocess.run(command, cwd=directory, input=STDIN, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, without_addresses(done.stderr.replace(str(directory), "DIR"))


@pytest.mark.parametrize("code", SNIPPETS.values(), ids=SNIPPETS.keys())
def test_a_snippet_runs_as_a_script(tmp_path, code):
    (tmp_path / SNIPPET_NAME).write_text(code, encoding="utf-8")

    plain = run([sys.executable, "-I", "-B", "-X", "utf8", SNIPPET_NAME], tmp_path)
    runner = run(snippet_command(sys.executable, LIMITS), tmp_path)

    assert runner == plain
    assert "<string>" not in runner[2]  # no frame of the runner in a traceback


def test_keyboard_interrupt_ends_as_sigint(tmp_path):
    (tmp_path / SNIPPET_NAME).write_text("raise KeyboardInterrupt\n")

    assert run(snippet_command(sys.executable, LIMITS), tmp_path)[0] == -signal.SIGINT


def test_the_snippet_runs_under_the_limits(tmp_path):
    names = ["RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE"]
    (tmp_path / SNIPPET_NAME).write_text(f"import resource\nfor name in {names}:\n"
                                         "    print(*resource.getrlimit(getattr(resource, name)))\n")

    code, stdout, stderr = run(snippet_command(sys.executable, LIMITS), tmp_path)

    assert (code, stderr) == (0, "")
    assert stdout.splitlines() == ["3 4", f"{2**30} {2**30}", "4096 4096", f"{2**20} {2**20}", "50 50", "0 0"]
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] != 50  # set in the child, not here


def test_a_file_left_open_is_flushed_at_exit(tmp_path):
    (tmp_path / SNIPPET_NAME).write_text("f = open('out.txt', 'w')\nf.write('kept')\n"
                                         "class A:\n    pass\na = A(); a.me = a; a.f = open('cycle.txt', 'w')\n"
                                         "a.f.write('in a cycle')\n")

    assert run(snippet_command(sys.executable, LIMITS), tmp_path) == (0, "", "")
    assert (tmp_path / "out.txt").read_text() == "kept"
    assert (tmp_path / "cycle.txt").read_text() == "in a cycle"
