"""Shaped per-token reward, as TorchRL's ``RolloutFromModel`` builds it::

    score_reward[t] = clip(score, -score_clip, score_clip)  if t is the last response token else 0
    kl_reward[t]    = -kl_coef * kl[t]
    reward[t]       = score_reward[t] + kl_reward[t]

The three parts are returned separately (TorchRL's ``reward_raw`` /
``reward_kl`` / ``reward``) so they can be logged apart; ``raw_scores`` is the
task score before clipping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.reward import validation
from rlfleet.services.reward.kl import sample_ids_of
from rlfleet.services.reward.scores import clip_scores

PerToken = TypeVar("PerToken", Tensor, list[Tensor])


@dataclass(frozen=True)
class ShapedRewards(Generic[PerToken]):
    """Per-token rewards split into their parts; padded ``[B, T]`` or ragged lists."""

    raw_scores: Tensor
    """``[B]`` task scores as given, before clipping."""
    score_rewards: PerToken
    """Clipped score at the last response token, 0 elsewhere."""
    kl_rewards: PerToken
    """``-kl_coef * kl`` at every response token."""
    rewards: PerToken
    """``score_rewards + kl_rewards``: what the advantage estimator consumes."""


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last ``True`` in each row of a ``[B, T]`` mask (-1 for an empty row)."""
    if mask.shape[-1] == 0:
        return torch.full(mask.shape[:-1], -1, dtype=torch.long, device=mask.device)
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=-1)


def shape_rewards(
    scores: Tensor,
    per_token_kl: Tensor,
    mask: Tensor,
    *,
    kl_coef: float,
    score_clip: float | None = None,
) -> ShapedRewards[Tensor]:
    """Shaped rewards for padded ``[B, T]`` KL values and the response ``mask``."""
    if scores.ndim != 1 or scores.shape[0] != per_token_kl.shape[0]:
        raise InvalidArgument(
            f"scores has shape {tuple(scores.shape)}, expected [{per_token_kl.shape[0]}]"
        )
    if per_token_kl.shape != mask.shape or mask.dtype != torch.bool:
        raise InvalidArgument(
            f"mask must be a bool tensor of shape {tuple(per_token_kl.shape)}, "
            f"got {mask.dtype} {tuple(mask.shape)}"
        )
    if not math.isfinite(kl_coef) or kl_coef < 0:
        raise InvalidArgument(f"kl_coef must be finite and >= 0, got {kl_coef}")
    validation.check_finite("scores", scores)
    validation.check_finite("kl", per_token_kl, mask)

    last = last_token_index(mask)
    if bool((last < 0).any()):
        empty = int((last < 0).nonzero()[0])
        raise InvalidArgument(f"sample {empty}: the response has no tokens to put the score on")

    dtype = torch.promote_types(per_token_kl.dtype, torch.float32)
    rows = torch.arange(mask.shape[0], device=mask.device)
    score_rewards = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    score_rewards[rows, last] = clip_scores(scores.to(dtype), score_clip)
    kl_rewards = torch.where(mask, -kl_coef * per_token_kl.to(dtype), torch.zeros((), dtype=dtype))
    return ShapedRewards(
        raw_scores=scores,
        score_rewards=score_rewards,
        kl_rewards=kl_rewards,
        rewards=score_rewards + kl_rewards,
    )


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
) -> ShapedRewards[Tensor]:
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


def shape_rewards_ragged(
    scores: Tensor,
    per_token_kl: Sequence[Tensor],
    *,
    kl_coef: float,
    score_clip: float | None = None,
) -> ShapedRewards[list[Tensor]]:
    """Ragged twin of :func:`shape_rewards`: one 1-D KL tensor per sample (response tokens)."""
    per_token_kl = validation.as_ragged("kl", per_token_kl)
    if scores.ndim != 1 or scores.shape[0] != len(per_token_kl):
        raise InvalidArgument(f"scores has shape {tuple(scores.shape)}, expected [{len(per_token_kl)}]")
    validation.check_finite_ragged("kl", per_token_kl)
    lengths = [row.numel() for row in per_token_kl]
    flat_kl = torch.cat(per_token_kl) if per_token_kl else torch.zeros(0)
    mask = torch.ones(flat_kl.shape, dtype=torch.bool)
    sample_ids = sample_ids_of(torch.tensor(lengths, dtype=torch.long))
    shaped = shape_rewards_flat(scores, flat_kl, mask, sample_ids, kl_coef=kl_coef, score_clip=score_clip)
    return ShapedRewards(
        raw_scores=scores,
        score_rewards=list(shaped.score_rewards.split(lengths)),
        kl_rewards=list(shaped.kl_rewards.split(lengths)),
        rewards=list(shaped.rewards.split(lengths)),
    )
