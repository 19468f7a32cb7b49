"""Hardening of the reward service: every bad input a precise status, bounded resources.

Three findings of a fuzz of ComputeRewards, one section each: reward functions that
raise (or get bad arguments), patterns from requests (RE2, time limit), and size bounds
checked before anything is decoded or padded.
"""

import asyncio
import math
import sys
import textwrap

import pytest
import torch

from rlfleet.services.common.errors import InvalidArgument, ResourceExhausted
from rlfleet.services.reward import kl, servicer, validation
from rlfleet.services.reward.budget import TimeBudget
from rlfleet.services.reward.config import RewardFunctionConfig, RewardServiceConfig
from rlfleet.services.reward.reward_engine import RewardEngine, RewardRequest
from rlfleet.services.reward.functions import RewardFunctions, TaskSpec
from rlfleet.services.reward.batch_rewards import RewardInputs, compute_rewards
from rlfleet.services.reward.scores import ScoreInput, build_scorer, compute_scores
from rlfleet.v1 import reward_pb2
from rlfleet.wire import Ragged, encode_ragged
from tests.waiting import wait_for_async


def samples(*responses, ground_truth=None):
    return [ScoreInput("", response, ground_truth, response_length=3) for response in responses]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "hardening_rewards.py").write_text(textwrap.dedent("""
        import math
        import threading

        RELEASE = threading.Event()
        STARTED = threading.Event()

        def picky(sample):
            if "7" in sample.response:
                raise ValueError("sevens are not allowed")
            return 1.0

        def recurse(sample):
            return recurse(sample)

        def overflow(sample):
            return math.exp(1000)

        def huge_int(sample):
            return 10 ** 5000

        def hungry(sample):
            raise MemoryError()

        def shouting(sample):
            raise RuntimeError("x" * 100_000)

        def hold(sample):
            STARTED.set()
            RELEASE.wait(120)  # released by the test
            return 1.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("hardening_rewards", None)  # a fresh RELEASE and STARTED per test
    yield "hardening_rewards"
    module = sys.modules.pop("hardening_rewards", None)
    if module is not None:
        module.RELEASE.set()  # no worker thread outlives the test


def loaded(default="numeric_match", configured=None) -> RewardFunctions:
    specs = {name: RewardFunctionConfig(function=function, params=params or {})
             for name, (function, params) in (configured or {}).items()}
    functions = RewardFunctions(default, None, specs)
    functions.load()
    return functions


# ------------------------------------------- 1. arguments and functions that raise


@pytest.mark.parametrize("args, message", [
    ({"tolerance": "-1"}, "sample 1: reward function 'numeric_match': argument tolerance='-1': "
                          "Input should be greater than or equal to 0"),
    ({"tolerance": "nan"}, "argument tolerance='nan': Input should be a finite number"),
    ({"tolerance": "1e400"}, "argument tolerance='1e400': Input should be a finite number"),
])
def test_bad_tolerance_is_refused_before_running_naming_the_argument(args, message):
    functions = loaded()
    with pytest.raises(InvalidArgument) as err:
        functions.score(samples("1", "2"), [TaskSpec("", "1"), TaskSpec("numeric_match", "2", args)])
    assert message in str(err.value)


@pytest.mark.parametrize("name, params, argument", [
    ("format_check", {"pattern": "x", "reward": "inf"}, "reward"),
    ("format_check", {"pattern": "x", "penalty": float("nan")}, "penalty"),
    ("length_penalty", {"max_length": "-1"}, "max_length"),
    ("length_penalty", {"max_length": 10, "coef": -0.5}, "coef"),
    ("exact_match", {"ignore_case": "perhaps"}, "ignore_case"),
])
def test_builtin_arguments_are_checked_from_requests_and_config(name, params, argument):
    with pytest.raises(InvalidArgument, match=f"reward function '{name}': argument {argument}="):
        build_scorer(name, params)


def test_a_negative_tolerance_in_the_config_stops_the_start():
    functions = RewardFunctions("numeric_match", {"tolerance": -1.0})
    with pytest.raises(InvalidArgument, match="default_reward_fn: reward function 'numeric_match': argument tolerance"):
        functions.load()


@pytest.mark.parametrize("function, status, message", [
    ("picky", InvalidArgument, "sample 2: reward function 'fn' raised ValueError: sevens are not allowed"),
    ("recurse", InvalidArgument, "sample 1: reward function 'fn' raised RecursionError: maximum recursion depth"),
    ("overflow", InvalidArgument, "sample 1: reward function 'fn' raised OverflowError: math range error"),
    ("huge_int", InvalidArgument, "sample 1: reward function 'fn' returned <int of 16610 bits>, expected a finite"),
    ("hungry", ResourceExhausted, "sample 1: reward function 'fn' ran out of memory"),
])
def test_a_configured_function_that_raises_names_the_sample_function_and_exception(
        user_module, function, status, message):
    functions = loaded(configured={"fn": (f"{user_module}:{function}", None)})
    tasks = [TaskSpec("numeric_match", "1"), TaskSpec("fn"), TaskSpec("fn")]
    with pytest.raises(status) as err:
        functions.score(samples("1", "x", "7"), tasks)
    assert message in str(err.value)


def test_error_messages_stay_short_whatever_the_input(user_module):
    functions = loaded(configured={"fn": (f"{user_module}:shouting", None)})
    with pytest.raises(InvalidArgument, match="raised RuntimeError: x+\\.\\.\\. \\(100000 chars\\)") as err:
        functions.score(samples("a"), [TaskSpec("fn")])
    assert len(str(err.value)) < 400
    with pytest.raises(InvalidArgument, match="holds no number") as err:
        functions.score(samples("1"), [TaskSpec("numeric_match", "y" * 60_000)])
    assert len(str(err.value)) < 400


def test_huge_numbers_score_instead_of_raising():
    scorer = build_scorer("numeric_match")
    huge = "1" + "0" * 5000
    got = compute_scores(scorer, [ScoreInput("", huge, "1e999"), ScoreInput("", "-1e999", huge),
                                  ScoreInput("", "9" * 400, "9" * 400)])
    assert got.tolist() == [1.0, 0.0, 1.0]  # both beyond float range: equal as inf


# ----------------------------------------------------------- 2. regex safety


def test_catastrophic_backtracking_pattern_is_linear_with_re2():
    scorer = build_scorer("regex_match", {"pattern": "(a+)+$"})
    # Python's re takes ~2^n steps here: 2.25 s at n = 26, forever at n = 64.
    assert scorer(samples("a" * 64 + "!", "a" * 64, "b")) == [0.0, 1.0, 0.0]
    fmt = build_scorer("format_check", {"pattern": "(x+x+)+y"})
    assert fmt(samples("x" * 10_000, "xxy")) == [0.0, 1.0]


@pytest.mark.parametrize("name, pattern", [
    ("regex_match", r"(a)\1"),
    ("format_check", r"(?=a)a"),
    ("char_fraction", r"(?<!x)[0-9]"),
    ("regex_match", "a{1001}"),
    ("format_check", r"(?P<x>a)(?P=x)"),
    ("regex_match", "x" * 1000 + "["),
])
def test_patterns_re2_cannot_compile_are_invalid_argument_naming_the_argument(name, pattern):
    with pytest.raises(InvalidArgument, match=f"reward function '{name}': argument pattern=.* "
                                              "is an invalid regex: RE2 syntax is required") as err:
        build_scorer(name, {"pattern": pattern})
    assert len(str(err.value)) < 500


def test_patterns_that_break_pythons_re_compile_and_match_linearly():
    nested = build_scorer("format_check", {"pattern": "(" * 2000 + "a" + ")" * 2000})  # re: RecursionError
    assert nested(samples("a", "aa")) == [1.0, 0.0]
    repeat = build_scorer("regex_match", {"pattern": "a{99999999999999999999}"})  # re: OverflowError; RE2: literal
    assert repeat(samples("a{99999999999999999999}", "aaa")) == [1.0, 0.0]


def test_a_ground_truth_pattern_re2_cannot_compile_names_the_sample():
    functions = loaded()
    with pytest.raises(InvalidArgument, match=r"^sample 1: reward function 'regex_match': ground_truth='\(\?<=a\)b' "
                                              "is an invalid regex: RE2 syntax"):
        functions.score(samples("ab", "ab"), [TaskSpec("regex_match", "a"), TaskSpec("regex_match", "(?<=a)b")])


def test_re2_keeps_the_semantics_the_builtins_document():
    assert build_scorer("regex_match", {"pattern": "a.b"})(samples("a\nb")) == [1.0]  # dot matches newlines
    assert build_scorer("char_fraction", {"pattern": "[0-9]"})(samples("1 2ab", "", "  ")) == [0.5, 0.0, 0.0]


def test_time_budget_commit_and_expire_exclude_each_other():
    committed = TimeBudget(60)
    committed.commit()
    assert committed.expire() is False  # the worker applies its result: the event loop waits for it

    expired = TimeBudget(60)
    expired.enter("running reward function 'slow'")
    assert expired.expire() is True
    with pytest.raises(ResourceExhausted, match=r"reward_time_limit_seconds=60\) while running reward function 'slow'"):
        expired.commit()
    with pytest.raises(ResourceExhausted):
        expired.check()
    assert TimeBudget().remaining() is None


def test_scoring_stops_before_the_next_function_once_time_is_up(user_module):
    functions = loaded(configured={"hold": (f"{user_module}:hold", None)})
    budget = TimeBudget(60)
    budget.expire()  # the event loop answered already
    with pytest.raises(ResourceExhausted, match="ran past its time limit"):
        functions.score(samples("a"), [TaskSpec("hold")], budget)


def test_an_expired_request_never_updates_the_controller():
    engine = RewardEngine(RewardServiceConfig(kl_controller="adaptive"))
    engine.load()
    before = engine.controller.state_dict()
    inputs = RewardInputs([torch.tensor([-1.0, -1.5])], [torch.tensor([-1.2, -1.0])])
    budget = TimeBudget(60)
    original_score = engine.functions.score

    def score_then_time_runs_out(*args):
        values = original_score(*args)
        budget.expire()  # as the event loop does at the limit, while this worker was still busy
        return values

    engine.functions.score = score_then_time_runs_out
    request = RewardRequest(inputs, response_texts=["1"], tasks=[TaskSpec("", "1")], update_kl_controller=True)
    with pytest.raises(ResourceExhausted, match="reward_time_limit_seconds"):
        engine.compute(request, budget)
    assert engine.controller.state_dict() == before


def test_the_service_answers_at_the_time_limit_and_its_event_loop_keeps_running(user_module):
    from rlfleet.services.reward.service import RewardService

    functions = {"hold": {"function": f"{user_module}:hold"}}
    service = RewardService(RewardServiceConfig(reward_functions=functions, reward_time_limit_seconds=2.0))
    inputs = RewardInputs([torch.tensor([-1.0])], [torch.tensor([-1.0])])
    request = RewardRequest(inputs, response_texts=["a"], tasks=[TaskSpec("hold")])

    async def scenario():
        await service.run_blocking(service.engine.load)
        ticks = 0

        async def other_work():  # what the loop must keep serving (health checks) while the reward runs
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(other_work())
        call = asyncio.ensure_future(service.compute(request))
        await asyncio.wait({call})
        ticker.cancel()
        return ticks, call

    try:
        ticks, call = asyncio.run(scenario())
        with pytest.raises(ResourceExhausted, match=r"\(reward_time_limit_seconds=2.0\) while running reward "
                                                    "function 'hold'"):
            call.result()
        assert ticks > 5
    finally:
        asyncio.run(service.stop())


def test_the_wait_for_a_free_worker_counts_in_the_time_limit(user_module):
    from rlfleet.services.reward.service import RewardService

    functions = {"hold": {"function": f"{user_module}:hold"}}
    service = RewardService(RewardServiceConfig(reward_functions=functions, reward_time_limit_seconds=2.0,
                                                compute_threads=1))
    inputs = RewardInputs([torch.tensor([-1.0])], [torch.tensor([-1.0])])
    busy = RewardRequest(inputs, response_texts=["a"], tasks=[TaskSpec("hold")])
    quick = RewardRequest(inputs, response_texts=["1"], tasks=[TaskSpec("", "1")])

    async def scenario():
        await service.run_blocking(service.engine.load)
        first = asyncio.ensure_future(service.compute(busy))
        held = sys.modules[user_module].STARTED  # imported by engine.load
        await wait_for_async(held.is_set, 60, "the first request to take the only worker")
        second = asyncio.ensure_future(service.compute(quick))
        return await asyncio.gather(first, second, return_exceptions=True)

    try:
        first, second = asyncio.run(scenario())
        assert isinstance(first, ResourceExhausted) and "running reward function 'hold'" in str(first)
        assert isinstance(second, ResourceExhausted) and "waiting for a free worker thread" in str(second)
    finally:
        asyncio.run(service.stop())


# ------------------------------------------------------------ 3. size bounds


SMALL = RewardServiceConfig(max_samples_per_request=4, max_tokens_per_sample=8, max_tokens_per_request=20,
                            max_text_chars=10, max_ground_truth_chars=5, max_args_per_task=2, max_arg_chars=6)


@pytest.mark.parametrize("lengths, dims, error, message", [
    ([1] * 5, 1, ResourceExhausted, "x.lengths has 5 entries, over max_samples_per_request=4"),
    ([1, 9], 1, ResourceExhausted, "sample 1: x has 9 tokens, over max_tokens_per_sample=8"),
    ([8, 8, 8], 1, ResourceExhausted, "x holds 24 tokens, over max_tokens_per_request=20"),
    ([1, 1], 2, InvalidArgument, "x.values must be 1-D (one entry per token), got 2 dims"),
])
def test_ragged_bounds(lengths, dims, error, message):
    with pytest.raises(error) as err:
        validation.check_ragged_size("x", lengths, dims, SMALL)
    assert str(err.value) == message
    validation.check_ragged_size("x", [8, 8, 4], 1, SMALL)
    validation.check_ragged_size("x", [], None, SMALL)


def test_text_and_task_bounds():
    with pytest.raises(ResourceExhausted, match="sample 1: prompt_texts has 11 characters, over max_text_chars=10"):
        validation.check_texts("prompt_texts", ["ok", "x" * 11], SMALL)
    with pytest.raises(ResourceExhausted, match="response_texts has 5 entries, over max_samples_per_request=4"):
        validation.check_texts("response_texts", [""] * 5, SMALL)
    with pytest.raises(ResourceExhausted,
                       match=r"tasks\[2\].ground_truth has 6 characters, over max_ground_truth_chars=5"):
        validation.check_task(2, "x" * 6, {}, SMALL)
    with pytest.raises(ResourceExhausted, match=r"tasks\[0\].args has 3 entries, over max_args_per_task=2"):
        validation.check_task(0, "", {"a": "", "b": "", "c": ""}, SMALL)
    with pytest.raises(ResourceExhausted, match=r"tasks\[0\].args\['pattern'\] has 7 characters, over max_arg_chars=6"):
        validation.check_task(0, "", {"pattern": "(a+)+$"}, SMALL)
    validation.check_task(0, "x" * 5, {"a": "x" * 6, "b": ""}, SMALL)


def proto_request(lengths, **fields) -> reward_pb2.ComputeRewardsRequest:
    rows = [torch.full((n,), -1.0) for n in lengths]
    request = reward_pb2.ComputeRewardsRequest(
        behavior_log_probs=encode_ragged(Ragged.from_list(rows, torch.float32)),
        ref_log_probs=encode_ragged(Ragged.from_list(rows, torch.float32)), **fields)
    return request


def test_oversize_requests_are_refused_before_anything_is_decoded(monkeypatch):
    def no_decoding(*args):
        raise AssertionError("decoded before the size bounds were checked")

    monkeypatch.setattr(servicer, "decode_ragged", no_decoding)
    # The fuzz's request: 100,000 empty samples and one long one (padding it cost 1.4 GB).
    config = RewardServiceConfig()
    with pytest.raises(ResourceExhausted, match="behavior_log_probs.lengths has 100001 entries, over "
                                                "max_samples_per_request=4096"):
        servicer.request_from_proto(proto_request([0] * 100_000 + [20_000]), config)
    too_long = proto_request([1, 2])
    too_long.response_mask.CopyFrom(encode_ragged(Ragged.from_list([torch.ones(1, dtype=torch.bool),
                                                                    torch.ones(9, dtype=torch.bool)])))
    with pytest.raises(ResourceExhausted, match="sample 1: response_mask has 9 tokens, over max_tokens_per_sample=8"):
        servicer.request_from_proto(too_long, SMALL)
    cases = {
        "group_ids has 5 entries": proto_request([1], group_ids=[1] * 5),
        "sample 0: response_texts has 11 characters": proto_request([1], response_texts=["x" * 11]),
        "tasks has 5 entries": proto_request([1], tasks=[reward_pb2.Task()] * 5),
        r"tasks\[0\].args\['pattern'\] has 7": proto_request(
            [1], tasks=[reward_pb2.Task(reward_fn="regex_match", args={"pattern": "(a+)+$"})]),
    }
    for message, request in cases.items():
        with pytest.raises(ResourceExhausted, match=message):
            servicer.request_from_proto(request, SMALL)


@pytest.mark.parametrize("values, message", [
    ([1.0, 2.0], "environment_rewards has 2 entries for 3 samples: send one per sample or none"),
    ([1.0] * 4, "environment_rewards has 4 entries for 3 samples"),
    ([0.0, float("nan"), 1.0], "sample 1: environment_rewards is nan, expected a finite number"),
    ([0.0, 1.0, float("-inf")], "sample 2: environment_rewards is -inf"),
    ([1e39, 0.0, 0.0], "sample 0: environment_rewards is 1e+39, expected a finite number within float32's range"),
])
def test_environment_rewards_are_one_finite_number_per_sample_checked_before_decoding(monkeypatch, values, message):
    def no_decoding(*args):
        raise AssertionError("decoded before environment_rewards was checked")

    with pytest.raises(InvalidArgument) as err:
        validation.check_environment_rewards(values, 3)
    assert message in str(err.value)
    monkeypatch.setattr(servicer, "decode_ragged", no_decoding)
    with pytest.raises(InvalidArgument) as err:
        servicer.request_from_proto(proto_request([1, 2, 1], environment_rewards=values), SMALL)
    assert message in str(err.value)


def test_environment_rewards_empty_or_one_per_sample_reach_the_domain():
    validation.check_environment_rewards([], 3)
    validation.check_environment_rewards([-3.4e38, 0.0, 3.4e38], 3)
    none = servicer.request_from_proto(proto_request([1, 2]), SMALL)
    assert none.inputs.environment_rewards is None
    some = servicer.request_from_proto(proto_request([1, 2], environment_rewards=[0.5, 0.1]), SMALL)
    assert some.inputs.environment_rewards.dtype == torch.float64
    assert some.inputs.environment_rewards.tolist() == [0.5, 0.1]  # not rounded to float32 before the sum


def test_decoded_response_texts_are_bounded_too(tmp_path):
    engine = RewardEngine(RewardServiceConfig(max_text_chars=3))
    engine.load()

    class Tokenizer:
        def __len__(self):
            return 100

        def batch_decode(self, rows, skip_special_tokens):
            return ["word " * len(row) for row in rows]

    engine.tokenizer = Tokenizer()
    inputs = RewardInputs([torch.tensor([-1.0, -1.0])], [torch.tensor([-1.0, -1.0])], [torch.tensor([1, 2])])
    with pytest.raises(ResourceExhausted, match=r"sample 0: response_texts \(decoded from response_token_ids\) has "
                                                "10 characters, over max_text_chars=3"):
        engine.compute(RewardRequest(inputs, tasks=[TaskSpec("exact_match", "x")]))


def padded_reference(inputs: RewardInputs, scores, kl_coef, estimator):
    """What the pipeline computed before (padded to batch x longest), to check the flat version against."""
    lengths = torch.tensor([row.numel() for row in inputs.behavior_log_probs])
    behavior = torch.nn.utils.rnn.pad_sequence(list(inputs.behavior_log_probs), batch_first=True)
    ref = torch.nn.utils.rnn.pad_sequence(list(inputs.ref_log_probs), batch_first=True)
    mask = torch.arange(behavior.shape[-1]) < lengths[:, None]
    per_token = kl.per_token_kl(behavior, ref, mask, estimator)  # 0 outside the mask
    kl_sum = per_token.sum(dim=-1)
    score_rewards = torch.zeros_like(per_token)
    score_rewards[torch.arange(len(lengths)), lengths - 1] = scores.to(per_token.dtype)
    rewards = torch.where(mask, score_rewards - kl_coef * per_token, torch.zeros_like(per_token))
    return per_token, kl_sum, kl_sum / lengths, rewards


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_flat_pipeline_equals_the_padded_computation(estimator):
    generator = torch.Generator().manual_seed(1)
    lengths = [1, 7, 1, 30, 2, 1, 16]
    behavior = [torch.randn(n, generator=generator) - 2 for n in lengths]
    ref = [row + 0.3 * torch.randn(row.shape, generator=generator) for row in behavior]
    scores = torch.rand(len(lengths), generator=generator)
    inputs = RewardInputs(behavior, ref)
    out = compute_rewards(inputs, lambda: scores, kl_coef=0.2, kl_estimator=estimator)
    per_token, kl_sum, kl_mean, rewards = padded_reference(inputs, scores, 0.2, estimator)
    for index, length in enumerate(lengths):
        torch.testing.assert_close(out.kl[index], per_token[index, :length])
        torch.testing.assert_close(out.rewards[index], rewards[index, :length])
    torch.testing.assert_close(out.kl_sum, kl_sum)
    torch.testing.assert_close(out.kl_mean, kl_mean)


def test_one_long_sample_among_many_short_ones_costs_its_tokens_not_batch_times_longest():
    # Padded, this batch is 4096 x 131072 float32 = 2 GiB per tensor; flat it is 135,167 tokens.
    lengths = [1] * 4095 + [131_072]
    behavior = list(torch.full((sum(lengths),), -1.0).split(lengths))
    ref = list(torch.full((sum(lengths),), -1.5).split(lengths))
    out = compute_rewards(RewardInputs(behavior, ref), lambda: torch.ones(len(lengths)), kl_coef=0.1)
    assert out.kl_sum[-1].item() == pytest.approx(0.5 * 131_072, rel=1e-6)
    assert out.rewards[-1][-1].item() == pytest.approx(1.0 - 0.1 * 0.5)
    assert math.isclose(out.kl_mean[0].item(), 0.5, rel_tol=1e-6)
