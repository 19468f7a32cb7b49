"""The MCP tool client against the example MCP server (examples/mcp_server.py) as real processes,
over stdio and streamable HTTP: listing, calls, the model's errors, the host's errors, a server dying."""

from __future__ import annotations

import asyncio
import base64
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import mcp_types
import psutil
import pytest
from pydantic import ValidationError

from rlfleet.services.environment.mcp_tools import (
    MCPServerSpec,
    MCPServerUnavailable,
    MCPTools,
    ToolNameCollision,
    ToolOutput,
    _result_text,
)
from rlfleet.services.launch import free_port
from tests.waiting import wait_for

EXAMPLE_SERVER = Path(__file__).resolve().parents[2] / "examples" / "mcp_server.py"
SERVER_START_SECONDS = 60  # a Python process importing the mcp package, on a loaded 2-core machine
ARITHMETIC_TOOLS = ["add", "multiply", "fail", "sleep", "shout"]


def stdio_spec(name: str = "calc", *server_args: str, **fields) -> MCPServerSpec:
    return MCPServerSpec(name=name, command=[sys.executable, str(EXAMPLE_SERVER), *server_args], **fields)


def accepts_connections(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


class HttpServer:
    """The example server over streamable HTTP, a subprocess of this test; ready once it accepts."""

    def __init__(self, *server_args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        command = [sys.executable, str(EXAMPLE_SERVER), "--transport", "http", "--port", str(self.port), *server_args]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for(self._ready, SERVER_START_SECONDS, f"the MCP server on port {self.port} to accept connections")

    def _ready(self) -> bool:
        if self.process.poll() is not None:  # died at start: fail now, with its reason
            raise RuntimeError(f"the MCP server exited at start: {self.process.stderr.read().decode()[-2000:]}")
        return accepts_connections(self.port)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.process.stderr.close()


@pytest.fixture(scope="module")
def http_server():
    server = HttpServer()
    yield server
    server.kill()


@pytest.fixture
def own_http_server():
    """A server a test may kill."""
    server = HttpServer()
    yield server
    server.kill()


def mcp_server_children() -> list[psutil.Process]:
    """Live child processes of this test process: the stdio servers, and HTTP servers of fixtures."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def started_since(before: set[int]) -> list[psutil.Process]:
    return [server for server in mcp_server_children() if server.pid not in before]


@pytest.fixture
def no_stray_servers() -> set[int]:
    """Every stdio server the test starts is gone when it returns: the client waits for its servers'
    exit before its close returns. Yields the pids running before (those of module fixtures)."""
    before = {server.pid for server in mcp_server_children()}
    yield before
    assert not started_since(before), "a stdio MCP server outlived the test"


async def assert_arithmetic(tools: MCPTools, server: str) -> None:
    listed = {tool.name: tool for tool in tools.list()}
    assert sorted(listed) == sorted(ARITHMETIC_TOOLS)
    assert {tool.server for tool in listed.values()} == {server}
    assert listed["add"].description == "Add two numbers and return the sum."
    assert listed["add"].input_schema["properties"] == {
        "a": {"title": "A", "type": "number"},
        "b": {"title": "B", "type": "number"},
    }
    assert listed["add"].input_schema["required"] == ["a", "b"]

    assert await tools.call("add", {"a": 2, "b": 3}) == ToolOutput(ok=True, text="5.0", error=None)
    assert await tools.call("multiply", {"a": 2.5, "b": 4}) == ToolOutput(ok=True, text="10.0", error=None)


async def test_stdio_lists_and_calls(no_stray_servers):
    async with MCPTools([stdio_spec()]) as tools:
        await assert_arithmetic(tools, "calc")
        openai = tools.as_openai_tools()

    add = next(tool for tool in openai if tool["function"]["name"] == "add")
    assert add == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers and return the sum.",
            "parameters": next(t for t in tools.list() if t.name == "add").input_schema,
        },
    }


async def test_streamable_http_lists_and_calls(http_server):
    tools = await MCPTools.connect([MCPServerSpec(name="calc-http", url=http_server.url)])
    try:
        await assert_arithmetic(tools, "calc-http")
    finally:
        await tools.aclose()
    assert http_server.process.poll() is None, "closing a client must not stop an HTTP server"


async def test_two_servers_at_once(no_stray_servers):
    remote = HttpServer("--tools", "multiply,sleep")
    try:
        specs = [stdio_spec("local", "--tools", "add,fail"), MCPServerSpec(name="remote", url=remote.url)]
        async with MCPTools(specs) as tools:
            assert [(tool.name, tool.server) for tool in tools.list()] == [
                ("add", "local"),
                ("fail", "local"),
                ("multiply", "remote"),
                ("sleep", "remote"),
            ]
            assert await tools.call("add", {"a": 1, "b": 2}) == ToolOutput(ok=True, text="3.0", error=None)
            assert await tools.call("multiply", {"a": 3, "b": 2}) == ToolOutput(ok=True, text="6.0", error=None)
    finally:
        remote.kill()


async def test_a_tool_name_on_two_servers_is_refused(http_server, no_stray_servers):
    specs = [stdio_spec("local", "--tools", "add"), MCPServerSpec(name="remote", url=http_server.url)]

    with pytest.raises(ToolNameCollision, match="'add' is offered by both MCP servers 'local' and 'remote'"):
        await MCPTools.connect(specs)


@pytest.fixture(scope="module")
async def calc():
    """One stdio session for the tests of the model's errors; a short call timeout for the sleep."""
    async with MCPTools([stdio_spec(call_timeout_seconds=3, max_result_bytes=100)]) as tools:
        yield tools


async def test_unknown_tool(calc):
    output = await calc.call("subtract", {"a": 1, "b": 2})

    assert output.ok is False and output.text == ""
    assert output.error == "There is no tool named 'subtract'; the tools are: add, multiply, fail, sleep, shout."


@pytest.mark.parametrize(
    "arguments, error",
    [
        ({"a": "two", "b": 3}, "Invalid arguments for add: 'two' is not of type 'number' (at a)."),
        ({"a": 2}, "Invalid arguments for add: 'b' is a required property."),
        ([2, 3], "The arguments of add must be a JSON object, not list."),
        ("{'a': 2, 'b': 3}", "The arguments of add must be a JSON object, not str."),
    ],
)
async def test_bad_arguments(calc, arguments, error):
    assert await calc.call("add", arguments) == ToolOutput(ok=False, text="", error=error)


async def test_a_failing_tool_says_why(calc):
    output = await calc.call("fail", {"message": "boom"})

    assert output == ToolOutput(ok=False, text="", error="Error executing tool fail: boom")


async def test_a_call_past_its_timeout_fails_and_the_next_call_works(calc):
    started = time.monotonic()
    output = await calc.call("sleep", {"seconds": 600})
    waited = time.monotonic() - started

    assert output == ToolOutput(
        ok=False, text="", error="The tool sleep did not answer within 3 s (MCP server 'calc')."
    )
    assert 2.9 < waited < 3 + 15  # the timeout, then the cancel sent to the server (bounded by the SDK)
    assert await calc.call("add", {"a": 1, "b": 1}) == ToolOutput(ok=True, text="2.0", error=None)


async def test_long_output_is_truncated_with_a_marker(calc):
    output = await calc.call("shout", {"text": "ab", "times": 100})

    assert output.ok
    assert output.text == "ab" * 50 + "\n[... output truncated: 100 of 200 bytes cut, the limit is 100 bytes]"
    assert await calc.call("shout", {"text": "ab", "times": 50}) == ToolOutput(ok=True, text="ab" * 50, error=None)


async def test_a_command_that_does_not_exist_is_refused_at_connect(no_stray_servers):
    spec = MCPServerSpec(name="ghost", command=["/nonexistent/mcp-server", "--stdio"])

    with pytest.raises(MCPServerUnavailable, match=r"MCP server 'ghost' cannot be started \('/nonexistent/mcp-server'"):
        await MCPTools.connect([spec])


async def test_a_command_that_exits_at_once_is_refused_at_connect(no_stray_servers):
    spec = MCPServerSpec(name="quitter", command=[sys.executable, "-c", "pass"])

    with pytest.raises(MCPServerUnavailable, match="'quitter' closed the connection before the MCP handshake"):
        await MCPTools.connect([spec])


async def test_a_server_silent_past_the_connect_timeout_is_refused_and_stopped(no_stray_servers):
    silent = [sys.executable, "-c", "import sys; sys.stdin.read()"]  # says nothing, exits at stdin's end
    spec = MCPServerSpec(name="mute", command=silent, connect_timeout_seconds=2)

    with pytest.raises(MCPServerUnavailable, match="'mute' did not finish its handshake and tool listing within 2 s"):
        await MCPTools.connect([spec])


async def test_a_url_nobody_listens_on_is_refused_at_connect_and_the_other_servers_are_stopped(no_stray_servers):
    url = f"http://127.0.0.1:{free_port()}/mcp"
    specs = [stdio_spec("fine"), MCPServerSpec(name="nobody", url=url)]

    with pytest.raises(MCPServerUnavailable, match=rf"MCP server 'nobody' is unreachable at {url} \(ConnectError"):
        await MCPTools.connect(specs)


async def test_an_http_server_killed_mid_run(own_http_server):
    spec = MCPServerSpec(name="remote", url=own_http_server.url, call_timeout_seconds=30)
    async with MCPTools([spec]) as tools:
        assert (await tools.call("add", {"a": 2, "b": 3})).ok
        pending = asyncio.create_task(tools.call("sleep", {"seconds": 600}))

        own_http_server.kill()

        # The pending call (its response stream cut, or its request refused), and two calls after it:
        # each ends well before its timeout, naming the server.
        started = time.monotonic()
        outputs = [await pending, await tools.call("add", {"a": 2, "b": 3}), await tools.call("add", {"a": 1, "b": 1})]
        assert time.monotonic() - started < spec.call_timeout_seconds
        for output in outputs:
            assert not output.ok and output.text == ""
            assert output.error.startswith("The MCP server 'remote' is unavailable: it "), output.error


async def test_a_stdio_server_killed_while_a_call_is_pending(no_stray_servers):
    spec = stdio_spec("local", call_timeout_seconds=60)
    async with MCPTools([spec]) as tools:
        [server] = started_since(no_stray_servers)
        pending = asyncio.create_task(tools.call("sleep", {"seconds": 600}))
        server.kill()

        output = await asyncio.wait_for(pending, 30)  # well below the call's own 60 s timeout

        assert output == ToolOutput(
            ok=False, text="", error="The MCP server 'local' is unavailable: it closed its connection."
        )
        assert await tools.call("add", {"a": 1, "b": 1}) == output


async def test_close_leaves_no_stdio_server_running(no_stray_servers):
    tools = await MCPTools.connect([stdio_spec("one", "--tools", "multiply"), stdio_spec("two", "--tools", "add")])
    servers = started_since(no_stray_servers)
    assert len(servers) == 2

    await tools.aclose()

    assert not [server for server in servers if server.is_running()]
    assert await tools.call("add", {"a": 1, "b": 1}) == ToolOutput(
        ok=False, text="", error="The MCP server 'two' is unavailable: it is closed."
    )


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({}, "give exactly one of `command` (stdio) or `url` (HTTP)"),
        ({"command": ["x"], "url": "http://h/mcp"}, "give exactly one of `command` (stdio) or `url` (HTTP)"),
        ({"command": []}, "`command` needs a program"),
        ({"url": "http://h/mcp", "env": {"A": "1"}}, "`env` and `cwd` apply to a `command` only"),
        ({"url": "ftp://h/mcp"}, "`url` must be http:// or https://"),
        ({"url": "http://h/mcp", "timeout": 3}, "Extra inputs are not permitted"),
    ],
)
def test_a_spec_names_one_transport(fields, problem):
    with pytest.raises(ValidationError, match=re.escape(problem)):
        MCPServerSpec(name="s", **fields)


def test_contents_other_than_text_are_described():
    png = base64.b64encode(b"\x89PNG" * 100).decode()
    image = mcp_types.ImageContent(type="image", data=png, mime_type="image/png")
    blob = mcp_types.BlobResourceContents(uri="file:///a.bin", blob=base64.b64encode(b"12345").decode())
    text = mcp_types.TextResourceContents(uri="file:///a.txt", text="hello")
    result = mcp_types.CallToolResult(
        content=[
            mcp_types.TextContent(type="text", text="here:"),
            image,
            mcp_types.EmbeddedResource(type="resource", resource=blob),
            mcp_types.EmbeddedResource(type="resource", resource=text),
            mcp_types.ResourceLink(type="resource_link", name="b", uri="file:///b"),
        ]
    )

    assert _result_text(result).split("\n") == [
        "here:",
        "[image/png, 400 bytes]",
        "[resource file:///a.bin, binary, 5 bytes]",
        "[resource file:///a.txt]",
        "hello",
        "[resource link file:///b]",
    ]
    assert _result_text(mcp_types.CallToolResult(content=[], structured_content={"result": 5.0})) == '{"result": 5.0}'
