"""verifiers environments (``verifiers`` 0.4, prime-rl's format), run unchanged as rlfleet environments.

A verifiers 0.4 environment (``verifiers.v1``: a ``Taskset`` of ``Task`` rows with ``@vf.reward`` /
``@vf.metric`` methods, its ``Toolset`` MCP servers, an ``Env`` that plays them with agents) owns the
loop: ``Env.run_episode(task, ModelContext(...))`` runs a *harness* (an agent program; the default
here is verifiers' own tool-calling chat loop, ``null``) whose every model call goes through
verifiers' interception server to an OpenAI-compatible endpoint, then scores the trace. That is the
entry point verifiers' own eval runner uses for one rollout, and the one used here, unchanged.
``VerifiersEnvironment`` is that endpoint, per rlfleet episode, turned inside out:

- one local HTTP server per environment-service process (127.0.0.1, an ephemeral port, aiohttp)
  serves ``POST /v1/chat/completions``; each episode's rollout runs in a background task with an
  ``EvalClientConfig`` pointing there. Its calls are told apart by the ``X-Session-ID`` header
  verifiers sends (the trace id, learnt from ``run_episode``'s ``on_trace`` before any call), not
  by a base URL per episode: verifiers keeps one HTTP client per distinct endpoint for as long as
  its interception server lives, which here is the whole service.
- ``reset``: the rollout's first chat-completions call is the opening: ``reset`` returns its
  ``messages`` and sets ``tools`` from its ``tools``.
- ``step``: the model's turn answers the pending call: the assistant message is the turn's text,
  its ``<tool_call>`` blocks (the chat template's format, ``rlfleet.env.tool_calls``) parsed into
  OpenAI ``tool_calls``, ``finish_reason`` ``length`` / ``tool_calls`` / ``stop`` (streamed as SSE
  when the call asks to stream). The next call's messages must be the previous call's, then exactly
  the assistant message answered (content and tool calls), then the observation (tool results,
  user turns): ``step`` returns that observation. Anything else (a rewritten history, an edited
  reply, a second conversation or agent on the same episode, an assistant message the model did not
  write, other tools) is ``VerifiersConversationDiverged``: such an episode could not be token-exact.
- when the rollout returns, the pending ``step`` returns ``done`` (``truncated`` when verifiers
  says the trace was cut: a turn limit, a ``length`` finish) with the trace's reward (verifiers'
  weighted sum of its ``@vf.reward`` s) and, in ``info``, each reward, each metric, the stop
  condition and the turns. A rollout that failed (verifiers recorded an error: a harness that
  exited badly, a reward that raised, a setup that failed) or that raised makes ``reset`` / ``step``
  raise ``VerifiersRolloutFailed`` quoting it: the service ends the episode (FAILED_PRECONDITION)
  and the collector retries or dead-letters the prompt. ``close`` cancels the rollout (verifiers
  kills the harness program and tears its runtime down) and drops the episode's calls.

Token-exact all the same: the endpoint never samples. Each turn is sampled by the collector through
the generation service from the episode's token history, which records the prompt, the sampled token
ids, their log-probs and the policy version of every call; the environment service renders the
observation the rollout sent into the tokens that follow (checking the chat template is
prefix-stable), so the trainer's sequence is prompt + sampled + observation tokens exactly. What the
rollout asks for per call (temperature, max_tokens, ...) cannot be honoured (the collector samples
with its own settings): it is recorded in each step's ``info`` as ``requested_sampling``. No token
usage is reported back (the prompt's token count is the service's to know).

Subclass it per verifiers environment and register the subclass by import path (the taskset's
module on ``PYTHONPATH``; the harness program runs with ``uv``, which the extra installs)::

    class Sums(VerifiersEnvironment):
        taskset_id = "verifiers_sums"   # the verifiers taskset (its importable module)
        harness_id = "null"             # verifiers' tool-calling chat loop (the default)

The environment's serving resources (its interception server, its shared tool servers) come up with
the first episode of a subclass and go down ``idle_shutdown_seconds`` after its last one closed. The
rlfleet task becomes a verifiers task (``make_task``): its prompt (a leading system message as the
``system_prompt``), its ground truth as the task data's ``answer`` field and the metadata entries
named like the task data's own fields. Not mapped: multi-agent episodes (one conversation is one
rlfleet episode), harnesses speaking other dialects than chat completions (Anthropic messages,
OpenAI responses), verifiers' own episode retries (the collector retries instead).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from typing import Any

from rlfleet.env import AssistantTurn, Environment, StepResult, Task

try:
    import verifiers.v1 as vf
    from verifiers.v1.clients.client import SESSION_ID_HEADER
except ImportError as exc:  # the extra is not installed
    raise ImportError(f"the verifiers adapter needs verifiers: pip install 'rlfleet[verifiers]' ({exc})") from exc

from rlfleet.services.common.background import BackgroundTasks  # noqa: E402 - after the extra's check
from rlfleet.services.environment.chat_endpoint import (  # noqa: E402 - after the extra's check
    SESSION_HEADER, Call, ChatEndpoint, ConversationDiverged, Exchange, acquire_endpoint, answer_turn,
    chat_completion, completion_events, continuation, release_endpoint, requested_sampling, rlfleet_messages,
    shorten)

log = logging.getLogger("rlfleet.environment.verifiers")
if SESSION_ID_HEADER != SESSION_HEADER:  # the endpoint routes calls by it
    raise ImportError(f"verifiers names its session header {SESSION_ID_HEADER!r}, the endpoint reads {SESSION_HEADER!r}")
API_KEY_VARIABLE = "RLFLEET_VERIFIERS_API_KEY"
"""The variable verifiers reads the endpoint's API key from; unset: "EMPTY" (the endpoint is on loopback
and routes by unguessable trace ids)."""


def _remove_port_files() -> None:
    """verifiers 0.4 starts a toolset's MCP server in a subprocess that writes its port to
    ``/tmp/vf-port-<uuid>`` (a fixed directory, not TMPDIR) and never removes that file: one left in
    ``/tmp`` per server. Its port read back, the file is removed here (the server reads it no more)."""
    from verifiers.v1.mcp import launch

    read_back = getattr(launch, "_read_back_port", None)
    if read_back is None or getattr(read_back, "removes_the_file", False):
        return  # another verifiers: nothing to mend, or mended already

    async def read_back_and_remove(runtime, path: str) -> int:
        try:
            return await read_back(runtime, path)
        finally:
            if getattr(runtime, "type", None) == "subprocess" and path.startswith("/tmp/vf-port-"):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    read_back_and_remove.removes_the_file = True
    launch._read_back_port = read_back_and_remove


_remove_port_files()


class VerifiersRolloutFailed(RuntimeError):
    """The verifiers rollout failed (verifiers recorded an error on it) or raised."""


VerifiersConversationDiverged = ConversationDiverged
"""The rollout's next model call does not continue the conversation as the model wrote it."""


# --- one verifiers Env per subclass, serving while its episodes run ---


class _Host:
    """A subclass's verifiers ``Env`` inside ``Env.serving()`` (its interception server and shared tool
    servers, held by a task of its own: a context manager is left by the task that entered it)."""

    def __init__(self, cls: type[VerifiersEnvironment]):
        self.cls = cls
        self.users = 0
        self.stopping = False
        self.broken = False
        """It stopped serving on its own: the next episode starts a new one."""
        self.env: Any = None
        self.endpoint: ChatEndpoint | None = None
        self._started: asyncio.Future | None = None
        self._serving: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._linger: asyncio.TimerHandle | None = None
        self._stopper = BackgroundTasks()  # a lingering host's stop, once idle: a failure is logged by name

    async def started(self) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        if shutil.which("uv") is None:
            log.warning("no uv on PATH: verifiers' chat harnesses run their program with uv (the verifiers extra "
                        "installs it into the virtualenv's bin)")
        self.endpoint = await acquire_endpoint()
        try:
            self.env = vf.load_environment(self.cls.env_config())
            ready = asyncio.get_running_loop().create_future()
            self._serving = asyncio.create_task(self._serve(ready), name=f"verifiers-{self.cls.__name__}")
            await ready
        except BaseException:
            endpoint, self.endpoint = self.endpoint, None
            await release_endpoint(endpoint)
            raise

    async def _serve(self, ready: asyncio.Future) -> None:
        try:
            async with self.env.serving():
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():  # the start failed: the episode starting it says why
                if isinstance(exc, asyncio.CancelledError):
                    ready.cancel()
                    raise
                ready.set_exception(exc)
                return
            self.broken = True
            if not isinstance(exc, asyncio.CancelledError):  # cancelled: the process is stopping
                log.error("the verifiers environment stopped serving", exc_info=exc)
            raise

    def hold(self) -> None:
        self.users += 1
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None

    async def release(self) -> None:
        self.users -= 1
        if self.users:
            return
        if self.cls.idle_shutdown_seconds <= 0 or self.broken:
            await self.stop()
        else:
            self._linger = asyncio.get_running_loop().call_later(self.cls.idle_shutdown_seconds, self._stop_later)

    def _stop_later(self) -> None:
        self._stopper.start(self.stop(), f"stop-idle-{self.cls.__name__}")

    async def stop(self) -> None:
        """Leave ``Env.serving()`` (a start in progress finishes first) and release the endpoint."""
        if self.stopping:
            return
        self.stopping = True
        if self._linger is not None:
            self._linger.cancel()
        key = (self.cls, asyncio.get_running_loop())
        if _hosts.get(key) is self:
            del _hosts[key]
        if self._started is not None:
            await asyncio.gather(asyncio.shield(self._started), return_exceptions=True)
        self._stop.set()
        serving, self._serving = self._serving, None
        try:
            if serving is not None:
                await asyncio.gather(serving, return_exceptions=True)
        finally:
            if self.endpoint is not None:
                endpoint, self.endpoint = self.endpoint, None
                await release_endpoint(endpoint)


_hosts: dict[tuple[type, asyncio.AbstractEventLoop], _Host] = {}


async def _acquire_host(cls: type[VerifiersEnvironment]) -> _Host:
    key = (cls, asyncio.get_running_loop())
    host = _hosts.get(key)
    if host is None or host.stopping or host.broken:
        host = _hosts[key] = _Host(cls)
    host.hold()
    try:
        await host.started()
    except BaseException:
        host.users -= 1
        if host.users == 0:  # a failed (or abandoned) start: nothing serves; the next episode starts afresh
            await host.stop()
        raise
    return host


# --- the rlfleet environment ---


class VerifiersEnvironment(Environment):
    """One episode of a verifiers environment; see the module docstring. Set ``taskset_id`` (or
    override ``env_config``) in a subclass."""

    taskset_id: str = ""
    """The verifiers taskset: its module name (importable, exporting its ``Taskset`` via ``__all__``)."""
    harness_id: str = "null"
    """The harness that plays the agent: ``null`` is verifiers' tool-calling chat loop (the taskset's
    MCP tools, no shell); any harness speaking OpenAI chat completions works."""
    env_id: str = ""
    """A verifiers ``Env`` to pair with the taskset; empty: the taskset's own, else ``SingleAgentEnv``."""
    agent_name: str = "agent"
    """The env config's agent seat (the one whose conversation is the episode)."""
    answer_field: str = "answer"
    """The task data field the rlfleet task's ground truth fills (when the data has it)."""
    model_name: str = "rlfleet-policy"
    """The model name the rollout's calls carry."""
    idle_shutdown_seconds: float = 60.0
    """How long the environment keeps serving (interception, shared tool servers) after its last
    episode closed; 0 stops it at once."""
    close_timeout_seconds: float = 30.0
    """The bound on a cancelled rollout's teardown (harness program, runtime) in ``close``."""

    def __init__(self) -> None:
        self._host: _Host | None = None
        self._exchange: Exchange | None = None
        self._rollout: asyncio.Task | None = None
        self._call: Call | None = None
        self._conversation: list[dict[str, Any]] = []
        self._turns = 0

    # --- what a subclass may override ---

    @classmethod
    def env_config(cls) -> Any:
        """The verifiers ``EnvConfig``: ``taskset_id`` (with ``env_id``), its agent seat played by
        ``harness_id`` in the local ``subprocess`` runtime (verifiers' default is a remote sandbox)."""
        if not cls.taskset_id:
            raise TypeError(f"{cls.__name__}: set taskset_id (the verifiers taskset), or override env_config")
        return vf.resolve_env_config({"id": cls.env_id, "taskset": {"id": cls.taskset_id},
                                      cls.agent_name: {"harness": {"id": cls.harness_id},
                                                       "runtime": {"type": "subprocess"}}})

    def make_task(self, task: Task, taskset: Any) -> Any:
        """The verifiers task for ``task``: the taskset's task type over its data type, with the prompt
        (a leading system message as ``system_prompt``; one user message as a plain string), the ground
        truth as ``answer_field`` and the metadata entries named like the data type's own fields."""
        task_type = type(taskset).task_type()
        data_type = task_type.data_type()
        own = set(data_type.model_fields) - set(vf.TaskData.model_fields)
        fields: dict[str, Any] = {key: value for key, value in task.metadata.items() if key in own}
        if self.answer_field in own and task.ground_truth:
            fields[self.answer_field] = task.ground_truth
        prompt = list(task.prompt)
        system = prompt.pop(0)["content"] if prompt and prompt[0]["role"] == "system" else None
        if taskset.system_prompt is not None:
            system = taskset.system_prompt
        if system is not None:
            fields["system_prompt"] = system
        opening: Any = prompt[0]["content"] if len(prompt) == 1 and prompt[0]["role"] == "user" else prompt
        return task_type(data_type(prompt=opening or None, **fields), taskset.config.task)

    @classmethod
    def is_serving(cls) -> bool:
        """Whether this environment's verifiers env is being served now (on any event loop of this process)."""
        return any(key[0] is cls for key in _hosts)

    @classmethod
    async def stop_serving(cls) -> None:
        """Stop this environment's serving resources on the running event loop now rather than
        ``idle_shutdown_seconds`` after its last episode closed (a script or a test ending); nothing
        while an episode is open."""
        host = _hosts.get((cls, asyncio.get_running_loop()))
        if host is not None and host.users == 0:
            await host.stop()

    # --- the rlfleet environment ---

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        self._host = await _acquire_host(type(self))
        self._exchange = Exchange()
        verifiers_task = self.make_task(task, self._host.env.taskset)
        context = vf.ModelContext(model=self.model_name, client=vf.EvalClientConfig(
            base_url=self._host.endpoint.base_url, api_key_var=API_KEY_VARIABLE))
        self._rollout = asyncio.create_task(self._host.env.run_episode(verifiers_task, context, on_trace=self._route))
        event = await self._next()
        if not isinstance(event, Call):
            raise VerifiersRolloutFailed(_failure(event) or "the rollout ended without calling the model")
        messages = rlfleet_messages(event.body["messages"], "the first model call")
        self.tools = list(event.body.get("tools") or [])
        self._call, self._conversation = event, messages
        return messages

    async def step(self, turn: AssistantTurn) -> StepResult:
        call, self._call = self._call, None
        if call is None:
            raise RuntimeError("step before reset, or after the rollout ended")
        self._turns += 1
        message, finish_reason = answer_turn(turn, f"call_{self._turns}")
        if not call.answer.done():
            call.answer.set_result(chat_completion(message, finish_reason, self.model_name))
        sampling = requested_sampling(call.body)
        info: dict[str, Any] = {"requested_sampling": json.dumps(sampling, sort_keys=True)} if sampling else {}
        event = await self._next()
        if not isinstance(event, Call):
            return self._final(event, info)
        observation = continuation(self._conversation, message, event.body["messages"])
        if list(event.body.get("tools") or []) != list(self.tools):
            raise VerifiersConversationDiverged("the next model call offers other tools than the first; the "
                                                "prompt was rendered with the first call's")
        self._call = event
        self._conversation = [*self._conversation, message, *observation]
        return StepResult(messages=observation, info=info)

    async def close(self) -> None:
        rollout, self._rollout = self._rollout, None
        exchange, self._exchange = self._exchange, None
        host, self._host = self._host, None
        self._call = None
        try:
            if exchange is not None:
                exchange.close()  # a call still waiting is refused at once
            if rollout is not None and not rollout.done():
                rollout.cancel()  # verifiers kills the harness program and stops its runtime
                await asyncio.wait({rollout}, timeout=self.close_timeout_seconds)
                if not rollout.done():
                    log.warning("a cancelled verifiers rollout is still tearing down after %g s",
                                self.close_timeout_seconds)
            if rollout is not None and rollout.done() and not rollout.cancelled():
                rollout.exception()  # retrieved: step reported it, or the episode was closed before
        finally:
            if exchange is not None and host is not None and host.endpoint is not None:
                for trace_id in exchange.trace_ids:
                    host.endpoint.routes.pop(trace_id, None)
            if host is not None:
                await host.release()

    # --- internals ---

    def _route(self, trace: Any) -> None:
        """``run_episode``'s ``on_trace``: a trace of this episode, minted before its first call."""
        self._exchange.trace_ids.add(trace.id)
        self._host.endpoint.routes[trace.id] = self._exchange

    async def _next(self) -> Call | Any:
        """The rollout's next model call, or its episode once it returned; raises what it raised, or
        the divergence the endpoint saw."""
        events = self._exchange.events
        if events.empty():
            upcoming = asyncio.ensure_future(events.get())
            try:
                await asyncio.wait({upcoming, self._rollout}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not upcoming.done():
                    upcoming.cancel()
            if upcoming.done() and not upcoming.cancelled():
                events.put_nowait(upcoming.result())
        while not events.empty():
            event = events.get_nowait()
            if isinstance(event, Exception):
                raise event  # a divergence: the cause of whatever the rollout did next
            if not self._rollout.done():
                return event
        try:
            return self._rollout.result()
        except asyncio.CancelledError:
            raise VerifiersRolloutFailed("the rollout was cancelled") from None
        except Exception as exc:
            raise VerifiersRolloutFailed(f"the rollout raised {type(exc).__name__}: {exc}") from exc

    def _final(self, episode: Any, info: dict[str, Any]) -> StepResult:
        """The step that ends the episode: the conversation's trace's reward, rewards and metrics."""
        if (failure := _failure(episode)) is not None:
            raise VerifiersRolloutFailed(failure)
        traces = [trace for trace in episode.traces if trace.id == self._exchange.caller] or episode.traces[-1:]
        if not traces:
            raise VerifiersRolloutFailed("the rollout returned no trace")
        (trace,) = traces
        info.update({f"reward/{name}": reward.score for name, reward in trace.rewards.items() if reward is not None})
        info.update({f"metric/{name}": value for name, value in trace.metrics.items() if value is not None})
        info.update(verifiers_reward=trace.reward, verifiers_turns=trace.num_turns)
        if trace.stop_condition is not None:
            info["verifiers_stop_condition"] = trace.stop_condition
        return StepResult(reward=float(trace.reward), done=not trace.is_truncated, truncated=trace.is_truncated,
                          info=info)


def _failure(episode: Any) -> str | None:
    """Why a finished verifiers episode failed (its errors and its traces', last first), or None."""
    if episode.ok:
        return None
    errors = [*episode.errors, *(error for trace in episode.traces for error in trace.errors)]
    if not errors:
        return "the rollout failed without recording an error"
    return "; ".join(f"{error.type}: {shorten(error.message, 1000)}" for error in reversed(errors[-4:]))


__all__ = ["API_KEY_VARIABLE", "VerifiersConversationDiverged", "VerifiersEnvironment", "VerifiersRolloutFailed",
           "answer_turn", "chat_completion", "completion_events", "continuation", "requested_sampling",
           "rlfleet_messages"]
