"""docs/reference/cli.md: every console script's ``--help``, as the installed script prints it."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from ._markdown import generated_banner

ROOT = Path(__file__).resolve().parents[2]


def console_scripts() -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml: name -> ``module:function``."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def help_text(name: str, entry: str) -> str:
    module, function = entry.split(":")
    # The entry point as the installed script runs it, with a fixed width so the page is stable.
    code = f"import sys; sys.argv[0] = {name!r}; from {module} import {function} as main; sys.exit(main())"
    env = {**os.environ, "COLUMNS": "100", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{entry} --help exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout.rstrip()


def render() -> dict[str, str]:
    scripts = console_scripts()
    lines = [*generated_banner("scripts/gen_docs/cli.py", "each console script's --help"),
             "# Command line", "",
             "The console scripts `pip install` puts on the PATH (`[project.scripts]` in `pyproject.toml`). "
             "Each service's flags are its settings (Reference → Settings); every flag is also an "
             "environment variable and a `--config` file key.", "",
             "| script | entry point |", "|---|---|"]
    lines += [f"| [`{name}`](#{name}) | `{entry}` |" for name, entry in scripts.items()]
    for name, entry in scripts.items():
        lines += ["", f"## {name}", "", "```text", help_text(name, entry), "```"]
    return {"reference/cli.md": "\n".join(lines) + "\n"}
