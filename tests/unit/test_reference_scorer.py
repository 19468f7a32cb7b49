from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rlfleet.services.common.errors import InvalidArgument, Unavailable
from rlfleet.services.reference.config import ReferenceConfig
from rlfleet.services.reference.scorer import ReferenceScorer, plan_batches


@pytest.fixture(scope="module")
def tiny_model(request) -> Path:
    from rlfleet.services.models.tiny import build_tiny_model

    return build_tiny_model(request.config.cache.mkdir("rlfleet-tiny-model"))


@pytest.fixture(scope="module")
def scorers(tiny_model):
    """One loaded scorer per (padding side, attention implementation), small budget."""
    made = {}
    for side in ("left", "right"):
        for attention in ("sdpa", "eager"):
            scorer = ReferenceScorer(ReferenceConfig(
                model_path=str(tiny_model), padding_side=side, attn_implementation=attention,
                token_budget=96, max_len=64,
            ))
            scorer.load()
            made[side, attention] = scorer
    return made


def direct_scores(model, sequence: torch.Tensor, start: int):
    """The definition: log_softmax(model(ids).logits), gathered, one sequence alone."""
    with torch.inference_mode():
        log_probs = model(sequence.unsqueeze(0)).logits[0].float().log_softmax(-1)
    chosen = log_probs[:-1].gather(-1, sequence[1:].unsqueeze(-1)).squeeze(-1)[start - 1 :]
    entropy = -(log_probs.exp() * log_probs).sum(-1)[start - 1 : -1]
    return chosen, entropy


def ragged_batch(seed: int, vocab_size: int):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(1, 1), (3, 14), (20, 2), (7, 7), (1, 40), (33, 9), (2, 1), (12, 30)]  # (prompt, response)
    sequences = [torch.randint(0, vocab_size, (p + r,), generator=generator) for p, r in shapes]
    return sequences, [p for p, _ in shapes]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_parity_with_direct_log_softmax(scorers, side, attention):
    scorer = scorers[side, attention]
    sequences, starts = ragged_batch(seed=1, vocab_size=scorer.vocab_size)
    out = scorer.score(sequences, starts, with_entropy=True)
    assert len(out.log_probs) == len(out.entropies) == len(sequences)
    for sequence, start, log_probs, entropy in zip(sequences, starts, out.log_probs, out.entropies):
        expected, expected_entropy = direct_scores(scorer.model, sequence, start)
        assert log_probs.dtype == torch.float32
        assert log_probs.shape == (sequence.numel() - start,)
        torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)


def test_plain_lists_and_no_entropy(scorers):
    scorer = scorers["right", "sdpa"]
    sequences, starts = ragged_batch(seed=2, vocab_size=scorer.vocab_size)
    from_lists = scorer.score([s.tolist() for s in sequences], starts)
    assert from_lists.entropies is None
    from_tensors = scorer.score(sequences, starts)
    for a, b in zip(from_lists.log_probs, from_tensors.log_probs):
        torch.testing.assert_close(a, b)
    assert scorer.score([], []).log_probs == []


def test_token_ids_that_equal_the_pad_id_are_scored_normally(scorers):
    # Padding is carried by lengths: a sequence made of the tokenizer's pad id is still data.
    scorer = scorers["left", "sdpa"]
    pad_id = scorer.model.config.pad_token_id
    sequence = torch.tensor([5, pad_id, pad_id, 9, pad_id])
    out = scorer.score([sequence, torch.arange(20)], [1, 3])
    expected, _ = direct_scores(scorer.model, sequence, 1)
    torch.testing.assert_close(out.log_probs[0], expected, atol=1e-5, rtol=0)


def test_budget_splits_into_several_forward_passes(scorers, monkeypatch):
    scorer = scorers["right", "sdpa"]
    widths = []
    original = scorer.model.forward

    def spy(*args, **kwargs):
        widths.append(tuple(kwargs["input_ids"].shape))
        return original(*args, **kwargs)

    monkeypatch.setattr(scorer.model, "forward", spy)
    sequences, starts = ragged_batch(seed=3, vocab_size=scorer.vocab_size)
    scorer.score(sequences, starts)
    assert len(widths) > 1
    assert all(batch * width <= scorer.config.token_budget for batch, width in widths)


def test_plan_batches_by_hand():
    # longest first: 8 -> [8, 5] fills 2 * 8 = 16; 3 starts a new batch; 2 joins it (2 * 3 = 6)
    assert plan_batches([5, 3, 8, 2], token_budget=16) == [[2, 0], [1, 3]]
    assert plan_batches([50, 1], token_budget=16) == [[0], [1]]
    assert plan_batches([], token_budget=16) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), max_size=40), st.integers(64, 512))
def test_plan_batches_partitions_under_the_budget(lengths, budget):
    batches = plan_batches(lengths, budget)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) * max(lengths[i] for i in batch) <= budget


@pytest.mark.parametrize("sequence, start, match", [
    ([], 1, "sample 1: sequence is empty"),
    ([1, 2, 3], 0, r"sample 1: response_start 0 must be an int in \[1, 2\]"),
    ([1, 2, 3], 3, r"sample 1: response_start 3 must be an int in \[1, 2\]"),
    ([1, 2, 3], True, "sample 1: response_start True"),
    ([5], 1, "sample 1: sequence has 1 token; scoring needs at least one prompt"),
    ([1, -1, 3], 1, r"sample 1, token 1: id -1 is outside the vocabulary \[0, 512\)"),
    ([1, 2, 512], 1, r"sample 1, token 2: id 512 is outside the vocabulary \[0, 512\)"),
    (list(range(65)), 1, "sample 1: sequence has 65 tokens, max_len is 64"),
    ([[1, 2], [3, 4]], 1, r"sample 1: sequence must be 1-D"),
    ([1.0, 2.0], 1, "sample 1: token ids must be integers"),
    (torch.tensor([True, False]), 1, "sample 1: token ids must be integers"),
    (["a", "b"], 1, "sample 1: sequence is not a list of token ids"),
])
def test_invalid_inputs_name_the_sample(scorers, sequence, start, match):
    scorer = scorers["right", "sdpa"]
    with pytest.raises(InvalidArgument, match=match):
        scorer.score([[1, 2, 3], sequence], [1, start])


def test_count_mismatch_and_unloaded_model(scorers, tiny_model):
    with pytest.raises(InvalidArgument, match="2 sequences but 1 response_starts"):
        scorers["right", "sdpa"].score([[1, 2], [1, 2]], [1])
    with pytest.raises(Unavailable, match="not loaded"):
        ReferenceScorer(ReferenceConfig(model_path=str(tiny_model))).score([[1, 2]], [1])


def test_model_is_frozen(scorers):
    model = scorers["left", "sdpa"].model
    assert not model.training
    assert not any(parameter.requires_grad for parameter in model.parameters())


def test_default_max_len_is_capped_by_the_budget(tiny_model):
    scorer = ReferenceScorer(ReferenceConfig(model_path=str(tiny_model), token_budget=100))
    scorer.load()
    assert scorer.max_len == 100  # the model allows 2048


def test_config_fields_are_documented_and_checked():
    for name, field in ReferenceConfig.model_fields.items():
        assert field.description, f"ReferenceConfig.{name} has no docstring"
    with pytest.raises(ValidationError, match="token_budget"):
        ReferenceConfig(model_path="m", token_budget=10, max_len=20)
    with pytest.raises(ValidationError):
        ReferenceConfig(model_path="m", padding_side="middle")
    with pytest.raises(ValidationError):
        ReferenceConfig(model_path="m", unknown_option=1)


def test_request_and_queue_bounds_are_configured_consistently():
    config = ReferenceConfig(model_path="m")
    assert (config.max_request_tokens, config.max_queued_requests, config.max_queued_tokens) == (262_144, 1024, 1 << 20)
    with pytest.raises(ValidationError, match="max_request_tokens"):
        ReferenceConfig(model_path="m", token_budget=100, max_len=100, max_request_tokens=50)
    with pytest.raises(ValidationError):
        ReferenceConfig(model_path="m", max_queued_requests=0)
