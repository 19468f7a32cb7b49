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

LIMITS = SandboxLimits(cpu_seconds=3, memory_bytes=1024 * 2**20, max_processes=4096, max_file_bytes=2**20,
                       max_open_files=50)
STDIN = "line one\nline two\n"

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
}


def run(command: list[str], directory) -> tuple[int, str, str]:
    done = subprocess.run(command, cwd=directory, input=STDIN, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr.replace(str(directory), "DIR")


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
