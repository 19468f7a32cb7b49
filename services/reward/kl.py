"""Per-token KL estimators between the sampling policy and the reference model.

Convention (Schulman, "Approximating KL divergence", 2020):

* ``p`` is the policy the tokens were **sampled from** (the behaviour policy, or
  the current policy when it is re-scored), ``q`` the frozen reference model.
* ``log_ratio = log p(x) - log q(x)``, evaluated on the sampled token ``x ~ p``.
* The target quantity is ``KL(p || q) = E_{x~p}[log p(x) - log q(x)]``.

The three estimators, all functions of ``log_ratio`` only:

==== ============================================ ========= =========
name per-token value                               unbiased  always >= 0
==== ============================================ ========= =========
k1   ``log_ratio``                                 yes       no
k2   ``0.5 * log_ratio**2``                        no        yes
k3   ``q/p - 1 - log(q/p) = exp(-r) - 1 + r``      yes       yes
==== ============================================ ========= =========

k3 is unbiased because ``E_p[q/p] = 1``; it is non-negative because
``exp(y) >= 1 + y`` with ``y = -r``.

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
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.reward import validation


def _log_ratio(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    # Half-precision log-probs lose the small differences KL is made of.
    dtype = torch.promote_types(torch.promote_types(log_probs.dtype, ref_log_probs.dtype), torch.float32)
    return log_probs.to(dtype) - ref_log_probs.to(dtype)


def kl_k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``log p - log q``: unbiased, high variance, can be negative per token."""
    return _log_ratio(log_probs, ref_log_probs)


def kl_k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``0.5 * (log p - log q)**2``: biased, low variance, non-negative."""
    return 0.5 * _log_ratio(log_probs, ref_log_probs).square()


def kl_k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``q/p - 1 - log(q/p)``: unbiased and non-negative."""
    log_ratio = _log_ratio(log_probs, ref_log_probs)
    # expm1 keeps precision near r = 0, where exp(-r) - 1 would cancel.
    return torch.expm1(-log_ratio) + log_ratio


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
