"""Multi-turn environments: subclass ``Environment``; ``tool_calls`` parses the model's tool calls."""

from rlfleet.env.base import ROLES, AssistantTurn, Environment, StepResult, Task, check_messages, check_step_result
from rlfleet.env.tool_calls import ParsedToolCalls, ToolCall, parse_tool_calls, render_tool_result

__all__ = [
    "ROLES",
    "AssistantTurn",
    "Environment",
    "ParsedToolCalls",
    "StepResult",
    "Task",
    "ToolCall",
    "check_messages",
    "check_step_result",
    "parse_tool_calls",
    "render_tool_result",
]
