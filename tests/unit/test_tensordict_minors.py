"""rlfleet supports two tensordict minors: 0.14 (what torchrl 0.14 pins: this environment) and 0.15
(what a services-only install resolves). The SDK's tensordict-facing tests run again under 0.15,
from the overlay ``scripts/bootstrap`` installs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tensordict

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = Path(sys.prefix) / "overlays" / "tensordict-0.15"  # scripts/bootstrap puts it in the venv
TENSORDICT_TESTS = ["tests/unit/test_wire_tensordict.py", "tests/unit/test_client_sdk.py",
                    "tests/unit/test_trajectory_store.py", "tests/unit/test_torchrl_layout.py"]


def test_this_environment_runs_the_minor_torchrl_pins():
    assert tensordict.__version__.startswith("0.14."), tensordict.__version__


def test_the_sdk_tests_pass_on_tensordict_0_15():
    assert OVERLAY.is_dir(), f"{OVERLAY} is missing: run scripts/bootstrap"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(OVERLAY), str(ROOT)]))
    version = subprocess.run([sys.executable, "-c", "import tensordict; print(tensordict.__version__)"],
                             env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert version.startswith("0.15."), version
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TENSORDICT_TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
