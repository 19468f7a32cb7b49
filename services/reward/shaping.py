"""Shaped per-token reward, as TorchRL's ``RolloutFromModel`` builds it::

    score_reward[t] = clip(score, -score_clip, score_clip)  if t is the last response token else 0
    kl_reward[t]    = -kl_coef * kl[t]
    reward[t]       = score_reward[t] + kl_reward[t]

The three parts are returned separately (TorchRL's ``reward_raw`` /
``reward_kl`` / ``reward``) so they can be logged apart; ``raw_scores`` is the
task score before clipping. Computed on a batch's tokens back to back (flat
``[N]``, as the reward pipeline holds them), never padded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.reward import validation
from rlfleet.services.reward.scores import clip_scores


@dataclass(frozen=True)
class ShapedRewards:
    """Per-token rewards split into their parts, flat ``[N]`` like the KL they were shaped from."""

    raw_scores: Tensor
    """``[B]`` task scores as given, before clipping."""
    score_rewards: Tensor
    """Clipped score at the last response token, 0 elsewhere."""
    kl_rewards: Tensor
    """``-kl_coef * kl`` at every response token."""
    rewards: Tensor
    """``score_rewards + kl_rewards``: what the advantage estimator consumes."""


def last_token_index_flat(mask: Tensor, sample_ids: Tensor, batch_size: int) -> Tensor:
    """Flat position of each sample's last ``True`` in a flat ``[N]`` mask (-1 for none);
    ``sample_ids[i]`` is the sample of token ``i``."""
    positions = torch.arange(mask.numel(), device=mask.device)
    marked = torch.where(mask, positions, torch.full_like(positions, -1))
    last = torch.full((batch_size,), -1, dtype=torch.long, device=mask.device)
    return last.scatter_reduce_(0, sample_ids, marked, reduce="amax")


def shape_rewards_flat(
    scores: Tensor,
    per_token_kl: Tensor,
    mask: Tensor,
    sample_ids: Tensor,
    *,
    kl_coef: float,
    score_clip: float | None = None,
) -> ShapedRewards:
    """Shaped rewards for flat ``[N]`` KL values: every sample's tokens back to back,
    ``sample_ids[i]`` the sample of token ``i``, ``mask`` the tokens that count. No padding."""
    if scores.ndim != 1:
        raise InvalidArgument(f"scores has shape {tuple(scores.shape)}, expected [batch]")
    if per_token_kl.shape != mask.shape or mask.dtype != torch.bool or sample_ids.shape != mask.shape:
        raise InvalidArgument(
            f"per-token KL, mask (bool) and sample ids must share one flat shape, got {tuple(per_token_kl.shape)}, "
            f"{mask.dtype} {tuple(mask.shape)} and {tuple(sample_ids.shape)}"
        )
    if not math.isfinite(kl_coef) or kl_coef < 0:
        raise InvalidArgument(f"kl_coef must be finite and >= 0, got {kl_coef}")
    validation.check_finite("scores", scores)
    if bool((~torch.isfinite(per_token_kl) & mask).any()):
        raise InvalidArgument("kl holds NaN/inf at a counted token")

    last = last_token_index_flat(mask, sample_ids, scores.shape[0])
    if bool((last < 0).any()):
        empty = int((last < 0).nonzero()[0])
        raise InvalidArgument(f"sample {empty}: the response has no tokens to put the score on")

    dtype = torch.promote_types(per_token_kl.dtype, torch.float32)
    score_rewards = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    score_rewards[last] = clip_scores(scores.to(dtype), score_clip)
    kl_rewards = torch.where(mask, -kl_coef * per_token_kl.to(dtype), torch.zeros((), dtype=dtype))
    return ShapedRewards(
        raw_scores=scores,
        score_rewards=score_rewards,
        kl_rewards=kl_rewards,
        rewards=score_rewards + kl_rewards,
    )
