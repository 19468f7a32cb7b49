"""Multi-turn episodes through the whole suite as real processes: collector, environment service,
a vLLM replica, reference, reward and trajectory. The trainer's tokens are exactly the prompt, the
sampled and the observation tokens; behaviour and reference log-probs match a plain Hugging Face
forward over the full sequence; each turn records the versions that sampled it; an environment
that fails ends its prompt as a dead letter while the run goes on; a SIGKILLed environment service
loses no episode.

Needs root (the environment service's sandbox drops to uid 65534; it refuses to start without one).
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
import torch

from rlfleet.services.launch import ServiceProcess
from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite
from rlfleet.v1 import collector_pb2, collector_pb2_grpc, sampling_pb2
from rlfleet.wire import encode_tensor
from tests.hf_reference import load_hf, response_log_probs
from tests.integration.readers import Reader, runs
from tests.integration.suites import episode_collector_args
from tests.integration.pushes import push
from tests.scrape import scrape_metric
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops to uid 65534, which needs root")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GROUP = 2
ENVIRONMENTS = {"counter": "tests.environments:CounterEnv", "gated": "tests.environments:GatedCounterEnv",
                "raising": "tests.environments:RaisingEnv"}
COUNTER_REWARD = 1 + 2 + 3 + 30
"""CounterEnv: turn i rewarded i, 10 per turn at the end."""
TIMEOUT = 300.0
"""Until episodes of a few turns of at most 16 tokens are generated, scored and appended on a loaded machine."""


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    """GatedCounterEnv's gate directory (see tests/environments.py)."""
    return tmp_path_factory.mktemp("gate")


@pytest.fixture(scope="module")
def suite(tiny_model_dir, tmp_path_factory, gate):
    options = SuiteOptions(
        model_dir=tiny_model_dir, environments=ENVIRONMENTS,
        environment_env={"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
                         "RLFLEET_TEST_GATE_DIR": str(gate)},
        collector_args=episode_collector_args("counter", GROUP, max_episode_tokens=512), metrics=True)
    procs = start_suite(options, tmp_path_factory.mktemp("episodes"))
    yield procs
    stop_suite(procs)




def submit(channel, specs: list[collector_pb2.PromptSpec]) -> list[str]:
    stub = collector_pb2_grpc.CollectorServiceStub(channel)
    return list(stub.SubmitPrompts(collector_pb2.SubmitPromptsRequest(prompts=specs), timeout=30).prompt_ids)


def chat(prompt_id: str, content: str, environment: str = "") -> collector_pb2.PromptSpec:
    return collector_pb2.PromptSpec(prompt_id=prompt_id, environment=environment, prompt=sampling_pb2.Prompt(
        chat=sampling_pb2.ChatMessages(messages=[sampling_pb2.ChatMessage(role="user", content=content)])))


def samples_of(channel, prompt_ids: set[str]) -> list[dict]:
    """Per-sample views of the batches read until every prompt in ``prompt_ids`` came (others skipped)."""
    found, pending, deadline = [], set(prompt_ids), time.monotonic() + TIMEOUT
    reader = Reader(channel, batch_size=GROUP)
    try:
        while pending:
            assert time.monotonic() < deadline, f"no batch for {sorted(pending)}"
            batch = reader.next()
            for i, prompt_id in enumerate(batch["prompt_id"]):
                if prompt_id in prompt_ids:
                    pending.discard(prompt_id)
                    sample = {key: batch[key][i] for key in batch.keys(include_nested=True, leaves_only=True)}
                    found.append({**sample, "prompt_id": prompt_id})
    finally:
        reader.close()
    return found



def test_a_three_turn_episode_is_token_exact_with_engine_and_reference_log_probs(channel, tokenizer, tiny_model_dir):
    submit(channel, [chat("count-0", "what is 2 plus 3")])
    samples = samples_of(channel, {"count-0"})
    assert len(samples) == GROUP
    model = load_hf(tiny_model_dir)
    opening = [{"role": "system", "content": "count with me"}, {"role": "user", "content": "what is 2 plus 3"}]
    prompt_ids = tokenizer(tokenizer.apply_chat_template(opening, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"]
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for sample in samples:
        prompt, response, full = sample["tokens", "prompt"], sample["tokens", "response"], sample["tokens", "full"]
        mask = sample["masks", "all_assistant_mask"]
        assert prompt.tolist() == prompt_ids
        assert full.tolist() == prompt.tolist() + response.tolist()
        assert len(mask) == len(full) and not mask[:len(prompt)].any()
        turns = runs(mask)
        assert len(turns) == 3, turns
        assert turns[-1][1] == len(full), "an episode ends on sampled tokens"
        # Between two sampled turns: exactly the chat template's rendering of CounterEnv's answer.
        for i, ((_, end), (next_start, _)) in enumerate(zip(turns, turns[1:]), start=1):
            closed = full[end - 1].item() == end_of_turn
            text = ("\n" if closed else "<|im_end|>\n") + f"<|im_start|>user\nturn {i}<|im_end|>\n<|im_start|>assistant\n"
            assert full[end:next_start].tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
        # Behaviour log-probs at the sampled positions: a plain HF forward over the full sequence.
        sampled = mask[len(prompt):]
        behaviour = sample["log_probs", "response"]
        assert len(behaviour) == len(response) == len(sample["ref_log_probs", "response"]) == len(sample["kl"])
        expected = response_log_probs(model, prompt.tolist(), response.tolist())
        assert (behaviour[sampled] - expected[sampled]).abs().max().item() <= 1e-4
        assert (behaviour[~sampled] == 0).all() and (sample["kl"][~sampled] == 0).all()
        assert (sample["ref_log_probs", "response"] - expected).abs().max().item() <= 1e-4
        versions = sample["turns", "policy_versions"]
        assert versions.shape == (3, 2)
        assert sample["environment_reward"].item() == COUNTER_REWARD == sample["score"].item()
        assert sample["next", "terminated"].item() and not sample["next", "truncated"].item()
    status = collector_pb2_grpc.CollectorServiceStub(channel).GetStatus(collector_pb2.GetStatusRequest(), timeout=30)
    assert status.episodes >= GROUP and status.episode_turns == 3 * status.episodes


def test_later_turns_find_their_history_in_the_prefix_cache(suite, channel):
    """Every later turn's history (prompt, earlier turns, observations: > 32 tokens) starts with a full KV
    block the replica computed for the episode's earlier turns; the collector counts the hit
    (rlfleet_episode_cached_prompt_tokens_total, from the samples' cached_prompt_tokens)."""
    port = suite["collector"].metrics_port
    before = {turn: (scrape_metric(port, "rlfleet_episode_prompt_tokens_total", turn=turn),
                     scrape_metric(port, "rlfleet_episode_cached_prompt_tokens_total", turn=turn))
              for turn in ("first", "later")}
    submit(channel, [chat("cached-0", "what is 4 plus 5")])
    assert len(samples_of(channel, {"cached-0"})) == GROUP
    later_prompt = scrape_metric(port, "rlfleet_episode_prompt_tokens_total", turn="later") - before["later"][0]
    later_cached = scrape_metric(port, "rlfleet_episode_cached_prompt_tokens_total", turn="later") - before["later"][1]
    first_prompt = scrape_metric(port, "rlfleet_episode_prompt_tokens_total", turn="first") - before["first"][0]
    assert first_prompt > 0 and later_prompt > first_prompt
    assert later_cached >= 32 * 2 * GROUP  # turns 2 and 3 of each episode: at least one 32-token block each
    assert later_cached < later_prompt


def test_a_weight_push_between_turns_is_recorded_per_turn(channel, tiny_model_dir, gate):
    state = load_hf(tiny_model_dir).state_dict()
    stub = collector_pb2_grpc.CollectorServiceStub(channel)
    before = stub.GetPolicyVersion(collector_pb2.GetPolicyVersionRequest(), timeout=30).version
    submit(channel, [chat("gated-0", "count to three", environment="gated")])
    # Both episodes sampled two turns at `before` and wait in their second step: push, then open the gate.
    wait_for(lambda: len(list(gate.glob("waiting-gated-0-*"))) == GROUP, TIMEOUT, "both episodes at their second step")
    assert push(channel, state).version == before + 1
    (gate / "open-gated-0").touch()
    samples = samples_of(channel, {"gated-0"})
    assert len(samples) == GROUP
    for sample in samples:
        assert sample["turns", "policy_versions"].tolist() == [[before, before], [before, before],
                                                               [before + 1, before + 1]]
        assert sample["policy_version_start"].item() == before
        assert sample["policy_version_end"].item() == before + 1


def test_bad_episodes_end_as_dead_letters_and_the_run_goes_on(channel):
    stub = collector_pb2_grpc.CollectorServiceStub(channel)
    spec = collector_pb2.PromptSpec(prompt_id="ids", environment="counter")
    encode_tensor(torch.tensor([1, 2, 3]), out=spec.prompt.token_ids)
    with pytest.raises(grpc.RpcError) as refused:
        submit(channel, [spec])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompts[0].prompt" in refused.value.details() and "token ids" in refused.value.details()
    submit(channel, [chat("raises-0", "hello", environment="raising"), chat("unknown-0", "hi", environment="nope"),
                     chat("count-after", "and now")])
    failures = lambda: {f.prompt_id: f for f in stub.ListFailures(collector_pb2.ListFailuresRequest(), timeout=30).failures}
    wait_for(lambda: {"raises-0", "unknown-0"} <= set(failures()), TIMEOUT, "the bad episodes' dead letters")
    raised, unknown = failures()["raises-0"], failures()["unknown-0"]
    assert raised.code == "FAILED_PRECONDITION" and "the scripted environment broke" in raised.error
    assert raised.attempts == 2
    assert unknown.code == "NOT_FOUND" and "nope" in unknown.error and unknown.attempts == 0  # refused: not retried
    (sample, *_) = samples_of(channel, {"count-after"})
    assert sample["environment_reward"].item() == COUNTER_REWARD


def test_a_sigkilled_environment_service_loses_no_episode(suite, channel, gate):
    stub = collector_pb2_grpc.CollectorServiceStub(channel)
    ids = submit(channel, [chat(f"survive-{i}", f"count {i}", environment="gated") for i in range(3)])
    # Every episode is mid-flight (one turn answered, its second step waiting) when the service dies.
    wait_for(lambda: len(list(gate.glob("waiting-survive-*"))) == 3 * GROUP, TIMEOUT, "the episodes at turn 2")
    old = suite["environment"]
    os.kill(old.process.pid, signal.SIGKILL)
    old.process.wait(30)
    restarted = ServiceProcess(old.name, [*old.args, "--port", str(old.port)], env=old.env)
    restarted.start(old.log_path.parent / "restarted").wait_ready(120)
    suite["environment"] = restarted
    for prompt_id in ids:
        (gate / f"open-{prompt_id}").touch()
    samples = samples_of(channel, set(ids))
    assert sorted({s["prompt_id"] for s in samples}) == sorted(ids) and len(samples) == 3 * GROUP
    assert all(s["environment_reward"].item() == COUNTER_REWARD for s in samples)
    assert all(len(s["turns", "policy_versions"]) == 3 for s in samples)
    dead = {f.prompt_id for f in stub.ListFailures(collector_pb2.ListFailuresRequest(), timeout=30).failures}
    assert not dead & set(ids)
