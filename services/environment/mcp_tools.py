"""Tools from MCP servers, for a model's tool calls: connect to the servers of a config, list their
tools in the chat template's format, call them, and turn every outcome into text for the model.

Tool names: the model sees each tool under the name its server gives it (``add``, not
``calc.add``): chat formats restrict function names (OpenAI's ``^[a-zA-Z0-9_-]{1,64}$`` has no
dot), and models are trained on plain names. So two servers may not offer the same name: connecting
refuses such a pair, naming both servers. ``ToolSpec.server`` says where each tool comes from.

Whose fault decides how a failure surfaces:
- the model's (an unknown tool, arguments that are not an object or do not match the tool's input
  schema, a tool that raises or reports ``is_error``, a call past ``call_timeout_seconds``, a server
  that died mid-episode): ``ToolOutput(ok=False, error=<one sentence>)``, never an exception, so the
  episode goes on and the model reads what went wrong;
- the host's (a server that cannot be started or reached, or fails the handshake, at connect; two
  servers offering one tool name): ``MCPServerUnavailable`` / ``ToolNameCollision``, naming the
  server(s) and why;
- a server breaking the protocol mid-run (a malformed result, structured content against its own
  output schema): the SDK's ``pydantic.ValidationError`` / ``RuntimeError`` propagate, as bugs do.

Each server's transport and session live in an asyncio task of their own: the SDK's transports run
task groups, and a transport that fails (an HTTP server gone: connection refused) cancels the task
that entered them. Entered in the caller's task, that would cancel the episode; in the owner task,
it ends that server's connection only, and its calls answer ``ok=False`` naming the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Sequence

import anyio
import httpx2
import jsonschema
import mcp_types
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlfleet.services.common.errors import FailedPrecondition, Unavailable

log = logging.getLogger(__name__)

_CLOSE_SECONDS = 15.0  # a graceful close: the stdio transport's own escalation takes at most ~7 s
_MAX_LIST_PAGES = 100  # a server whose tools/list cursor never ends cannot hang the connect

# What an unreachable, refusing or dying server raises out of the SDK's transports and session, and
# nothing else: each is a fact about the server, reported as such; anything else is a bug, raised.
_SERVER_ERRORS = (
    OSError,  # stdio: the command cannot be spawned (FileNotFoundError, PermissionError), a broken pipe
    httpx2.HTTPError,  # http: connection refused or reset, a read cut mid-stream, a 4xx/5xx status
    MCPError,  # the protocol: the connection closed, an error answer to initialize or tools/list
    anyio.BrokenResourceError,  # a transport stream closed under a send
    anyio.ClosedResourceError,
    ValidationError,  # the server answered the handshake with something that is not MCP
)


class MCPServerUnavailable(Unavailable):
    """An MCP server of the config cannot be started, reached or handshaken; the message names it."""


class ToolNameCollision(FailedPrecondition):
    """Two MCP servers of the config offer a tool of the same name; the message names both."""


class MCPServerSpec(BaseModel):
    """One MCP server whose tools the model may call: a command to start (stdio) or a URL (HTTP)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    """Names the server in errors and in ``ToolSpec.server``; unique within a config."""
    command: list[str] | None = None
    """Stdio transport: the program and its arguments, started at connect, stopped at close."""
    env: dict[str, str] | None = None
    """Stdio only: variables set for the server, over the SDK's minimal inherited environment (HOME,
    LOGNAME, PATH, SHELL, TERM, USER): nothing else of the host's environment reaches it."""
    cwd: str | None = None
    """Stdio only: the server's working directory (the host's by default)."""
    url: str | None = None
    """Streamable HTTP transport: the server's endpoint (``MCPServer`` serves ``/mcp``)."""
    connect_timeout_seconds: float = Field(30.0, gt=0)
    """Start (stdio), handshake and tool listing; past it the connect fails naming the server."""
    call_timeout_seconds: float = Field(30.0, gt=0)
    """One tool call; past it the call answers ``ok=False`` and the server is asked to cancel it (the
    SDK bounds that request by 5 s more, reached only when the transport is wedged)."""
    max_result_bytes: int = Field(64 * 2**10, ge=1)
    """UTF-8 bytes kept of one call's output (or error); the rest is cut, and a marker says how much."""

    @model_validator(mode="after")
    def _one_transport(self) -> MCPServerSpec:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r}: give exactly one of `command` (stdio) or `url` (HTTP)")
        if self.command is not None and (not self.command or not self.command[0]):
            raise ValueError(f"MCP server {self.name!r}: `command` needs a program")
        if self.url is not None and (self.env is not None or self.cwd is not None):
            raise ValueError(f"MCP server {self.name!r}: `env` and `cwd` apply to a `command` only")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"MCP server {self.name!r}: `url` must be http:// or https://, not {self.url!r}")
        return self


@dataclass(frozen=True)
class ToolSpec:
    """One tool as the model sees it."""

    name: str
    description: str
    input_schema: dict[str, Any]
    """JSON Schema of the arguments object, as the server declares it."""
    server: str
    """``MCPServerSpec.name`` of the server that offers it."""

    def as_openai_tool(self) -> dict[str, Any]:
        """The OpenAI / Hugging Face chat-template function-tool format."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.input_schema},
        }


@dataclass(frozen=True)
class ToolOutput:
    """How one tool call ended, as the model will read it."""

    ok: bool
    text: str
    """The tool's output: its text contents joined, other contents described; empty when not ok."""
    error: str | None
    """Why it is not ok, a short sentence for the model; ``None`` when ok."""


def _failed(error: str) -> ToolOutput:
    return ToolOutput(ok=False, text="", error=error)


class MCPTools:
    """Open sessions to several MCP servers; ``async with MCPTools(specs) as tools`` or
    ``tools = await MCPTools.connect(specs)`` … ``await tools.aclose()``. Calls may run concurrently."""

    def __init__(self, specs: Sequence[MCPServerSpec]):
        names = [spec.name for spec in specs]
        if duplicates := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"MCP server names must be unique; repeated: {duplicates}")
        self._connections = {spec.name: _Connection(spec) for spec in specs}
        self._tools: dict[str, ToolSpec] = {}
        self._validators: dict[str, jsonschema.protocols.Validator | None] = {}

    @classmethod
    async def connect(cls, specs: Sequence[MCPServerSpec]) -> MCPTools:
        """Connect to every server and list its tools; raises if any cannot (none is left open)."""
        tools = cls(specs)
        await tools.__aenter__()
        return tools

    async def __aenter__(self) -> MCPTools:
        connections = list(self._connections.values())
        try:
            outcomes = await asyncio.gather(*(c.open() for c in connections), return_exceptions=True)
            if failures := [outcome for outcome in outcomes if isinstance(outcome, BaseException)]:
                if all(isinstance(failure, MCPServerUnavailable) for failure in failures):
                    raise MCPServerUnavailable("; ".join(str(failure) for failure in failures))
                raise next(f for f in failures if not isinstance(f, MCPServerUnavailable))
            for connection in connections:
                for tool in connection.tools:
                    self._add_tool(tool, connection.spec.name)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every session and stop every stdio server (its whole process group)."""
        outcomes = await asyncio.gather(*(c.close() for c in self._connections.values()), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    def _add_tool(self, tool: mcp_types.Tool, server: str) -> None:
        if (other := self._tools.get(tool.name)) is not None:
            raise ToolNameCollision(
                f"tool {tool.name!r} is offered by both MCP servers {other.server!r} and {server!r}; "
                "a model sees tools by name, so each name must come from one server"
            )
        self._tools[tool.name] = ToolSpec(tool.name, tool.description or "", dict(tool.input_schema), server)
        self._validators[tool.name] = _arguments_validator(tool, server)

    def list(self) -> list[ToolSpec]:
        """Every tool of every server, in config order, then in each server's order."""
        return list(self._tools.values())

    def as_openai_tools(self) -> list[dict[str, Any]]:
        """``list()`` in the OpenAI / Hugging Face function-tool format (a chat template's ``tools=``)."""
        return [tool.as_openai_tool() for tool in self._tools.values()]

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutput:
        """Call a tool; whatever the model got wrong comes back as ``ok=False`` with a sentence."""
        tool = self._tools.get(name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            return _failed(f"There is no tool named {_echo(name)}; the tools are: {known}.")
        if not isinstance(arguments, dict):
            return _failed(f"The arguments of {name} must be a JSON object, not {type(arguments).__name__}.")
        validator = self._validators[name]
        if validator is not None and (problem := jsonschema.exceptions.best_match(validator.iter_errors(arguments))):
            # The message quotes the offending value, which the model wrote: it may be long.
            where = f" (at {'.'.join(str(part) for part in problem.absolute_path)})" if problem.absolute_path else ""
            return _failed(f"Invalid arguments for {name}: {_echo(problem.message, quote=False)}{where}.")
        return await self._connections[tool.server].call(name, arguments)


def _arguments_validator(tool: mcp_types.Tool, server: str) -> jsonschema.protocols.Validator | None:
    """A validator of the tool's arguments, so the model reads a short reason before any round trip;
    ``None`` (the server alone validates) when the server's schema is not valid JSON Schema."""
    validator_class = jsonschema.validators.validator_for(tool.input_schema)
    try:
        validator_class.check_schema(tool.input_schema)
    except jsonschema.SchemaError as error:
        log.warning("MCP server %r: tool %r has an invalid input schema (%s)", server, tool.name, error.message)
        return None
    return validator_class(tool.input_schema)


class _Connection:
    """One server's transport and session, held open by a task of their own until ``close()``."""

    def __init__(self, spec: MCPServerSpec):
        self.spec = spec
        self.tools: list[mcp_types.Tool] = []
        self._session: ClientSession | None = None
        self._failure: str | None = None  # why the connection ended or was lost, once it has
        self._settled = asyncio.Event()  # connected, or ended trying
        self._stop = asyncio.Event()
        self._scope: anyio.CancelScope | None = None
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"mcp-server-{self.spec.name}")
        try:
            await asyncio.wait_for(self._settled.wait(), self.spec.connect_timeout_seconds)
        except TimeoutError:
            await self._cancel()
            raise MCPServerUnavailable(
                f"MCP server {self.spec.name!r} did not finish its handshake and tool listing "
                f"within {self.spec.connect_timeout_seconds:g} s"
            ) from None
        if self._session is None:
            await asyncio.wait({self._task})
            self._task.result()  # a bug in the owner task surfaces here, with its traceback
            raise MCPServerUnavailable(f"MCP server {self.spec.name!r} {self._failure}")

    async def _run(self) -> None:
        try:
            with anyio.CancelScope() as self._scope:  # close() cancels it if a graceful stop hangs
                try:
                    async with AsyncExitStack() as stack:
                        session = await self._open_session(stack)
                        self.tools = await _list_tools(session)
                        self._session = session
                        self._settled.set()
                        await self._stop.wait()
                        self._failure = "is closed"
                except* _SERVER_ERRORS as group:
                    self._failure = _why(group, self.spec, connected=self._session is not None)
                    log.warning("MCP server %r: %s", self.spec.name, self._failure)
        finally:
            self._failure = self._failure or "ended its connection"
            self._settled.set()

    async def _open_session(self, stack: AsyncExitStack) -> ClientSession:
        if self.spec.command is not None:
            program, *args = self.spec.command
            server = StdioServerParameters(command=program, args=args, env=self.spec.env, cwd=self.spec.cwd)
            read_stream, write_stream = await stack.enter_async_context(stdio_client(server, errlog=sys.stderr))
        else:
            read_stream, write_stream = await stack.enter_async_context(streamable_http_client(self.spec.url))
        session = await stack.enter_async_context(ClientSession(read_stream, write_stream))
        await session.initialize()
        return session

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutput:
        if self._session is None or self._task.done():
            return _failed(self._gone())
        timeout = self.spec.call_timeout_seconds
        try:
            # The whole call, the request's write included; the SDK tells the server to cancel it.
            with anyio.fail_after(timeout):
                result = await self._session.call_tool(name, arguments)
        except TimeoutError:
            return _failed(f"The tool {name} did not answer within {timeout:g} s (MCP server {self.spec.name!r}).")
        except MCPError as error:
            if error.code == mcp_types.CONNECTION_CLOSED:
                self._failure = self._failure or "closed its connection"
                return _failed(self._gone())
            refusal = f"The MCP server {self.spec.name!r} refused the call of {name}: {error.message}"
            return _failed(_cut(refusal, self.spec.max_result_bytes))
        text = _cut(_result_text(result), self.spec.max_result_bytes)
        if result.is_error:
            return _failed(text or f"The tool {name} failed without saying why.")
        return ToolOutput(ok=True, text=text, error=None)

    def _gone(self) -> str:
        return f"The MCP server {self.spec.name!r} is unavailable: it {self._failure or 'closed its connection'}."

    async def close(self) -> None:
        if self._task is None:
            return
        if not self._settled.is_set():  # closed while connecting (the caller cancelled the connect)
            await self._cancel()
        self._stop.set()
        done, _ = await asyncio.wait({self._task}, timeout=_CLOSE_SECONDS)
        if not done:
            log.warning("MCP server %r: no clean close within %g s; cancelling", self.spec.name, _CLOSE_SECONDS)
            await self._cancel()
        if not self._task.cancelled():
            self._task.result()  # re-raises a bug of the owner task

    async def _cancel(self) -> None:
        """Cancel through anyio, not ``Task.cancel()``: the stdio transport shields the stop of its
        server from anyio cancellation only, so a native cancel could leave the process running."""
        if self._scope is not None:
            self._scope.cancel()
        else:  # the owner task has not run yet: it has started nothing
            self._task.cancel()
        await asyncio.wait({self._task})


async def _list_tools(session: ClientSession) -> list[mcp_types.Tool]:
    tools: list[mcp_types.Tool] = []
    cursor = None
    for _ in range(_MAX_LIST_PAGES):
        page = await session.list_tools(params=mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools.extend(page.tools)
        if not (cursor := page.next_cursor):
            break
    return tools


def _why(group: BaseExceptionGroup, spec: MCPServerSpec, connected: bool) -> str:
    """What the first server error of the group says, as a clause: 'cannot be started (…)', …"""
    error = group.exceptions[0]
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    reason = f"{type(error).__name__}: {error}"
    if isinstance(error, OSError) and spec.command is not None and not connected:
        return f"cannot be started ({spec.command[0]!r}: {error.strerror or error})"
    if isinstance(error, httpx2.HTTPError) and spec.url is not None:
        return f"is unreachable at {spec.url} ({reason})"
    if isinstance(error, MCPError) and error.code == mcp_types.CONNECTION_CLOSED:
        return "closed its connection" if connected else "closed the connection before the MCP handshake completed"
    if isinstance(error, MCPError | ValidationError) and not connected:
        return f"failed the MCP handshake or tool listing ({reason})"
    return f"broke the connection ({reason})"


def _result_text(result: mcp_types.CallToolResult) -> str:
    """The text contents joined; other contents described; the structured content when nothing else."""
    if not result.content and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(_content_text(block) for block in result.content)


def _content_text(block: mcp_types.ContentBlock) -> str:
    if isinstance(block, mcp_types.TextContent):
        return block.text
    if isinstance(block, (mcp_types.ImageContent, mcp_types.AudioContent)):
        return f"[{block.mime_type}, {_decoded_size(block.data)} bytes]"
    if isinstance(block, mcp_types.EmbeddedResource):
        resource = block.resource
        if isinstance(resource, mcp_types.TextResourceContents):
            return f"[resource {resource.uri}]\n{resource.text}"
        return f"[resource {resource.uri}, {resource.mime_type or 'binary'}, {_decoded_size(resource.blob)} bytes]"
    if isinstance(block, mcp_types.ResourceLink):
        return f"[resource link {block.uri}]"
    return f"[{block.type} content]"  # a content type newer than this module


def _decoded_size(data: str) -> int:
    """Bytes the base64 ``data`` stands for, without decoding it (nor failing on a malformed one)."""
    return len(data) * 3 // 4 - data[-2:].count("=")


def _echo(text: str, quote: bool = True, limit: int = 200) -> str:
    """``text`` (a name or a message the model's input shaped) cut to ``limit`` characters for a sentence."""
    shown = text if len(text) <= limit else text[:limit] + "…"
    return repr(shown) if quote else shown


def _cut(text: str, cap: int) -> str:
    encoded = text.encode()
    if len(encoded) <= cap:
        return text
    kept = encoded[:cap].decode(errors="ignore")  # never half a character
    cut = len(encoded) - len(kept.encode())
    return f"{kept}\n[... output truncated: {cut} of {len(encoded)} bytes cut, the limit is {cap} bytes]"
