"""Every correction preset against hand-computed weights, masks and metrics (rlfleet.client.offpolicy)."""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet.client.offpolicy import PRESETS, Correction, importance_weights

# Two sequences: ratios (trainer over behaviour) 1, 4, 1/4 (product 1, geometric mean 1) and 2, 2 (product 4,
# geometric mean 2) with a padding position; behaviour log-probs -1, the trainer's -1 + log r.
RATIOS = torch.tensor([[1.0, 4.0, 0.25], [2.0, 2.0, 1.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])
BEHAVIOUR = torch.full((2, 3), -1.0)
TRAINER = BEHAVIOUR + RATIOS.log()


@pytest.mark.parametrize(("preset", "weights", "truncated", "masked", "masked_sequences"), [
    ("none", [[1, 1, 1], [1, 1, 0]], 0, 0, 0),
    ("token_tis", [[1, 2, 0.25], [2, 2, 0]], 1 / 5, 0, 0),  # min(r, 2)
    ("seq_tis", [[1, 1, 1], [2, 2, 0]], 2 / 5, 0, 0),  # min(R, 2): R = 1 and 4
    ("seq_mis", [[1, 1, 1], [0, 0, 0]], 0, 2 / 5, 1 / 2),  # R <= 2 keeps R, else the sequence goes
    ("geo_mis", [[1, 1, 1], [0, 0, 0]], 0, 2 / 5, 1 / 2),  # G in [0.999, 1.001] keeps 1
    ("icepop", [[1, 4, 0], [2, 2, 0]], 0, 1 / 5, 0),  # r in [0.5, 5] keeps r, else the token goes
])
def test_each_preset_gives_the_hand_computed_weights(preset, weights, truncated, masked, masked_sequences):
    corrected = importance_weights(TRAINER, BEHAVIOUR, MASK, preset)

    assert torch.allclose(corrected.weights, torch.tensor(weights, dtype=torch.float32), atol=1e-6)
    assert torch.equal(corrected.mask, MASK & (corrected.weights > 0))
    assert corrected.metrics["truncated_fraction"] == pytest.approx(truncated)
    assert corrected.metrics["masked_fraction"] == pytest.approx(masked)
    assert corrected.metrics["masked_sequence_fraction"] == pytest.approx(masked_sequences)


def test_the_mismatch_metrics_are_the_hand_computed_ones():
    metrics = importance_weights(TRAINER, BEHAVIOUR, MASK, "none").metrics
    ratios = [1, 4, 0.25, 2, 2]

    assert metrics["kl_k1"] == pytest.approx(-sum(map(math.log, ratios)) / 5)
    assert metrics["kl_k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 5)
    assert metrics["chi2_token"] == pytest.approx(sum(r * r for r in ratios) / 5 - 1)  # 4.0125
    assert metrics["chi2_sequence"] == pytest.approx((1 + 16) / 2 - 1)
    assert metrics["ess_token"] == pytest.approx(9.25 ** 2 / (5 * 25.0625))
    assert metrics["ess_sequence"] == pytest.approx(25 / 34)
    assert metrics["tokens"] == 5


def test_metrics_per_version_lag():
    versions = torch.tensor([[5, 5, 5], [3, 4, 0]])  # the padding's version is never read

    by_lag = importance_weights(TRAINER, BEHAVIOUR, MASK, "icepop", versions=versions, trainer_version=5).by_lag

    assert sorted(by_lag) == [0, 1, 2]
    assert by_lag[0]["tokens"] == 3 and by_lag[0]["kl_k1"] == pytest.approx(0.0, abs=1e-6)
    assert by_lag[0]["masked_fraction"] == pytest.approx(1 / 3)  # the 1/4 ratio
    assert by_lag[2] == pytest.approx({"tokens": 1, "kl_k1": -math.log(2), "kl_k3": 1 - math.log(2),
                                       "ess_token": 1.0, "masked_fraction": 0.0})


def test_equal_numerics_give_unit_weights_and_no_mismatch():
    corrected = importance_weights(BEHAVIOUR, BEHAVIOUR, MASK, "token_tis")

    assert torch.equal(corrected.weights, MASK.float())
    assert corrected.metrics["kl_k3"] == 0 and corrected.metrics["ess_token"] == pytest.approx(1.0)


def test_weights_are_detached_and_extreme_ratios_stay_finite():
    trainer = TRAINER.clone().requires_grad_()
    huge = trainer + torch.tensor([[0.0, 500.0, 0.0], [0.0, 0.0, 0.0]])

    corrected = importance_weights(huge, BEHAVIOUR, MASK, "seq_tis")

    assert not corrected.weights.requires_grad
    assert torch.isfinite(corrected.weights).all() and math.isfinite(corrected.metrics["chi2_token"])


def test_a_custom_correction_and_bad_input_are_checked():
    rejection_only = Correction("token", "mask", lower=0.5, upper=2.0, inside="one")
    assert importance_weights(TRAINER, BEHAVIOUR, MASK, rejection_only).weights.tolist() == [[1, 0, 0], [1, 1, 0]]
    with pytest.raises(ValueError, match="unknown correction 'tis'; the presets are none, token_tis"):
        importance_weights(TRAINER, BEHAVIOUR, MASK, "tis")
    with pytest.raises(ValueError, match="lower .* must not exceed upper"):
        Correction(lower=2.0, upper=1.0)
    with pytest.raises(ValueError, match="must have one shape"):
        importance_weights(TRAINER, BEHAVIOUR[:1], MASK)
    with pytest.raises(ValueError, match="give both versions and trainer_version"):
        importance_weights(TRAINER, BEHAVIOUR, MASK, versions=torch.zeros(2, 3))
    assert set(PRESETS) == {"none", "token_tis", "seq_tis", "seq_mis", "geo_mis", "icepop"}


# One extreme token in a sequence: log-ratios 25, -8, -8, -8 sum to 1 (R = e). Clamping each token to ±20 before
# summing would give R = e^-4 and keep the sequence; the sum is clamped, as veRL does.
EXTREME = torch.tensor([[25.0, -8.0, -8.0, -8.0], [0.5, 0.0, 0.0, 0.0]])
EXTREME_MASK = torch.ones(2, 4, dtype=torch.bool)
E = math.e


def test_one_extreme_token_decides_its_sequence_by_the_true_sum():
    behaviour = torch.full((2, 4), -30.0)

    mis = importance_weights(behaviour + EXTREME, behaviour, EXTREME_MASK, "seq_mis")
    tis = importance_weights(behaviour + EXTREME, behaviour, EXTREME_MASK, "seq_tis")
    geo = importance_weights(behaviour + EXTREME, behaviour, EXTREME_MASK,
                             Correction("geometric", "mask", lower=0.5, upper=1.2, inside="one"))

    assert mis.weights[0].tolist() == [0, 0, 0, 0]  # R = e > 2: the whole sequence goes
    assert mis.weights[1].tolist() == pytest.approx([math.exp(0.5)] * 4)  # R = e^0.5 kept, weight R
    assert mis.metrics["masked_sequence_fraction"] == 0.5 and mis.metrics["masked_fraction"] == 0.5
    assert tis.weights[0].tolist() == [2, 2, 2, 2] and tis.metrics["truncated_fraction"] == 0.5
    assert geo.weights[0].tolist() == [0, 0, 0, 0]  # G = e^(1/4) = 1.284 > 1.2
    assert mis.metrics["chi2_sequence"] == pytest.approx((E ** 2 + E) / 2 - 1, rel=1e-6)
    assert mis.metrics["ess_sequence"] == pytest.approx((E + E ** 0.5) ** 2 / (2 * (E ** 2 + E)), rel=1e-6)
    assert mis.metrics["kl_k1"] == pytest.approx(-1.5 / 8)  # unclamped: 25 counts as 25


def test_a_sequence_sum_beyond_the_bound_is_clamped_at_the_sum():
    behaviour = torch.zeros(1, 3)
    trainer = torch.tensor([[15.0, 15.0, -1.0]])  # sum 29: R = e^20, not e^29

    tis = importance_weights(trainer, behaviour, torch.ones(1, 3, dtype=torch.bool),
                             Correction("sequence", "truncate"))

    assert tis.weights[0, 0].item() == pytest.approx(math.exp(20), rel=1e-5)


def test_chi2_and_ess_per_sequence_count_only_sequences_with_a_trained_token():
    mask = MASK.clone()
    trainer, behaviour = torch.cat([TRAINER, TRAINER[:1]]), torch.cat([BEHAVIOUR, BEHAVIOUR[:1]])
    with_padding_row = torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)])  # veRL would count R = 1 for it

    metrics = importance_weights(trainer, behaviour, with_padding_row, "seq_mis").metrics

    assert metrics["chi2_sequence"] == pytest.approx((1 + 16) / 2 - 1)
    assert metrics["ess_sequence"] == pytest.approx(25 / 34)
    assert metrics["masked_sequence_fraction"] == pytest.approx(1 / 2)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("trainer", float("nan"), r"trainer_log_probs is nan at \(sequence 1, token 0\), a trained position"),
    ("behaviour", float("-inf"), r"behaviour_log_probs is -inf at \(sequence 1, token 0\)"),
    ("trainer", float("inf"), r"trainer_log_probs is inf at \(sequence 1, token 0\)"),
])
def test_a_non_finite_log_prob_at_a_trained_position_is_refused_by_position(name, value, message):
    trainer, behaviour = TRAINER.clone(), BEHAVIOUR.clone()
    (trainer if name == "trainer" else behaviour)[1, 0] = value

    for preset in PRESETS:
        with pytest.raises(ValueError, match=message):
            importance_weights(trainer, behaviour, MASK, preset)


def test_a_non_finite_log_prob_off_the_mask_is_padding_and_ignored():
    trainer = TRAINER.clone()
    trainer[1, 2] = float("nan")  # the padding position

    corrected = importance_weights(trainer, BEHAVIOUR, MASK, "token_tis")

    assert torch.isfinite(corrected.weights).all() and corrected.weights[1, 2] == 0


def test_a_batch_with_no_trained_token_is_refused():
    with pytest.raises(ValueError, match="mask has no trained token"):
        importance_weights(TRAINER, BEHAVIOUR, torch.zeros_like(MASK), "icepop")


def test_weights_keep_a_float64_input_dtype_and_versions_of_another_shape_are_a_value_error():
    corrected = importance_weights(TRAINER.double(), BEHAVIOUR.double(), MASK, "seq_mis")

    assert corrected.weights.dtype == torch.float64
    assert importance_weights(TRAINER.half(), BEHAVIOUR.half(), MASK, "none").weights.dtype == torch.float32
    with pytest.raises(ValueError, match=r"versions \(2, 2\) must have the log-probs' shape \(2, 3\)"):
        importance_weights(TRAINER, BEHAVIOUR, MASK, versions=torch.zeros(2, 2), trainer_version=1)


def test_k3_is_exact_near_zero_in_float32():
    """Lag-0 mismatches are log-ratios of 1e-4 or less: ``exp(x) - 1 - x`` in float32 gets them wrong (often
    negative); ``expm1(x) - x`` gets them to float32's precision."""
    log_ratio = torch.linspace(-3e-4, 3e-4, 61, dtype=torch.float64)
    log_ratio = log_ratio[log_ratio != 0]
    behaviour = torch.full((1, log_ratio.numel()), -2.0)
    trainer = behaviour.double() + log_ratio
    exact = (torch.expm1(log_ratio) - log_ratio)  # float64

    corrected = importance_weights(trainer.float(), behaviour, torch.ones_like(behaviour, dtype=torch.bool),
                                   "none", versions=torch.zeros_like(behaviour), trainer_version=0)

    # trainer.float() rounds each log-ratio to float32's grid near -2 (steps of 2.4e-7): compare to what it holds
    held = (trainer.float().double() - behaviour.double())[0]
    assert corrected.metrics["kl_k3"] == pytest.approx((torch.expm1(held) - held).mean().item(), rel=1e-3)
    assert corrected.by_lag[0]["kl_k3"] == pytest.approx(corrected.metrics["kl_k3"], rel=1e-6)
    assert exact.min() > 0
