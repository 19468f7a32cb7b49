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
