"""The OpenEnv adapter against real OpenEnv servers (``openenv-core``'s own ``create_app`` under uvicorn,
each a subprocess of this test): the example game (examples/openenv_guess.py) and the echo environment
``openenv init`` generates, run unchanged, through OpenEnv's generic client and through the echo
environment's own client; a server that is down or dies mid-episode is a clear
``OpenEnvConnectionError``; and the environment service (a real process) hosting both kinds, where
those errors answer FAILED_PRECONDITION."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from rlfleet.env import AssistantTurn, Task
from rlfleet.services.environment.openenv_adapter import OpenEnvConnectionError, OpenEnvEnvironment
from rlfleet.services.launch import ServiceProcess, free_port
from rlfleet.v1 import environment_pb2, environment_pb2_grpc, sampling_pb2
from rlfleet.wire import decode_tensor, encode_tensor
from tests.example_modules import import_example
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SERVER_START_SECONDS = 120  # a Python process importing openenv-core (gradio, fastmcp), on a loaded 2-core machine
TASK = Task(prompt=[{"role": "user", "content": "let's play"}], ground_truth="42")
GUESSES = ["50<|im_end|>", "maybe 30?", "42<|im_end|>"]
GUESS_STEPS = [([{"role": "user", "content": "lower"}], -0.1, False),
               ([{"role": "user", "content": "higher"}], -0.1, False),
               ([{"role": "user", "content": "correct"}], 1.0, True)]


class OpenEnvServer:
    """``uvicorn <app>`` as a subprocess of this test; ready once OpenEnv's ``/health`` answers."""

    def __init__(self, *app: str, cwd: Path, pythonpath: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "uvicorn", *app, "--host", "127.0.0.1", "--port", str(self.port),
                   "--log-level", "warning"]
        path = os.pathsep.join(filter(None, [str(pythonpath), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for(self._ready, SERVER_START_SECONDS, f"the OpenEnv server on port {self.port} to answer /health")

    def _ready(self) -> bool:
        if self.process.poll() is not None:  # died at start: fail now, with its reason
            raise RuntimeError(f"the OpenEnv server exited at start: {self.process.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process.stderr.close()


def guess_server() -> OpenEnvServer:
    return OpenEnvServer("--factory", "openenv_guess:app", cwd=ROOT, pythonpath=EXAMPLES)


@pytest.fixture(scope="module")
def guess_module():
    return import_example("openenv_guess")


@pytest.fixture
def own_guess_server():
    """A server a test may kill."""
    server = guess_server()
    yield server
    server.kill()


def remote(guess_module, url: str) -> OpenEnvEnvironment:
    class Remote(guess_module.GuessRemote):
        base_url = url

    return Remote()


async def play(env: OpenEnvEnvironment, task: Task, texts: list[str]) -> tuple[list[dict], list[tuple]]:
    try:
        opening = await env.reset(task)
        steps = [await env.step(AssistantTurn(text=text)) for text in texts]
    finally:
        await env.close()
    return opening, [(step.messages, step.reward, step.done) for step in steps]


async def test_a_remote_episode_matches_the_in_process_one(guess_module, own_guess_server):
    remote_run = await play(remote(guess_module, own_guess_server.url), TASK, GUESSES)
    in_process_run = await play(guess_module.GuessInProcess(), TASK, GUESSES)

    assert remote_run == in_process_run
    assert remote_run == ([*TASK.prompt, {"role": "user", "content": "Guess a number from 1 to 100."}], GUESS_STEPS)


async def test_a_server_that_is_down_or_dies_mid_episode_raises_a_connection_error_naming_it(guess_module,
                                                                                           own_guess_server):
    url = own_guess_server.url
    env = remote(guess_module, url)
    await env.reset(TASK)
    own_guess_server.kill()
    with pytest.raises(OpenEnvConnectionError, match=f"the OpenEnv server at {url}: step failed: ConnectionClosed"):
        await env.step(AssistantTurn(text="7"))
    await env.close()  # nothing left to close: no error

    down = remote(guess_module, url)
    with pytest.raises(OpenEnvConnectionError,
                       match=f"the OpenEnv server at {url}: reset failed: ConnectionError: Failed to connect"):
        await down.reset(TASK)
    await down.close()


@pytest.fixture(scope="module")
def echo_env_dir(tmp_path_factory) -> Path:
    """The echo environment ``openenv init`` writes (OpenEnv's template: models, server, client)."""
    parent = tmp_path_factory.mktemp("openenv-init")
    init = subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env", "--output-dir", str(parent)],
                          capture_output=True, text=True, timeout=SERVER_START_SECONDS)
    assert init.returncode == 0, init.stdout + init.stderr
    return parent / "echo_env"


async def test_the_echo_environment_openenv_init_writes_runs_unchanged_both_ways(echo_env_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(echo_env_dir.parent))
    from echo_env import EchoAction, EchoEnv  # the generated package: its models and its own client
    from echo_env.server.echo_env_environment import EchoEnvironment

    class InProcess(OpenEnvEnvironment):
        openenv_class = EchoEnvironment
        action_class = EchoAction
        observation_field = "echoed_message"

    server = OpenEnvServer("server.app:app", cwd=echo_env_dir, pythonpath=echo_env_dir)  # as its README says
    try:
        class Remote(OpenEnvEnvironment):
            base_url = server.url
            client_class = EchoEnv
            action_class = EchoAction
            observation_field = "echoed_message"

        runs = [await play(env, Task(prompt=[]), ["hello<|im_end|>", "hi"]) for env in (InProcess(), Remote())]
    finally:
        server.kill()

    assert runs[0] == runs[1] == (
        [{"role": "user", "content": "Echo Env environment ready!"}],
        [([{"role": "user", "content": "hello"}], pytest.approx(0.5), False),  # its reward: 0.1 per character
         ([{"role": "user", "content": "hi"}], pytest.approx(0.2), False)])


# --- the environment service hosting OpenEnv environments ---


@pytest.mark.skipif(os.geteuid() != 0, reason="the service's sandbox drops to uid 65534, which needs root")
def test_the_environment_service_hosts_openenv_episodes_and_answers_failed_precondition_when_the_server_is_gone(
        tiny_model_dir, tmp_path, own_guess_server):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    environments = {"guess": "openenv_guess:GuessInProcess", "guess_remote": "openenv_guess:GuessRemote"}
    service = ServiceProcess("environment", ["--tokenizer-path", str(tiny_model_dir), "--log-format", "text"], env={
        "RLFLEET_ENVIRONMENT_ENVIRONMENTS": json.dumps(environments), "OPENENV_GUESS_URL": own_guess_server.url,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(EXAMPLES), os.environ.get("PYTHONPATH")]))})
    service.start(tmp_path)
    try:
        service.wait_ready(SERVER_START_SECONDS + 60)
        with grpc.insecure_channel(service.address) as channel:
            check_service(environment_pb2_grpc.EnvironmentServiceStub(channel), tokenizer, own_guess_server)
    finally:
        service.stop()


def check_service(stub, tokenizer, server: OpenEnvServer) -> None:
    def open_episode(episode_id: str, environment: str):
        return stub.OpenEpisode(environment_pb2.OpenEpisodeRequest(
            environment=environment, episode_id=episode_id, ground_truth=TASK.ground_truth,
            prompt=[sampling_pb2.ChatMessage(**message) for message in TASK.prompt]), timeout=60)

    def step(episode_id: str, number: int, text: str):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        request = environment_pb2.StepRequest(episode_id=episode_id, turn=number, finish_reason="stop")
        encode_tensor(torch.as_tensor(ids, dtype=torch.int64), out=request.token_ids)
        return stub.Step(request, timeout=60)

    for environment in ("guess", "guess_remote"):
        opened = open_episode(environment, environment)
        assert [(m.role, m.content) for m in opened.messages] == [
            ("user", "let's play"), ("user", "Guess a number from 1 to 100.")]
        answers = [step(environment, number, text) for number, text in enumerate(["50", "30", "42"], start=1)]
        assert [([{"role": m.role, "content": m.content} for m in a.observation], a.reward, a.done)
                for a in answers] == [(messages, pytest.approx(reward), done) for messages, reward, done in GUESS_STEPS]
        assert tokenizer.decode(decode_tensor(answers[0].observation_token_ids).tolist()) == (
            "\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n")
        stub.CloseEpisode(environment_pb2.CloseEpisodeRequest(episode_id=environment), timeout=60)

    open_episode("cut-off", "guess_remote")
    server.kill()
    with pytest.raises(grpc.RpcError) as mid_episode:
        step("cut-off", 1, "50")
    with pytest.raises(grpc.RpcError) as at_open:
        open_episode("unreachable", "guess_remote")
    for caught, what in ((mid_episode, "step failed: ConnectionClosed"), (at_open, "reset failed: ConnectionError")):
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, caught.value.details()
        assert f"the OpenEnv server at {server.url}: {what}" in caught.value.details()
