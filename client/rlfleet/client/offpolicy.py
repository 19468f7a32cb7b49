"""Importance-sampling correction of the train/inference mismatch: per-token weights, masks, metrics.

Every token a trainer learns from was sampled by some policy version under the engine's numerics
(the batch's behaviour log-probs, ``log_probs/response``); the trainer's own log-prob of it differs
by staleness and by numerics. Given both, the tokens' mask and (optionally) the version that sampled
each token, ``importance_weights`` returns per-token weights to multiply into the policy-gradient
loss (detached: they scale the gradient, they are not differentiated), the tokens kept, and
metrics of the mismatch overall and per version lag. Pure torch: no vLLM, no gRPC.

The ratio is the trainer's over the behaviour's, as every peer has it: ``r = exp(trainer - behaviour)``
per token. The log-ratio at the level a ratio is taken is clamped to ±20 before ``exp``, as veRL does:
a token's own, a sequence's sum ``Σ log r`` (never its tokens before summing: one extreme token must
still decide its sequence), a sequence's mean. A ``Correction`` says at which level the ratio is taken
and what is done outside its bounds:

- ``level``: ``token`` (r), ``sequence`` (the product over the sequence's tokens, ``exp(Σ log r)``,
  given to each of its tokens) or ``geometric`` (the geometric mean, ``exp(mean log r)``);
- ``action``: ``truncate`` (weight ``clamp(ratio, lower, upper)``) or ``mask`` (tokens, or whole
  sequences, whose ratio lies outside ``[lower, upper]`` get weight 0 and leave the mask);
- ``inside``: for ``mask``, the weight of what is kept: the ratio itself (masked IS) or 1 (rejection
  sampling only).

The presets and the peers' settings they match (see docs/guides/off-policy.md for the formulas):

=============  ===========================================  =====================================================
preset         weight of a token (``R``: its level's ratio)  peers
=============  ===========================================  =====================================================
``none``       1 (metrics only)                              veRL ``disabled``
``token_tis``  ``min(r, 2)``                                 veRL ``decoupled_token_is``; SkyRL ``tis_ratio_type:
                                                             token``; TRL ``token_truncate`` (cap 3); OpenRLHF
                                                             ``tis`` (clamp to [0.5, 5])
``seq_tis``    ``min(R, 2)``, R the sequence's product       veRL ``decoupled_seq_is``; TRL ``sequence_truncate``;
                                                             SkyRL ``tis_ratio_type: sequence`` (cap 5)
``seq_mis``    ``R`` if ``R <= 2`` else 0 (whole sequence)   TRL ``sequence_mask`` (cap 3); the "MIS" of Liu, Li
                                                             et al., "When Speed Kills Stability" (2025)
``geo_mis``    1 if ``0.999 <= G <= 1.001`` else 0, G the    veRL ``decoupled_geo_rs`` (``seq_mean_k1``
               geometric mean (whole sequence)               0.999_1.001); SkyRL ``sequence_mask_metric:
                                                             geometric`` (0.99, 1.01)
``icepop``     ``r`` if ``0.5 <= r <= 5`` else 0 (per token) OpenRLHF ``icepop``; TRL ``token_mask``; IcePop
                                                             (Ling team, 2025)
=============  ===========================================  =====================================================

Metrics (over the trained tokens of the input mask, before the correction acts): ``kl_k1`` =
mean(behaviour - trainer), unclamped, and ``kl_k3`` = mean(r - 1 - log r) (as ``expm1(log r) - log r``,
exact near 0 in float32), two estimates of KL(behaviour ‖ trainer) from the behaviour's samples;
``chi2_token`` = mean(r²) - 1 and ``chi2_sequence`` = mean over the sequences with a trained token of
R² - 1; ``ess_token`` = (Σr)² / (N Σr²) and ``ess_sequence`` the same over those sequences' products
(both in (0, 1]: 1 when every ratio is equal, taken before any truncation); ``truncated_fraction``
and ``masked_fraction`` (of tokens), ``masked_sequence_fraction`` (of the sequences with a trained
token); ``weight_mean`` / ``weight_max`` (over the tokens kept). ``by_lag`` holds ``kl_k1``,
``kl_k3``, ``ess_token``, ``masked_fraction`` and ``tokens`` per version lag (``trainer_version -
versions``) when ``versions`` is given. docs/guides/off-policy.md sets each beside the peers' own.

Refused with a ValueError that names the problem: tensors of different shapes or not 2-D, ``versions``
of another shape, a mask with no trained token (no metric means anything), and a non-finite log-prob
at a trained position (NaN would spread into every weight; a -inf behaviour log-prob is a token the
engine could not have sampled), named by its (sequence, token) position. The weights come back in
the log-probs' floating dtype (float32 at least).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from rlfleet.client import kl

Level = Literal["token", "sequence", "geometric"]
Action = Literal["truncate", "mask"]
LOG_RATIO_CLAMP = 20.0
"""A level's log-ratio is clamped to ±this before ``exp`` (veRL's ``SAFETY_BOUND``): a weight stays finite."""


@dataclass(frozen=True)
class Correction:
    """How importance weights are made from the ratios (module docstring)."""

    level: Level = "token"
    action: Action = "truncate"
    lower: float | None = None
    """Lower bound of the ratio (None: none)."""
    upper: float | None = None
    """Upper bound of the ratio (None: none)."""
    inside: Literal["ratio", "one"] = "ratio"
    """``mask``: the weight of what is kept, the ratio (masked IS) or 1 (rejection sampling only)."""
    enabled: bool = True
    """False: weights are 1 and nothing is masked; the metrics are still computed."""

    def __post_init__(self):
        if self.level not in ("token", "sequence", "geometric"):
            raise ValueError(f"level must be token, sequence or geometric, not {self.level!r}")
        if self.action not in ("truncate", "mask"):
            raise ValueError(f"action must be truncate or mask, not {self.action!r}")
        if self.inside not in ("ratio", "one"):
            raise ValueError(f"inside must be ratio or one, not {self.inside!r}")
        for name in ("lower", "upper"):
            bound = getattr(self, name)
            if bound is not None and not bound > 0:
                raise ValueError(f"{name} must be a positive ratio, not {bound!r}")
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            raise ValueError(f"lower ({self.lower}) must not exceed upper ({self.upper})")


PRESETS: dict[str, Correction] = {
    "none": Correction(enabled=False),
    "token_tis": Correction("token", "truncate", upper=2.0),
    "seq_tis": Correction("sequence", "truncate", upper=2.0),
    "seq_mis": Correction("sequence", "mask", upper=2.0, inside="ratio"),
    "geo_mis": Correction("geometric", "mask", lower=0.999, upper=1.001, inside="one"),
    "icepop": Correction("token", "mask", lower=0.5, upper=5.0, inside="ratio"),
}
"""The named corrections (module docstring: what each is, and which peer's setting it matches)."""


@dataclass
class Corrected:
    """What ``importance_weights`` returns."""

    weights: torch.Tensor
    """Per-token weights, detached, the input's shape; 0 where ``mask`` is false."""
    mask: torch.Tensor
    """The input mask less the tokens the correction masked out."""
    metrics: dict[str, float]
    by_lag: dict[int, dict[str, float]] = field(default_factory=dict)

    def flat_metrics(self, prefix: str = "offpolicy/") -> dict[str, float]:
        """``metrics`` and ``by_lag`` in one flat dict (``offpolicy/kl_k3``, ``offpolicy/lag1/kl_k3``), for a logger."""
        flat = {f"{prefix}{key}": value for key, value in self.metrics.items()}
        for lag, values in sorted(self.by_lag.items()):
            flat.update({f"{prefix}lag{lag}/{key}": value for key, value in values.items()})
        return flat


def importance_weights(
    trainer_log_probs: torch.Tensor,
    behaviour_log_probs: torch.Tensor,
    mask: torch.Tensor,
    correction: str | Correction = "token_tis",
    *,
    versions: torch.Tensor | None = None,
    trainer_version: int | None = None,
) -> Corrected:
    """Weights, mask and metrics for tokens laid out ``[sequences, tokens]`` (padded; ``mask`` true at
    the tokens trained on, the assistant's sampled tokens). ``versions`` (same shape) is the policy
    version that sampled each token; with ``trainer_version`` (the version the trainer's weights are,
    e.g. the client's ``policy_version``) the metrics are also given per lag."""
    correction = _resolve(correction)
    _check_layout(trainer_log_probs, behaviour_log_probs, mask, versions, trainer_version)
    mask = mask.bool()
    dtype = torch.promote_types(torch.promote_types(trainer_log_probs.dtype, behaviour_log_probs.dtype),
                                torch.float32)
    trainer, behaviour = trainer_log_probs.detach().to(dtype), behaviour_log_probs.detach().to(dtype)
    _check_finite(trainer, "trainer_log_probs", mask)
    _check_finite(behaviour, "behaviour_log_probs", mask)
    log_ratio = torch.where(mask, trainer - behaviour, torch.zeros_like(trainer))  # unclamped: k1, the levels' sums
    clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_ratio = torch.exp(clamped)
    tokens_per_sequence = mask.sum(-1)
    sequence_ratio = torch.exp(log_ratio.sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    ratio = _level_ratio(correction.level, token_ratio, sequence_ratio, log_ratio, tokens_per_sequence)

    weights, kept, truncated = _apply(correction, ratio, mask)
    has_tokens = tokens_per_sequence > 0
    metrics = _mismatch_metrics(log_ratio[mask], clamped[mask], sequence_ratio[has_tokens])
    tokens = int(mask.sum())
    sequences_masked = (has_tokens & ~(kept & mask).any(-1)).sum()
    metrics.update(
        truncated_fraction=(truncated & mask).sum().item() / tokens,
        masked_fraction=(mask & ~kept).sum().item() / tokens,
        masked_sequence_fraction=sequences_masked.item() / int(has_tokens.sum()),
        weight_mean=_masked_mean(weights, kept & mask),
        weight_max=weights[kept & mask].max().item() if (kept & mask).any() else 0.0,
    )
    by_lag = {} if versions is None else _by_lag(trainer_version - versions.long(), mask, kept, log_ratio, clamped,
                                                 token_ratio)
    return Corrected(weights=weights.detach(), mask=kept & mask, metrics=metrics, by_lag=by_lag)


def _check_layout(trainer_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, mask: torch.Tensor,
                  versions: torch.Tensor | None, trainer_version: int | None) -> None:
    """ValueError unless the tensors are ``[sequences, tokens]`` of one shape, with a trained token, and
    ``versions`` comes with ``trainer_version``."""
    if trainer_log_probs.shape != behaviour_log_probs.shape or mask.shape != trainer_log_probs.shape:
        raise ValueError(f"trainer_log_probs {tuple(trainer_log_probs.shape)}, behaviour_log_probs "
                         f"{tuple(behaviour_log_probs.shape)} and mask {tuple(mask.shape)} must have one shape")
    if trainer_log_probs.dim() != 2:
        raise ValueError(f"expected [sequences, tokens] tensors, not {trainer_log_probs.dim()}-D ones")
    if (versions is None) != (trainer_version is None):
        raise ValueError("give both versions and trainer_version, or neither")
    if versions is not None and versions.shape != mask.shape:
        raise ValueError(f"versions {tuple(versions.shape)} must have the log-probs' shape {tuple(mask.shape)}")
    if not mask.bool().any():
        raise ValueError("mask has no trained token: there is nothing to weigh and no mismatch to measure")


def _by_lag(lags: torch.Tensor, mask: torch.Tensor, kept: torch.Tensor, log_ratio: torch.Tensor,
            clamped: torch.Tensor, token_ratio: torch.Tensor) -> dict[int, dict[str, float]]:
    """The mismatch metrics of the tokens at each version lag."""
    by_lag = {}
    for lag in torch.unique(lags[mask]).tolist():
        at_lag = mask & (lags == lag)
        by_lag[int(lag)] = {
            "tokens": int(at_lag.sum()),
            "kl_k1": (-log_ratio[at_lag]).mean().item(),
            "kl_k3": _k3(clamped[at_lag]).mean().item(),
            "ess_token": _ess(token_ratio[at_lag]),
            "masked_fraction": (at_lag & ~kept).sum().item() / int(at_lag.sum()),
        }
    return by_lag


def _check_finite(log_probs: torch.Tensor, name: str, mask: torch.Tensor) -> None:
    bad = mask & ~torch.isfinite(log_probs)
    if bad.any():
        sequence, token = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} is {log_probs[sequence, token].item()} at (sequence {sequence}, token {token}), "
                         f"a trained position ({int(bad.sum())} non-finite in all): a log-prob must be finite")


def _resolve(correction: str | Correction) -> Correction:
    if isinstance(correction, Correction):
        return correction
    try:
        return PRESETS[correction]
    except KeyError:
        raise ValueError(f"unknown correction {correction!r}; the presets are {', '.join(PRESETS)}") from None


def _level_ratio(level: Level, token_ratio, sequence_ratio, log_ratio, tokens_per_sequence) -> torch.Tensor:
    """The ratio each token is judged by: its own, or its sequence's (product or geometric mean), each
    from the unclamped log-ratios, clamped at its own level."""
    if level == "token":
        return token_ratio
    if level == "sequence":
        per_sequence = sequence_ratio
    else:
        mean = log_ratio.sum(-1) / tokens_per_sequence.clamp(min=1)
        per_sequence = torch.exp(mean.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return per_sequence[:, None].expand_as(token_ratio)


def _apply(correction: Correction, ratio: torch.Tensor, mask: torch.Tensor):
    """(weights, kept, truncated) for ``ratio`` under ``correction``; weights are 0 off ``mask``."""
    ones = torch.ones_like(ratio)
    nothing = torch.zeros_like(mask)
    if not correction.enabled:
        return torch.where(mask, ones, torch.zeros_like(ratio)), mask.clone(), nothing
    lower = correction.lower if correction.lower is not None else 0.0
    upper = correction.upper if correction.upper is not None else float("inf")
    if correction.action == "truncate":
        weights = ratio.clamp(min=lower, max=upper)
        kept, truncated = mask.clone(), (ratio < lower) | (ratio > upper)
    else:
        kept = mask & (ratio >= lower) & (ratio <= upper)
        weights = ratio if correction.inside == "ratio" else ones
        truncated = nothing
    return torch.where(kept, weights, torch.zeros_like(ratio)), kept, truncated


def _mismatch_metrics(log_ratio, clamped, sequence_ratio) -> dict[str, float]:
    """Over the trained tokens (``log_ratio`` unclamped, ``clamped`` at ±20) and the sequences with one."""
    ratio = torch.exp(clamped)
    return {
        "kl_k1": (-log_ratio).mean().item(),
        "kl_k3": _k3(clamped).mean().item(),
        "chi2_token": (ratio.square().mean() - 1).item(),
        "chi2_sequence": (sequence_ratio.square().mean() - 1).item(),
        "ess_token": _ess(ratio),
        "ess_sequence": _ess(sequence_ratio),
        "tokens": int(log_ratio.numel()),
    }


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """``r - 1 - log r`` per token of the trainer-over-behaviour log-ratio: ``rlfleet.kl``'s k3 of
    KL(behaviour || trainer), whose log-ratio is the negated one (``expm1``: exact near 0 in float32)."""
    return kl.k3(-log_ratio)


def _ess(ratio: torch.Tensor) -> float:
    """Normalised effective sample size, (Σw)² / (N Σw²), in (0, 1]."""
    return (ratio.sum().square() / (ratio.numel() * ratio.square().sum())).item()


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return values[mask].mean().item() if mask.any() else 0.0
