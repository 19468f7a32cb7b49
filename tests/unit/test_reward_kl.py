import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.reward import kl, validation

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


def test_padded_per_token_kl_and_per_sample_sums():
    log_p = torch.stack([LOG_P, LOG_P])
    log_q = torch.stack([LOG_Q, LOG_Q])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    per_token = kl.per_token_kl(log_p, log_q, mask, "k1")
    torch.testing.assert_close(per_token, torch.tensor([[0.5, -1.0, 0.0], [0.5, -1.0, 0.0]]))
    # The pipeline's layout: the samples' tokens back to back, summed per sample.
    sample_ids = kl.sample_ids_of(torch.tensor([3, 2]))
    assert sample_ids.tolist() == [0, 0, 0, 1, 1]
    torch.testing.assert_close(kl.sample_sums(per_token[mask], sample_ids, 2), torch.tensor([-0.5, -0.5]))
    k2 = kl.per_token_kl(log_p, log_q, mask, "k2")
    torch.testing.assert_close(kl.sample_sums(k2[mask], sample_ids, 2), torch.tensor([0.625, 0.625]))


def test_padding_may_hold_garbage():
    log_p = torch.tensor([[-1.0, float("nan"), -float("inf")]])
    log_q = torch.tensor([[-1.5, -float("inf"), 0.0]])
    mask = torch.tensor([[True, False, False]])
    for estimator in ("k1", "k2", "k3"):
        out = kl.per_token_kl(log_p, log_q, mask, estimator)
        assert torch.isfinite(out).all()
        assert out[0, 1:].eq(0).all()


def test_a_sample_without_tokens_sums_to_zero():
    sums = kl.sample_sums(torch.tensor([0.5, 0.25]), torch.tensor([0, 2]), 3)
    assert sums.tolist() == [0.5, 0.0, 0.25]


def test_one_flat_row_matches_padded_rows():
    rows_p = [LOG_P, LOG_P[:2], LOG_P[:1]]
    rows_q = [LOG_Q, LOG_Q[:2], LOG_Q[:1]]
    padded_p = torch.nn.utils.rnn.pad_sequence(rows_p, batch_first=True)
    padded_q = torch.nn.utils.rnn.pad_sequence(rows_q, batch_first=True)
    mask = torch.arange(3) < torch.tensor([3, 2, 1])[:, None]
    flat_p, flat_q = torch.cat(rows_p)[None], torch.cat(rows_q)[None]
    for estimator in ("k1", "k2", "k3"):
        flat = kl.per_token_kl(flat_p, flat_q, torch.ones_like(flat_p, dtype=torch.bool), estimator)[0]
        torch.testing.assert_close(flat, kl.per_token_kl(padded_p, padded_q, mask, estimator)[mask])


def test_bf16_inputs_are_computed_in_float32():
    out = kl.kl_k3(LOG_P.bfloat16(), LOG_Q.bfloat16())
    assert out.dtype == torch.float32


def test_ragged_length_mismatch_names_the_sample():
    with pytest.raises(InvalidArgument, match="sample 1: log_probs has 2 tokens but ref_log_probs has 3"):
        validation.check_same_lengths("log_probs", [LOG_P, LOG_P[:2]], "ref_log_probs", [LOG_Q, LOG_Q])
    with pytest.raises(InvalidArgument, match="2 samples but ref_log_probs has 1"):
        validation.check_same_lengths("log_probs", [LOG_P, LOG_P], "ref_log_probs", [LOG_Q])


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
        validation.check_finite_tokens("ref_log_probs", log_p.reshape(-1), [4, 4, 4])


def test_unknown_estimator():
    with pytest.raises(InvalidArgument, match="unknown KL estimator 'k4'"):
        kl.per_token_kl(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), "k4")


def test_ragged_rejects_non_tensors():
    with pytest.raises(InvalidArgument, match="log_probs: sample 0 must be a 1-D tensor"):
        validation.as_ragged("log_probs", [[0.0]])


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
