"""A guess-the-number game written as an OpenEnv environment (``openenv-core`` 0.3), and the two ways
rlfleet's environment service hosts it (``rlfleet.services.environment.openenv_adapter``).

The OpenEnv side knows nothing of rlfleet: ``GuessEnvironment`` is an ``openenv`` ``Environment``
with its ``GuessAction`` / ``GuessObservation``, served by OpenEnv's own server::

    python examples/openenv_guess.py --port 8000      # or: uvicorn --factory openenv_guess:app

The rlfleet side is two subclasses of the adapter, registered by import path (with ``examples`` on
``PYTHONPATH``)::

    RLFLEET_ENVIRONMENT_ENVIRONMENTS='{"guess": "openenv_guess:GuessInProcess",
                                       "guess_remote": "openenv_guess:GuessRemote"}'

``GuessInProcess`` runs the game inside the environment service; ``GuessRemote`` connects each
episode to the server at ``$OPENENV_GUESS_URL`` (default ``http://127.0.0.1:8000``). The secret is
the task's ``ground_truth`` (a dataset row's answer), passed to OpenEnv's ``reset`` as a keyword.
"""

from __future__ import annotations

import argparse
import os
import random
import re
from typing import Any, Optional
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from rlfleet.env import Task
from rlfleet.services.environment.openenv_adapter import OpenEnvEnvironment

HIGHEST = 100
WRONG_GUESS_REWARD = -0.1


class GuessAction(Action):
    """A guess, as the player wrote it: its last integer counts."""

    guess: str = Field(..., description="text ending with the guessed number")


class GuessObservation(Observation):
    """What the game says back."""

    feedback: str = Field(default="", description="the instructions, then 'higher', 'lower' or 'correct'")
    attempts: int = Field(default=0, description="guesses so far")


class GuessEnvironment(Environment):
    """Guess a number from 1 to ``HIGHEST``: "higher" or "lower" after each wrong guess (reward
    ``WRONG_GUESS_REWARD``), "correct" ends the game (reward 1)."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # all state is the instance's

    def __init__(self) -> None:
        super().__init__()
        self._secret = 0
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              secret: Optional[int] = None, **kwargs: Any) -> GuessObservation:
        self._secret = int(secret) if secret is not None else random.Random(seed).randint(1, HIGHEST)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(feedback=f"Guess a number from 1 to {HIGHEST}.", reward=None, done=False)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        numbers = re.findall(r"-?\d+", action.guess)
        guess = int(numbers[-1]) if numbers else None
        if guess == self._secret:
            return GuessObservation(feedback="correct", attempts=self._state.step_count, reward=1.0, done=True)
        feedback = "say a number" if guess is None else ("higher" if guess < self._secret else "lower")
        return GuessObservation(feedback=feedback, attempts=self._state.step_count, reward=WRONG_GUESS_REWARD)

    @property
    def state(self) -> State:
        return self._state


def app():
    """OpenEnv's server for the game (a factory: importing this module starts nothing)."""
    from openenv.core.env_server.http_server import create_app

    return create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)


class _Guess(OpenEnvEnvironment):
    """What both rlfleet registrations share: the action, the text shown, the secret from the task."""

    action_class = GuessAction
    observation_field = "feedback"

    def reset_kwargs(self, task: Task) -> dict[str, Any]:
        return {"secret": int(task.ground_truth)} if task.ground_truth.strip() else {}


class GuessInProcess(_Guess):
    """The game inside the environment service, one ``GuessEnvironment`` per episode."""

    openenv_class = GuessEnvironment


class GuessRemote(_Guess):
    """The game on an OpenEnv server (``$OPENENV_GUESS_URL``), one WebSocket session per episode."""

    @property
    def base_url(self) -> str:
        return os.environ.get("OPENENV_GUESS_URL", "http://127.0.0.1:8000")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    arguments = parser.parse_args()
    import uvicorn

    uvicorn.run(app(), host=arguments.host, port=arguments.port)
