"""Number duel: a two-player game for runs that share a fleet, each run's policy playing the other's.

An episode is three turns: the episode's own policy speaks, then its opponent (another run's policy:
the collector's ``players`` setting maps ``opponent`` to that run), then the own policy again. A
turn's number is what it says: the more of its characters are digits, the bigger (``digit_fraction``).
The episode's reward, for its own policy: the digit fraction of each of its two turns, plus
``WIN_BONUS`` when its second turn says a bigger number than the opponent's turn. The opponent's turn
is context to the episode's run (never trained on in its batch); the opponent's run plays its own
episodes, where the roles swap.

Registered by import path (with ``examples`` on ``PYTHONPATH``)::

    RLFLEET_ENVIRONMENT_ENVIRONMENTS='{"number_duel": "number_duel:NumberDuel"}'

``examples/train_two_players.py`` trains two runs on it against each other
(docs/concepts/many-runs.md, "Several policies in one episode").
"""

from __future__ import annotations

from typing import Any

from rlfleet.env import AssistantTurn, Environment, StepResult, Task

OPPONENT = "opponent"
"""The player the environment names for the other side's turn (a collector's ``players`` key)."""
WIN_BONUS = 0.5


def digit_fraction(text: str) -> float:
    """The share of the text's characters (whitespace left out) that are digits; 0 for none."""
    characters = [c for c in text if not c.isspace()]
    return sum(c in "0123456789" for c in characters) / len(characters) if characters else 0.0


class NumberDuel(Environment):
    """Own turn, the opponent's turn, own turn: see the module docstring."""

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        self.own: list[float] = []
        self.opponent: list[float] = []
        return list(task.prompt) or [{"role": "user", "content": "number duel: say a bigger number"}]

    async def step(self, turn: AssistantTurn) -> StepResult:
        said = digit_fraction(turn.text)
        if turn.player == OPPONENT:
            self.opponent.append(said)
            return StepResult(messages=[{"role": "user", "content": "your move"}])
        if turn.player:
            raise ValueError(f"number duel has one other player, {OPPONENT!r}; a turn came from {turn.player!r}")
        self.own.append(said)
        if len(self.own) == 1:
            return StepResult(messages=[{"role": "user", "content": "your opponent's move"}], reward=said,
                              next_player=OPPONENT)
        won = bool(self.opponent) and said > self.opponent[-1]
        return StepResult(reward=said + (WIN_BONUS if won else 0.0), done=True,
                          info={"won": int(won), "opponent_digit_fraction": self.opponent[-1] if self.opponent else 0.0})
