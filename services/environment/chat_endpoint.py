"""An OpenAI-compatible chat-completions endpoint for environments that own the loop and call the model.

An agent program (a verifiers harness, any OpenAI client) calls ``POST /v1/chat/completions``; the call
waits in its episode's ``Exchange`` until the episode's next sampled turn answers it. The endpoint never
samples: the collector samples every turn from the episode's token history, so the episode stays
token-exact; what this module checks is that each call continues the one conversation as the model
wrote it (``continuation``), since anything else could not be. One HTTP server per event loop
(127.0.0.1, an ephemeral port, aiohttp); a call goes to the episode named by its ``X-Session-ID``
header. The wire helpers (``answer_turn``, ``chat_completion``, ``completion_events``,
``rlfleet_messages``) are pure functions. Used by ``verifiers_adapter.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from aiohttp import web

from rlfleet.env import ROLES, AssistantTurn, parse_tool_calls

log = logging.getLogger("rlfleet.environment.chat_endpoint")
SESSION_HEADER = "X-Session-ID"
"""The header naming a call's episode (verifiers sends its trace id there)."""
_NOT_SAMPLING = frozenset({"messages", "tools", "model", "stream", "stream_options", "tool_choice",
                           "parallel_tool_calls"})
_MAX_BODY_BYTES = 256 << 20


class ConversationDiverged(RuntimeError):
    """A model call does not continue the conversation as the model wrote it."""


# --- the chat-completions wire (pure functions) ---


def answer_turn(turn: AssistantTurn, call_id_prefix: str) -> tuple[dict[str, Any], str]:
    """The assistant message a chat-completions API returns for ``turn`` and its finish reason: the
    ``<tool_call>`` blocks parsed into ``tool_calls`` (ids ``<prefix>_<i>``), the rest of the text as
    the content (None when empty); a malformed call stays in the content, as vLLM's Hermes parser
    leaves it."""
    calls = parse_tool_calls(turn.text).calls
    if not calls:
        message: dict[str, Any] = {"role": "assistant", "content": turn.text}
    else:
        content = turn.text
        for call in calls:
            content = content.replace(call.raw, "", 1)
        message = {"role": "assistant", "content": content.strip() or None, "tool_calls": [
            {"id": f"{call_id_prefix}_{index}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for index, call in enumerate(calls)]}
    if turn.finish_reason == "length":
        return message, "length"
    return message, "tool_calls" if calls else "stop"


def chat_completion(message: dict[str, Any], finish_reason: str, model: str) -> dict[str, Any]:
    """A ``chat.completion`` object with one choice."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "logprobs": None,
                                         "finish_reason": finish_reason}]}


def completion_events(completion: dict[str, Any]) -> list[bytes]:
    """``completion`` as the SSE events of a streamed answer: the whole message in one delta, the
    finish reason, ``[DONE]``."""
    (choice,) = completion["choices"]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant"}
    if message.get("content") is not None:
        delta["content"] = message["content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": index, **call} for index, call in enumerate(message["tool_calls"])]
    head = {key: completion[key] for key in ("id", "created", "model")}
    chunks = [{**head, "object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]},
              {**head, "object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}]}]
    return [f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks] + [b"data: [DONE]\n\n"]


def requested_sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a call asks of sampling (temperature, max_tokens, ...): every field but the conversation's."""
    return {key: value for key, value in body.items() if key not in _NOT_SAMPLING and value is not None}


def rlfleet_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """A call's chat messages as rlfleet messages: a known role ("developer" read as "system"), string
    content (text parts joined, None empty), and the keys a chat template reads (``name``,
    ``tool_call_id``, ``tool_calls``). Raises ``ConversationDiverged`` for what cannot be one."""
    if not isinstance(messages, list):
        raise ConversationDiverged(f"{where}: messages must be a list, not {type(messages).__name__}")
    converted = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConversationDiverged(f"{where}: message {index} is a {type(message).__name__}, not a dict")
        role = "system" if message.get("role") == "developer" else message.get("role")
        if role not in ROLES:
            raise ConversationDiverged(f"{where}: message {index} has role {role!r}; "
                                                f"the roles are {', '.join(ROLES)}")
        out = {"role": role, "content": _text(message.get("content"), f"{where}: message {index}")}
        out.update({key: message[key] for key in ("name", "tool_call_id", "tool_calls") if message.get(key)})
        converted.append(out)
    return converted


def continuation(previous: list[dict[str, Any]], answered: dict[str, Any], messages: Any,
                 where: str = "the next model call") -> list[dict[str, Any]]:
    """The observation in ``messages`` (a call's messages, as rlfleet messages): what follows the
    previous call's messages and the assistant message answered to it. Raises
    ``ConversationDiverged`` naming the first difference when ``messages`` do not continue
    that conversation, or add an assistant message the model did not write."""
    messages = rlfleet_messages(messages, where)
    for index, (before, now) in enumerate(zip(previous, messages)):
        if _identity(before) != _identity(now):
            raise ConversationDiverged(
                f"{where} rewrote message {index} of the conversation ({_brief(_identity(before))} became "
                f"{_brief(_identity(now))}); a token-exact episode only grows")
    if len(messages) <= len(previous):
        raise ConversationDiverged(f"{where} has {len(messages)} messages, the conversation "
                                            f"{len(previous)} and the model's reply after them")
    echoed = messages[len(previous)]
    if _identity(echoed) != _identity(answered):
        raise ConversationDiverged(f"{where} sent back {_brief(_identity(echoed))} as the model's reply, "
                                            f"which was {_brief(_identity(answered))}")
    observation = messages[len(previous) + 1:]
    for index, message in enumerate(observation, start=len(previous) + 1):
        if message["role"] == "assistant":
            raise ConversationDiverged(f"{where}: message {index} is an assistant message the model "
                                                "did not write")
    return observation


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" for part in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise ConversationDiverged(f"{where}: content other than text ({type(content).__name__}) "
                                        "cannot be rendered into tokens here")


def shorten(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters: an error's text travels in a gRPC trailer (16 KiB at most)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _brief(value: Any) -> str:
    return shorten(repr(value))


def _identity(message: dict[str, Any]) -> tuple:
    """What must not change about a message once sent: role, text, tool call ids, names and arguments."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):
                arguments = json.loads(arguments)
        calls.append((call.get("id"), function.get("name"), json.dumps(arguments, sort_keys=True)))
    text = message.get("content")
    return (message.get("role"), text if isinstance(text, str) else _text(text, "a message"),
            message.get("tool_call_id"), tuple(calls))


# --- the endpoint: one HTTP server per event loop, routing calls to episodes by trace id ---


@dataclass(eq=False)
class Call:
    """One chat-completions call of a rollout, answered by the adapter's next ``step``."""

    body: dict[str, Any]
    answer: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Exchange:
    """The model calls of one episode: a queue the adapter reads, one conversation (one trace)."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[Call | Exception] = asyncio.Queue()
        self.trace_ids: set[str] = set()
        self.caller: str | None = None
        """The trace whose calls are the episode (the first to call)."""
        self.last: Call | None = None
        self.closed = False

    def submit(self, trace_id: str, body: dict[str, Any]) -> Call:
        if self.closed:
            raise Refused(410, "the rlfleet episode is closed")
        if self.caller is None:
            self.caller = trace_id
        elif trace_id != self.caller:
            raise self._diverged(f"a second agent (trace {trace_id}) called the model; an rlfleet episode is "
                                 f"one conversation (trace {self.caller})")
        last = self.last
        if last is not None and last.body == body:
            return last  # a retry of the same call: the same answer
        if last is not None and not last.answer.done():
            raise self._diverged("the rollout made a model call while its previous one was unanswered; an "
                                 "rlfleet episode is one conversation, one call at a time")
        self.last = Call(body)
        self.events.put_nowait(self.last)
        return self.last

    def _diverged(self, why: str) -> Refused:
        self.events.put_nowait(ConversationDiverged(why))
        return Refused(409, why)

    def close(self) -> None:
        self.closed = True
        if self.last is not None and not self.last.answer.done():
            self.last.answer.set_exception(Refused(410, "the rlfleet episode is closed"))
            self.last.answer.exception()  # retrieved here: the call may be gone already


class ChatEndpoint:
    """``POST /v1/chat/completions`` on 127.0.0.1, an ephemeral port; a call goes to the episode whose
    rollout minted the trace named by its ``X-Session-ID`` header."""

    def __init__(self) -> None:
        self.routes: dict[str, Exchange] = {}
        self.users = 0
        self.started: asyncio.Future | None = None
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    async def start(self) -> None:
        app = web.Application(client_max_size=_MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_route("*", "/{tail:.*}", self._unsupported)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        log.info("chat-completions endpoint up", extra={"url": self.base_url})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        exchange = self.routes.get(request.headers.get(SESSION_HEADER, ""))
        if exchange is None:
            return _error(404, f"no open rlfleet episode has the trace named by {SESSION_HEADER}")
        try:
            body = await request.json()
        except ValueError as exc:
            return _error(400, f"the body is not JSON: {exc}")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(400, "a chat-completions body needs a messages list")
        try:
            call = exchange.submit(request.headers[SESSION_HEADER], body)
            completion = await asyncio.shield(call.answer)
        except Refused as refused:
            return _error(refused.status, str(refused))
        if not body.get("stream"):
            return web.json_response(completion)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for event in completion_events(completion):
            await response.write(event)
        await response.write_eof()
        return response

    async def _unsupported(self, request: web.Request) -> web.Response:
        return _error(404, f"{request.method} {request.path}: the rlfleet endpoint serves POST "
                           "/v1/chat/completions only (a harness speaking another dialect cannot run here)")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=status)


_endpoints: dict[asyncio.AbstractEventLoop, ChatEndpoint] = {}


async def acquire_endpoint() -> ChatEndpoint:
    loop = asyncio.get_running_loop()
    endpoint = _endpoints.get(loop)
    if endpoint is None:
        endpoint = _endpoints[loop] = ChatEndpoint()
        endpoint.started = asyncio.ensure_future(endpoint.start())
    endpoint.users += 1
    try:
        await asyncio.shield(endpoint.started)
    except BaseException:
        await release_endpoint(endpoint)
        raise
    return endpoint


async def release_endpoint(endpoint: ChatEndpoint) -> None:
    endpoint.users -= 1
    if endpoint.users == 0:
        loop = asyncio.get_running_loop()
        if _endpoints.get(loop) is endpoint:
            del _endpoints[loop]
        await asyncio.gather(asyncio.shield(endpoint.started), return_exceptions=True)
        await endpoint.stop()
