"""Numbered steps make the environment service's Step safe to retry: a turn sent again gets its first
answer (awaited while in flight) and the environment steps it once; turns out of order or repeated with
other tokens are refused."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.env import AssistantTurn, StepResult
from rlfleet.services.common.errors import FailedPrecondition
from rlfleet.services.environment.open_episodes import Episodes, OpenEpisodeLimits, StepTurn
from rlfleet.services.environment.rendering import ChatRenderer
from rlfleet.env import Task
from tests.environments import CounterEnv

LIMITS = OpenEpisodeLimits(max_turns=8, max_open_episodes=8, step_timeout_seconds=30, idle_episode_seconds=600)
TASK = Task(prompt=[{"role": "user", "content": "count"}])


class GatedCounterEnv(CounterEnv):
    """A CounterEnv whose steps wait for ``gate``; counts the steps it took."""

    gate: asyncio.Event
    stepped = 0

    async def step(self, turn: AssistantTurn) -> StepResult:
        type(self).stepped += 1
        await self.gate.wait()
        return await super().step(turn)


@pytest.fixture(scope="module")
def renderer(tiny_model_dir) -> ChatRenderer:
    return ChatRenderer.from_pretrained(str(tiny_model_dir))


def turn(number: int, token_ids=(5, 6, 7)) -> StepTurn:
    return StepTurn(token_ids=list(token_ids), text=None, finish_reason="stop", number=number)


def test_a_repeated_turn_gets_its_first_answer_and_steps_once(renderer):
    async def scenario():
        GatedCounterEnv.gate, GatedCounterEnv.stepped = asyncio.Event(), 0
        episodes = Episodes(renderer, {"gated": GatedCounterEnv}, LIMITS)
        await episodes.open("e", "gated", TASK)
        first = asyncio.create_task(episodes.step("e", turn(1)))
        await asyncio.sleep(0)
        retry_in_flight = asyncio.create_task(episodes.step("e", turn(1)))  # its answer was "lost"
        await asyncio.sleep(0)
        GatedCounterEnv.gate.set()
        answer, again = await first, await retry_in_flight
        late_retry = await episodes.step("e", turn(1))
        assert answer == again == late_retry and answer.reward == 1.0
        assert GatedCounterEnv.stepped == 1
        with pytest.raises(FailedPrecondition, match="turn 3 is out of order; 1 turns were answered, the next is turn 2"):
            await episodes.step("e", turn(3))
        with pytest.raises(FailedPrecondition, match="turn 1 was stepped with other tokens"):
            await episodes.step("e", turn(1, (9,)))
        second = await episodes.step("e", turn(2))
        assert second.reward == 2.0 and GatedCounterEnv.stepped == 2
        unchecked = await episodes.step("e", turn(0))  # no number: stepped as a new turn
        assert unchecked.reward == 3.0 and unchecked.done
        await episodes.close("e")

    asyncio.run(scenario())
