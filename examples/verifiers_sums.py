"""A tutoring environment written on ``verifiers`` 0.4 (``verifiers.v1``, prime-rl's format), and its
registration in rlfleet's environment service (``rlfleet.services.environment.verifiers_adapter``).

The verifiers side knows nothing of rlfleet:

- ``Calculator``: a verifiers ``Toolset`` (an MCP server verifiers launches, once per environment)
  offering ``add(a, b)``;
- ``SumTask``: "what is A plus B", scored by two ``@vf.reward`` s: ``correct`` (the last reply
  holds A + B; a row whose answer is not a whole number is broken, and its scoring raises) and
  ``concise`` (a format reward: a reply of one to ``CONCISE_WORDS`` words, weight 0.5);
- ``SumTaskset``: a few rows, and the calculator;
- ``SumTutor``: the ``Env`` playing them: the agent answers (calling ``add`` if it likes, through
  verifiers' own chat loop, the ``null`` harness); while its answer is wrong and rounds remain,
  the tutor says "Not quite." and asks again. So even a model that never calls the tool plays a
  multi-turn episode.

The rlfleet side is one subclass of the adapter, registered by import path (with ``examples`` on
``PYTHONPATH``, where verifiers also finds the taskset and launches the calculator with
``python -m verifiers_sums``; ``uv`` on ``PATH`` runs verifiers' chat program)::

    RLFLEET_ENVIRONMENT_ENVIRONMENTS='{"sums": "verifiers_sums:Sums"}'

A prompt row ``{"prompt": [{"role": "user", "content": "what is 2 plus 3"}], "ground_truth": "5"}``
then runs as one ``SumTutor`` episode of that task; its reward is the verifiers reward. Verifiers'
own CLI runs the same environment against any OpenAI-compatible server:
``PYTHONPATH=examples vf-eval verifiers_sums --env.agent.harness.id null ...``.
"""

from __future__ import annotations

import re

import verifiers.v1 as vf
from pydantic import Field

from rlfleet.services.environment.verifiers_adapter import VerifiersEnvironment

SYSTEM_PROMPT = "Answer with the number. You may call the add tool."
RETRY = "Not quite. What is the sum?"
CONCISE_WORDS = 12


def correct_score(answer: str, reply: str) -> float:
    """1.0 when ``reply`` holds the integer ``answer``; raises ``ValueError`` when ``answer`` is not one."""
    expected = int(answer)
    return float(str(expected) in re.findall(r"-?\d+", reply))


def concise_score(reply: str) -> float:
    """1.0 for a reply of one to ``CONCISE_WORDS`` words."""
    return float(0 < len(reply.split()) <= CONCISE_WORDS)


class Calculator(vf.Toolset[vf.SharedToolsetConfig]):
    """The calculator the agent may call."""

    TOOL_PREFIX = None  # the tool is called "add", not "calculator_add"

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class SumData(vf.TaskData):
    answer: str = ""
    """The sum, as a whole number."""
    system_prompt: str | None = SYSTEM_PROMPT


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return correct_score(task.answer, trace.last_reply)

    @vf.reward(weight=0.5)
    async def concise(self, trace: vf.Trace) -> float:
        return concise_score(trace.last_reply)


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        for a, b in ((2, 3), (7, 5), (12, 30)):
            yield SumTask(SumData(prompt=f"what is {a} plus {b}", answer=str(a + b)), self.config.task)

    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        return [Calculator(vf.SharedToolsetConfig())]


class SumTutorConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"})
    rounds: int = Field(3, ge=1)
    """Answers the agent gets to give."""


class SumTutor(vf.Env[SumTutorConfig]):
    """The agent answers; a wrong answer is met with ``RETRY``, up to ``rounds`` answers."""

    async def run(self, task: SumTask, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as tutoring:
            reply = await tutoring.turn()
            for _ in range(self.config.rounds - 1):
                if reply.terminated or correct_score(task.data.answer, reply.last_reply):
                    break
                reply = await tutoring.turn(RETRY)


class Sums(VerifiersEnvironment):
    """``SumTutor`` episodes in rlfleet's environment service, played by verifiers' chat loop."""

    taskset_id = "verifiers_sums"


__all__ = ["Calculator", "SumTaskset", "SumTutor", "Sums"]

if __name__ == "__main__":  # how verifiers launches the calculator's MCP server
    Calculator.run()
