"""The verifiers adapter: its chat-completions wire as plain functions; its endpoint over real HTTP
(spoken to by the ``openai`` SDK, streamed and not); and, marked slow, the adapter driven directly with
hand-written turns against real ``verifiers`` 0.4 environments: the example (examples/verifiers_sums.py:
verifiers' own chat program, its calculator MCP server, its tutor) end to end, the same through the
environment service's ``Episodes`` (token-exact observations; a rollout that raises ends the episode as
FAILED_PRECONDITION), ``close`` cancelling a rollout mid-call, and a reply the environment rewrites
refused as a diverged conversation. The service around it is in tests/integration/test_verifiers_adapter.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import types
from pathlib import Path

import openai
import psutil
import pytest
import verifiers.v1 as vf
from verifiers.v1.clients.client import SESSION_ID_HEADER

from rlfleet.env import AssistantTurn, Task
from rlfleet.services.environment import chat_endpoint
from rlfleet.services.environment.open_episodes import EnvironmentFailed, Episodes, OpenEpisodeLimits, StepTurn
from rlfleet.services.environment.rendering import ChatRenderer
from rlfleet.services.environment.verifiers_adapter import (
    VerifiersConversationDiverged, VerifiersEnvironment, VerifiersRolloutFailed, answer_turn, chat_completion,
    completion_events, continuation, requested_sampling, rlfleet_messages)
from tests.example_modules import import_example
from tests.waiting import wait_for_async

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TASK = Task(prompt=[{"role": "user", "content": "what is 2 plus 3"}], ground_truth="5")
TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

# --- the wire, as plain functions ---


def test_a_turn_becomes_the_message_a_chat_api_returns_with_its_tool_calls_parsed():
    assert answer_turn(AssistantTurn(text="it is 5"), "call_1") == (
        {"role": "assistant", "content": "it is 5"}, "stop")
    message, finish_reason = answer_turn(AssistantTurn(text=f"let me add {TOOL_CALL}"), "call_2")
    assert finish_reason == "tool_calls"
    assert message == {"role": "assistant", "content": "let me add", "tool_calls": [
        {"id": "call_2_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}
    assert answer_turn(AssistantTurn(text=TOOL_CALL), "c")[0]["content"] is None
    assert answer_turn(AssistantTurn(text=TOOL_CALL, finish_reason="length"), "c")[1] == "length"
    broken = '<tool_call>{"name": </tool_call>'  # malformed: left in the content, as vLLM's parser leaves it
    assert answer_turn(AssistantTurn(text=broken), "c") == ({"role": "assistant", "content": broken}, "stop")

    completion = chat_completion(message, finish_reason, "policy")
    assert completion["object"] == "chat.completion" and completion["model"] == "policy"
    assert completion["choices"] == [{"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls"}]
    events = completion_events(completion)
    assert events[-1] == b"data: [DONE]\n\n" and all(event.endswith(b"\n\n") for event in events)
    first, last = (json.loads(event[len(b"data: "):]) for event in events[:2])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "let me add", "tool_calls": [
        {"index": 0, **message["tool_calls"][0]}]}
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}

    body = {"model": "m", "messages": [], "tools": [], "stream": True, "temperature": 0.2, "max_tokens": 64,
            "top_p": None}
    assert requested_sampling(body) == {"temperature": 0.2, "max_tokens": 64}


def test_messages_become_rlfleet_messages_or_a_clear_error():
    assert rlfleet_messages([
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}], "reasoning": "dropped"},
        {"role": "tool", "content": "5", "tool_call_id": "1", "name": "add"}], "a call") == [
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
        {"role": "tool", "content": "5", "name": "add", "tool_call_id": "1"}]
    with pytest.raises(VerifiersConversationDiverged, match="a call: message 0 has role 'robot'"):
        rlfleet_messages([{"role": "robot", "content": "beep"}], "a call")
    with pytest.raises(VerifiersConversationDiverged, match="message 0: content other than text"):
        rlfleet_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "a call")


def test_the_next_call_must_continue_the_conversation_as_answered():
    before = [{"role": "user", "content": "what is 2 plus 3"}]
    answered, _ = answer_turn(AssistantTurn(text=TOOL_CALL), "call_1")
    echoed = {"role": "assistant", "tool_calls": [  # as an SDK sends it back: arguments re-spaced, an index added
        {"id": "call_1_0", "index": 0, "type": "function", "function": {"name": "add", "arguments": '{"b":3,"a":2}'}}]}
    result = {"role": "tool", "tool_call_id": "call_1_0", "content": "5"}
    assert continuation(before, answered, [*before, echoed, result]) == [result]
    assert continuation(before, answered, [*before, echoed]) == []

    with pytest.raises(VerifiersConversationDiverged, match="rewrote message 0"):
        continuation(before, answered, [{"role": "user", "content": "what is 2 plus 4"}, echoed, result])
    edited = {**echoed, "tool_calls": [{**echoed["tool_calls"][0], "function": {"name": "add", "arguments": "{}"}}]}
    with pytest.raises(VerifiersConversationDiverged, match="sent back .* as the model's reply, which was"):
        continuation(before, answered, [*before, edited, result])
    with pytest.raises(VerifiersConversationDiverged, match="message 3 is an assistant message the model did not"):
        continuation(before, answered, [*before, echoed, result, {"role": "assistant", "content": "5"}])
    with pytest.raises(VerifiersConversationDiverged, match="has 1 messages, the conversation 1"):
        continuation(before, answered, before)


async def test_an_exchange_is_one_conversation_answered_one_call_at_a_time():
    exchange = chat_endpoint.Exchange()
    call = exchange.submit("trace-a", {"messages": [1]})
    assert exchange.submit("trace-a", {"messages": [1]}) is call  # a retry waits for the same answer
    with pytest.raises(chat_endpoint.Refused, match="previous one was unanswered") as concurrent:
        exchange.submit("trace-a", {"messages": [2]})
    assert concurrent.value.status == 409
    with pytest.raises(chat_endpoint.Refused, match="a second agent"):
        exchange.submit("trace-b", {"messages": [1]})
    events = [exchange.events.get_nowait() for _ in range(exchange.events.qsize())]
    assert events[0] is call and all(isinstance(event, VerifiersConversationDiverged) for event in events[1:])
    exchange.close()
    with pytest.raises(chat_endpoint.Refused, match="closed"):
        call.answer.result()


async def test_the_endpoint_answers_the_openai_sdk_over_http_streamed_or_not_and_refuses_what_it_cannot_route():
    endpoint = await chat_endpoint.acquire_endpoint()
    exchange = chat_endpoint.Exchange()
    endpoint.routes["trace-1"] = exchange
    message, finish_reason = answer_turn(AssistantTurn(text=f"adding {TOOL_CALL}"), "call_1")
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="none", max_retries=0,
                                default_headers={SESSION_ID_HEADER: "trace-1"})

    async def answer(text: str) -> None:
        call = await exchange.events.get()
        assert call.body["messages"] == [{"role": "user", "content": text}]
        call.answer.set_result(chat_completion(message, finish_reason, "policy"))

    try:
        request = {"model": "policy", "messages": [{"role": "user", "content": "plain"}], "temperature": 0.5}
        completion, _ = await asyncio.gather(client.chat.completions.create(**request), answer("plain"))
        assert completion.choices[0].finish_reason == "tool_calls"
        assert completion.choices[0].message.content == "adding"
        assert completion.choices[0].message.tool_calls[0].function.arguments == '{"a": 2, "b": 3}'

        async def streamed() -> list:
            stream = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "streamed"}], stream=True)
            return [chunk async for chunk in stream]

        chunks, _ = await asyncio.gather(streamed(), answer("streamed"))
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == "adding"
        assert chunks[0].choices[0].delta.tool_calls[0].function.name == "add"
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        stranger = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="none", max_retries=0,
                                      default_headers={SESSION_ID_HEADER: "trace-unknown"})
        with pytest.raises(openai.NotFoundError, match="no open rlfleet episode"):
            await stranger.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.NotFoundError, match="serves POST /v1/chat/completions only"):
            await client.responses.create(model="policy", input="hi")
        exchange.close()
        with pytest.raises(openai.APIStatusError, match="the rlfleet episode is closed") as closed:
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "late"}])
        assert closed.value.status_code == 410
    finally:
        await client.close()
        await chat_endpoint.release_endpoint(endpoint)


def test_a_subclass_without_a_taskset_says_what_to_set():
    with pytest.raises(TypeError, match="Bare: set taskset_id"):
        type("Bare", (VerifiersEnvironment,), {}).env_config()


async def test_an_environment_that_cannot_start_fails_its_episode_and_the_next_one_tries_again():
    missing = type("Missing", (VerifiersEnvironment,), {"taskset_id": "no_such_verifiers_taskset"})
    for _ in range(2):
        env = missing()
        with pytest.raises(ModuleNotFoundError, match="taskset 'no_such_verifiers_taskset' not found"):
            await env.reset(TASK)
        await env.close()
        assert not missing.is_serving()
    assert chat_endpoint._endpoints == {}


# --- real verifiers environments, driven by hand-written turns ---


@pytest.fixture(scope="module")
def example():
    return import_example("verifiers_sums")


@pytest.fixture(scope="module")
def verifiers_can_run(example):
    """What verifiers needs to run the example here: the taskset's module importable (in this process,
    and by the calculator's server, ``python -m verifiers_sums``) and ``uv`` (in this virtualenv's bin)
    to run its chat program."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "verifiers_sums", example)
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")])))
        patch.setenv("PATH", os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
        yield


@pytest.fixture(scope="module")
async def sums(example, verifiers_can_run):
    """The example's registration; its environment (interception, calculator) serves the module's tests."""
    registered = type("Sums", (example.Sums,), {})
    yield registered
    await registered.stop_serving()
    assert await verifiers_children_left() == []


def verifiers_children(what: str = "verifiers") -> list[psutil.Process]:
    """This process's children that verifiers started (``what`` in their command line): chat programs
    (``runtimes/scripts``) and tool servers (``verifiers_sums``)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and any(what in part for part in child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


async def verifiers_children_left(what: str = "verifiers") -> list[psutil.Process]:
    """``verifiers_children`` once those that were killed have ended: a SIGKILLed process still shows
    for a moment while the kernel tears it down (longer on a loaded machine)."""
    with contextlib.suppress(TimeoutError):
        await wait_for_async(lambda: not verifiers_children(what), timeout=30, what=f"{what} children to end")
    return verifiers_children(what)


@pytest.mark.slow
async def test_the_example_runs_verifiers_own_chat_program_and_calculator_turn_by_turn(example, sums):
    env = sums()
    try:
        opening = await env.reset(TASK)
        assert opening == [{"role": "system", "content": example.SYSTEM_PROMPT},
                           {"role": "user", "content": "what is 2 plus 3"}]
        assert [tool["function"]["name"] for tool in env.tools] == ["add"]
        called = await env.step(AssistantTurn(text=TOOL_CALL))  # run by the chat program on the MCP server
        assert (called.messages, called.done) == (
            [{"role": "tool", "content": "5", "name": "add", "tool_call_id": "call_1_0"}], False)
        wrong = await env.step(AssistantTurn(text="it is four"))  # the tutor asks again
        assert (wrong.messages, wrong.reward, wrong.done) == ([{"role": "user", "content": example.RETRY}], None, False)
        right = await env.step(AssistantTurn(text="it is 5"))
        assert (right.messages, right.reward, right.done, right.truncated) == ([], 1.5, True, False)
        assert right.info == {"reward/correct": 1.0, "reward/concise": 1.0, "verifiers_reward": 1.5,
                              "verifiers_turns": 3, "verifiers_stop_condition": "user_closed"}
    finally:
        await env.close()
    assert await verifiers_children_left("runtimes/scripts") == []


@pytest.fixture(scope="module")
def renderer(tiny_model_dir) -> ChatRenderer:
    return ChatRenderer.from_pretrained(str(tiny_model_dir))


@pytest.mark.slow
async def test_episodes_render_it_token_exact_and_end_it_when_the_rollout_raises(example, sums, renderer):
    limits = OpenEpisodeLimits(max_turns=8, max_open_episodes=8, step_timeout_seconds=120, idle_episode_seconds=600)
    episodes = Episodes(renderer, {"sums": sums}, limits)
    tokenizer = renderer.tokenizer

    def sampled(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    opening = await episodes.open("right", "sums", TASK)
    assert opening.prompt_token_ids == renderer.prompt(opening.messages, opening.tools)[1]
    assert '"name": "add"' in tokenizer.decode(opening.prompt_token_ids)
    answer = await episodes.step("right", StepTurn(token_ids=sampled(TOOL_CALL), text=None, finish_reason="stop",
                                               number=1))
    assert tokenizer.decode(answer.observation_token_ids) == (
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    answer = await episodes.step("right", StepTurn(token_ids=sampled("5"), text=None, finish_reason="stop", number=2))
    assert (answer.reward, answer.done, answer.observation_token_ids) == (1.5, True, [])
    await episodes.close("right")

    # The answer is not a whole number: the tutor's check raises in verifiers' Env.run.
    await episodes.open("broken", "sums", Task(prompt=TASK.prompt, ground_truth="five"))
    with pytest.raises(EnvironmentFailed, match="step raised VerifiersRolloutFailed: .*ValueError: invalid literal "
                                                "for int.*'five'.*; the episode is ended") as failed:
        await episodes.step("broken", StepTurn(token_ids=sampled("it is 5"), text=None, finish_reason="stop", number=1))
    assert failed.value.code == "FAILED_PRECONDITION" and len(episodes) == 0
    assert await verifiers_children_left("runtimes/scripts") == []


@pytest.mark.slow
async def test_a_rollout_that_fails_before_calling_the_model_fails_the_reset(sums):
    env = sums()
    try:
        with pytest.raises(VerifiersRolloutFailed, match=r"EnvError: SumTutor.run\(\): ValueError: nothing to run a "
                                                         "turn on"):  # a prompt-less task: the tutor has no question
            await env.reset(Task(prompt=[], ground_truth="5"))
    finally:
        await env.close()


@pytest.mark.slow
async def test_close_cancels_a_rollout_waiting_on_the_model_and_the_environment_stops_serving(example,
                                                                                           verifiers_can_run):
    env = type("Sums", (example.Sums,), {"idle_shutdown_seconds": 0})()
    await env.reset(TASK)
    assert verifiers_children("runtimes/scripts")  # the chat program waits for its answer
    await asyncio.wait_for(env.close(), 30)
    assert await verifiers_children_left("runtimes/scripts") == []
    assert not type(env).is_serving()
    with pytest.raises(RuntimeError, match="step before reset, or after the rollout ended"):
        await env.step(AssistantTurn(text="too late"))


class ShoutingTask(vf.Task[vf.TaskData]):
    """Rewrites every model reply (an ``@vf.intercept`` on the response): what the model wrote is not
    what the conversation goes on with."""

    @vf.intercept
    async def shout(self, response: vf.Response) -> vf.Response:
        message = response.message.model_copy(update={"content": (response.message.content or "").upper()})
        return response.model_copy(update={"message": message})


class ShoutingTaskset(vf.Taskset[ShoutingTask]):
    def load(self):
        yield ShoutingTask(vf.TaskData(prompt="hello"), self.config.task)


class Retell(vf.Env[vf.SingleAgentEnvConfig]):
    """Two segments: the model's opening reply, then a user turn asking for more."""

    async def run(self, task, agents) -> None:
        async with agents.agent.interaction(task) as talk:
            await talk.turn()
            await talk.turn("go on")


@pytest.mark.slow
async def test_a_reply_the_environment_rewrites_is_refused_as_a_diverged_conversation(monkeypatch, verifiers_can_run):
    module = types.ModuleType("rlfleet_verifiers_shouting")
    module.ShoutingTaskset, module.Retell, module.__all__ = ShoutingTaskset, Retell, ["ShoutingTaskset", "Retell"]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    shouting = type("Shouting", (VerifiersEnvironment,), {"taskset_id": module.__name__, "idle_shutdown_seconds": 0})
    env = shouting()
    try:
        assert await env.reset(Task(prompt=[{"role": "user", "content": "hello"}])) == [
            {"role": "user", "content": "hello"}]
        with pytest.raises(VerifiersConversationDiverged, match="sent back .*'HI THERE'.* as the model's reply, "
                                                                "which was .*'hi there'"):
            await env.step(AssistantTurn(text="hi there"))
    finally:
        await env.close()
    assert await verifiers_children_left("runtimes/scripts") == []
