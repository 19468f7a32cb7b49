"""The environment service as a real process: token-exact episodes of a scripted environment and of
the built-in tool_calling one (a real sandbox), idempotent opens, environments that raise or hang
ending only their own episode, bounded open episodes and the idle reaper.

Needs root (the sandbox drops to uid 65534, and the service refuses to start without a sandbox).
"""

from __future__ import annotations

import json
import os
import subprocess

import grpc
import pytest
import torch

from rlfleet.services.launch import ServiceProcess, free_port
from rlfleet.v1 import environment_pb2, environment_pb2_grpc, sampling_pb2
from rlfleet.wire import decode_tensor, encode_tensor
from tests.scrape import scrape_metric
from tests.sandbox_cases import sandbox_processes
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops to uid 65534, which needs root")]

ENVIRONMENTS = {"counter": "tests.environments:CounterEnv", "raising": "tests.environments:RaisingEnv",
                "hanging": "tests.environments:HangingEnv"}
STEP_TIMEOUT_SECONDS = 10.0
"""The module's service's step_timeout_seconds: what cuts the hanging environment's step (its test waits this
long), with room for a sandboxed python tool call on a loaded 2-core machine (1 s was seen to cut one)."""
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHONPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))



def start(tiny_model_dir, workdir, *args: str) -> ServiceProcess:
    proc = ServiceProcess(
        "environment", ["--tokenizer-path", str(tiny_model_dir), "--log-format", "text", *args],
        env={"RLFLEET_ENVIRONMENT_ENVIRONMENTS": json.dumps(ENVIRONMENTS), "PYTHONPATH": PYTHONPATH})
    return proc.start(workdir)


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    proc = start(tiny_model_dir, tmp_path_factory.mktemp("environment"),
                 "--step-timeout-seconds", str(STEP_TIMEOUT_SECONDS), "--max-turns", "4", "--metrics-port", str(free_port()))
    try:
        yield proc.wait_ready(120)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def stub(service):
    with grpc.insecure_channel(service.address) as channel:
        yield environment_pb2_grpc.EnvironmentServiceStub(channel)


def sampled(tokenizer, text: str, *, eos: bool = True) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids + [tokenizer.eos_token_id] if eos else ids


def open_episode(stub, episode_id: str, environment: str = "counter", content: str = "count to three"):
    request = environment_pb2.OpenEpisodeRequest(
        environment=environment, episode_id=episode_id, prompt=[sampling_pb2.ChatMessage(role="user", content=content)])
    return stub.OpenEpisode(request, timeout=30)


def step(stub, episode_id: str, token_ids, finish_reason: str = "stop", text: str = ""):
    request = environment_pb2.StepRequest(episode_id=episode_id, finish_reason=finish_reason, text=text)
    encode_tensor(torch.as_tensor(token_ids, dtype=torch.int64), out=request.token_ids)
    return stub.Step(request, timeout=30)


def ids(tensor) -> list[int]:
    return decode_tensor(tensor).tolist()


def status_of(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, **kwargs)
    return caught.value


def test_a_scripted_episode_is_token_exact_with_per_turn_rewards(stub, tokenizer):
    opened = open_episode(stub, "counter-1")
    messages = [{"role": m.role, "content": m.content} for m in opened.messages]
    assert messages == [{"role": "system", "content": "count with me"}, {"role": "user", "content": "count to three"}]
    prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids(opened.prompt_token_ids) == tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    assert list(opened.tools_json) == []

    sequence = ids(opened.prompt_token_ids)
    for turn in (1, 2, 3):
        turn_ids = sampled(tokenizer, f"one {turn}")
        answer = step(stub, "counter-1", turn_ids)
        assert (answer.reward, answer.has_reward, answer.done, answer.truncated) == (turn, True, turn == 3, False)
        assert answer.info["text"] == f"one {turn}"  # decoded, the end-of-turn token left out
        sequence += turn_ids + ids(answer.observation_token_ids)
        messages.append({"role": "assistant", "content": f"one {turn}"})
        if turn < 3:
            assert [(m.role, m.content) for m in answer.observation] == [("user", f"turn {turn}")]
            assert tokenizer.decode(ids(answer.observation_token_ids)) == (
                f"\n<|im_start|>user\nturn {turn}<|im_end|>\n<|im_start|>assistant\n")
            messages.append({"role": "user", "content": f"turn {turn}"})
        else:
            assert ids(answer.observation_token_ids) == []
    # The episode's sequence is the template's rendering of its conversation, up to the last sampled
    # token (the template's newline after the final <|im_end|> was never sampled).
    assert tokenizer.decode(sequence) + "\n" == tokenizer.apply_chat_template(messages, tokenize=False)

    after_done = status_of(step, stub, "counter-1", sampled(tokenizer, "more"))
    assert after_done.code() == grpc.StatusCode.FAILED_PRECONDITION and "is over" in after_done.details()
    closed = stub.CloseEpisode(environment_pb2.CloseEpisodeRequest(episode_id="counter-1"), timeout=30)
    assert (closed.final_reward, closed.has_final_reward) == (30.0, True)
    gone = status_of(step, stub, "counter-1", sampled(tokenizer, "more"))
    assert gone.code() == grpc.StatusCode.NOT_FOUND and "closed" in gone.details()


def test_tool_calling_runs_python_and_answers_with_token_exact_observations(stub, tokenizer):
    opened = open_episode(stub, "tools-1", environment="tool_calling", content="what is 6 times 7?")
    assert [json.loads(tool)["function"]["name"] for tool in opened.tools_json] == ["python"]
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'

    first = step(stub, "tools-1", sampled(tokenizer, call))
    assert [(m.role, m.content) for m in first.observation] == [("tool", "42")]
    assert tokenizer.decode(ids(first.observation_token_ids)) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert (first.done, first.truncated, first.info["tool_calls"]) == (False, False, "1")

    cut = step(stub, "tools-1", sampled(tokenizer, call.replace("6 * 7", "6 * 8"), eos=False), finish_reason="length")
    assert [(m.role, m.content) for m in cut.observation] == [("tool", "48")]
    assert tokenizer.decode(ids(cut.observation_token_ids)) == (
        "<|im_end|>\n<|im_start|>tool\n48<|im_end|>\n<|im_start|>assistant\n")  # closes the cut turn

    last = step(stub, "tools-1", sampled(tokenizer, "the answer is 42"))
    assert (last.done, list(last.observation), ids(last.observation_token_ids)) == (True, [], [])
    closed = stub.CloseEpisode(environment_pb2.CloseEpisodeRequest(episode_id="tools-1"), timeout=30)
    assert not closed.has_final_reward


def metric(service, name: str, **labels: str) -> float:
    """One sample of the service's Prometheus endpoint (0 when it has none yet)."""
    port = next(arg for flag, arg in zip(service.args, service.args[1:]) if flag == "--metrics-port")
    return scrape_metric(port, name, **labels)


def test_tool_calls_are_counted_by_outcome_and_the_isolation_is_shown(service, stub, tokenizer):
    calls = {"ok": "print(6 * 7)", "error": "1 / 0"}
    before = {outcome: metric(service, "rlfleet_tool_calls_total", tool="python", outcome=outcome) for outcome in calls}
    open_episode(stub, "metrics-1", environment="tool_calling", content="what is 6 times 7?")
    for code in calls.values():
        call = '<tool_call>\n{"name": "python", "arguments": {"code": "%s"}}\n</tool_call>' % code
        step(stub, "metrics-1", sampled(tokenizer, call))
    stub.CloseEpisode(environment_pb2.CloseEpisodeRequest(episode_id="metrics-1"), timeout=30)

    for outcome in calls:
        assert metric(service, "rlfleet_tool_calls_total", tool="python", outcome=outcome) == before[outcome] + 1
    assert metric(service, "rlfleet_sandbox_isolation", isolation="bwrap") == 1


def python_pids(stub, tokenizer, episode_id: str, calls: int) -> list[str]:
    """What ``print(os.getpid(), os.getppid())`` answers, ``calls`` turns of one tool_calling episode."""
    open_episode(stub, episode_id, environment="tool_calling", content="which process are you?")
    code = "import os; print(os.getpid(), os.getppid())"
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "%s"}}\n</tool_call>' % code
    answers = [step(stub, episode_id, sampled(tokenizer, call)).observation[0].content for _ in range(calls)]
    stub.CloseEpisode(environment_pb2.CloseEpisodeRequest(episode_id=episode_id), timeout=30)
    return answers


def test_sandbox_per_episode_keeps_one_sandbox_for_the_episodes_calls(stub, tiny_model_dir, tmp_path, tokenizer):
    """Each call a fresh process, forked by a sandbox's zygote (pid 1). By default each call gets a
    sandbox of its own from the pool: reused after the call before it reset it (the module's service
    has run calls already: pids grow). With sandbox_per_episode an episode's calls share one (its pids
    grow from 2); the next episode gets that sandbox, reset after its last call (its pids go on
    growing); the service's stop ends it."""
    per_call = python_pids(stub, tokenizer, "pooled", 3)
    pooled_sandboxes = set(sandbox_processes())  # the module's service's, parked for its next calls
    proc = start(tiny_model_dir, tmp_path, "--sandbox-per-episode", "true", "--metrics-port", str(free_port()))
    try:
        with grpc.insecure_channel(proc.wait_ready(120).address) as channel:
            service = environment_pb2_grpc.EnvironmentServiceStub(channel)
            per_episode = python_pids(service, tokenizer, "kept", 3)
            next_episode = python_pids(service, tokenizer, "next", 2)
            counted = {name: metric(proc, f"rlfleet_{name}", **labels) for name, labels in (
                ("episode_sandboxes_started_total", {}), ("episode_sandboxes_reused_total", {}),
                ("episode_sandbox_resets_total", {"outcome": "clean"}),
                ("episode_sandbox_cpu_seconds_count", {"step": "call"}),
                ("episode_sandbox_cpu_seconds_sum", {"step": "call"}),
                ("episode_sandboxes", {"state": "idle"}))}
    finally:
        proc.stop()
    assert set(sandbox_processes()) <= pooled_sandboxes  # the parked sandbox ended with the service

    pooled = [int(answer.split()[0]) for answer in per_call]
    assert pooled == sorted(set(pooled)) and all(answer.endswith(" 1") for answer in per_call), per_call
    pids = [int(answer.split()[0]) for answer in per_episode + next_episode]
    assert per_episode[0] == "2 1" and pids == sorted(set(pids)), (per_episode, next_episode)
    assert all(answer.endswith(" 1") for answer in per_episode + next_episode)
    # one start, one reuse, no reset beyond the one after each call (each answered clean); five calls'
    # CPU as the zygote counted it
    assert {name: value for name, value in counted.items() if name != "episode_sandbox_cpu_seconds_sum"} == {
        "episode_sandboxes_started_total": 1, "episode_sandboxes_reused_total": 1,
        "episode_sandbox_resets_total": 0, "episode_sandbox_cpu_seconds_count": 5, "episode_sandboxes": 1}
    assert 0 < counted["episode_sandbox_cpu_seconds_sum"] < 5, counted


def test_opening_is_idempotent(stub):
    first = open_episode(stub, "twice")
    assert open_episode(stub, "twice") == first
    other = status_of(open_episode, stub, "twice", content="another task")
    assert other.code() == grpc.StatusCode.FAILED_PRECONDITION and "twice" in other.details()


def test_unknown_names_and_bad_input_are_named(stub, tokenizer):
    unknown = status_of(open_episode, stub, "u-1", environment="chess")
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    assert "'chess'" in unknown.details() and "counter" in unknown.details() and "tool_calling" in unknown.details()
    missing = status_of(step, stub, "never-opened", sampled(tokenizer, "hi"))
    assert missing.code() == grpc.StatusCode.NOT_FOUND and "never-opened" in missing.details()

    def invalid(field: str, call, *args, **kwargs) -> None:
        error = status_of(call, *args, **kwargs)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and field in error.details(), error.details()

    invalid("episode_id", open_episode, stub, "")
    bad_role = environment_pb2.OpenEpisodeRequest(environment="counter", episode_id="r",
                                                  prompt=[sampling_pb2.ChatMessage(role="wizard", content="x")])
    invalid("prompt[0].role", stub.OpenEpisode, bad_role, timeout=30)
    open_episode(stub, "bad-steps")
    invalid("token_ids", step, stub, "bad-steps", [[1, 2], [3, 4]])
    invalid("token_ids", step, stub, "bad-steps", [10**6])
    invalid("finish_reason", step, stub, "bad-steps", [1], finish_reason="tired")
    floats = environment_pb2.StepRequest(episode_id="bad-steps")
    encode_tensor(torch.tensor([1.0]), out=floats.token_ids)
    invalid("token_ids", stub.Step, floats, timeout=30)


def test_an_environment_that_raises_ends_only_its_episode(stub, tokenizer):
    open_episode(stub, "raises-1", environment="raising")
    error = status_of(step, stub, "raises-1", sampled(tokenizer, "hi"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "raises-1" in error.details() and "RuntimeError: the scripted environment broke" in error.details()
    ended = status_of(step, stub, "raises-1", sampled(tokenizer, "hi"))
    assert ended.code() == grpc.StatusCode.NOT_FOUND and "RuntimeError" in ended.details()
    open_episode(stub, "after-raise")
    assert step(stub, "after-raise", sampled(tokenizer, "hi")).reward == 1.0


def test_an_environment_that_hangs_is_cut_at_the_step_timeout(stub, tokenizer):
    open_episode(stub, "hangs-1", environment="hanging")
    error = status_of(step, stub, "hangs-1", sampled(tokenizer, "hi"))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "hangs-1" in error.details() and "step_timeout_seconds" in error.details()
    open_episode(stub, "after-hang")
    assert step(stub, "after-hang", sampled(tokenizer, "hi")).reward == 1.0


def test_open_episodes_are_bounded_and_idle_ones_reaped(tiny_model_dir, tmp_path, tokenizer):
    proc = start(tiny_model_dir, tmp_path, "--max-open-episodes", "2", "--idle-episode-seconds", "1")
    try:
        with grpc.insecure_channel(proc.wait_ready(120).address) as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            open_episode(stub, "a"), open_episode(stub, "b")
            full = status_of(open_episode, stub, "c")
            assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_open_episodes" in full.details()

            def opens() -> bool:
                try:
                    return bool(open_episode(stub, "c"))
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    return False

            wait_for(opens, 30, "the idle reaper to free a slot")
            reaped = status_of(step, stub, "a", sampled(tokenizer, "hi"))
            assert reaped.code() == grpc.StatusCode.NOT_FOUND and "idle" in reaped.details()
    finally:
        proc.stop()


def test_a_bad_environment_path_refuses_to_start(tiny_model_dir, tmp_path):
    proc = ServiceProcess("environment", ["--tokenizer-path", str(tiny_model_dir)],
                          env={"RLFLEET_ENVIRONMENT_ENVIRONMENTS": json.dumps({"nope": "tests.environments:Missing"}),
                               "PYTHONPATH": PYTHONPATH})
    proc.start(tmp_path)
    try:
        assert proc.process.wait(120) == 2
    except subprocess.TimeoutExpired:
        pytest.fail("the service started with a bad environments entry")
    finally:
        proc.stop()
    assert "environments['nope']" in proc.log_tail() and "Missing" in proc.log_tail()
