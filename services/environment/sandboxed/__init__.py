"""The programs that run inside the sandbox, one module per program, as files a linter reads.

None is imported: running one is its whole purpose (it reads ``sys.argv``, sets rlimits, runs the
snippet). The host passes a program's text to the sandbox's interpreter as ``python -c`` (``source``),
so that nothing of rlfleet has to be mounted into the sandbox. Each program reads the same first
arguments: the five rlimits (CPU seconds, address space, processes, file size, open files) and the
snippet's file name (``sandbox.interpreter_command``).

- ``snippet_runner.py``: sets the rlimits, then runs the snippet as ``python snippet.py`` would
  (``PythonSandbox``, one interpreter per call);
- ``zygote.py``: the init of an episode's sandbox, forking a process per call that goes on as the
  snippet runner (``EpisodeSandbox``): it runs as ``source("zygote", "snippet_runner")``.
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def source(*programs: str) -> str:
    """The text of these programs (module names of this package), in order, as one program."""
    here = Path(__file__).parent
    return "".join((here / f"{program}.py").read_text(encoding="utf-8") for program in programs)
