"""The whole suite as a module-scoped fixture, and the examples run against it (demo, TorchRL, node client)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite

ROOT = Path(__file__).resolve().parents[2]
DEMO_COLLECTOR_ARGS = ["--mode=sync", "--group-size=4", "--groups-per-step=8",
                       '--sampling={"temperature": 1.0, "max_tokens": 24}', "--reward-fn=char_fraction"]
"""The collector settings of scripts/demo (8 groups of 4 per step, on-policy, the digits task)."""
AGENTIC_COLLECTOR_ARGS = ["--mode=sync", "--group-size=8", "--groups-per-step=4",
                          '--sampling={"temperature": 1.0, "max_tokens": 96}', "--max-turns=3",
                          "--reward-fn=numeric_match"]
"""The collector settings of scripts/demo --agentic (4 groups of 8 episodes per step, on-policy, a tool
call fits a turn, 3 turns at most); its suite also runs the environment service."""


def episode_collector_args(environment: str, group_size: int, max_episode_tokens: int) -> list[str]:
    """The collector settings of the episode tests: every prompt an episode group of ``environment``,
    environment rewards only, 16-token turns, a failing prompt dead-lettered after 2 quick attempts."""
    return ["--group-size", str(group_size), "--groups-per-step", "64", "--environment", environment,
            "--reward-fn", "none", "--sampling", '{"temperature": 1.0, "max_tokens": 16}',
            "--max-episode-tokens", str(max_episode_tokens), "--prompt-attempts", "2",
            "--retry-backoff-seconds", "0.2", "--replica-check-seconds", "0.5"]


def suite_fixture(collector_args: list[str], name: str):
    """A module-scoped fixture: the whole suite as processes with ``collector_args``, stopped after the module."""
    @pytest.fixture(scope="module")
    def suite(tiny_model_dir, tmp_path_factory):
        procs = start_suite(SuiteOptions(model_dir=tiny_model_dir, collector_args=collector_args),
                            tmp_path_factory.mktemp(name))
        yield procs
        stop_suite(procs)
    return suite


def run_example(script: str, suite, model_dir: Path, steps: int, out: Path, *args: str) -> list[dict]:
    """Run ``examples/<script>`` (with ``args``) against ``suite`` for ``steps``; its metrics.json (the plot
    checked written)."""
    subprocess.run([sys.executable, str(ROOT / "examples" / script), "--collector", suite["collector"].address,
                    "--model-dir", str(model_dir), "--steps", str(steps), "--out", str(out), *args],
                   check=True, timeout=1200)
    assert (out / "metrics.png").stat().st_size > 10_000
    return json.loads((out / "metrics.json").read_text())
