import textwrap
from pathlib import Path

import pytest
import torch

from rlfleet.services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from rlfleet.services.reward import scores
from rlfleet.services.reward.scores import ScoreInput, build_scorer, compute_scores


def inputs(*responses, ground_truth=None, lengths=None):
    lengths = lengths or [None] * len(responses)
    return [ScoreInput("Q: ", r, ground_truth, n) for r, n in zip(responses, lengths)]


@pytest.mark.parametrize("text, expected", [
    ("The answer is 42.", 42.0),
    ("3 plus 4 equals 7", 7.0),
    ("total: 1,234.5 apples", 1234.5),
    ("it is -3", -3.0),
    ("#### 1,000", 1000.0),
    ("x = 1e3", 1000.0),
    ("about .5", 0.5),
    ("no number here", None),
])
def test_last_number(text, expected):
    assert scores.last_number(text) == expected


def test_numeric_match():
    scorer = build_scorer("numeric_match")
    got = compute_scores(scorer, inputs("so 42", "41", "no idea", "42.0000000001", ground_truth="#### 42"))
    assert got.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_numeric_match_needs_a_numeric_ground_truth():
    scorer = build_scorer("numeric_match")
    with pytest.raises(InvalidArgument, match="sample 1: reward function 'numeric_match' needs"):
        scorer([ScoreInput("", "1", "1"), ScoreInput("", "1", None)])
    with pytest.raises(InvalidArgument, match="sample 0: ground truth 'forty' holds no number"):
        scorer(inputs("40", ground_truth="forty"))


def test_exact_match():
    assert build_scorer("exact_match")(inputs(" Paris\n", "paris", ground_truth="Paris")) == [1.0, 0.0]
    assert build_scorer("exact_match", {"ignore_case": True})(inputs("paris", ground_truth="Paris")) == [1.0]
    assert build_scorer("exact_match", {"strip": False})(inputs(" Paris", ground_truth="Paris")) == [0.0]


def test_regex_match_from_params_or_ground_truth():
    fixed = build_scorer("regex_match", {"pattern": r"\bcat\b"})
    assert fixed(inputs("a cat sat", "concatenate")) == [1.0, 0.0]
    per_sample = build_scorer("regex_match")
    assert per_sample(inputs("answer: B", "answer: C", ground_truth=r"answer:\s*B")) == [1.0, 0.0]


def test_format_check_requires_a_full_match():
    scorer = build_scorer(
        "format_check", {"pattern": r"<think>.*</think>\s*<answer>.*</answer>", "penalty": -1.0}
    )
    got = scorer(inputs(
        "<think>a\nb</think> <answer>4</answer>",
        "<answer>4</answer>",
        "x<think></think><answer></answer>",
    ))
    assert got == [1.0, -1.0, -1.0]


def test_length_penalty():
    scorer = build_scorer("length_penalty", {"max_length": 10, "coef": 0.5})
    assert scorer(inputs("a", "b", "c", lengths=[5, 10, 14])) == [0.0, 0.0, -2.0]
    with pytest.raises(InvalidArgument, match="sample 0: length_penalty needs response_length"):
        scorer(inputs("a"))


def test_unknown_and_misconfigured_functions():
    with pytest.raises(NotFound, match="reward function 'nope' is not registered"):
        build_scorer("nope")
    with pytest.raises(InvalidArgument, match="reward function 'exact_match': bad parameters"):
        build_scorer("exact_match", {"pattern": "x"})
    with pytest.raises(InvalidArgument, match="'format_check': argument pattern='\\(' is an invalid regex"):
        build_scorer("format_check", {"pattern": "("})
    with pytest.raises(InvalidArgument, match="sample 0: reward function 'regex_match': ground_truth='\\(' is an invalid"):
        build_scorer("regex_match")(inputs("x", ground_truth="("))
    built_ins = {"numeric_match", "exact_match", "regex_match", "format_check", "length_penalty"}
    assert built_ins | {"reward_model"} <= set(scores.available())


def test_clip_scores():
    values = torch.tensor([-20.0, 3.0, 20.0])
    assert scores.clip_scores(values, 10.0).tolist() == [-10.0, 3.0, 10.0]
    assert scores.clip_scores(values, None).tolist() == values.tolist()
    with pytest.raises(InvalidArgument, match="score_clip must be > 0"):
        scores.clip_scores(values, 0.0)


def test_weighted_sum():
    combined = scores.WeightedSum([
        (1.0, build_scorer("numeric_match")),
        (0.5, build_scorer("format_check", {"pattern": r".*\d"})),
    ])
    assert combined(inputs("is 4", "is 5", "four", ground_truth="4")) == [1.5, 0.5, 0.0]


def test_compute_scores_checks_the_scorer_output():
    with pytest.raises(InvalidArgument, match="bad returned 1 scores for 2 samples"):
        compute_scores(lambda samples: [1.0], inputs("a", "b"), name="bad")
    with pytest.raises(InvalidArgument, match="sample 1: bad returned nan"):
        compute_scores(lambda samples: [1.0, float("nan")], inputs("a", "b"), name="bad")


# ------------------------------------------------------------ user functions


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        NOT_CALLABLE = 3

        def contains(sample, word="cat", bonus=1.0):
            return bonus if word in sample.response else 0.0

        def broken(sample):
            return float("nan") if sample.response == "x" else 1.0

        class Nested:
            @staticmethod
            def length(sample):
                return len(sample.response)
    """))
    (tmp_path / "needs_missing_dep.py").write_text("import surely_not_installed_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_user_function_by_import_path(user_module):
    scorer = build_scorer("my_rewards:contains", {"word": "dog", "bonus": 2.0})
    assert compute_scores(scorer, inputs("a dog", "a cat")).tolist() == [2.0, 0.0]
    assert build_scorer("my_rewards:Nested.length")(inputs("abc")) == [3.0]


def test_user_function_errors(user_module):
    with pytest.raises(NotFound, match="'no_such_module_xyz:f': no module"):
        build_scorer("no_such_module_xyz:f")
    with pytest.raises(NotFound, match="'my_rewards:missing'"):
        build_scorer("my_rewards:missing")
    with pytest.raises(InvalidArgument, match="'my_rewards:NOT_CALLABLE' is not callable"):
        build_scorer("my_rewards:NOT_CALLABLE")
    with pytest.raises(InvalidArgument, match="expected 'module:function'"):
        build_scorer("my_rewards:")
    with pytest.raises(InvalidArgument, match="sample 1: reward function 'my_rewards:broken' returned nan"):
        build_scorer("my_rewards:broken")(inputs("ok", "x"))
    with pytest.raises(InvalidArgument, match="import paths are not allowed"):
        build_scorer("my_rewards:contains", allow_imports=False)
    # A dependency missing *inside* the user's module is its bug, not "function not found".
    with pytest.raises(ModuleNotFoundError, match="surely_not_installed_xyz"):
        build_scorer("needs_missing_dep:f")


# ------------------------------------------------------------- reward model


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory, request) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    from rlfleet.services.models.tiny import build_tiny_model

    tiny = build_tiny_model(request.config.cache.mkdir("rlfleet-tiny-model"))
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_labels=1,
        pad_token_id=tokenizer.pad_token_id, max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    out = tmp_path_factory.mktemp("tiny-rm")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_reward_model_is_lazy_batched_and_batch_invariant(tiny_reward_model):
    scorer = build_scorer("reward_model", {"path": str(tiny_reward_model), "batch_size": 2})
    assert not scorer.loaded
    samples = [
        ScoreInput("what is 2 plus 2? ", "4"),
        ScoreInput("count up: ", "one two three four five six seven"),
        ScoreInput("", "yes"),
        ScoreInput("the answer is ", "the answer is 12 plus 30 equals 42."),
        ScoreInput("red blue ", "green"),
    ]
    batched = compute_scores(scorer, samples, name="reward_model")
    assert scorer.loaded
    one_by_one = torch.tensor([scorer([sample])[0] for sample in samples])
    torch.testing.assert_close(batched, one_by_one, atol=1e-5, rtol=0)
    assert len(set(batched.tolist())) == len(samples)  # really different inputs, different scores
    assert scorer([]) == []


def test_reward_model_truncates_from_the_left(tiny_reward_model):
    scorer = build_scorer("reward_model", {"path": str(tiny_reward_model), "max_length": 4})
    long_prompt = ScoreInput("one two three four five six seven eight ", "nine ten")
    short_prompt = ScoreInput("eight ", "nine ten")
    scorer.load()
    text = long_prompt.prompt + long_prompt.response
    kept = scorer.tokenizer(text, truncation=True, max_length=4)["input_ids"]
    full = scorer.tokenizer(text)["input_ids"]
    assert kept == full[-4:]
    assert len(scorer([long_prompt, short_prompt])) == 2


def test_reward_model_label_index_out_of_range(tiny_reward_model):
    scorer = build_scorer("reward_model", {"path": str(tiny_reward_model), "label_index": 1})
    with pytest.raises(FailedPrecondition, match="has 1 labels; label_index 1 is out of range"):
        scorer.load()
    assert not scorer.loaded


def test_char_fraction_counts_matching_characters():
    from rlfleet.services.reward.scores import ScoreInput, build_scorer

    scorer = build_scorer("char_fraction", {"pattern": "[0-9]"})
    samples = [ScoreInput(prompt="", response=r) for r in ("12ab", "7 7", "", "abc")]
    assert scorer(samples) == [0.5, 1.0, 0.0, 0.0]
    assert scorer(samples) == [0.5, 1.0, 0.0, 0.0]  # the characters' matches remembered


def test_char_fraction_scores_the_same_once_its_memory_of_characters_is_full(monkeypatch):
    from rlfleet.services.reward.scores import ScoreInput, build_scorer

    monkeypatch.setattr(scores, "_CHAR_CACHE_SIZE", 2)
    scorer = build_scorer("char_fraction", {"pattern": "[a-c]"})
    responses = ("ab", "xyz", "abcx", "cz9", "ab")
    assert scorer([ScoreInput(prompt="", response=r) for r in responses]) == [1.0, 0.0, 0.75, 1 / 3, 1.0]


def test_none_scores_every_sample_zero_and_takes_no_arguments():
    assert build_scorer("none")(inputs("42", "", "anything")) == [0.0, 0.0, 0.0]
    assert "none" in scores.available()
    with pytest.raises(InvalidArgument, match="reward function 'none': bad parameters"):
        build_scorer("none", {"pattern": "x"})
