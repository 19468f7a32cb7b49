"""The OpenEnv adapter in-process, against real ``openenv-core`` environments (no sockets): the example
game (examples/openenv_guess.py) and environments written here. Reset and step map to chat messages,
rewards and done; kwargs, actions and observations follow OpenEnv's own server; a sync environment
lives on one thread of its own, an async one on the loop; a raising one ends its episode through the
environment service's ``Episodes`` as FAILED_PRECONDITION. The server side is in
tests/integration/test_openenv_adapter.py."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any, Optional

import pytest
from openenv.core.env_server.interfaces import Environment as OpenEnvBase
from openenv.core.env_server.types import Action, Observation, State

from rlfleet.env import AssistantTurn, Task
from rlfleet.services.environment.open_episodes import EnvironmentFailed, Episodes, OpenEpisodeLimits, StepTurn
from rlfleet.services.environment.openenv_adapter import OpenEnvEnvironment
from rlfleet.services.environment.rendering import ChatRenderer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openenv_guess.py"
TASK = Task(prompt=[{"role": "system", "content": "play fair"}, {"role": "user", "content": "let's play"}],
            ground_truth="42")


@pytest.fixture(scope="module")
def guess():
    spec = importlib.util.spec_from_file_location("openenv_guess_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def play(env: OpenEnvEnvironment, task: Task, texts: list[str]) -> tuple[list[dict], list]:
    try:
        opening = await env.reset(task)
        return opening, [await env.step(AssistantTurn(text=text)) for text in texts]
    finally:
        await env.close()


async def test_a_guess_episode_maps_observations_rewards_and_done(guess):
    opening, steps = await play(guess.GuessInProcess(), TASK, ["50<|im_end|>", "maybe 30?", "42<|im_end|>"])

    assert opening == [*TASK.prompt, {"role": "user", "content": "Guess a number from 1 to 100."}]
    assert [(s.messages, s.reward, s.done, s.truncated) for s in steps] == [
        ([{"role": "user", "content": "lower"}], -0.1, False, False),
        ([{"role": "user", "content": "higher"}], -0.1, False, False),
        ([{"role": "user", "content": "correct"}], 1.0, True, False),
    ]


# --- environments written here, against openenv-core's base classes ---


class ReadingAction(Action):
    dial: str


class ReadingObservation(Observation):
    temperature: int = 0
    note: str = ""


class Thermostat(OpenEnvBase):
    """Its reset takes ``seed`` only; records the thread of every call and whether it was closed."""

    instances: list["Thermostat"] = []

    def __init__(self) -> None:
        super().__init__()
        self.threads = {"init": threading.get_ident()}
        self.reset_with: dict[str, Any] = {}
        self.closed = 0
        self.temperature = 0
        Thermostat.instances.append(self)

    def reset(self, seed: Optional[int] = None) -> ReadingObservation:
        self.threads["reset"] = threading.get_ident()
        self.reset_with = {"seed": seed}
        self.temperature = seed or 0
        return ReadingObservation(temperature=self.temperature, note="set", metadata={"hidden": True})

    def step(self, action: ReadingAction, timeout_s: Optional[float] = None, **kwargs: Any) -> ReadingObservation:
        self.threads["step"] = threading.get_ident()
        if action.dial == "break":
            raise ValueError("the dial snapped")
        self.temperature += int(action.dial)
        return ReadingObservation(temperature=self.temperature, note="ok", reward=True, done=self.temperature > 25)

    @property
    def state(self) -> State:
        return State()

    def close(self) -> None:
        self.threads["close"] = threading.get_ident()
        self.closed += 1


class ThermostatEnv(OpenEnvEnvironment):
    openenv_class = Thermostat
    action_class = ReadingAction

    def reset_kwargs(self, task: Task) -> dict[str, Any]:
        return {"seed": 20, "difficulty": "hard"}  # Thermostat.reset takes no difficulty: dropped


async def test_observations_without_a_field_are_their_fields_as_json_and_unknown_reset_kwargs_are_dropped():
    Thermostat.instances.clear()
    opening, steps = await play(ThermostatEnv(), Task(prompt=[]), ["3", "4<|im_end|>"])

    (thermostat,) = Thermostat.instances
    assert thermostat.reset_with == {"seed": 20}
    assert opening == [{"role": "user", "content": '{"temperature": 20, "note": "set"}'}]  # no done/reward/metadata
    assert [(s.messages[0]["content"], s.reward, s.done) for s in steps] == [
        ('{"temperature": 23, "note": "ok"}', 1.0, False),  # a bool reward is a number
        ('{"temperature": 27, "note": "ok"}', 1.0, True),
    ]


async def test_a_sync_environment_lives_on_one_thread_of_its_own_and_is_closed_once():
    Thermostat.instances.clear()
    await play(ThermostatEnv(), Task(prompt=[]), ["1"])

    (thermostat,) = Thermostat.instances
    assert set(thermostat.threads) == {"init", "reset", "step", "close"}
    assert len(set(thermostat.threads.values())) == 1
    assert thermostat.threads["init"] != threading.get_ident()
    assert thermostat.closed == 1


class AsyncThermostat(Thermostat):
    async def reset_async(self, seed: Optional[int] = None, **kwargs: Any) -> ReadingObservation:
        observation = self.reset(seed)
        self.threads["reset"] = threading.get_ident()
        self.reset_with = {"seed": seed, **kwargs}
        return observation

    async def step_async(self, action: ReadingAction, timeout_s: Optional[float] = None,
                         **kwargs: Any) -> ReadingObservation:
        observation = self.step(action)
        self.threads["step"] = threading.get_ident()
        return observation


async def test_an_async_environment_is_awaited_on_the_event_loop():
    class AsyncThermostatEnv(ThermostatEnv):
        openenv_class = AsyncThermostat

    Thermostat.instances.clear()
    await play(AsyncThermostatEnv(), Task(prompt=[]), ["1"])

    (thermostat,) = Thermostat.instances
    assert thermostat.threads["reset"] == thermostat.threads["step"] == threading.get_ident()
    assert thermostat.reset_with == {"seed": 20, "difficulty": "hard"}  # its **kwargs takes every keyword
    assert thermostat.threads["close"] == thermostat.threads["init"] != threading.get_ident()


async def test_a_factory_function_picked_fields_and_the_tool_role():
    def make_thermostat() -> Thermostat:
        return Thermostat()

    class Picked(ThermostatEnv):
        openenv_class = make_thermostat  # a plain function: called unbound, with no arguments
        observation_field = "temperature"
        observation_role = "tool"

    opening, (step,) = await play(Picked(), Task(prompt=[]), ["5"])
    assert opening == [{"role": "tool", "content": "20"}]  # a non-str field is its JSON
    assert step.messages == [{"role": "tool", "content": "25"}]

    class Missing(ThermostatEnv):
        observation_field = "humidity"

    with pytest.raises(KeyError, match="no field 'humidity'; its fields: temperature, note"):
        await play(Missing(), Task(prompt=[]), [])


class TwoFieldAction(Action):
    code: str
    language: str
    timeout: float = 1.0


def test_the_models_text_goes_into_the_one_required_str_field_less_its_end_of_turn_token():
    class Reading(ThermostatEnv):
        pass

    turn = AssistantTurn(text="print(1)<|im_end|>")
    assert Reading().make_action(turn) == ReadingAction(dial="print(1)")
    assert Reading().action_text(AssistantTurn(text="a</s>")) == "a"
    assert Reading().action_text(AssistantTurn(text="<|im_end|> inside")) == "<|im_end|> inside"

    class Ambiguous(ThermostatEnv):
        action_class = TwoFieldAction

    with pytest.raises(TypeError, match=r"TwoFieldAction has 2 required str fields \(code, language\).*action_field"):
        Ambiguous().make_action(turn)

    class Remote(OpenEnvEnvironment):
        base_url = "http://127.0.0.1:8000"
        action_field = "message"

    assert Remote().make_action(turn) == {"message": "print(1)"}  # no action class: a dict for the server


def test_a_subclass_missing_its_settings_says_what_to_set():
    class Neither(OpenEnvEnvironment):
        action_field = "message"

    class Both(Neither):
        openenv_class = Thermostat
        base_url = "http://127.0.0.1:8000"

    class Untyped(OpenEnvEnvironment):
        openenv_class = Thermostat
        action_field = "dial"

    class NoAction(OpenEnvEnvironment):
        base_url = "http://127.0.0.1:8000"

    for subclass in (Neither, Both):
        with pytest.raises(TypeError, match="set exactly one of openenv_class .* and base_url"):
            subclass()
    with pytest.raises(TypeError, match="in-process OpenEnv environment needs action_class"):
        Untyped()
    with pytest.raises(TypeError, match="set action_class or action_field"):
        NoAction()


# --- through the environment service's episodes (token-exact rendering, errors) ---


@pytest.fixture(scope="module")
def renderer(tiny_model_dir) -> ChatRenderer:
    return ChatRenderer.from_pretrained(str(tiny_model_dir))


async def test_episodes_host_it_and_end_the_episode_when_the_openenv_environment_raises(renderer, guess):
    limits = OpenEpisodeLimits(max_turns=8, max_open_episodes=8, step_timeout_seconds=30, idle_episode_seconds=600)
    episodes = Episodes(renderer, {"guess": guess.GuessInProcess, "thermostat": ThermostatEnv}, limits)
    tokens = renderer.tokenizer("50", add_special_tokens=False)["input_ids"] + [renderer.tokenizer.eos_token_id]

    opening = await episodes.open("g", "guess", TASK)
    assert opening.messages[-1] == {"role": "user", "content": "Guess a number from 1 to 100."}
    answer = await episodes.step("g", StepTurn(token_ids=tokens, text=None, finish_reason="stop", number=1))
    assert (answer.observation, answer.reward, answer.done) == ([{"role": "user", "content": "lower"}], -0.1, False)
    assert renderer.tokenizer.decode(answer.observation_token_ids) == (
        "\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n")
    await episodes.close("g")

    Thermostat.instances.clear()
    await episodes.open("t", "thermostat", Task(prompt=[{"role": "user", "content": "heat"}]))
    broken = renderer.tokenizer("break", add_special_tokens=False)["input_ids"]
    ended = "step raised ValueError: the dial snapped; the episode is ended"
    with pytest.raises(EnvironmentFailed, match=ended) as failed:
        await episodes.step("t", StepTurn(token_ids=broken, text=None, finish_reason="length", number=1))
    assert failed.value.code == "FAILED_PRECONDITION"
    assert len(episodes) == 0 and Thermostat.instances[0].closed == 1
