"""The environment of ``bench/pipeline.py`` part (d): every assistant turn costs one real python tool call.

Registered with the environment service by import path (``_environments:ToolTurns``, with ``bench/``
on its PYTHONPATH). The tiny random model never writes a tool call, so the environment makes one
for it: each step runs ``SNIPPET`` in the real sandbox, one of its own per call from a pool of ready ones
(``EpisodeSandboxes.run``, as the built-in ``tool_calling`` environment's python tool by default) and answers with a ``tool`` message
holding its output, whatever the model wrote. The ``TURNS``-th step ends the episode; it runs its
tool call too (the collector keeps no observation after the last turn, so that output is dropped):
every turn pays one call, an upper bound on what a model that answers without a tool would cost.

``EpisodeToolTurns`` runs the same calls in a sandbox of the episode's own that stays up for its calls
(``EpisodeSandbox``: one bwrap per episode, a fresh process forked in it per call), started in the
background when the episode opens and ended when it closes.

``CannedToolTurns`` answers the same turns with the same message without running anything: the
difference between the two is the tool calls' cost, the rest is the turns' own.

With ``RLFLEET_BENCH_TOOL_SECONDS_FILE`` set, each call appends its seconds (the whole
``sandbox.run``, as the step waits for it) to that file (``EpisodeToolTurns``: that path plus
``.episode``), one line per call, for the bench to average.
"""

from __future__ import annotations

import os
import time

from typing import Any

from rlfleet.env import AssistantTurn, Environment, StepResult, Task, render_tool_result
from rlfleet.services.environment.episode_sandbox import EpisodeSandbox, EpisodeSandboxes
from rlfleet.services.environment.sandbox import PythonSandbox

TURNS = 3
"""Assistant turns per episode, each followed by one tool call."""
SNIPPET = "print(sum(i * i for i in range(10_000)))"
"""A small, fixed tool call: the output (and so the observation's tokens) is the same every time."""
TOOL_SECONDS_FILE = "RLFLEET_BENCH_TOOL_SECONDS_FILE"

EPISODE_SECONDS_SUFFIX = ".episode"
"""``EpisodeToolTurns`` logs its calls' seconds to ``RLFLEET_BENCH_TOOL_SECONDS_FILE`` + this."""

EPISODE_SANDBOXES = 256
"""Per-episode sandboxes alive at once: more than the episodes part (d) opens at once (its 32 groups of 4),
so that every episode of that side runs its calls in its own (with the service's default of 64, half of
them ran each call in a fresh sandbox: the side then cost as much as fresh sandboxes)."""

_sandbox: PythonSandbox | None = None
_episode_sandboxes: EpisodeSandboxes | None = None
_call_sandboxes: EpisodeSandboxes | None = None


def shared_sandbox() -> PythonSandbox:
    """One sandbox for every episode of this process (made on first use: nothing runs at import),
    as the environment service shares its own between ``tool_calling`` episodes."""
    global _sandbox
    if _sandbox is None:
        _sandbox = PythonSandbox()
    return _sandbox


def episode_sandboxes() -> EpisodeSandboxes:
    """The per-episode sandboxes of every ``EpisodeToolTurns`` of this process (the shared sandbox's limits)."""
    global _episode_sandboxes
    if _episode_sandboxes is None:
        _episode_sandboxes = EpisodeSandboxes(shared_sandbox(), max_live=EPISODE_SANDBOXES)
    return _episode_sandboxes


def call_sandboxes() -> EpisodeSandboxes:
    """The pool ``ToolTurns`` takes a sandbox from for each call (a pool of its own: the sides' sandbox
    starts are counted apart)."""
    global _call_sandboxes
    if _call_sandboxes is None:
        _call_sandboxes = EpisodeSandboxes(shared_sandbox(), max_live=EPISODE_SANDBOXES)
    return _call_sandboxes


SNIPPET_OUTPUT = f"{sum(i * i for i in range(10_000))}\n"
"""What ``SNIPPET`` prints (checked on every run)."""


class ToolTurns(Environment):
    """``TURNS`` assistant turns, each answered with the output of ``SNIPPET`` run in the sandbox."""

    seconds_suffix = ""

    def __init__(self) -> None:
        self.turns = 0

    async def step(self, turn: AssistantTurn) -> StepResult:
        self.turns += 1
        return StepResult(messages=[render_tool_result("python", await self.tool_output())],
                          done=self.turns >= TURNS)

    async def tool_output(self) -> str:
        started = time.perf_counter()
        result = await self.sandbox().run(SNIPPET)
        seconds = time.perf_counter() - started
        if not result.ok or result.stdout != SNIPPET_OUTPUT:  # ours: a failure is the host's, not a cheap turn
            raise RuntimeError(f"the bench's tool call failed: {result.error}: {result.stderr[-500:]}")
        path = os.environ.get(TOOL_SECONDS_FILE)
        if path:
            with open(path + self.seconds_suffix, "a", encoding="utf-8") as out:
                out.write(f"{seconds:.6f}\n")
        return result.stdout

    def sandbox(self) -> EpisodeSandboxes | EpisodeSandbox:
        return call_sandboxes()


class EpisodeToolTurns(ToolTurns):
    """``ToolTurns`` with the episode's calls in a sandbox of its own that stays up for them."""

    seconds_suffix = EPISODE_SECONDS_SUFFIX

    def __init__(self) -> None:
        super().__init__()
        self._sandbox = episode_sandboxes().episode()

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        self._sandbox.prestart()  # up by the end of the first turn's generation
        return await super().reset(task)

    def sandbox(self) -> EpisodeSandbox:
        return self._sandbox

    async def close(self) -> None:
        await self._sandbox.close()


class CannedToolTurns(ToolTurns):
    """``ToolTurns`` with the tool call's output given, not run: the same tokens, no sandbox."""

    async def tool_output(self) -> str:
        return SNIPPET_OUTPUT
