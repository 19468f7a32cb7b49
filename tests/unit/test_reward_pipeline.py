"""The reward chain (pipeline), reward-function resolution and the engine, on hand-checkable numbers."""

import math
import textwrap

import pytest
import torch

from rlfleet.services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from rlfleet.services.reward.config import RewardFunctionConfig, RewardServiceConfig
from rlfleet.services.reward.reward_engine import RewardEngine, RewardRequest
from rlfleet.services.reward.functions import RewardFunctions, TaskSpec, expand_tasks
from rlfleet.services.reward.batch_rewards import RewardInputs, compute_rewards
from rlfleet.services.reward.scores import ScoreInput

REF = [[-1.0, -2.0, -3.0], [-0.5, -1.5], [-2.0, -2.0, -2.0, -2.0]]
OFFSETS = [[0.1, 0.2, 0.3], [0.0, -0.5], [0.25, 0.0, 0.0, 0.25]]


def t(rows, dtype=torch.float32):
    return [torch.tensor(row, dtype=dtype) for row in rows]


def hand_inputs(**overrides) -> RewardInputs:
    fields = dict(
        behavior_log_probs=[r + o for r, o in zip(t(REF), t(OFFSETS))],
        ref_log_probs=t(REF),
        response_token_ids=[torch.arange(len(row)) for row in REF],
        group_ids=[7, 7, 9],
    )
    fields.update(overrides)
    return RewardInputs(**fields)


def fixed(*scores):
    return lambda: torch.tensor(scores, dtype=torch.float32)


def never_called():
    raise AssertionError("scores must not be computed for an invalid batch")


def close(got, want, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float32),
                               torch.tensor(want, dtype=torch.float32), atol=atol, rtol=0)


def test_k1_equals_the_offsets_and_everything_follows_by_hand():
    out = compute_rewards(hand_inputs(), fixed(1.0, 0.0, 3.0), kl_coef=0.1, score_clip=2.0)
    for got, want in zip(out.kl, OFFSETS):
        close(got, want)
    close(out.kl_sum, [0.6, -0.5, 0.5])
    close(out.kl_mean, [0.2, -0.25, 0.125])
    assert out.batch_kl == pytest.approx(0.2, abs=1e-6)
    close(out.scores, [1.0, 0.0, 3.0])
    close(out.clipped_scores, [1.0, 0.0, 2.0])
    # Clipped score at the last token, -0.1 * KL everywhere.
    close(out.rewards[0], [-0.01, -0.02, 1.0 - 0.03])
    close(out.rewards[1], [0.0, 0.0 + 0.05])
    close(out.rewards[2], [-0.025, 0.0, 0.0, 2.0 - 0.025])
    # Group 7 = {1, 0}: mean 0.5, unbiased std sqrt(0.5). Group 9 has one sample: 0.
    close(out.advantages, [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), 0.0], atol=1e-5)
    assert out.kl_coef == 0.1


def test_environment_rewards_add_to_the_function_score_before_clipping():
    environment = torch.tensor([0.5, -1.0, 0.25], dtype=torch.float64)
    out = compute_rewards(hand_inputs(environment_rewards=environment), fixed(1.0, 0.0, 3.0), kl_coef=0.1,
                          score_clip=2.0)
    close(out.scores, [1.5, -1.0, 3.25])
    close(out.clipped_scores, [1.5, -1.0, 2.0])
    close(out.rewards[0], [-0.01, -0.02, 1.5 - 0.03])  # the clipped sum at the last token
    close(out.rewards[1], [0.0, -1.0 + 0.05])
    close(out.rewards[2], [-0.025, 0.0, 0.0, 2.0 - 0.025])
    # Group 7 = {1.5, -1}: mean 0.25, unbiased std sqrt(3.125). Group 9 has one sample: 0.
    close(out.advantages, [1.25 / math.sqrt(3.125), -1.25 / math.sqrt(3.125), 0.0], atol=1e-5)
    # The same as a reward function that scored the sums itself, field for field.
    summed = compute_rewards(hand_inputs(), fixed(1.5, -1.0, 3.25), kl_coef=0.1, score_clip=2.0)
    for name in ("scores", "clipped_scores", "advantages", "kl_sum"):
        torch.testing.assert_close(getattr(out, name), getattr(summed, name))
    for got, want in zip(out.rewards, summed.rewards):
        torch.testing.assert_close(got, want)


def test_environment_rewards_are_summed_in_float64_and_a_sum_past_float32_is_refused():
    out = compute_rewards(hand_inputs(environment_rewards=torch.tensor([0.1, 2.0**-30, 0.0], dtype=torch.float64)),
                          fixed(0.2, 1.0, 0.0), kl_coef=0.0)
    assert out.scores.dtype == torch.float32
    assert out.scores.tolist() == torch.tensor([float(torch.tensor(0.2)) + 0.1, 1.0 + 2.0**-30, 0.0]).tolist()
    big = torch.tensor([0.0, 3e38, 0.0], dtype=torch.float64)
    with pytest.raises(InvalidArgument, match=r"sample 1: score \(reward function score \+ environment reward\) "
                                              r"is inf"):
        compute_rewards(hand_inputs(environment_rewards=big), fixed(0.0, 3e38, 0.0), kl_coef=0.1)


def test_k2_k3_and_no_std_and_rloo():
    log2 = math.log(2.0)
    inputs = RewardInputs(
        behavior_log_probs=t([[log2 - 1.0], [-1.0], [-3.0], [-1.0]]),
        ref_log_probs=t([[-1.0], [-1.0], [-3.0], [-1.0]]),
        group_ids=[0, 0, 1, 1],
    )
    k2 = compute_rewards(inputs, fixed(1, 0, 3, 1), kl_coef=0.0, kl_estimator="k2", advantage_mode="grpo_no_std")
    close(k2.kl[0], [0.5 * log2**2])
    close(k2.advantages, [0.5, -0.5, 1.0, -1.0])
    k3 = compute_rewards(inputs, fixed(1, 0, 3, 1), kl_coef=0.0, kl_estimator="k3", advantage_mode="rloo")
    close(k3.kl[0], [0.5 - 1.0 + log2])
    close(k3.advantages, [1.0, -1.0, 2.0, -2.0])


def test_grpo_advantages_of_a_group_sum_to_zero():
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(int(n), generator=generator) - 2 for n in torch.randint(1, 9, (12,), generator=generator)]
    scores = torch.rand(12, generator=generator)
    group_ids = [i % 3 for i in range(12)]
    out = compute_rewards(RewardInputs(rows, rows, group_ids=group_ids), lambda: scores, kl_coef=0.05)
    for group in range(3):
        assert float(out.advantages[group::3].sum()) == pytest.approx(0.0, abs=1e-5)
    assert all(float(row.abs().max()) == 0.0 for row in out.kl)  # identical log-probs: no KL


def test_mask_excludes_tokens_and_moves_the_score():
    behavior = [r + o for r, o in zip(t(REF), t(OFFSETS))]
    behavior[0] = torch.tensor([-0.9, -1.8, float("nan")])  # masked-out tokens may hold anything
    masks = [torch.tensor([True, True, False]), torch.tensor([True, True]), torch.tensor([False, True, True, False])]
    out = compute_rewards(hand_inputs(behavior_log_probs=behavior, response_masks=masks), fixed(1.0, 0.0, 3.0),
                          kl_coef=0.1)
    close(out.kl[0], [0.1, 0.2, 0.0])
    close(out.kl[2], [0.0, 0.0, 0.0, 0.0])
    close(out.kl_sum, [0.3, -0.5, 0.0])
    close(out.kl_mean, [0.15, -0.25, 0.0])
    close(out.rewards[0], [-0.01, 1.0 - 0.02, 0.0])
    close(out.rewards[2], [0.0, 0.0, 3.0, 0.0])


def test_empty_batch():
    out = compute_rewards(RewardInputs([], []), fixed(), kl_coef=0.1)
    assert out.kl == [] and out.rewards == [] and out.advantages.numel() == 0 and out.batch_kl == 0.0


@pytest.mark.parametrize("overrides, mode, message", [
    (dict(ref_log_probs=t([[-1.0, -2.0, -3.0], [-0.5, -1.5, 0.0], [-2.0] * 4])), "grpo",
     "sample 1: behavior_log_probs has 2 tokens but ref_log_probs has 3"),
    (dict(ref_log_probs=t(REF[:2])), "grpo", "behavior_log_probs has 3 samples but ref_log_probs has 2"),
    (dict(response_token_ids=[torch.arange(3), torch.arange(2), torch.arange(5)]), "grpo",
     "sample 2: response_token_ids has 5 tokens but behavior_log_probs has 4"),
    (dict(response_token_ids=[torch.zeros(3), torch.zeros(2), torch.zeros(4)]), "grpo",
     "response_token_ids: sample 0 must hold integers"),
    (dict(response_masks=[torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool),
                          torch.ones(4, dtype=torch.bool)]), "grpo",
     "sample 1: response_mask has 3 tokens but behavior_log_probs has 2"),
    (dict(response_masks=[torch.ones(3), torch.ones(2), torch.ones(4)]), "grpo",
     "response_mask: sample 0 must be bool"),
    (dict(response_masks=[torch.ones(3, dtype=torch.bool), torch.zeros(2, dtype=torch.bool),
                          torch.ones(4, dtype=torch.bool)]), "grpo",
     "sample 1: no response token to put the score on (response_mask is all False)"),
    (dict(behavior_log_probs=t([[-1.0], [], [-2.0]]), ref_log_probs=t([[-1.0], [], [-2.0]]), response_token_ids=None),
     "grpo", "sample 1: no response token to put the score on (the response is empty)"),
    (dict(behavior_log_probs=t([[-1.0, -2.0, -3.0], [float("nan"), -1.0], [-2.0] * 4])), "grpo",
     "sample 1, token 0: behavior_log_probs is nan"),
    (dict(ref_log_probs=t([[-1.0, -2.0, -3.0], [-0.5, -1.5], [-2.0, -2.0, float("-inf"), -2.0]])), "grpo",
     "sample 2, token 2: ref_log_probs is -inf"),
    (dict(behavior_log_probs=t([[-1, -2, -3], [-1, -2], [-2] * 4], torch.int64)), "grpo",
     "behavior_log_probs: sample 0 must be floating point"),
    (dict(group_ids=[1, 2]), "grpo", "group_ids has 2 entries for 3 samples"),
    (dict(), "rloo", "sample 2: group 9 has 1 samples, expected at least 2"),
    (dict(), "ppo", "unknown advantage mode 'ppo'"),
])
def test_invalid_batches_name_the_sample_and_compute_no_scores(overrides, mode, message):
    with pytest.raises(InvalidArgument) as err:
        compute_rewards(hand_inputs(**overrides), never_called, kl_coef=0.1, advantage_mode=mode)
    assert message in str(err.value)


def test_scores_of_the_wrong_shape_or_not_finite_are_refused():
    with pytest.raises(InvalidArgument, match=r"scores have shape \(2,\), expected \[3\]"):
        compute_rewards(hand_inputs(), fixed(1.0, 2.0), kl_coef=0.1)
    with pytest.raises(InvalidArgument, match="sample 1: score is inf"):
        compute_rewards(hand_inputs(), fixed(1.0, float("inf"), 0.0), kl_coef=0.1)


# ------------------------------------------------------------------ functions


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_task_rewards.py").write_text(textwrap.dedent("""
        def contains(sample, word="cat", bonus=1.0):
            return bonus if word in sample.response else 0.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_task_rewards:contains"


def functions(default="numeric_match", params=None, configured=None) -> RewardFunctions:
    specs = {name: RewardFunctionConfig(function=function, params=fn_params)
             for name, (function, fn_params) in (configured or {}).items()}
    made = RewardFunctions(default, params, specs)
    made.load()
    return made


def samples(*responses):
    return [ScoreInput("", response, response_length=1) for response in responses]


def test_default_builtins_aliases_and_coerced_args():
    fns = functions()
    assert fns.score(samples("it is 42", "41"), [TaskSpec("", "42")] * 2).tolist() == [1.0, 0.0]
    assert fns.score(samples("it is 42.5"), [TaskSpec("numeric_answer", "42", {"tolerance": "1"})]).tolist() == [1.0]
    fmt = TaskSpec("format", None, {"pattern": "<a>.*</a>", "reward": "2.5", "penalty": "-1"})
    assert fns.score(samples("<a>x</a>", "x"), [fmt, fmt]).tolist() == [2.5, -1.0]
    assert fns.score(samples("Yes"), [TaskSpec("exact_match", "yes", {"ignore_case": "true"})]).tolist() == [1.0]


def test_request_names_that_are_refused(user_module):
    fns = functions(configured={"cat": (user_module, {"word": "cat"})})
    with pytest.raises(InvalidArgument, match="sample 1: reward function 'os:system': import paths are accepted only"):
        fns.score(samples("a", "b"), [TaskSpec(), TaskSpec("os:system")])
    with pytest.raises(NotFound, match="sample 0: reward function 'nope' is not registered; known: .*'cat'"):
        fns.score(samples("a"), [TaskSpec("nope")])
    with pytest.raises(NotFound, match="sample 0: reward function 'reward_model' is not configured here"):
        fns.score(samples("a"), [TaskSpec("reward_model", None, {"path": "/tmp"})])
    with pytest.raises(InvalidArgument, match="sample 1: reward function 'cat' is configured on the service"):
        fns.score(samples("a", "b"), [TaskSpec("cat"), TaskSpec("cat", None, {"word": "dog"})])
    with pytest.raises(InvalidArgument, match="sample 0: reward function 'numeric_match': argument tolerance='x'"):
        fns.score(samples("1"), [TaskSpec("numeric_match", "1", {"tolerance": "x"})])
    with pytest.raises(InvalidArgument, match="sample 0: reward function 'numeric_match': bad parameters"):
        fns.score(samples("1"), [TaskSpec("numeric_match", "1", {"colour": "red"})])


def test_configured_user_function_and_errors_name_the_request_sample(user_module):
    fns = functions(default="cat", configured={"cat": (user_module, {"word": "cat", "bonus": 2.0})})
    tasks = [TaskSpec(), TaskSpec("numeric_match", "3"), TaskSpec("cat"), TaskSpec("numeric_match")]
    # Sample 3 is the second sample scored by numeric_match: the error must say 3, not 1.
    with pytest.raises(InvalidArgument, match="^sample 3: reward function 'numeric_match' needs a ground_truth"):
        fns.score(samples("a cat", "3", "dog", "4"), tasks)
    tasks[3] = TaskSpec("numeric_match", "4")
    assert fns.score(samples("a cat", "3", "dog", "5"), tasks).tolist() == [2.0, 1.0, 0.0, 0.0]


def test_bad_config_entries_fail_at_load():
    with pytest.raises(NotFound, match=r"reward_functions\[x\]: reward function 'no_such_module:f'"):
        functions(configured={"x": ("no_such_module:f", {})})
    with pytest.raises(InvalidArgument, match="default_reward_fn: reward function 'format_check': bad parameters"):
        functions(default="format_check")


def test_expand_tasks():
    assert expand_tasks([], 2) == [TaskSpec(), TaskSpec()]
    one = TaskSpec("exact_match", "x")
    assert expand_tasks([one], 3) == [one] * 3
    with pytest.raises(InvalidArgument, match="tasks has 2 entries for 3 samples"):
        expand_tasks([one, one], 3)


# --------------------------------------------------------------------- engine


def engine(tmp_path, **config) -> RewardEngine:
    made = RewardEngine(RewardServiceConfig(**config))
    made.load()
    return made


def request(**overrides) -> RewardRequest:
    fields = dict(inputs=hand_inputs(), response_texts=["7", "8", "9"],
                  tasks=[TaskSpec("", "7"), TaskSpec("", "7"), TaskSpec("", "9")])
    fields.update(overrides)
    return RewardRequest(**fields)


def test_engine_updates_the_controller_after_computing_and_persists(tmp_path):
    path = tmp_path / "kl" / "state.json"
    settings = dict(kl_controller="adaptive", init_kl_coef=0.1, kl_target=0.1, kl_horizon=100,
                    kl_state_path=str(path))
    first = engine(tmp_path, **settings)
    out = first.compute(request(update_kl_controller=True))
    assert out.kl_coef == 0.1  # the coefficient the rewards were shaped with
    close(out.scores, [1.0, 0.0, 1.0])
    # batch KL 0.2 vs target 0.1: error clipped to +0.2, 3 samples of a horizon of 100.
    want = 0.1 * (1 + 0.2 * 3 / 100)
    assert first.controller.coef == pytest.approx(want)
    assert first.compute(request()).kl_coef == pytest.approx(want)  # no update asked: unchanged
    assert first.controller_state().updates == 1

    restarted = engine(tmp_path, **settings)
    state = restarted.controller_state()
    assert (state.kind, state.coef, state.updates, state.steps) == ("adaptive", pytest.approx(want), 1, 3)

    with pytest.raises(FailedPrecondition, match="'adaptive' controller, not 'constant'"):
        engine(tmp_path, kl_state_path=str(path))


def test_each_run_sharing_the_service_has_its_own_controller_kept_beside_the_services(tmp_path):
    """Batches of runs A and B (``run_id``) move only their own run's coefficient; each is kept in a file of
    its own and restored after a restart; ``fresh`` deletes them all; runs are bounded by max_runs."""
    path = tmp_path / "kl" / "state.json"
    settings = dict(kl_controller="adaptive", init_kl_coef=0.1, kl_target=0.1, kl_horizon=100,
                    kl_state_path=str(path), max_runs=2)
    first = engine(tmp_path, **settings)
    want = 0.1 * (1 + 0.2 * 3 / 100)  # one update of batch KL 0.2 (see the test above)
    assert first.compute(request(update_kl_controller=True, run_id="run-a")).kl_coef == pytest.approx(0.1)
    assert first.compute(request(run_id="run-a")).kl_coef == pytest.approx(want)
    assert first.compute(request(run_id="run-b")).kl_coef == pytest.approx(0.1)  # untouched by run-a's batch
    assert first.controller.coef == pytest.approx(0.1) and first.controller_state().updates == 0
    assert first.controller_state("run-a").updates == 1 and first.controller_state("run-b").updates == 0
    assert (path.parent / "state.run-a.json").exists() and not path.exists()
    with pytest.raises(ResourceExhausted, match="max_runs=2"):
        first.compute(request(run_id="run-c"))
    with pytest.raises(InvalidArgument, match="not a run id"):
        first.compute(request(run_id="../etc"))

    restarted = engine(tmp_path, **settings)
    with pytest.raises(NotFound, match="run-b"):
        restarted.controller_state("run-b")  # never updated: nothing kept of it
    assert restarted.controller_state("run-a").coef == pytest.approx(want)
    assert restarted.compute(request(run_id="run-a")).kl_coef == pytest.approx(want)

    engine(tmp_path, **settings, fresh=True)
    assert not list(path.parent.iterdir())


def test_a_failed_save_leaves_the_controller_unchanged(tmp_path, monkeypatch):
    made = engine(tmp_path, kl_controller="adaptive", kl_state_path=str(tmp_path / "kl.json"))
    before = made.controller.state_dict()

    def fail(path):
        raise OSError("disk full")

    monkeypatch.setattr(made.controller, "save", fail)
    with pytest.raises(OSError, match="disk full"):
        made.compute(request(update_kl_controller=True))
    assert made.controller.state_dict() == before


def test_engine_request_checks(tmp_path):
    made = engine(tmp_path)
    with pytest.raises(InvalidArgument, match="response_texts has 2 entries for 3 samples"):
        made.compute(request(response_texts=["1", "2"]))
    with pytest.raises(InvalidArgument, match="no tokenizer_path to decode response_token_ids"):
        made.compute(request(response_texts=[]))
    with pytest.raises(InvalidArgument, match="response_token_ids is absent"):
        made.compute(request(response_texts=[], inputs=hand_inputs(response_token_ids=None)))
    out = made.compute(request(kl_estimator="k3", advantage_mode="grpo_no_std"))
    assert float(out.kl[1][1]) == pytest.approx(math.exp(0.5) - 1 - 0.5, abs=1e-6)
    close(out.advantages, [0.5, -0.5, 0.0])
