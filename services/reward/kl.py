"""Per-token KL estimators between the sampling policy and the reference model: the reward's KL penalty.

``p`` is the policy the tokens were **sampled from** (the behaviour policy, or the current policy when it
is re-scored), ``q`` the frozen reference model; ``log_ratio = log p(x) - log q(x)`` on the sampled token,
and the target is ``KL(p || q)``. The estimators k1, k2 and k3 and their properties are
``rlfleet.kl``'s (one home for the formulas, shared with the SDK's mismatch metrics).

``per_token_kl`` takes ``[B, T]`` tensors with a bool ``mask`` of the tokens that
count. The reward pipeline (``pipeline.py``) passes a whole batch as one row: the
concatenation of its samples (flat ``[N]``, with the sample of each token, see
``sample_ids_of``), never padded, so memory follows the tokens sent, not
batch x longest; ``sample_sums`` reduces that row per sample.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlfleet.choices import KL_ESTIMATORS, KLEstimatorName
from rlfleet import kl as estimators
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.reward import validation


def kl_k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``log p - log q``: unbiased, high variance, can be negative per token."""
    return estimators.k1(estimators.log_ratio(log_probs, ref_log_probs))


def kl_k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``0.5 * (log p - log q)**2``: biased, low variance, non-negative."""
    return estimators.k2(estimators.log_ratio(log_probs, ref_log_probs))


def kl_k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``q/p - 1 - log(q/p)``: unbiased and non-negative."""
    return estimators.k3(estimators.log_ratio(log_probs, ref_log_probs))


# The formulas in the order of the names' table (k1, k2, k3): a name added there without its
# formula here fails at import.
ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = dict(
    zip(KL_ESTIMATORS, (kl_k1, kl_k2, kl_k3), strict=True))


def _estimator(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown KL estimator {name!r}; expected one of {sorted(ESTIMATORS)}"
        ) from None


# ---------------------------------------------------------------- padded [B, T]


def per_token_kl(
    log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor, estimator: KLEstimatorName = "k1"
) -> Tensor:
    """Per-token KL ``[B, T]``; exactly 0 outside ``mask`` (padding may hold NaN/-inf)."""
    estimate = _estimator(estimator)
    validation.check_padded(log_probs, ref_log_probs, mask)
    validation.check_finite("log_probs", log_probs, mask)
    validation.check_finite("ref_log_probs", ref_log_probs, mask)
    values = estimate(log_probs, ref_log_probs)
    return torch.where(mask, values, torch.zeros_like(values))


# ------------------------------------------------- flat [N]: samples back to back


def sample_ids_of(lengths: Tensor) -> Tensor:
    """``[N]`` int64: the sample each token belongs to, for samples of ``lengths`` tokens back to back."""
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths)


def sample_sums(values: Tensor, sample_ids: Tensor, batch_size: int) -> Tensor:
    """Per-sample sum ``[B]`` of flat ``values`` ``[N]`` (``sample_ids[i]``: the sample of token ``i``).

    Accumulated in float64: a long response sums many small terms, one by one here.
    """
    sums = torch.zeros(batch_size, dtype=torch.float64).index_add_(0, sample_ids, values.double())
    return sums.to(values.dtype)
