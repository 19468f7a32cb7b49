"""Schulman's per-token KL estimators ("Approximating KL divergence", 2020), one home for the formulas: the
reward service's KL penalty (``services/reward/kl.py``: the policy against the reference) and the
importance-sampling library's mismatch metrics (``rlfleet.client.offpolicy``: the behaviour against the
trainer) both compute them here. Pure torch.

Each is a function of ``log_ratio = log p(x) - log q(x)`` on tokens ``x`` **sampled from p**, and estimates
``KL(p || q)``:

==== ============================================ ========= =========
name per-token value                               unbiased  always >= 0
==== ============================================ ========= =========
k1   ``log_ratio``                                 yes       no
k2   ``0.5 * log_ratio**2``                        no        yes
k3   ``q/p - 1 - log(q/p) = exp(-r) - 1 + r``      yes       yes
==== ============================================ ========= =========

k3 is unbiased because ``E_p[q/p] = 1``; it is non-negative because ``exp(y) >= 1 + y`` with ``y = -r``.
It is computed as ``expm1(-r) + r``: ``exp(-r) - 1`` would cancel the digits k3 is made of near ``r = 0``
(in float32 a few percent of lag-0 mismatches, log-ratios of 1e-4, would come out negative).
"""

from __future__ import annotations

import torch
from torch import Tensor


def log_ratio(sampler_log_probs: Tensor, other_log_probs: Tensor) -> Tensor:
    """``log p - log q`` in at least float32: half-precision log-probs lose the small differences KL is
    made of."""
    dtype = torch.promote_types(torch.promote_types(sampler_log_probs.dtype, other_log_probs.dtype), torch.float32)
    return sampler_log_probs.to(dtype) - other_log_probs.to(dtype)


def k1(log_ratio: Tensor) -> Tensor:
    """``log p - log q``: unbiased, high variance, can be negative per token."""
    return log_ratio


def k2(log_ratio: Tensor) -> Tensor:
    """``0.5 * (log p - log q)**2``: biased, low variance, non-negative."""
    return 0.5 * log_ratio.square()


def k3(log_ratio: Tensor) -> Tensor:
    """``q/p - 1 - log(q/p)``: unbiased and non-negative."""
    return torch.expm1(-log_ratio) + log_ratio


__all__ = ["k1", "k2", "k3", "log_ratio"]
