"""Open episodes: one ``Environment`` instance each, answered with token-exact observations.

An episode holds its conversation as rendered so far (the opening messages, then each assistant turn
as sampled and its observation) and the tools offered; ``ChatRenderer`` turns the next observation
into the tokens that follow the sampled ones. Episodes are bounded in number (``max_open_episodes``),
in time per environment call (``step_timeout_seconds``), in turns (``max_turns``) and in idleness
(``close_idle``, run by the service's reaper).

An environment is user code: whatever it raises, or a call that outlives the timeout, ends *its*
episode (the instance is closed, the id forgotten) and the caller is told which episode and why;
the other episodes and the service go on. Environments must not block the event loop; the chat
template's rendering and the tokenizer run in worker threads, so health and other episodes answer
while a long conversation is rendered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, TypeVar

from rlfleet.env import AssistantTurn, Environment, Task, check_messages, check_step_result
from rlfleet.services.common.errors import FailedPrecondition, NotFound, ResourceExhausted, RlfleetError
from rlfleet.services.environment.rendering import ChatRenderer, TemplateNotPrefixStable

log = logging.getLogger("rlfleet.environment")
T = TypeVar("T")
_REMEMBERED_ENDINGS = 4096  # why recently ended episodes ended, for a clear NOT_FOUND


class EnvironmentFailed(FailedPrecondition):
    """An environment raised (or returned something invalid); its episode is ended."""


class EnvironmentTimedOut(RlfleetError):
    """An environment call outlived ``step_timeout_seconds``; its episode is ended."""

    code = "DEADLINE_EXCEEDED"


@dataclass(frozen=True)
class OpenEpisodeLimits:
    max_turns: int
    max_open_episodes: int
    step_timeout_seconds: float
    idle_episode_seconds: float


@dataclass(frozen=True)
class Opening:
    """What a sampler needs to start: the opening messages, their tokens and the tools offered."""

    messages: list[dict[str, Any]]
    prompt_token_ids: list[int]
    tools: list[dict[str, Any]]


@dataclass(frozen=True)
class StepTurn:
    """One assistant turn as sampled."""

    token_ids: list[int]
    text: str | None
    """What the environment reads; ``None``: the tokens decoded (special tokens kept) less a trailing
    end-of-turn token: the assistant message's content."""
    finish_reason: str
    number: int = 0
    """1 for the episode's first turn; 0: not checked (see ``Episodes.step``)."""
    player: str = ""
    """Who sampled it (``AssistantTurn.player``)."""


@dataclass(frozen=True)
class StepAnswer:
    observation: list[dict[str, Any]]
    observation_token_ids: list[int]
    """Empty once the episode is over."""
    reward: float | None
    done: bool
    truncated: bool
    info: dict[str, str]
    next_player: str = ""


@dataclass(eq=False)
class _Episode:
    episode_id: str
    environment: str
    task: Task
    opening: asyncio.Task[Opening] | None = None
    env: Environment | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation as rendered so far."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    over: bool = False
    stepping: bool = False
    last_step: tuple[StepTurn, asyncio.Future[StepAnswer]] | None = None
    """The last turn stepped and its answer (awaited by a retry of the same turn)."""
    last_used: float = 0.0

    @property
    def name(self) -> str:
        return f"episode {self.episode_id!r} (environment {self.environment!r})"


class Episodes:
    """The open episodes of one service; see the module docstring."""

    def __init__(
        self,
        renderer: ChatRenderer,
        factories: Mapping[str, Callable[[], Environment]],
        limits: OpenEpisodeLimits,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.renderer = renderer
        self.factories = dict(factories)
        self.limits = limits
        self.clock = clock
        self._open: dict[str, _Episode] = {}
        self._endings: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    async def open(self, episode_id: str, environment: str, task: Task) -> Opening:
        """Open an episode, or return the opening of the open episode with this id (same request)."""
        episode = self._open.get(episode_id)
        if episode is not None:
            if (episode.environment, episode.task) != (environment, task):
                raise FailedPrecondition(f"{episode.name} is open with another task; close it or pick another id")
            return await asyncio.shield(episode.opening)
        if environment not in self.factories:
            raise NotFound(f"environment {quoted(environment)} is not registered; the environments are: "
                           f"{', '.join(sorted(self.factories))}")
        if len(self._open) >= self.limits.max_open_episodes:
            raise ResourceExhausted(f"{len(self._open)} episodes are open, the service's max_open_episodes; "
                                    "close some (or wait for idle ones to be reaped)")
        episode = _Episode(episode_id, environment, task, last_used=self.clock())
        self._open[episode_id] = episode
        self._endings.pop(episode_id, None)
        episode.opening = asyncio.ensure_future(self._start(episode))
        return await asyncio.shield(episode.opening)

    async def _start(self, episode: _Episode) -> Opening:
        try:
            episode.env = await self._call(episode, "construction", self._construct(episode))
            messages = await self._call(episode, "reset", episode.env.reset(episode.task))
            self._check(episode, "reset", lambda: check_messages(messages, "reset"))
            episode.tools = self._check(episode, "tools", lambda: _json_tools(episode.env.tools))
            episode.messages = list(messages)
            _, prompt_token_ids = await asyncio.to_thread(self.renderer.prompt, episode.messages, episode.tools)
        except BaseException as exc:
            await self._end(episode, f"its opening failed: {type(exc).__name__}: {exc}")
            raise
        log.info("episode opened", extra={"episode_id": episode.episode_id, "environment": episode.environment})
        return Opening(list(messages), prompt_token_ids, episode.tools)

    async def _construct(self, episode: _Episode) -> Environment:
        return self.factories[episode.environment]()

    async def step(self, episode_id: str, turn: StepTurn) -> StepAnswer:
        """Answer one assistant turn of an open episode. A numbered turn sent again (a caller's retry after
        a lost answer) gets the answer of its first Step, awaited while it is in flight: the environment
        steps each turn once."""
        episode = self._get(episode_id)
        if episode.opening is None or not episode.opening.done():
            raise FailedPrecondition(f"{episode.name} is still opening; wait for OpenEpisode's answer")
        if turn.number and episode.last_step is not None and turn.number == episode.last_step[0].number:
            first, answer = episode.last_step
            if (first.token_ids, first.text, first.finish_reason) != (turn.token_ids, turn.text, turn.finish_reason):
                raise FailedPrecondition(f"{episode.name}: turn {turn.number} was stepped with other tokens; "
                                         "a repeated turn must be the same turn")
            return await asyncio.shield(answer)
        if turn.number and turn.number != episode.turns + 1:
            raise FailedPrecondition(f"{episode.name}: turn {turn.number} is out of order; {episode.turns} "
                                     f"turns were answered, the next is turn {episode.turns + 1}")
        if episode.over:
            raise FailedPrecondition(f"{episode.name} is over (done or truncated); close it")
        if episode.stepping:
            raise FailedPrecondition(f"a step of {episode.name} is in flight; steps of one episode go in order")
        episode.stepping = True
        answered: asyncio.Future[StepAnswer] = asyncio.get_running_loop().create_future()
        answered.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure nobody retried is fine
        episode.last_step = (turn, answered)
        try:
            answer = await self._step(episode, turn)
        except BaseException as exc:  # the episode's state is unknown: end it (cancellation included)
            await self._end(episode, f"its step failed: {type(exc).__name__}: {exc}")
            answered.set_exception(self._not_found(episode_id))  # a retry learns the episode ended, and why
            raise
        finally:
            episode.stepping = False
            episode.last_used = self.clock()
        answered.set_result(answer)
        return answer

    async def _step(self, episode: _Episode, turn: StepTurn) -> StepAnswer:
        if turn.text is None:  # what a chat API would return: the content, less the end-of-turn token
            _, message = await asyncio.to_thread(self.renderer.assistant_message, turn.token_ids)
            text = message["content"]
        else:
            text = turn.text
        assistant_turn = AssistantTurn(text=text, token_ids=list(turn.token_ids), finish_reason=turn.finish_reason,
                                       player=turn.player)
        result = await self._call(episode, "step", episode.env.step(assistant_turn))
        self._check(episode, "step", lambda: check_step_result(result, "step"))
        episode.turns += 1
        info = {str(key): str(value) for key, value in result.info.items()}
        truncated = result.truncated
        if not result.done and not truncated and episode.turns >= self.limits.max_turns:
            truncated = True
            info["truncated_by"] = "max_turns"
        episode.over = result.done or truncated
        observation_token_ids: list[int] = []
        if episode.over:
            _, assistant = self.renderer.assistant_message(turn.token_ids)
            episode.messages += [assistant, *result.messages]
        else:
            rendered = await asyncio.to_thread(self.renderer.observation, episode.messages, turn.token_ids,
                                               result.messages, episode.tools)
            episode.messages += [rendered.assistant_message, *result.messages]
            observation_token_ids = rendered.token_ids
        return StepAnswer(list(result.messages), observation_token_ids, result.reward, result.done, truncated, info,
                          "" if episode.over else result.next_player)

    async def close(self, episode_id: str) -> float | None:
        """Close an episode; the environment's final reward (``None`` when it gives none)."""
        episode = self._get(episode_id)
        if episode.stepping:
            raise FailedPrecondition(f"a step of {episode.name} is in flight; close it once the step answered")
        if episode.opening is not None and not episode.opening.done():
            await asyncio.wait({episode.opening})
            if episode_id not in self._open:  # its opening failed and ended it
                raise self._not_found(episode_id)
        try:
            final_reward = _final_reward(episode.env)
        except Exception as exc:
            log.warning("environment final_reward raised", exc_info=exc, extra={"episode_id": episode_id})
            raise EnvironmentFailed(f"{episode.name}: the environment's final_reward raised "
                                    f"{type(exc).__name__}: {exc}; the episode is closed") from exc
        finally:
            await self._end(episode, "it was closed")
        return final_reward

    async def close_idle(self) -> list[str]:
        """End the episodes not used for ``idle_episode_seconds``; their ids."""
        horizon = self.clock() - self.limits.idle_episode_seconds
        idle = [episode for episode in self._open.values()
                if episode.last_used < horizon and not episode.stepping and episode.opening.done()]
        for episode in idle:
            log.warning("closing an idle episode", extra={"episode_id": episode.episode_id,
                                                         "idle_seconds": self.limits.idle_episode_seconds})
            await self._end(episode, f"it was idle for {self.limits.idle_episode_seconds:g} s")
        return [episode.episode_id for episode in idle]

    async def close_all(self) -> None:
        for episode in list(self._open.values()):
            await self._end(episode, "the service stopped")

    def _get(self, episode_id: str) -> _Episode:
        episode = self._open.get(episode_id)
        if episode is None:
            raise self._not_found(episode_id)
        return episode

    def _not_found(self, episode_id: str) -> NotFound:
        if (why := self._endings.get(episode_id)) is not None:
            return NotFound(f"episode {episode_id!r} is not open: it was ended because {why}")
        return NotFound(f"episode {episode_id!r} is not open (never opened, or closed)")

    async def _call(self, episode: _Episode, what: str, call: Awaitable[T]) -> T:
        """An environment call, bounded in time; whatever it raises becomes ``EnvironmentFailed``."""
        timeout = self.limits.step_timeout_seconds
        try:
            return await asyncio.wait_for(call, timeout)
        except TimeoutError:
            raise EnvironmentTimedOut(f"{episode.name}: the environment's {what} took longer than "
                                      f"step_timeout_seconds ({timeout:g} s); the episode is ended") from None
        except Exception as exc:
            log.warning("environment %s raised", what, exc_info=exc, extra={"episode_id": episode.episode_id})
            raise EnvironmentFailed(f"{episode.name}: the environment's {what} raised "
                                    f"{type(exc).__name__}: {exc}; the episode is ended") from exc

    def _check(self, episode: _Episode, what: str, check: Callable[[], T]) -> T:
        try:
            return check()
        except (ValueError, TypeError) as exc:
            raise EnvironmentFailed(f"{episode.name}: the environment's {what} returned something invalid: "
                                    f"{exc}; the episode is ended") from exc

    async def _end(self, episode: _Episode, why: str) -> None:
        """Forget the episode and close its environment (bounded in time; a failure is logged)."""
        if self._open.get(episode.episode_id) is episode:
            del self._open[episode.episode_id]
            self._endings[episode.episode_id] = why
            while len(self._endings) > _REMEMBERED_ENDINGS:
                self._endings.popitem(last=False)
        env, episode.env = episode.env, None
        if env is None:
            return
        try:
            await asyncio.wait_for(env.close(), self.limits.step_timeout_seconds)
        except Exception as exc:  # the episode is over either way; its environment's bug is logged
            log.warning("environment close failed", exc_info=exc, extra={"episode_id": episode.episode_id})


def quoted(value: str, limit: int = 40) -> str:
    """``value`` as an error message shows what a request sent: its first ``limit`` characters and its length.
    A status's message travels in a trailer that clients cap at 16 KiB: echoing a huge value whole would turn
    the precise status into RESOURCE_EXHAUSTED "Stream removed"."""
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"


def _json_tools(tools: Any) -> list[dict[str, Any]]:
    tools = list(tools)
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise TypeError(f"tools[{index}] must be a dict (an OpenAI function-tool spec), not {type(tool).__name__}")
        json.dumps(tool)  # TypeError when it cannot travel as JSON
    return tools


def _final_reward(env: Environment) -> float | None:
    reward = env.final_reward()
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise ValueError(f"final_reward must be a finite number or None, not {reward!r}")
    return None if reward is None else float(reward)


__all__ = ["EnvironmentFailed", "EnvironmentTimedOut", "EpisodeLimits", "Episodes", "Opening", "StepAnswer",
           "Turn", "TemplateNotPrefixStable", "quoted"]
