"""A verifiers 0.4 environment through the whole suite as real processes: the example
(examples/verifiers_sums.py: a ``Taskset``, a calculator ``Toolset``, a tutoring ``Env``), played by
verifiers' own chat program (its ``null`` harness, run with ``uv``) inside the environment service,
whose model calls the adapter's endpoint answers with the turns the collector sampled on the vLLM
replica. The trainer's tokens are exactly the prompt, the sampled and the observation tokens;
behaviour log-probs match a plain Hugging Face forward at the sampled positions; each turn records
its policy versions; the verifiers reward reaches the batch; a rollout that raises ends its prompt
as a dead letter quoting the error.

Needs root (the environment service's sandbox drops to uid 65534; it refuses to start without one).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite
from rlfleet.v1 import collector_pb2, collector_pb2_grpc, sampling_pb2
from tests.hf_reference import load_hf, response_log_probs
from tests.integration.readers import Reader, runs
from tests.integration.suites import episode_collector_args
from tests.waiting import wait_for
from tests.example_modules import import_example

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops to uid 65534, which needs root")]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GROUP = 2
TIMEOUT = 400.0
"""Until a group of episodes (a chat program started per segment, up to 3 segments) is generated, scored and
appended on a loaded 2-core machine."""


@pytest.fixture(scope="module")
def example():
    return import_example("verifiers_sums")


@pytest.fixture(scope="module")
def suite(tiny_model_dir, tmp_path_factory):
    options = SuiteOptions(
        model_dir=tiny_model_dir, environments={"sums": "verifiers_sums:Sums"},
        environment_env={  # the taskset's module for verifiers, uv (this virtualenv's bin) for its chat program
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(EXAMPLES), os.environ.get("PYTHONPATH")])),
            "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])},
        environment_args=["--step-timeout-seconds", "240"],
        collector_args=episode_collector_args("sums", GROUP, max_episode_tokens=1024))
    procs = start_suite(options, tmp_path_factory.mktemp("verifiers"))
    yield procs
    stop_suite(procs)




def submit(channel, prompt_id: str, question: str, answer: str) -> None:
    spec = collector_pb2.PromptSpec(prompt_id=prompt_id, ground_truth=answer, prompt=sampling_pb2.Prompt(
        chat=sampling_pb2.ChatMessages(messages=[sampling_pb2.ChatMessage(role="user", content=question)])))
    collector_pb2_grpc.CollectorServiceStub(channel).SubmitPrompts(
        collector_pb2.SubmitPromptsRequest(prompts=[spec]), timeout=30)


def samples_of(channel, prompt_id: str) -> list[dict]:
    """The per-sample views of the first batch holding ``prompt_id``'s group (other batches skipped)."""
    reader, deadline = Reader(channel, batch_size=GROUP), time.monotonic() + TIMEOUT
    try:
        while True:
            assert time.monotonic() < deadline, f"no batch for {prompt_id}"
            batch = reader.next()
            keys = list(batch.keys(include_nested=True, leaves_only=True))
            found = [{key: batch[key][i] for key in keys} for i, sample_id in enumerate(batch["prompt_id"])
                     if sample_id == prompt_id]
            if found:
                return found
    finally:
        reader.close()



def test_episodes_are_token_exact_and_carry_the_verifiers_reward(channel, tokenizer, tiny_model_dir, example):
    submit(channel, "sum-0", "what is 2 plus 3", "5")
    samples = samples_of(channel, "sum-0")
    assert len(samples) == GROUP
    opening = [{"role": "system", "content": example.SYSTEM_PROMPT}, {"role": "user", "content": "what is 2 plus 3"}]
    parameters = {"type": "object", "properties": {"a": {"title": "A", "type": "integer"},  # in the order sent
                                                   "b": {"title": "B", "type": "integer"}},
                  "required": ["a", "b"], "title": "addArguments"}
    tools = [{"type": "function",  # what verifiers' chat program offers for Calculator.add
              "function": {"name": "add", "description": "Add two integers.", "parameters": parameters}}]
    text = tokenizer.apply_chat_template(opening, tools=tools, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    end_of_turn = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    model = load_hf(tiny_model_dir)
    turn_counts = []
    for sample in samples:
        prompt, response, full = sample["tokens", "prompt"], sample["tokens", "response"], sample["tokens", "full"]
        mask = sample["masks", "all_assistant_mask"]
        assert prompt.tolist() == prompt_ids
        assert full.tolist() == prompt.tolist() + response.tolist()
        assert len(mask) == len(full) and not mask[:len(prompt)].any()
        turns = runs(mask)
        assert turns[-1][1] == len(full), "an episode ends on sampled tokens"
        # What the tutor saw: each turn's content (less its end-of-turn token); it asks again until right, 3 at most.
        replies = [tokenizer.decode(full[start:end - 1 if full[end - 1].item() in end_of_turn else end].tolist())
                   for start, end in turns]
        asked = next((i + 1 for i, reply in enumerate(replies) if example.correct_score("5", reply)), 3)
        assert len(turns) == asked, replies
        turn_counts.append(len(turns))
        # Between two sampled turns: exactly the chat template's rendering of the tutor's question.
        for (_, end), (next_start, _) in zip(turns, turns[1:]):
            closed = full[end - 1].item() in end_of_turn
            text = ("\n" if closed else "<|im_end|>\n") + f"<|im_start|>user\n{example.RETRY}<|im_end|>\n" \
                "<|im_start|>assistant\n"
            assert full[end:next_start].tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
        # Behaviour log-probs at the sampled positions: a plain HF forward over the full sequence.
        sampled = mask[len(prompt):]
        behaviour = sample["log_probs", "response"]
        expected = response_log_probs(model, prompt.tolist(), response.tolist())
        assert (behaviour[sampled] - expected[sampled]).abs().max().item() <= 1e-4
        assert (behaviour[~sampled] == 0).all()
        assert sample["turns", "policy_versions"].shape == (len(turns), 2)
        # The verifiers reward (SumTask's rewards over the last reply) is the sample's environment reward and score.
        last = replies[-1].strip()
        reward = example.correct_score("5", last) + 0.5 * example.concise_score(last)
        assert sample["environment_reward"].item() == pytest.approx(reward) == sample["score"].item()
    assert max(turn_counts) > 1, "the tiny model answered 5 at once in every episode: no observation was checked"


def test_a_rollout_that_raises_ends_its_prompt_as_a_dead_letter_quoting_the_error(channel):
    submit(channel, "broken-0", "what is 2 plus 3", "five")  # SumTutor's check raises on a non-integer answer
    stub = collector_pb2_grpc.CollectorServiceStub(channel)
    failures = lambda: {f.prompt_id: f for f in stub.ListFailures(collector_pb2.ListFailuresRequest(),
                                                                  timeout=30).failures}
    failure = wait_for(lambda: failures().get("broken-0"), TIMEOUT, "the raising rollout's dead letter")
    assert failure.code == "FAILED_PRECONDITION" and failure.attempts == 2
    assert "VerifiersRolloutFailed" in failure.error
    assert "invalid literal for int() with base 10: 'five'" in failure.error
