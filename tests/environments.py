"""Scripted environments the environment service's tests register by import path
(``tests.environments:CounterEnv``): no model, no tools, known answers."""

from __future__ import annotations

import asyncio
import os
import tempfile

from rlfleet.env import AssistantTurn, Environment, StepResult, Task


class CounterEnv(Environment):
    """Three turns: turn i is rewarded i, the user says "turn i" back, the third ends the episode."""

    TURNS = 3

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self, task: Task) -> list[dict]:
        return [{"role": "system", "content": "count with me"}, *task.prompt]

    async def step(self, turn: AssistantTurn) -> StepResult:
        self.turns += 1
        done = self.turns >= self.TURNS
        messages = [] if done else [{"role": "user", "content": f"turn {self.turns}"}]
        return StepResult(messages=messages, reward=float(self.turns), done=done,
                          info={"turn": self.turns, "finish_reason": turn.finish_reason, "text": turn.text})

    def final_reward(self) -> float | None:
        return 10.0 * self.turns


class RaisingEnv(Environment):
    """Raises on its first step, like a buggy environment."""

    async def step(self, turn: AssistantTurn) -> StepResult:
        raise RuntimeError("the scripted environment broke")


class HangingEnv(Environment):
    """Never answers a step."""

    async def step(self, turn: AssistantTurn) -> StepResult:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class GatedCounterEnv(CounterEnv):
    """CounterEnv whose second step waits for a gate, per prompt: it writes ``<gate dir>/waiting-<prompt
    id>-*`` and waits for ``<gate dir>/open-<prompt id>`` (the directory named by ``RLFLEET_TEST_GATE_DIR``),
    so a test acts while episodes are at a known turn."""

    async def reset(self, task: Task) -> list[dict]:
        self.prompt_id = task.metadata.get("prompt_id", "")
        return await super().reset(task)

    async def step(self, turn: AssistantTurn) -> StepResult:
        if self.turns == 1:
            gate = os.environ["RLFLEET_TEST_GATE_DIR"]
            with tempfile.NamedTemporaryFile(dir=gate, prefix=f"waiting-{self.prompt_id}-", delete=False):
                pass
            while not os.path.exists(os.path.join(gate, f"open-{self.prompt_id}")):
                await asyncio.sleep(0.05)
        return await super().step(turn)
