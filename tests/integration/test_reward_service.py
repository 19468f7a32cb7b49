"""The reward service as a real process: hand-checkable rewards on real tiny-model tokens,
the adaptive KL controller across restarts, bad input that names the sample, and bounded
resources (linear-time patterns, a time limit on slow reward functions, size bounds)."""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from rlfleet.services.launch import ServiceProcess
from rlfleet.v1 import reward_pb2, reward_pb2_grpc
from rlfleet.wire import Ragged, decode_ragged, decode_tensor, encode_ragged
from rlfleet.wire.error_details import sample_error_of
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

PROMPTS = ["what is 2 plus 3 ?", "what is 2 plus 3 ?", "what is 4 plus 4 ?", "what is 4 plus 4 ?"]
RESPONSES = [" the answer is 5", " the answer is 7", " 4 plus 4 equals 8", " eight 8"]
TRUTHS = ["5", "5", "8", "8"]
GROUPS = [11, 11, 42, 42]
INIT_KL_COEF = 0.05


@pytest.fixture(scope="module")
def tiny_model(request) -> Path:
    from rlfleet.services.models.tiny import build_tiny_model

    return build_tiny_model(request.config.cache.mkdir("rlfleet-tiny-model"))


@dataclass
class Batch:
    token_ids: list[torch.Tensor]
    ref_log_probs: list[torch.Tensor]
    offsets: list[torch.Tensor]

    @property
    def behavior_log_probs(self) -> list[torch.Tensor]:
        return [ref + offset for ref, offset in zip(self.ref_log_probs, self.offsets)]


@pytest.fixture(scope="module")
def batch(tiny_model) -> Batch:
    """Real tokens and real reference log-probs of the tiny model; behaviour = ref + known offsets."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    token_ids, ref_log_probs, offsets = [], [], []
    for index, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        prompt_ids = tokenizer(prompt)["input_ids"]
        response_ids = tokenizer(response)["input_ids"]
        assert tokenizer.decode(response_ids) == response
        ids = torch.tensor(prompt_ids + response_ids)
        with torch.inference_mode():
            log_probs = model(ids.unsqueeze(0)).logits[0].log_softmax(-1)
        chosen = log_probs[:-1].gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)[len(prompt_ids) - 1:]
        token_ids.append(torch.tensor(response_ids))
        ref_log_probs.append(chosen.float())
        # Hand-picked: k1 must come back as exactly these numbers.
        offsets.append(torch.tensor([0.01 * (position + 1) * (-1) ** index for position in range(len(response_ids))]))
    return Batch(token_ids, ref_log_probs, offsets)


def make_request(batch: Batch, *, texts=True, **fields) -> reward_pb2.ComputeRewardsRequest:
    request = reward_pb2.ComputeRewardsRequest(
        response_token_ids=encode_ragged(Ragged.from_list(batch.token_ids, torch.int64)),
        behavior_log_probs=encode_ragged(Ragged.from_list(batch.behavior_log_probs, torch.float32)),
        ref_log_probs=encode_ragged(Ragged.from_list(batch.ref_log_probs, torch.float32)),
        prompt_texts=PROMPTS,
        response_texts=RESPONSES if texts else [],
        tasks=[reward_pb2.Task(reward_fn="numeric_match", ground_truth=truth) for truth in TRUTHS],
        group_ids=GROUPS,
    )
    for name, value in fields.items():
        if isinstance(value, list):
            del getattr(request, name)[:]
            getattr(request, name).extend(value)
        elif isinstance(value, Message):
            getattr(request, name).CopyFrom(value)
        else:
            setattr(request, name, value)
    return request


@pytest.fixture(scope="module")
def user_rewards(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("user_rewards")
    (directory / "task_rewards.py").write_text(textwrap.dedent("""
        import os
        import time

        def mentions(sample, word="answer", bonus=1.0):
            return bonus if word in sample.response else 0.0

        def picky(sample):
            if "7" in sample.response:
                raise ValueError("sevens are not allowed")
            return 1.0

        def spin(sample, started, release):
            # A CPU-bound reward (pure Python) that runs until the test releases it.
            open(started, "w").close()
            deadline = time.monotonic() + 300
            while not os.path.exists(release) and time.monotonic() < deadline:
                sum(range(1000))
            return 1.0
    """))
    return directory


@pytest.fixture(scope="module")
def reward(tiny_model, user_rewards, tmp_path_factory):
    """One service for the read-only tests: tokenizer by flag, functions by env var (JSON)."""
    functions = {"mentions_answer": {"function": "task_rewards:mentions", "params": {"bonus": 2.0}},
                 "picky": {"function": "task_rewards:picky"}}
    proc = ServiceProcess(
        "reward",
        ["--tokenizer-path", str(tiny_model), "--init-kl-coef", str(INIT_KL_COEF), "--score-clip", "10",
         "--log-format", "text"],
        env={"RLFLEET_REWARD_REWARD_FUNCTIONS": json.dumps(functions), "PYTHONPATH": str(user_rewards)},
    )
    proc.start(tmp_path_factory.mktemp("reward"))
    try:
        proc.wait_ready(300)
        yield proc
    finally:
        proc.stop()


def stub_for(proc: ServiceProcess):
    channel = grpc.insecure_channel(proc.address)
    return reward_pb2_grpc.RewardServiceStub(channel), channel


@pytest.fixture(scope="module")
def stub(reward):
    stub, channel = stub_for(reward)
    yield stub
    channel.close()


def close(got, want, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float32),
                               torch.as_tensor(want, dtype=torch.float32), atol=atol, rtol=0)


def test_hand_checkable_rewards_on_real_tokens(reward, stub, batch):
    assert reward.health() == health_pb2.HealthCheckResponse.SERVING
    reply = stub.ComputeRewards(make_request(batch), timeout=60)

    kl = decode_ragged(reply.kl, "kl").to_list()
    for got, offsets in zip(kl, batch.offsets):
        close(got, offsets)  # k1 = behaviour - reference = the offsets
    close(decode_tensor(reply.kl_sum), [float(o.sum()) for o in batch.offsets])
    close(decode_tensor(reply.kl_mean), [float(o.mean()) for o in batch.offsets])

    scores = decode_tensor(reply.scores)
    assert scores.tolist() == [1.0, 0.0, 1.0, 1.0]  # numeric_match on the response texts
    assert decode_tensor(reply.clipped_scores).tolist() == [1.0, 0.0, 1.0, 1.0]
    assert reply.kl_coef == pytest.approx(INIT_KL_COEF)

    rewards = decode_ragged(reply.rewards, "rewards").to_list()
    for sample, (got, offsets) in enumerate(zip(rewards, batch.offsets)):
        want = -INIT_KL_COEF * offsets
        want[-1] += float(scores[sample])
        close(got, want)

    # GRPO: group 11 scored {1, 0} -> +-1/sqrt(2) (unbiased std); group 42 scored {1, 1} -> 0.
    advantages = decode_tensor(reply.advantages)
    close(advantages, [1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, 0.0], atol=1e-5)
    for group in (11, 42):
        members = [i for i, g in enumerate(GROUPS) if g == group]
        assert abs(float(advantages[members].sum())) < 1e-6

    rloo = stub.ComputeRewards(make_request(batch, advantage_mode=reward_pb2.ADVANTAGE_MODE_RLOO), timeout=60)
    close(decode_tensor(rloo.advantages), [1.0, -1.0, 0.0, 0.0])
    k3 = stub.ComputeRewards(make_request(batch, kl_estimator=reward_pb2.KL_ESTIMATOR_K3), timeout=60)
    for got, offsets in zip(decode_ragged(k3.kl).to_list(), batch.offsets):
        close(got, torch.expm1(-offsets) + offsets)


def test_service_decodes_token_ids_when_no_texts_are_sent(stub, batch):
    reply = stub.ComputeRewards(make_request(batch, texts=False), timeout=60)
    assert decode_tensor(reply.scores).tolist() == [1.0, 0.0, 1.0, 1.0]
    exact = make_request(batch, texts=False, tasks=[reward_pb2.Task(reward_fn="exact_match", ground_truth=r)
                                                   for r in RESPONSES])
    assert decode_tensor(stub.ComputeRewards(exact, timeout=60).scores).tolist() == [1.0] * 4


def test_one_task_for_all_configured_user_function_and_mask(stub, batch):
    one = make_request(batch, tasks=[reward_pb2.Task(reward_fn="mentions_answer")])
    assert decode_tensor(stub.ComputeRewards(one, timeout=60).scores).tolist() == [2.0, 2.0, 0.0, 0.0]
    args = make_request(batch, tasks=[reward_pb2.Task(reward_fn="format", args={"pattern": ".*8", "reward": "3"})])
    assert decode_tensor(stub.ComputeRewards(args, timeout=60).scores).tolist() == [0.0, 0.0, 3.0, 3.0]

    # Masking the last token of every sample: its KL is 0 and the score moves one token earlier.
    masks = [torch.arange(ids.numel()) < ids.numel() - 1 for ids in batch.token_ids]
    reply = stub.ComputeRewards(make_request(batch, response_mask=encode_ragged(Ragged.from_list(masks))), timeout=60)
    for got, offsets, mask, score in zip(decode_ragged(reply.rewards).to_list(), batch.offsets, masks,
                                         [1.0, 0.0, 1.0, 1.0]):
        want = torch.where(mask, -INIT_KL_COEF * offsets, torch.zeros(()))
        want[-2] += score
        close(got, want)


def test_environment_rewards_add_to_the_function_score_and_everything_follows_from_the_sum(stub, batch):
    environment = [0.5, 2.0, -0.25, 12.0]
    reply = stub.ComputeRewards(make_request(batch, environment_rewards=environment,
                                             advantage_mode=reward_pb2.ADVANTAGE_MODE_GRPO_NO_STD), timeout=60)
    # numeric_match scores [1, 0, 1, 1]; the service clips at 10.
    assert decode_tensor(reply.scores).tolist() == [1.5, 2.0, 0.75, 13.0]
    clipped = decode_tensor(reply.clipped_scores)
    assert clipped.tolist() == [1.5, 2.0, 0.75, 10.0]
    # Group 11 = {1.5, 2}: mean 1.75. Group 42 = {0.75, 10}: mean 5.375.
    close(decode_tensor(reply.advantages), [-0.25, 0.25, -4.625, 4.625])
    for sample, (got, offsets) in enumerate(zip(decode_ragged(reply.rewards).to_list(), batch.offsets)):
        want = -INIT_KL_COEF * offsets
        want[-1] += float(clipped[sample])
        close(got, want)
    # GRPO: group 11's order flips against the function's scores alone ({1, 0}).
    grpo = stub.ComputeRewards(make_request(batch, environment_rewards=environment), timeout=60)
    close(decode_tensor(grpo.advantages), [-1 / math.sqrt(2), 1 / math.sqrt(2), -1 / math.sqrt(2), 1 / math.sqrt(2)],
          atol=1e-5)
    # "none": the environment alone.
    alone = stub.ComputeRewards(make_request(batch, environment_rewards=environment,
                                             tasks=[reward_pb2.Task(reward_fn="none")]), timeout=60)
    assert decode_tensor(alone.scores).tolist() == environment


def bad_requests(batch: Batch) -> dict:
    short_ref = Batch(batch.token_ids, [*batch.ref_log_probs[:1], batch.ref_log_probs[1][:-1],
                                        *batch.ref_log_probs[2:]], batch.offsets)
    nan = Batch(batch.token_ids, batch.ref_log_probs, [o.clone() for o in batch.offsets])
    nan.offsets[2][0] = float("nan")
    wrong_vocab = [ids.clone() for ids in batch.token_ids]
    wrong_vocab[3][1] = 10**6
    no_ref = make_request(batch)
    no_ref.ClearField("ref_log_probs")
    return {
        "log-prob lengths differ": (make_request(batch, ref_log_probs=encode_ragged(short_ref.ref_log_probs)),
                                    "INVALID_ARGUMENT", "sample 1: behavior_log_probs has"),
        "NaN behaviour log-prob": (make_request(nan), "INVALID_ARGUMENT",
                                   "sample 2, token 0: behavior_log_probs is nan"),
        "group ids do not cover the batch": (make_request(batch, group_ids=[1, 1, 2]), "INVALID_ARGUMENT",
                                             "group_ids has 3 entries for 4 samples"),
        "RLOO with a singleton group": (make_request(batch, group_ids=[1, 1, 2, 3],
                                                     advantage_mode=reward_pb2.ADVANTAGE_MODE_RLOO),
                                        "INVALID_ARGUMENT", "sample 2: group 2 has 1 samples, expected at least 2"),
        "unknown reward function": (make_request(batch, tasks=[reward_pb2.Task(reward_fn="exact_match"),
                                                               reward_pb2.Task(reward_fn="no_such_fn")] * 2),
                                    "NOT_FOUND", "sample 1: reward function 'no_such_fn' is not registered"),
        "import path from a request": (make_request(batch, tasks=[reward_pb2.Task(reward_fn="os:getcwd")]),
                                       "INVALID_ARGUMENT", "import paths are accepted only in the service config"),
        "reward model from a request": (make_request(batch, tasks=[reward_pb2.Task(reward_fn="reward_model")]),
                                        "NOT_FOUND", "sample 0: reward function 'reward_model' is not configured"),
        "missing ground truth": (make_request(batch, tasks=[reward_pb2.Task(reward_fn="numeric_match",
                                                                            ground_truth=t) for t in
                                                            ["5", "5", "", "8"]]),
                                 "INVALID_ARGUMENT", "sample 2: reward function 'numeric_match' needs a ground_truth"),
        "three tasks for four samples": (make_request(batch, tasks=[reward_pb2.Task()] * 3), "INVALID_ARGUMENT",
                                         "tasks has 3 entries for 4 samples"),
        "token id outside the tokenizer": (make_request(batch, texts=False, response_token_ids=encode_ragged(
            Ragged.from_list(wrong_vocab, torch.int64))), "INVALID_ARGUMENT", "sample 3, token 1: response_token_ids"),
        "missing ref_log_probs": (no_ref, "INVALID_ARGUMENT", "ref_log_probs.values: missing"),
        "unknown estimator": (make_request(batch, kl_estimator=9), "INVALID_ARGUMENT", "kl_estimator: unknown value 9"),
        "float mask": (make_request(batch, response_mask=encode_ragged([torch.ones(ids.numel())
                                                                         for ids in batch.token_ids])),
                       "INVALID_ARGUMENT", "response_mask: sample 0 must be bool"),
        "negative tolerance": (make_request(batch, tasks=[reward_pb2.Task(reward_fn="numeric_match", ground_truth=t,
                                                                          args={"tolerance": "-1"}) for t in TRUTHS]),
                               "INVALID_ARGUMENT",
                               "sample 0: reward function 'numeric_match': argument tolerance='-1': "
                               "Input should be greater than or equal to 0"),
        "configured function raises": (make_request(batch, tasks=[reward_pb2.Task(reward_fn="picky")]),
                                       "INVALID_ARGUMENT",
                                       "sample 1: reward function 'picky' raised ValueError: sevens are not allowed"),
        "backreference pattern": (make_request(batch, tasks=[reward_pb2.Task(reward_fn="format_check",
                                                                             args={"pattern": r"(a)\1"})]),
                                  "INVALID_ARGUMENT",
                                  "reward function 'format_check': argument pattern='(a)\\\\1' is an "
                                  "invalid regex: RE2 syntax is required"),
        "lookbehind ground truth": (make_request(batch, tasks=[reward_pb2.Task(reward_fn="regex_match",
                                                                               ground_truth="(?<=is )5")] * 4),
                                    "INVALID_ARGUMENT", "sample 0: reward function 'regex_match': ground_truth="),
        "environment rewards not one per sample": (make_request(batch, environment_rewards=[1.0] * 3),
                                                   "INVALID_ARGUMENT",
                                                   "environment_rewards has 3 entries for 4 samples"),
        "NaN environment reward": (make_request(batch, environment_rewards=[0.0, 0.0, float("nan"), 0.0]),
                                   "INVALID_ARGUMENT", "sample 2: environment_rewards is nan"),
        "infinite environment reward": (make_request(batch, environment_rewards=[float("inf"), 0.0, 0.0, 0.0]),
                                        "INVALID_ARGUMENT", "sample 0: environment_rewards is inf"),
        "oversize ground truth": (make_request(batch, tasks=[reward_pb2.Task(reward_fn="numeric_match",
                                                                             ground_truth="5" * 70_000)]),
                                  "RESOURCE_EXHAUSTED", "tasks[0].ground_truth has 70000 characters, over "
                                                        "max_ground_truth_chars=65536"),
    }


@pytest.mark.parametrize("case", [
    "log-prob lengths differ", "NaN behaviour log-prob", "group ids do not cover the batch",
    "RLOO with a singleton group", "unknown reward function", "import path from a request",
    "reward model from a request", "missing ground truth", "three tasks for four samples",
    "token id outside the tokenizer", "missing ref_log_probs", "unknown estimator", "float mask",
    "negative tolerance", "configured function raises", "backreference pattern", "lookbehind ground truth",
    "environment rewards not one per sample", "NaN environment reward", "infinite environment reward",
    "oversize ground truth",
])
def test_bad_input_gets_a_proper_code_naming_the_sample(stub, batch, case):
    request, code, message = bad_requests(batch)[case]
    with pytest.raises(grpc.RpcError) as err:
        stub.ComputeRewards(request, timeout=60)
    assert err.value.code() == getattr(grpc.StatusCode, code), err.value.details()
    assert message in err.value.details()
    # The service keeps serving.
    assert decode_tensor(stub.ComputeRewards(make_request(batch), timeout=60).scores).tolist() == [1.0, 0.0, 1.0, 1.0]


def test_catastrophic_backtracking_pattern_is_answered_at_once(stub, batch):
    # (a+)+$ took 2.25 s on 26 characters with Python's re (2^n steps), blocking the event loop;
    # at 64 it would never finish. RE2 matches in linear time.
    texts = ["a" * 64 + "!", "a" * 64, "b", "aaa"]
    by_arg = make_request(batch, response_texts=texts,
                          tasks=[reward_pb2.Task(reward_fn="regex_match", args={"pattern": "(a+)+$"})])
    assert decode_tensor(stub.ComputeRewards(by_arg, timeout=60).scores).tolist() == [0.0, 1.0, 0.0, 1.0]
    by_truth = make_request(batch, response_texts=texts,
                            tasks=[reward_pb2.Task(reward_fn="regex_match", ground_truth="^(a|aa)+$")] * 4)
    assert decode_tensor(stub.ComputeRewards(by_truth, timeout=60).scores).tolist() == [0.0, 1.0, 0.0, 1.0]


def peak_rss_mib(proc: ServiceProcess) -> float:
    """The service process's peak resident memory so far (VmHWM)."""
    for line in Path(f"/proc/{proc.process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def test_oversize_requests_get_a_precise_status_without_a_memory_blowup(reward, stub, batch):
    before = peak_rss_mib(reward)
    # The fuzz's request: many empty samples and one long one. Padded to batch x longest it was
    # 100,001 x 20,000 floats per tensor; now its counts are refused before anything is decoded.
    lengths = [0] * 100_000 + [20_000]
    rows = [torch.full((n,), -1.0) for n in lengths]
    many = make_request(batch, behavior_log_probs=encode_ragged(Ragged.from_list(rows, torch.float32)),
                        ref_log_probs=encode_ragged(Ragged.from_list(rows, torch.float32)))
    many.ClearField("response_token_ids")
    too_long = make_request(batch, response_mask=encode_ragged(Ragged.from_list(
        [torch.ones(n, dtype=torch.bool) for n in (3, 131_073, 2, 2)])))
    for request, message in [
        (many, "behavior_log_probs.lengths has 100001 entries, over max_samples_per_request=4096"),
        (too_long, "sample 1: response_mask has 131073 tokens, over max_tokens_per_sample=131072"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            stub.ComputeRewards(request, timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        assert message in err.value.details()

    # Within every bound, but padded it would be 4096 x 131072 floats (2 GiB) per tensor:
    # computed on its 135,167 tokens instead.
    lengths = [1] * 4095 + [131_072]
    behavior = [torch.full((n,), -1.0) for n in lengths]
    ref = [torch.full((n,), -1.5) for n in lengths]
    wide = reward_pb2.ComputeRewardsRequest(
        behavior_log_probs=encode_ragged(Ragged.from_list(behavior, torch.float32)),
        ref_log_probs=encode_ragged(Ragged.from_list(ref, torch.float32)),
        response_texts=["x"] * len(lengths), tasks=[reward_pb2.Task(reward_fn="exact_match", ground_truth="x")])
    reply = stub.ComputeRewards(wide, timeout=120)
    assert decode_tensor(reply.kl_sum)[-1].item() == pytest.approx(0.5 * 131_072, rel=1e-6)
    assert decode_tensor(reply.scores).tolist() == [1.0] * len(lengths)
    assert peak_rss_mib(reward) - before < 300


def test_health_answers_while_a_slow_reward_runs_and_the_time_limit_answers(start_service, user_rewards, batch,
                                                                            tmp_path):
    started, release = tmp_path / "spin.started", tmp_path / "spin.release"
    functions = {"slow": {"function": "task_rewards:spin",
                          "params": {"started": str(started), "release": str(release)}}}
    proc = start_service("reward", "--reward-time-limit-seconds", "3", "--log-format", "text",
                         env={"RLFLEET_REWARD_REWARD_FUNCTIONS": json.dumps(functions),
                              "PYTHONPATH": str(user_rewards)}).wait_ready(300)
    stub, channel = stub_for(proc)
    try:
        call = stub.ComputeRewards.future(make_request(batch, tasks=[reward_pb2.Task(reward_fn="slow")]),
                                          timeout=120)
        wait_for(started.exists, 60, "the slow reward to start")  # a worker picks it up at once: 60 s is slack
        # It spins until released: every health check below is answered while it runs.
        for _ in range(5):
            assert proc.health(timeout=10) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            call.result(timeout=120)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        assert ("ran past its time limit (reward_time_limit_seconds=3.0) while running reward function 'slow'"
                in err.value.details())
        # Still spinning (a thread cannot be stopped mid-call): the service keeps answering on the other worker.
        assert not release.exists()
        assert proc.health(timeout=10) == health_pb2.HealthCheckResponse.SERVING
        reply = stub.ComputeRewards(make_request(batch), timeout=60)
        assert decode_tensor(reply.scores).tolist() == [1.0, 0.0, 1.0, 1.0]
    finally:
        release.touch()
        channel.close()


def test_adaptive_controller_state_survives_restarts(start_service, batch, tmp_path):
    state_path = tmp_path / "state" / "kl.json"
    args = ["--kl-controller", "adaptive", "--init-kl-coef", "0.1", "--kl-target", "0.01", "--kl-horizon", "100",
            "--kl-state-path", str(state_path), "--log-format", "text"]
    proc = start_service("reward", *args).wait_ready(300)
    stub, channel = stub_for(proc)
    state = stub.GetKLController(reward_pb2.GetKLControllerRequest(), timeout=30)
    assert (state.kind, state.coef, state.target, state.horizon, state.updates) == ("adaptive", 0.1, 0.01, 100, 0)

    # Samples 0/2 have positive offsets, 1/3 negative; the batch KL is their mean of sums.
    first = stub.ComputeRewards(make_request(batch, update_kl_controller=True), timeout=60)
    assert first.kl_coef == pytest.approx(0.1)  # the coefficient used, not the updated one
    batch_kl = float(decode_tensor(first.kl_sum).double().mean())
    error = min(max(batch_kl / 0.01 - 1, -0.2), 0.2)
    coef = 0.1 * (1 + error * 4 / 100)
    second = stub.ComputeRewards(make_request(batch, update_kl_controller=True), timeout=60)
    assert second.kl_coef == pytest.approx(coef)
    coef *= 1 + error * 4 / 100
    read_only = stub.ComputeRewards(make_request(batch), timeout=60)
    assert read_only.kl_coef == pytest.approx(coef)
    state = stub.GetKLController(reward_pb2.GetKLControllerRequest(), timeout=30)
    assert (state.coef, state.updates) == (pytest.approx(coef), 2)
    channel.close()

    # A hard kill: the state was persisted at each update, not at shutdown.
    proc.kill()
    proc.process.wait(30)
    proc = start_service("reward", *args).wait_ready(300)
    stub, channel = stub_for(proc)
    state = stub.GetKLController(reward_pb2.GetKLControllerRequest(), timeout=30)
    assert (state.kind, state.coef, state.updates) == ("adaptive", pytest.approx(coef, rel=1e-12), 2)
    third = stub.ComputeRewards(make_request(batch, update_kl_controller=True), timeout=60)
    assert third.kl_coef == pytest.approx(coef, rel=1e-12)
    coef *= 1 + error * 4 / 100
    channel.close()

    # A graceful stop and another start.
    assert proc.stop(timeout=30) == 0
    proc = start_service("reward", *args).wait_ready(300)
    stub, channel = stub_for(proc)
    state = stub.GetKLController(reward_pb2.GetKLControllerRequest(), timeout=30)
    assert (state.coef, state.updates) == (pytest.approx(coef, rel=1e-12), 3)
    assert json.loads(state_path.read_text())["updates"] == 3
    channel.close()


def test_state_of_another_controller_kind_stops_the_start(start_service, tmp_path):
    state_path = tmp_path / "kl.json"
    state_path.write_text(json.dumps({"format_version": 1, "kind": "constant", "settings": {}, "coef": 0.2,
                                      "steps": 0, "updates": 0, "history": []}))
    proc = start_service("reward", "--kl-controller", "adaptive", "--kl-state-path", str(state_path))
    with pytest.raises(RuntimeError, match="exited with code"):
        proc.wait_ready(300)
    assert "'constant' controller, not 'adaptive'" in proc.log_tail(80)


def test_check_tasks_answers_what_compute_rewards_would_refuse_without_scoring(stub):
    ok = [reward_pb2.Task(), reward_pb2.Task(reward_fn="picky"),
          reward_pb2.Task(reward_fn="regex_match", ground_truth="[0-9]+"),
          reward_pb2.Task(reward_fn="numeric_match", args={"tolerance": "0.5"})]
    assert stub.CheckTasks(reward_pb2.CheckTasksRequest(tasks=ok), timeout=60) == reward_pb2.CheckTasksResponse()
    for task, code, message in [
        (reward_pb2.Task(reward_fn="no_such_fn"), grpc.StatusCode.NOT_FOUND,
         "sample 1: reward function 'no_such_fn' is not registered"),
        (reward_pb2.Task(reward_fn="numeric_match", args={"tolerance": "-1"}), grpc.StatusCode.INVALID_ARGUMENT,
         "sample 1: reward function 'numeric_match': argument tolerance='-1'"),
        (reward_pb2.Task(reward_fn="picky", args={"x": "1"}), grpc.StatusCode.INVALID_ARGUMENT,
         "sample 1: reward function 'picky' is configured on the service"),
        (reward_pb2.Task(reward_fn="format_check", args={"pattern": r"(a)\1"}), grpc.StatusCode.INVALID_ARGUMENT,
         "RE2 syntax is required"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            stub.CheckTasks(reward_pb2.CheckTasksRequest(tasks=[ok[0], task]), timeout=60)
        assert err.value.code() == code and message in err.value.details(), err.value
        # The refused task, typed: what the collector reads (never the message text).
        detail = sample_error_of(err.value.trailing_metadata())
        assert detail.sample == 1 and err.value.details() == f"sample 1: {detail.description}"
