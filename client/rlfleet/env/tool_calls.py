"""Tool calls in an assistant turn's text, in the Hermes / Qwen format that Hugging Face chat templates
render for ``tools=``::

    <tool_call>
    {"name": "python", "arguments": {"code": "print(1 + 1)"}}
    </tool_call>

A turn may hold several. What the model got wrong (JSON that does not parse, no name, arguments
that are not an object, a tag never closed, more calls than allowed) comes back as ``problems``:
sentences to show the model, never exceptions. The work is bounded whatever the text: at most
``max_text_chars`` characters are searched and at most ``max_calls`` calls decoded, so a hostile
turn (megabytes, thousands of tags, JSON nested a million deep) costs one linear scan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
MAX_CALLS = 8
"""Default bound on the tool calls decoded from one turn."""
MAX_TEXT_CHARS = 256 * 1024
"""Default bound on the characters of one turn searched for tool calls."""
_ECHO_CHARS = 120  # of a malformed call, quoted back to the model


@dataclass(frozen=True)
class ToolCall:
    """One well-formed tool call."""

    name: str
    arguments: dict[str, Any]
    raw: str
    """The call as the model wrote it, tags included."""


class ParsedToolCalls(NamedTuple):
    """What ``parse_tool_calls`` found; unpacks as ``calls, problems, skipped``."""

    calls: list[ToolCall]
    """The well-formed calls, in the order written."""
    problems: list[str]
    """One sentence per malformed call (or cut text), for the model."""
    skipped: int
    """Calls past ``max_calls``, neither decoded nor run (a problem says so)."""


def parse_tool_calls(text: str, *, max_calls: int = MAX_CALLS, max_text_chars: int = MAX_TEXT_CHARS) -> ParsedToolCalls:
    """Find the ``<tool_call>`` blocks of ``text``; calls are numbered from 1 in problems."""
    calls: list[ToolCall] = []
    problems: list[str] = []
    if len(text) > max_text_chars:
        problems.append(
            f"The turn is {len(text)} characters long; only its first {max_text_chars} were searched for tool calls."
        )
        text = text[:max_text_chars]
    position = text.find(OPEN_TAG)
    number = 0
    while position != -1:
        number += 1
        if number > max_calls:
            skipped = text.count(OPEN_TAG, position)
            problems.append(f"{skipped} more tool call(s) were not run: at most {max_calls} are run per turn.")
            return ParsedToolCalls(calls, problems, skipped)
        body_start = position + len(OPEN_TAG)
        close = text.find(CLOSE_TAG, body_start)
        if close == -1:
            problems.append(f"Tool call {number} has no closing {CLOSE_TAG} tag: {_echo(text[body_start:])}")
            break  # everything after the opening tag is the unclosed call's
        end = close + len(CLOSE_TAG)
        call, problem = _decode(text[body_start:close], text[position:end], number)
        if call is not None:
            calls.append(call)
        else:
            problems.append(problem)
        position = text.find(OPEN_TAG, end)
    return ParsedToolCalls(calls, problems, 0)


def _decode(body: str, raw: str, number: int) -> tuple[ToolCall | None, str]:
    """The call in ``body``, or ``None`` and the sentence saying what is wrong with it."""
    try:
        decoded = json.loads(body)
    except RecursionError:
        return None, f"Tool call {number} is not valid JSON (nested too deeply): {_echo(body)}"
    except ValueError as error:  # JSONDecodeError, and integers past Python's digit limit
        return None, f"Tool call {number} is not valid JSON ({error}): {_echo(body)}"
    if not isinstance(decoded, dict):
        return None, f'Tool call {number} must be a JSON object {{"name": ..., "arguments": {{...}}}}: {_echo(body)}'
    name = decoded.get("name")
    if not isinstance(name, str) or not name:
        return None, f'Tool call {number} has no "name" (a non-empty string): {_echo(body)}'
    arguments = decoded.get("arguments", {})  # a tool without parameters may be called without them
    if not isinstance(arguments, dict):
        kind = type(arguments).__name__
        return None, f'Tool call {number} ({name}): "arguments" must be a JSON object, not {kind}: {_echo(body)}'
    return ToolCall(name=name, arguments=arguments, raw=raw), ""


def _echo(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _ECHO_CHARS else text[:_ECHO_CHARS] + "...")


def render_tool_result(name: str, text: str) -> dict[str, str]:
    """The chat message carrying a tool's output (or error) back to the model."""
    return {"role": "tool", "name": name, "content": text}
