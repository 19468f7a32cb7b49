"""A tiny MCP server with arithmetic tools, for an arithmetic-agent demo and the MCP client's tests.

    python examples/mcp_server.py                                   # stdio (the client starts it)
    python examples/mcp_server.py --transport http --port 8765      # streamable HTTP at /mcp
    python examples/mcp_server.py --tools add,multiply              # serve a subset of the tools

Tools: ``add`` and ``multiply`` (two floats, the result a float), ``fail`` (raises, so the client
sees a tool error), ``sleep`` (waits, so the client sees a timeout) and ``shout`` (a long text, so
the client sees truncation). ``--tools`` lets two instances serve disjoint sets side by side.

Over HTTP the server listens on 127.0.0.1 only, on the port given (pick a free one: uvicorn's
``--port 0`` would bind a port nobody could learn); it is ready once the port accepts connections
(uvicorn listens only after the app's startup).
"""

from __future__ import annotations

import argparse
import asyncio

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError


def add(a: float, b: float) -> float:
    """Add two numbers and return the sum."""
    return a + b


def multiply(a: float, b: float) -> float:
    """Multiply two numbers and return the product."""
    return a * b


def fail(message: str) -> str:
    """Always fail with the given message (a tool error, to test the client)."""
    # A ToolError's message reaches the client; any other exception is a crash, which the SDK
    # reports as a bare "Error executing tool fail" (the text stays in the server's log).
    raise ToolError(message)


async def sleep(seconds: float) -> str:
    """Wait the given number of seconds, then answer "slept" (to test the client's timeout)."""
    await asyncio.sleep(seconds)
    return "slept"


def shout(text: str, times: int) -> str:
    """Return ``text`` repeated ``times`` times (a long output, to test the client's truncation)."""
    return text * times


TOOLS = {tool.__name__: tool for tool in (add, multiply, fail, sleep, shout)}


def build_server(tool_names: list[str]) -> MCPServer:
    server = MCPServer(name="rlfleet-arithmetic", log_level="WARNING")
    for name in tool_names:
        server.tool()(TOOLS[name])
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    parser.add_argument("--port", type=int, default=8765, help="the HTTP port (http transport only)")
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {', '.join(TOOLS)}")
    args = parser.parse_args()
    tool_names = [name for name in args.tools.split(",") if name]
    if unknown := sorted(set(tool_names) - set(TOOLS)):
        parser.error(f"unknown tools {unknown}; this server has {sorted(TOOLS)}")

    server = build_server(tool_names)
    if args.transport == "http":
        server.run(transport="streamable-http", host="127.0.0.1", port=args.port)
    else:
        server.run()


if __name__ == "__main__":
    main()
