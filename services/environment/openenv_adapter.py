"""OpenEnv environments, run unchanged as rlfleet environments: in-process or through their server.

An OpenEnv (``openenv-core`` 0.3) environment is ``reset(**kwargs)`` / ``step(action)`` returning
pydantic observations (``done``, ``reward`` and the environment's own fields); its server
(``create_app``) serves one instance per WebSocket session, which its ``EnvClient`` speaks to.
``OpenEnvEnvironment`` hosts one such instance per rlfleet episode, either

- in-process (``openenv_class``: the OpenEnv ``Environment`` class, or a function of no arguments
  making one): built, reset, stepped and closed on one worker thread of its own, as OpenEnv's
  server does (thread-bound libraries such as Playwright need that); an environment that overrides
  ``reset_async`` / ``step_async`` is awaited on the event loop instead, as there; or
- remotely (``base_url``: a running OpenEnv server, ``http://host:port``): one WebSocket session
  per episode, through OpenEnv's ``GenericEnvClient`` (plain dicts: the environment's package need
  not be installed) or the environment's own ``client_class``.

The mapping, the same both ways (the observation is what OpenEnv's server sends: its fields without
``done``, ``reward`` and ``metadata``):

- ``reset``: the task's prompt, then the reset observation rendered as one message. OpenEnv's
  ``reset`` gets ``reset_kwargs(task)`` (none by default), less the keywords its signature does not
  take (what OpenEnv's server does too).
- ``step``: the model's text (the service hands environments the assistant message's content; a
  trailing end-of-turn token in text from elsewhere is left out by ``action_text``: an OpenEnv
  environment expects what a chat API returns) goes into the action (``make_action``: the action class's one required
  ``str`` field, or ``action_field``); the observation comes back as one ``observation_role``
  message (``render``: the ``observation_field``'s text, else the fields as JSON), with the
  observation's ``reward`` and ``done``. OpenEnv has no truncation: ``truncated`` stays False (the
  service's ``max_turns`` still cuts).

Subclass it per OpenEnv environment and register the subclass by import path (the service builds
environments with no arguments)::

    class Echo(OpenEnvEnvironment):
        openenv_class = EchoEnvironment          # or: base_url = "http://127.0.0.1:8000"
        action_class = EchoAction                # the model's text -> EchoAction(message=text)
        observation_field = "echoed_message"

A server that cannot be reached, that drops the connection or that does not answer within
``message_timeout_seconds`` raises ``OpenEnvConnectionError`` naming it (the service ends the
episode: FAILED_PRECONDITION); what the server reports (a bad action, the environment raising)
comes as OpenEnv's ``RuntimeError("Server error: ...")``. Not mapped: OpenEnv's MCP tool
environments (``CallToolAction``) to rlfleet's tool calls, and rubrics beyond the per-step reward.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from rlfleet.env import AssistantTurn, Environment, StepResult, Task

try:
    from openenv.core.env_server.interfaces import Environment as OpenEnvBase
except ImportError as exc:  # the extra is not installed
    raise ImportError(f"the OpenEnv adapter needs openenv-core: pip install 'rlfleet[openenv]' ({exc})") from exc

_NOT_SHOWN = ("done", "reward", "metadata")
"""Observation fields that are not the observation proper (OpenEnv's server leaves them out too)."""


class OpenEnvConnectionError(ConnectionError):
    """An OpenEnv server could not be reached, dropped the episode's connection or did not answer in time."""


class OpenEnvEnvironment(Environment):
    """One episode of an OpenEnv environment; see the module docstring. Set ``openenv_class`` or
    ``base_url`` (and ``action_class`` or ``action_field``) in a subclass."""

    openenv_class: Callable[[], Any] | None = None
    """In-process: the OpenEnv ``Environment`` class (or a function of no arguments making one)."""
    base_url: str | None = None
    """Remote: the OpenEnv server (``http://host:port`` or ``ws://host:port``); one session per episode."""
    client_class: type | None = None
    """Remote: the environment's own ``EnvClient`` subclass; None: OpenEnv's ``GenericEnvClient``."""
    action_class: type | None = None
    """The environment's ``Action`` class; needed in-process (its ``step`` gets this type)."""
    action_field: str | None = None
    """The action field the model's text goes into; None: the action class's one required ``str`` field."""
    observation_field: str | None = None
    """The observation field shown to the model as text; None: all its fields, as JSON."""
    observation_role: str = "user"
    """The role of the observation's message (``"user"`` or ``"tool"``)."""
    connect_timeout_seconds: float = 10.0
    """Remote: the bound on opening the WebSocket."""
    message_timeout_seconds: float = 60.0
    """Remote: the bound on one reset or step answer (keep it under the service's ``step_timeout_seconds``)."""
    end_of_turn_markers: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>",
                                            "<|end_of_text|>", "</s>")
    """End-of-turn tokens (as text) that ``action_text`` takes off the end of a turn."""

    def __init__(self) -> None:
        if (self.openenv_class is None) == (self.base_url is None):
            raise TypeError(f"{type(self).__name__}: set exactly one of openenv_class (in-process) "
                            "and base_url (an OpenEnv server)")
        if self.openenv_class is not None and self.action_class is None:
            raise TypeError(f"{type(self).__name__}: an in-process OpenEnv environment needs action_class")
        if self.action_class is None and self.action_field is None:
            raise TypeError(f"{type(self).__name__}: set action_class or action_field")
        self._env: Any = None
        self._client: Any = None
        self._executor: ThreadPoolExecutor | None = None

    # --- what a subclass may override ---

    def reset_kwargs(self, task: Task) -> dict[str, Any]:
        """The keywords for OpenEnv's ``reset`` (``seed``, ``episode_id`` or the environment's own);
        none by default. Keywords its ``reset`` does not take are dropped."""
        return {}

    def action_text(self, turn: AssistantTurn) -> str:
        """What the model wrote, as a chat API would return it: the turn's text less one trailing
        ``end_of_turn_markers`` token."""
        for marker in self.end_of_turn_markers:
            if turn.text.endswith(marker):
                return turn.text[: -len(marker)]
        return turn.text

    def make_action(self, turn: AssistantTurn) -> Any:
        """The action for the model's turn: ``action_text`` in ``action_field`` (or the action class's
        one required ``str`` field), as an ``action_class`` (or, remote without one, a dict)."""
        field = self.action_field or _text_field(self.action_class)
        if self.action_class is None:
            return {field: self.action_text(turn)}
        return self.action_class(**{field: self.action_text(turn)})

    def render(self, observation: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat messages showing an observation (its fields without done, reward, metadata):
        ``observation_field``'s text, else the fields as JSON; none when that is empty."""
        if self.observation_field is not None:
            if self.observation_field not in observation:
                raise KeyError(f"the observation has no field {self.observation_field!r}; "
                               f"its fields: {', '.join(observation) or 'none'}")
            value = observation[self.observation_field]
            text = value if isinstance(value, str) else json.dumps(value, default=str)
        else:
            text = json.dumps(observation, default=str) if observation else ""
        return [{"role": self.observation_role, "content": text}] if text else []

    # --- the rlfleet environment ---

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        kwargs = self.reset_kwargs(task)
        if self.openenv_class is not None:
            observation, _, _ = await self._reset_in_process(kwargs)
        else:
            observation, _, _ = await self._remote("reset", self._reset_remote(kwargs))
        return [*task.prompt, *self.render(observation)]

    async def step(self, turn: AssistantTurn) -> StepResult:
        action = self.make_action(turn)
        if self._env is not None:
            observation, reward, done = await self._step_in_process(action)
        elif self._client is not None:
            observation, reward, done = await self._remote("step", self._client.step(action))
        else:
            raise RuntimeError("step before reset")
        return StepResult(messages=self.render(observation), reward=None if reward is None else float(reward),
                          done=bool(done))

    async def close(self) -> None:
        env, self._env = self._env, None
        client, self._client = self._client, None
        executor, self._executor = self._executor, None
        try:
            if env is not None:
                await self._on_thread(executor, env.close)
            if client is not None:
                await client.close()  # best effort: OpenEnv's disconnect swallows transport errors
        finally:
            if executor is not None:
                executor.shutdown(wait=False)

    # --- in-process ---

    async def _reset_in_process(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], Any, bool]:
        factory = type(self).openenv_class  # through the class: a plain function stays unbound
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"openenv-{type(self).__name__}")
        self._env = await self._on_thread(self._executor, factory)
        if _overrides(self._env, "reset_async"):
            observation = await self._env.reset_async(**_accepted(self._env.reset_async, kwargs))
        else:
            observation = await self._on_thread(self._executor, self._env.reset, **_accepted(self._env.reset, kwargs))
        return _split(observation)

    async def _step_in_process(self, action: Any) -> tuple[dict[str, Any], Any, bool]:
        if _overrides(self._env, "step_async"):
            return _split(await self._env.step_async(action))
        return _split(await self._on_thread(self._executor, self._env.step, action))

    @staticmethod
    async def _on_thread(executor: ThreadPoolExecutor, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(executor, lambda: call(*args, **kwargs))

    # --- remote ---

    async def _reset_remote(self, kwargs: dict[str, Any]) -> Any:
        if self.client_class is None:
            from openenv.core.generic_client import GenericEnvClient as client_class
        else:
            client_class = self.client_class
        self._client = client_class(base_url=self.base_url, connect_timeout_s=self.connect_timeout_seconds,
                                    message_timeout_s=self.message_timeout_seconds)
        await self._client.connect()
        return await self._client.reset(**kwargs)

    async def _remote(self, what: str, call: Any) -> tuple[dict[str, Any], Any, bool]:
        """An OpenEnv client call; transport failures become ``OpenEnvConnectionError`` naming the server."""
        from websockets.exceptions import WebSocketException

        try:
            result = await call
        except (OSError, TimeoutError, WebSocketException) as exc:  # ConnectionError is an OSError
            raise OpenEnvConnectionError(f"the OpenEnv server at {self.base_url}: {what} failed: "
                                         f"{type(exc).__name__}: {exc}") from exc
        return _fields(result.observation), result.reward, result.done


def _fields(observation: Any) -> dict[str, Any]:
    """An observation's own fields: a typed observation's or a generic client's dict, less done/reward/metadata."""
    data = observation.model_dump() if hasattr(observation, "model_dump") else dict(observation)
    return {key: value for key, value in data.items() if key not in _NOT_SHOWN}


def _split(observation: Any) -> tuple[dict[str, Any], Any, bool]:
    return _fields(observation), observation.reward, observation.done


def _overrides(env: Any, method: str) -> bool:
    """Whether an OpenEnv environment has its own async ``reset_async`` / ``step_async`` (OpenEnv's
    defaults call the sync method, which then belongs on the environment's thread)."""
    own = getattr(type(env), method, None)
    return own is not None and own is not getattr(OpenEnvBase, method)


def _accepted(function: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    parameters = inspect.signature(function).parameters.values()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return dict(kwargs)
    names = {parameter.name for parameter in parameters}
    return {key: value for key, value in kwargs.items() if key in names}


def _text_field(action_class: type) -> str:
    """The action class's one required ``str`` field; ``TypeError`` when it has none or several."""
    fields = getattr(action_class, "model_fields", {})
    text = [name for name, info in fields.items() if info.is_required() and info.annotation is str]
    if len(text) != 1:
        raise TypeError(f"{action_class.__name__} has {len(text)} required str fields ({', '.join(text) or 'none'}) "
                        f"among {', '.join(fields) or 'none'}: set action_field, or override make_action")
    return text[0]


__all__ = ["OpenEnvConnectionError", "OpenEnvEnvironment"]
