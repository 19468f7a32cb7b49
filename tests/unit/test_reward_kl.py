import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.reward import kl

# Three tokens by hand: log_ratio r = log p - log q = [0.5, -1, 0].
LOG_P = torch.tensor([-1.0, -2.0, -0.5])
LOG_Q = torch.tensor([-1.5, -1.0, -0.5])


def test_k1_is_the_log_ratio():
    torch.testing.assert_close(kl.kl_k1(LOG_P, LOG_Q), torch.tensor([0.5, -1.0, 0.0]))


def test_k2_is_half_the_squared_log_ratio():
    torch.testing.assert_close(kl.kl_k2(LOG_P, LOG_Q), torch.tensor([0.125, 0.5, 0.0]))


def test_k3_is_q_over_p_minus_one_minus_log_q_over_p():
    expected = torch.tensor([math.exp(-0.5) - 0.5, math.e - 2.0, 0.0])  # exp(-r) - 1 + r
    torch.testing.assert_close(kl.kl_k3(LOG_P, LOG_Q), expected)


def test_padded_per_token_and_sequence_reductions():
    log_p = torch.stack([LOG_P, LOG_P])
    log_q = torch.stack([LOG_Q, LOG_Q])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    per_token = kl.per_token_kl(log_p, log_q, mask, "k1")
    torch.testing.assert_close(per_token, torch.tensor([[0.5, -1.0, 0.0], [0.5, -1.0, 0.0]]))
    torch.testing.assert_close(kl.sequence_kl(log_p, log_q, mask, "k1", "sum"), torch.tensor([-0.5, -0.5]))
    torch.testing.assert_close(
        kl.sequence_kl(log_p, log_q, mask, "k1", "mean"), torch.tensor([-0.5 / 3, -0.25])
    )
    torch.testing.assert_close(kl.sequence_kl(log_p, log_q, mask, "k2", "sum"), torch.tensor([0.625, 0.625]))


def test_padding_may_hold_garbage():
    log_p = torch.tensor([[-1.0, float("nan"), -float("inf")]])
    log_q = torch.tensor([[-1.5, -float("inf"), 0.0]])
    mask = torch.tensor([[True, False, False]])
    for estimator in ("k1", "k2", "k3"):
        out = kl.per_token_kl(log_p, log_q, mask, estimator)
        assert torch.isfinite(out).all()
        assert out[0, 1:].eq(0).all()


def test_empty_row_has_mean_zero_not_nan():
    out = kl.sequence_kl(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bool))
    assert out.tolist() == [0.0]


def test_ragged_matches_padded():
    rows_p = [LOG_P, LOG_P[:2], LOG_P[:1]]
    rows_q = [LOG_Q, LOG_Q[:2], LOG_Q[:1]]
    padded_p, mask = kl.pad_ragged(rows_p)
    padded_q, _ = kl.pad_ragged(rows_q)
    for estimator in ("k1", "k2", "k3"):
        ragged = kl.per_token_kl_ragged(rows_p, rows_q, estimator)
        assert [row.numel() for row in ragged] == [3, 2, 1]
        padded = kl.per_token_kl(padded_p, padded_q, mask, estimator)
        for index, row in enumerate(ragged):
            torch.testing.assert_close(row, padded[index, : row.numel()])
        for reduction in ("mean", "sum"):
            torch.testing.assert_close(
                kl.sequence_kl_ragged(rows_p, rows_q, estimator, reduction),
                kl.sequence_kl(padded_p, padded_q, mask, estimator, reduction),
            )


def test_bf16_inputs_are_computed_in_float32():
    out = kl.kl_k3(LOG_P.bfloat16(), LOG_Q.bfloat16())
    assert out.dtype == torch.float32


def test_ragged_length_mismatch_names_the_sample():
    with pytest.raises(InvalidArgument, match="sample 1: log_probs has 2 tokens but ref_log_probs has 3"):
        kl.per_token_kl_ragged([LOG_P, LOG_P[:2]], [LOG_Q, LOG_Q])
    with pytest.raises(InvalidArgument, match="2 samples but ref_log_probs has 1"):
        kl.per_token_kl_ragged([LOG_P, LOG_P], [LOG_Q])


def test_padded_shape_mismatch_names_the_field():
    with pytest.raises(InvalidArgument, match="mask has shape"):
        kl.per_token_kl(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(InvalidArgument, match="ref_log_probs has shape"):
        kl.per_token_kl(torch.zeros(2, 3), torch.zeros(1, 3), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(InvalidArgument, match="mask must be bool"):
        kl.per_token_kl(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_log_probs_name_sample_and_token(bad):
    log_p = torch.zeros(3, 4)
    log_p[2, 1] = bad
    mask = torch.ones(3, 4, dtype=torch.bool)
    with pytest.raises(InvalidArgument, match="sample 2, token 1: log_probs"):
        kl.per_token_kl(log_p, torch.zeros(3, 4), mask)
    with pytest.raises(InvalidArgument, match="sample 2, token 1: ref_log_probs"):
        kl.per_token_kl_ragged(list(torch.zeros(3, 4)), list(log_p))


def test_unknown_estimator_and_reduction():
    with pytest.raises(InvalidArgument, match="unknown KL estimator 'k4'"):
        kl.per_token_kl_ragged([], [], "k4")
    with pytest.raises(InvalidArgument, match="unknown reduction 'max'"):
        kl.sequence_kl_ragged([LOG_P], [LOG_Q], "k1", "max")


def test_ragged_rejects_non_tensors():
    with pytest.raises(InvalidArgument, match="log_probs: sample 0 must be a 1-D tensor"):
        kl.per_token_kl_ragged([[0.0]], [LOG_Q])


# ---------------------------------------------------------------- properties

logits = st.lists(st.floats(-3.0, 3.0), min_size=2, max_size=5)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_k1_and_k3_means_estimate_the_true_kl(data, seed):
    logits_p = torch.tensor(data.draw(logits), dtype=torch.float64)
    same_size = st.lists(st.floats(-3.0, 3.0), min_size=len(logits_p), max_size=len(logits_p))
    logits_q = torch.tensor(data.draw(same_size), dtype=torch.float64)
    log_p, log_q = logits_p.log_softmax(-1), logits_q.log_softmax(-1)
    true_kl = float((log_p.exp() * (log_p - log_q)).sum())

    samples = 200_000
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.multinomial(log_p.exp(), samples, replacement=True, generator=generator)
    for estimator in ("k1", "k3"):
        values = kl.ESTIMATORS[estimator](log_p[tokens], log_q[tokens])
        # Unbiased: within 6 standard errors of the truth.
        tolerance = 6 * float(values.std()) / math.sqrt(samples) + 1e-9
        assert abs(float(values.mean()) - true_kl) <= tolerance, estimator


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-80.0, 0.0, width=32), st.floats(-80.0, 0.0, width=32)),
        min_size=1,
        max_size=50,
    ),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_k3_is_never_negative(pairs, dtype):
    log_p = torch.tensor([p for p, _ in pairs]).to(dtype)
    log_q = torch.tensor([q for _, q in pairs]).to(dtype)
    assert (kl.kl_k3(log_p, log_q) >= 0).all()
    assert (kl.kl_k2(log_p, log_q) >= 0).all()


@settings(max_examples=200, deadline=None)
@given(st.floats(-0.0009765625, 0.0009765625, width=32), st.floats(-30.0, 0.0, width=32))
def test_k3_is_never_negative_near_zero_log_ratio(delta, base):
    log_q = torch.tensor([base])
    log_p = log_q + delta
    assert (kl.kl_k3(log_p, log_q) >= 0).all()
