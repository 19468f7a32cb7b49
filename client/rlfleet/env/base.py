"""What a user subclasses to write a multi-turn environment: ``class MyEnv(rlfleet.env.Environment)``.

The shape is the one TorchRL's ``ChatEnv``, OpenEnv's ``reset``/``step`` and verifiers'
``MultiTurnEnv`` share: the environment opens an episode with chat messages, then answers each
assistant turn with more chat messages (the observation), a per-turn reward and whether the episode
is over. Everything is text and chat messages: tokenizing the observation with the model's chat
template, and keeping the sampled tokens as they were sampled, is the collector's job, not the
environment's.

One instance per episode: ``reset`` is called once, then ``step`` once per assistant turn until a
result says ``done`` or ``truncated``, then ``close``. Keep per-episode state on ``self``; share
expensive things (a sandbox, tool servers, a dataset) by passing them to ``__init__``.

Stdlib only: the SDK installs without pydantic, vLLM or transformers.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

ROLES = ("system", "user", "assistant", "tool")
"""The chat roles a message may have."""


@dataclass
class Task:
    """One problem to run an episode on."""

    prompt: list[dict[str, Any]]
    """The opening chat messages (``{"role": ..., "content": ...}``)."""
    ground_truth: str = ""
    """What the reward functions compare the answer with; the environment may ignore it."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Anything else the dataset carries for this task (an id, a difficulty, tool settings)."""


@dataclass
class AssistantTurn:
    """What the model produced in one turn."""

    text: str
    """The sampled tokens decoded, special tokens kept, less a trailing end-of-turn token (as a chat API
    returns the content); tool calls are parsed from it."""
    token_ids: list[int] = field(default_factory=list)
    """The sampled token ids, exactly as sampled (never re-tokenized from ``text``)."""
    finish_reason: str = "stop"
    """Why sampling stopped: ``"stop"`` (an end token or stop string) or ``"length"`` (the token limit)."""
    player: str = ""
    """Who sampled it: ``""`` the episode's own policy; else the player this environment named in the
    last ``StepResult.next_player`` (another run's policy: several policies in one episode)."""


@dataclass
class StepResult:
    """The environment's answer to one assistant turn."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    """The observation: chat messages to append after the assistant turn (``role`` "tool" or "user")."""
    reward: float | None = None
    """A reward for this turn; ``None`` leaves the rewarding to the reward functions."""
    done: bool = False
    """The episode ended on its own (the model answered, the game is over)."""
    truncated: bool = False
    """The episode was cut by a limit (turns, tool calls) before it ended on its own."""
    info: dict[str, Any] = field(default_factory=dict)
    """Counters and diagnostics, logged with the trajectory, never shown to the model."""
    next_player: str = ""
    """Who plays the next turn: ``""`` the episode's own policy; else a player of this environment (an
    opponent, a teacher), whose turn the policy of the run the collector's ``players`` setting maps it to
    samples. That turn is context to the episode's run, never trained on (docs/concepts/many-runs.md)."""


class Environment(abc.ABC):
    """A multi-turn environment; subclass it and write ``step`` (and ``reset`` if the opening
    messages are not the task's prompt). One instance runs one episode (see the module docstring)."""

    tools: Sequence[dict[str, Any]] = ()
    """OpenAI function-tool specs offered to the model (the chat template's ``tools=``); none by default."""

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        """Start the episode on ``task``; returns its opening chat messages (by default the prompt)."""
        return list(task.prompt)

    @abc.abstractmethod
    async def step(self, turn: AssistantTurn) -> StepResult:
        """Answer one assistant turn: the observation, a reward, and whether the episode is over."""

    def final_reward(self) -> float | None:
        """A reward for the whole episode, asked once it is over; ``None`` (the default) leaves it
        to the reward functions."""
        return None

    async def close(self) -> None:
        """Release what the episode holds; called once, however the episode ended. Does nothing by default."""

    async def __aenter__(self) -> Environment:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def check_messages(messages: object, where: str) -> list[dict[str, Any]]:
    """Check that ``messages`` is a list of chat messages (a known ``role``, a string ``content``);
    returns it. Raises ``ValueError`` starting with ``where`` and naming the message's index and problem."""
    if not isinstance(messages, list):
        raise ValueError(f"{where}: messages must be a list of dicts, not {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: message {index} must be a dict, not {type(message).__name__}")
        if "role" not in message:
            raise ValueError(f"{where}: message {index} has no 'role'")
        if message["role"] not in ROLES:
            raise ValueError(f"{where}: message {index} has role {message['role']!r}; the roles are {', '.join(ROLES)}")
        if "content" not in message:
            raise ValueError(f"{where}: message {index} ({message['role']}) has no 'content'")
        if not isinstance(message["content"], str):
            content_type = type(message["content"]).__name__
            role = message["role"]
            raise ValueError(f"{where}: message {index} ({role}) has content of type {content_type}, not str")
    return messages


def check_step_result(result: object, where: str) -> StepResult:
    """Check what a ``step`` returned: a ``StepResult`` with valid messages, a finite reward or
    ``None``, and boolean flags; returns it. Raises ``ValueError`` starting with ``where``."""
    if not isinstance(result, StepResult):
        raise ValueError(f"{where}: step must return a StepResult, not {type(result).__name__}")
    check_messages(result.messages, where)
    if result.reward is not None:
        if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)):
            raise ValueError(f"{where}: reward must be a number or None, not {type(result.reward).__name__}")
        if not math.isfinite(result.reward):
            raise ValueError(f"{where}: reward must be finite, not {result.reward}")
    for flag in ("done", "truncated"):
        if not isinstance(getattr(result, flag), bool):
            raise ValueError(f"{where}: {flag} must be a bool, not {type(getattr(result, flag)).__name__}")
    if not isinstance(result.info, dict):
        raise ValueError(f"{where}: info must be a dict, not {type(result.info).__name__}")
    if not isinstance(result.next_player, str) or len(result.next_player) > 128:
        raise ValueError(f"{where}: next_player must be a player's name (a str of at most 128 characters), "
                         f"not {result.next_player!r:.160}")
    return result
