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

Two layouts are accepted everywhere: padded ``[B, T]`` tensors with a bool
``mask`` of response tokens, and ragged lists of 1-D tensors (one per sample,
response tokens only), which is what arrives on the wire. Ragged inputs are
computed on the concatenation of their samples (flat ``[N]``, with the sample of
each token), never padded: memory follows the tokens sent, not batch x longest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.reward import validation

Estimator = Literal["k1", "k2", "k3"]
Reduction = Literal["mean", "sum"]


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


ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def _estimator(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown KL estimator {name!r}; expected one of {sorted(ESTIMATORS)}"
        ) from None


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise InvalidArgument(f"unknown reduction {reduction!r}; expected 'mean' or 'sum'")


# ---------------------------------------------------------------- padded [B, T]


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Per-row sum of ``values`` over ``mask``: ``[B, T] -> [B]``."""
    return torch.where(mask, values, torch.zeros_like(values)).sum(dim=-1)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Per-row mean over ``mask``; a row with no masked token has mean 0 (not NaN)."""
    count = mask.sum(dim=-1).clamp_min(1)
    return masked_sum(values, mask) / count


def per_token_kl(
    log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor, estimator: Estimator = "k1"
) -> Tensor:
    """Per-token KL ``[B, T]``; exactly 0 outside ``mask`` (padding may hold NaN/-inf)."""
    estimate = _estimator(estimator)
    validation.check_padded(log_probs, ref_log_probs, mask)
    validation.check_finite("log_probs", log_probs, mask)
    validation.check_finite("ref_log_probs", ref_log_probs, mask)
    values = estimate(log_probs, ref_log_probs)
    return torch.where(mask, values, torch.zeros_like(values))


def sequence_kl(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    mask: Tensor,
    estimator: Estimator = "k1",
    reduction: Reduction = "mean",
) -> Tensor:
    """Per-sequence KL ``[B]``: mean or sum of the per-token estimate over the mask."""
    _check_reduction(reduction)
    values = per_token_kl(log_probs, ref_log_probs, mask, estimator)
    return masked_mean(values, mask) if reduction == "mean" else masked_sum(values, mask)


# ------------------------------------------------------------ ragged list[1-D]


def pad_ragged(rows: Sequence[Tensor], padding_value: float = 0.0) -> tuple[Tensor, Tensor]:
    """Ragged list of 1-D tensors -> right-padded ``[B, T]`` tensor and its bool mask."""
    rows = list(rows)
    if not rows:
        return torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.bool)
    lengths = torch.tensor([row.numel() for row in rows], dtype=torch.long)
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=padding_value)
    mask = torch.arange(padded.shape[-1]) < lengths.unsqueeze(-1)
    return padded, mask


def per_token_kl_ragged(
    log_probs: Sequence[Tensor], ref_log_probs: Sequence[Tensor], estimator: Estimator = "k1"
) -> list[Tensor]:
    """Per-token KL for ragged inputs: one 1-D tensor per sample, same lengths as the inputs."""
    estimate = _estimator(estimator)
    log_probs = validation.as_ragged("log_probs", log_probs)
    ref_log_probs = validation.as_ragged("ref_log_probs", ref_log_probs)
    validation.check_same_lengths("log_probs", log_probs, "ref_log_probs", ref_log_probs)
    validation.check_finite_ragged("log_probs", log_probs)
    validation.check_finite_ragged("ref_log_probs", ref_log_probs)
    if not log_probs:
        return []
    # One vectorised call over the concatenation, then split back per sample.
    values = estimate(torch.cat(log_probs), torch.cat(ref_log_probs))
    return list(values.split([row.numel() for row in log_probs]))


def sequence_kl_ragged(
    log_probs: Sequence[Tensor],
    ref_log_probs: Sequence[Tensor],
    estimator: Estimator = "k1",
    reduction: Reduction = "mean",
) -> Tensor:
    """Per-sequence KL ``[B]`` for ragged inputs (an empty sample has KL 0)."""
    _check_reduction(reduction)
    per_token = per_token_kl_ragged(log_probs, ref_log_probs, estimator)
    lengths = torch.tensor([row.numel() for row in per_token], dtype=torch.long)
    dtype = per_token[0].dtype if per_token else torch.float32
    flat = torch.cat(per_token) if per_token else torch.zeros(0, dtype=dtype)
    sums = sample_sums(flat, sample_ids_of(lengths), len(per_token))
    if reduction == "sum":
        return sums
    return sums / lengths.clamp_min(1).to(dtype)


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
