"""The environment programming model (rlfleet.env): its dataclasses, message checks, the tool-call
parser on good, malformed and hostile turns."""

from __future__ import annotations

import json
import re
import time

import pytest

import rlfleet.env
from rlfleet.env import (
    AssistantTurn,
    Environment,
    StepResult,
    Task,
    ToolCall,
    check_messages,
    check_step_result,
    parse_tool_calls,
    render_tool_result,
)


def call_block(payload: object) -> str:
    body = payload if isinstance(payload, str) else json.dumps(payload)
    return f"<tool_call>\n{body}\n</tool_call>"


# --- the dataclasses and the base class ---


def test_dataclass_defaults_are_not_shared():
    first, second = Task(prompt=[{"role": "user", "content": "hi"}]), Task(prompt=[])
    first.metadata["id"] = 1

    assert (second.ground_truth, second.metadata) == ("", {})
    assert StepResult() == StepResult(messages=[], reward=None, done=False, truncated=False, info={})
    assert StepResult().messages is not StepResult().messages
    assert AssistantTurn("4") == AssistantTurn(text="4", token_ids=[], finish_reason="stop")


class Echo(Environment):
    """What a user writes: a subclass with a step, nothing else."""

    async def step(self, turn: AssistantTurn) -> StepResult:
        return StepResult(messages=[{"role": "user", "content": f"you said {turn.text}"}], reward=0.5, done=True)


async def test_a_subclass_with_only_step_runs_an_episode():
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    task = Task(prompt=prompt, ground_truth="hello")

    async with Echo() as env:
        opening = await env.reset(task)
        result = check_step_result(await env.step(AssistantTurn("hello", [1, 2], "stop")), "Echo.step")

    assert opening == prompt and opening is not prompt
    assert result.messages == [{"role": "user", "content": "you said hello"}]
    assert (result.reward, result.done, result.truncated) == (0.5, True, False)
    assert (env.tools, env.final_reward()) == ((), None)


def test_step_is_abstract():
    class NoStep(Environment):
        pass

    with pytest.raises(TypeError, match="step"):
        NoStep()


def test_the_package_reexports_its_api():
    assert set(rlfleet.env.__all__) <= set(dir(rlfleet.env))
    assert rlfleet.env.Environment is Environment


# --- check_messages / check_step_result ---


def test_valid_messages_pass():
    messages = [
        {"role": "system", "content": ""},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "name": "python", "content": "4\n"},
    ]
    assert check_messages(messages, "reset") is messages
    assert check_messages([], "step") == []


@pytest.mark.parametrize(
    "messages, problem",
    [
        ({"role": "user", "content": "q"}, "reset: messages must be a list of dicts, not dict"),
        ([("user", "q")], "reset: message 0 must be a dict, not tuple"),
        ([{"role": "user", "content": "q"}, {"content": "q"}], "reset: message 1 has no 'role'"),
        ([{"role": "robot", "content": "q"}], "message 0 has role 'robot'; the roles are system, user, assistant"),
        ([{"role": "tool"}], "reset: message 0 (tool) has no 'content'"),
        ([{"role": "user", "content": None}], "reset: message 0 (user) has content of type NoneType, not str"),
        ([{"role": "user", "content": [{"type": "text"}]}], "reset: message 0 (user) has content of type list"),
    ],
)
def test_invalid_messages_are_named(messages, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        check_messages(messages, "reset")


@pytest.mark.parametrize(
    "result, problem",
    [
        ({"messages": []}, "step must return a StepResult, not dict"),
        (StepResult(messages=[{"role": "bot", "content": ""}]), "message 0 has role 'bot'"),
        (StepResult(reward="1"), "reward must be a number or None, not str"),
        (StepResult(reward=True), "reward must be a number or None, not bool"),
        (StepResult(reward=float("nan")), "reward must be finite, not nan"),
        (StepResult(done=1), "done must be a bool, not int"),
        (StepResult(truncated=None), "truncated must be a bool, not NoneType"),
        (StepResult(info=[]), "info must be a dict, not list"),
    ],
)
def test_invalid_step_results_are_named(result, problem):
    with pytest.raises(ValueError, match="^MyEnv.step: " + re.escape(problem)):
        check_step_result(result, "MyEnv.step")


# --- the tool-call parser: good input ---


def test_one_call():
    block = call_block({"name": "python", "arguments": {"code": "print(1)"}})

    assert parse_tool_calls(block) == ([ToolCall("python", {"code": "print(1)"}, block)], [], 0)


def test_two_calls_amid_text():
    first = call_block({"name": "add", "arguments": {"a": 2, "b": 3}})
    second = '<tool_call>{"name": "shout", "arguments": {"text": "</tool", "times": 2}}</tool_call>'
    text = f"Let me compute.\n{first}\nand also\n{second}\nDone."

    calls, problems, skipped = parse_tool_calls(text)

    assert calls == [
        ToolCall("add", {"a": 2, "b": 3}, first),
        ToolCall("shout", {"text": "</tool", "times": 2}, second),
    ]
    assert (problems, skipped) == ([], 0)


def test_no_call_and_missing_arguments():
    assert parse_tool_calls("The answer is 4.") == ([], [], 0)
    assert parse_tool_calls(call_block({"name": "now"})).calls[0].arguments == {}


def test_render_tool_result():
    assert render_tool_result("python", "4\n") == {"role": "tool", "name": "python", "content": "4\n"}
    check_messages([render_tool_result("add", "5.0")], "render_tool_result")


# --- the parser: malformed input, each reported, none raised ---


@pytest.mark.parametrize(
    "body, problem",
    [
        ('{"name": "add", "arguments": {"a": 1,}}', "Tool call 1 is not valid JSON (Expecting property name"),
        ("", "Tool call 1 is not valid JSON (Expecting value: line 3 column 1 (char 2)): ''"),
        ('["add", {"a": 1}]', 'Tool call 1 must be a JSON object {"name": ..., "arguments": {...}}'),
        ('{"arguments": {"a": 1}}', 'Tool call 1 has no "name" (a non-empty string)'),
        ('{"name": 7, "arguments": {}}', 'Tool call 1 has no "name"'),
        ('{"name": "", "arguments": {}}', 'Tool call 1 has no "name"'),
        ('{"name": "add", "arguments": "{}"}', 'Tool call 1 (add): "arguments" must be a JSON object, not str'),
        ('{"name": "add", "arguments": [1, 2]}', 'Tool call 1 (add): "arguments" must be a JSON object, not list'),
        ("[" * 100_000 + "]" * 100_000, "Tool call 1 is not valid JSON (nested too deeply)"),
        ('{"name": "add", "arguments": {"a": ' + "9" * 5000 + "}}", "Tool call 1 is not valid JSON (Exceeds the limit"),
    ],
)
def test_a_malformed_call_is_a_problem(body, problem):
    calls, problems, skipped = parse_tool_calls(call_block(body))

    assert (calls, skipped) == ([], 0)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_an_unclosed_tag_is_a_problem_and_the_good_calls_before_it_stand():
    good = call_block({"name": "add", "arguments": {"a": 1, "b": 2}})
    text = f'{good}\n<tool_call>\n{{"name": "add", "arguments": {{"a": 1'

    calls, problems, _ = parse_tool_calls(text)

    assert calls == [ToolCall("add", {"a": 1, "b": 2}, good)]
    assert problems == ["Tool call 2 has no closing </tool_call> tag: '{\"name\": \"add\", \"arguments\": {\"a\": 1'"]


def test_a_bad_call_between_good_ones_keeps_its_number():
    good = call_block({"name": "add", "arguments": {}})
    calls, problems, _ = parse_tool_calls(f"{good}{call_block('oops')}{good}")

    assert [call.name for call in calls] == ["add", "add"]
    assert len(problems) == 1 and problems[0].startswith("Tool call 2 is not valid JSON")


def test_calls_past_the_limit_are_skipped_and_counted():
    text = "".join(call_block({"name": "add", "arguments": {"a": index}}) for index in range(5))

    calls, problems, skipped = parse_tool_calls(text, max_calls=2)

    assert [call.arguments["a"] for call in calls] == [0, 1]
    assert (problems, skipped) == (["3 more tool call(s) were not run: at most 2 are run per turn."], 3)


def test_a_long_malformed_call_is_quoted_short():
    [problem] = parse_tool_calls(call_block("x" * 100_000)).problems

    assert len(problem) < 300 and problem.endswith("...'")


# --- the parser: hostile input returns fast ---


@pytest.mark.parametrize(
    "shape",
    ["10,000 good calls", "10,000 bad calls", "10,000 opening tags", "10,000 closing tags", "10 MB of one call"],
)
def test_a_hostile_turn_is_bounded(shape):
    good = call_block({"name": "add", "arguments": {"a": 1, "b": 2}})
    text = {
        "10,000 good calls": good * 10_000,
        "10,000 bad calls": call_block("{") * 10_000,
        "10,000 opening tags": "<tool_call>" * 10_000,
        "10,000 closing tags": "</tool_call>" * 10_000,
        "10 MB of one call": call_block('{"name": "add", "arguments": {"a": "' + "x" * 10_000_000 + '"}}'),
    }[shape]
    text += "y" * max(0, 10_000_000 - len(text))  # every shape is at least 10 MB

    started = time.perf_counter()
    calls, problems, skipped = parse_tool_calls(text)
    elapsed = time.perf_counter() - started

    assert elapsed < 0.5, f"{shape}: {elapsed:.3f} s"
    assert len(calls) <= 8 and len(problems) <= 8 + 2
    assert problems[0].startswith(f"The turn is {len(text)} characters long; only its first 262144 were searched")
    if shape == "10,000 good calls":
        assert len(calls) == 8 and skipped > 0 and problems[-1].endswith("at most 8 are run per turn.")
    if shape == "10,000 bad calls":
        assert calls == [] and len(problems) == 1 + 8 + 1 and skipped > 0
    if shape in ("10,000 opening tags", "10 MB of one call"):
        assert calls == [] and "has no closing </tool_call> tag" in problems[1]
    if shape == "10,000 closing tags":
        assert (calls, len(problems), skipped) == ([], 1, 0)
