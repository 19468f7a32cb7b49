"""The built-in tool-calling environment: the model calls ``python`` (a sandboxed snippet) and the tools
of MCP servers, and answers when it calls none.

Each assistant turn's ``<tool_call>`` blocks are run in order; each call's output, or one sentence
saying why it failed, goes back as a ``tool`` message, and the episode goes on. A turn without a
tool call ends the episode (``done``); its reward is left to the reward functions. Every mistake of
the model (malformed JSON, an unknown tool, bad arguments, code that raises or reaches for the
network) is a tool message, never an exception. The host's faults are exceptions:
``SandboxUnavailable`` when no sandbox can start.

Limits: ``max_turns`` assistant turns (the last one's calls are not run, the episode is
``truncated``), and ``max_tool_calls_per_turn`` (the calls past it are not run, the model is told,
and the episode is ``truncated``: a model that floods calls is cut, not fed more turns).

The MCP tools are shared by many episodes: the caller owns them, ``close`` leaves them open. So is a
``PythonSandbox`` (a fresh sandbox per call) and an ``EpisodeSandboxes`` pool (a sandbox of its own per
call, reused after a reset); an ``EpisodeSandbox`` (one sandbox kept up for the episode's calls) is the
episode's own: ``close`` gives it back.
"""

from __future__ import annotations

from typing import Any

from rlfleet.env import AssistantTurn, Environment, StepResult, Task, ToolCall, check_messages
from rlfleet.env.tool_calls import MAX_TEXT_CHARS, parse_tool_calls, render_tool_result
from rlfleet.services.common.errors import FailedPrecondition
from rlfleet.services.environment.metrics import TOOL_CALLS
from rlfleet.services.environment.episode_sandbox import EpisodeSandbox, EpisodeSandboxes
from rlfleet.services.environment.mcp_tools import MCPTools, ToolNameCollision
from rlfleet.services.environment.sandbox import PythonSandbox, ToolResult

PYTHON_TOOL_NAME = "python"
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": PYTHON_TOOL_NAME,
        "description": (
            "Run a Python 3 script in a fresh sandbox (no network, nothing kept between calls) "
            "and return what it prints: stdout, then stderr."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python source to run."}},
            "required": ["code"],
        },
    },
}
"""The ``python`` tool in the OpenAI function-tool format."""
PROBLEM_TOOL_NAME = "tool_call_error"
"""The ``name`` of the tool message answering a call too malformed to name its tool."""


class ToolCallingEnv(Environment):
    """One episode of a model calling ``python`` and MCP tools; see the module docstring."""

    def __init__(
        self,
        sandbox: PythonSandbox | EpisodeSandboxes | EpisodeSandbox,
        mcp_tools: MCPTools | None = None,
        *,
        max_turns: int = 8,
        max_tool_calls_per_turn: int = 4,
        max_text_chars: int = MAX_TEXT_CHARS,
    ):
        """``max_turns``: assistant turns per episode; ``max_tool_calls_per_turn``: calls run per turn;
        ``max_text_chars``: characters of a turn searched for calls. Raises ``ToolNameCollision``
        when an MCP server offers a tool named ``python``."""
        if max_turns < 1 or max_tool_calls_per_turn < 1:
            limits = f"max_turns ({max_turns}) and max_tool_calls_per_turn ({max_tool_calls_per_turn})"
            raise ValueError(f"{limits} must be >= 1")
        self.sandbox = sandbox
        self.mcp_tools = mcp_tools
        self.max_turns = max_turns
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.max_text_chars = max_text_chars
        mcp_specs = mcp_tools.list() if mcp_tools is not None else []
        if any(spec.name == PYTHON_TOOL_NAME for spec in mcp_specs):
            server = next(spec.server for spec in mcp_specs if spec.name == PYTHON_TOOL_NAME)
            raise ToolNameCollision(f"MCP server {server!r} offers a tool named {PYTHON_TOOL_NAME!r}, the sandbox's")
        self.tools = [PYTHON_TOOL, *(spec.as_openai_tool() for spec in mcp_specs)]
        self._mcp_names = {spec.name for spec in mcp_specs}
        self.turns = 0
        self.tool_calls = 0
        """Calls run this episode, failed ones included."""
        self.tool_errors = 0
        """Calls that failed this episode plus the parse problems reported (one per malformed call,
        one for all the calls past the per-turn limit)."""
        self._over = False

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        return check_messages(list(task.prompt), "the task's prompt")

    async def close(self) -> None:
        if isinstance(self.sandbox, EpisodeSandbox):
            await self.sandbox.close()

    async def step(self, turn: AssistantTurn) -> StepResult:
        if self._over:
            raise FailedPrecondition("this episode is over; a new episode needs a new ToolCallingEnv")
        result = await self._step(turn)
        self._over = result.done or result.truncated
        return result

    async def _step(self, turn: AssistantTurn) -> StepResult:
        self.turns += 1
        calls, problems, skipped = parse_tool_calls(
            turn.text, max_calls=self.max_tool_calls_per_turn, max_text_chars=self.max_text_chars
        )
        if not calls and not problems:
            return StepResult(done=True, info=self._info(0, 0))
        if self.turns >= self.max_turns:
            note = f"Not run: the episode reached its limit of {self.max_turns} turns."
            messages = [render_tool_result(call.name, note) for call in calls]
            return StepResult(messages=messages, truncated=True, info=self._info(0, 0))
        messages = []
        errors = 0
        for call in calls:
            text, ok = await self._run(call)
            TOOL_CALLS.labels(tool=call.name, outcome="ok" if ok else "error").inc()
            messages.append(render_tool_result(call.name, text))
            errors += not ok
        messages += [render_tool_result(PROBLEM_TOOL_NAME, f"Error: {problem}") for problem in problems]
        errors += len(problems)
        return StepResult(messages=messages, truncated=skipped > 0, info=self._info(len(calls), errors))

    def _info(self, tool_calls: int, tool_errors: int) -> dict[str, int]:
        self.tool_calls += tool_calls
        self.tool_errors += tool_errors
        return {"turn": self.turns, "tool_calls": tool_calls, "tool_errors": tool_errors}

    async def _run(self, call: ToolCall) -> tuple[str, bool]:
        """The text the model reads for ``call``, and whether the call succeeded."""
        if call.name == PYTHON_TOOL_NAME:
            code = call.arguments.get("code")
            if not isinstance(code, str):
                return 'Error: the python tool needs a "code" argument: the source to run, as a string.', False
            result = await self.sandbox.run(code)
            return _python_text(result), result.ok
        if call.name in self._mcp_names:
            output = await self.mcp_tools.call(call.name, call.arguments)
            return (output.text, True) if output.ok else (f"Error: {output.error}", False)
        names = ", ".join(sorted({PYTHON_TOOL_NAME, *self._mcp_names}))
        return f"Error: there is no tool named {call.name!r}; the tools are: {names}.", False


def _python_text(result: ToolResult) -> str:
    """What the model reads of a snippet's run: its output, and why it failed if it did."""
    parts = [result.stdout] if result.stdout else []
    if result.stderr:
        parts.append(f"stderr:\n{result.stderr}")
    if not result.ok:
        parts.append(f"Error: the code {result.error}.")
    return "\n".join(part.rstrip("\n") for part in parts) if parts else "(no output)"
