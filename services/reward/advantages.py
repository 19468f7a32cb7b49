"""Group-relative advantages: GRPO and RLOO.

A GRPO group is the ``n`` samples drawn for one prompt; ``group_ids[i]`` says
which group sample ``i`` belongs to (any hashable id: an int, a prompt uid).
Members of a group need not be adjacent in the batch.

GRPO (Shao et al. 2024, DeepSeekMath)::

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)        # scale_by_std=True
    A_i =  r_i - mean_g(r)                            # scale_by_std=False (Dr. GRPO)

``std_g`` is the unbiased (n - 1) standard deviation, as in TRL; a group of one
sample has advantage 0.

RLOO (Ahmadian et al. 2024), leave-one-out baseline::

    A_i = r_i - (sum_g(r) - r_i) / (n_g - 1)          # needs n_g >= 2

Both sum to zero within each group. Math runs in float64 so that holds to
rounding; results come back as float32.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.reward import validation


@dataclass(frozen=True)
class Groups:
    """A validated partition of the batch into groups."""

    index: Tensor
    """``[B]`` long: the contiguous group number (0..G-1) of each sample."""
    sizes: Tensor
    """``[G]`` long: the number of samples in each group."""


def make_groups(
    group_ids: Sequence[Hashable] | Tensor,
    batch_size: int,
    *,
    group_size: int | None = None,
    min_group_size: int = 1,
) -> Groups:
    """Check that ``group_ids`` partitions a batch of ``batch_size`` samples.

    Every sample carries a group id; with ``group_size`` set every group must be
    complete (exactly that many samples), otherwise at least ``min_group_size``.
    Errors name the first sample of the offending group.
    """
    ids = group_ids.tolist() if isinstance(group_ids, Tensor) else list(group_ids)
    if len(ids) != batch_size:
        raise InvalidArgument(f"group_ids has {len(ids)} entries for {batch_size} samples")
    if group_size is not None and group_size < max(1, min_group_size):
        raise InvalidArgument(f"group_size must be >= {max(1, min_group_size)}, got {group_size}")

    number_of: dict[Hashable, int] = {}
    first_sample: list[int] = []
    index = []
    for sample, group_id in enumerate(ids):
        if not isinstance(group_id, (numbers.Integral, str)):
            raise InvalidArgument(f"sample {sample}: group id {group_id!r} must be an int or a string")
        if group_id not in number_of:
            number_of[group_id] = len(number_of)
            first_sample.append(sample)
        index.append(number_of[group_id])
    index_tensor = torch.tensor(index, dtype=torch.long)
    sizes = torch.bincount(index_tensor, minlength=len(number_of))

    for group, size in enumerate(sizes.tolist()):
        if group_size is not None and size != group_size:
            expected = f"exactly {group_size}"
        elif size < min_group_size:
            expected = f"at least {min_group_size}"
        else:
            continue
        sample = first_sample[group]
        raise InvalidArgument(
            f"sample {sample}: group {ids[sample]!r} has {size} samples, expected {expected}"
        )
    return Groups(index=index_tensor, sizes=sizes)


def _check_scores(scores: Tensor) -> Tensor:
    if scores.ndim != 1:
        raise InvalidArgument(f"scores must be 1-D [batch], got shape {tuple(scores.shape)}")
    validation.check_finite("scores", scores)
    return scores.to(torch.float64)


def _group_sums(values: Tensor, groups: Groups) -> Tensor:
    return torch.zeros(groups.sizes.numel(), dtype=values.dtype).index_add_(0, groups.index, values)


def grpo_advantages(
    scores: Tensor,
    group_ids: Sequence[Hashable] | Tensor,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    group_size: int | None = None,
) -> Tensor:
    """GRPO advantages ``[B]``: scores normalised within their group."""
    rewards = _check_scores(scores)
    groups = make_groups(group_ids, rewards.numel(), group_size=group_size)
    sizes = groups.sizes.to(torch.float64)
    mean = _group_sums(rewards, groups) / sizes
    centered = rewards - mean[groups.index]
    if not scale_by_std:
        return centered.float()
    variance = _group_sums(centered.square(), groups) / (sizes - 1).clamp_min(1)
    std = variance.sqrt()
    return (centered / (std[groups.index] + eps)).float()


def rloo_advantages(
    scores: Tensor,
    group_ids: Sequence[Hashable] | Tensor,
    *,
    group_size: int | None = None,
) -> Tensor:
    """RLOO advantages ``[B]``: each score minus the mean of the *other* scores in its group."""
    rewards = _check_scores(scores)
    groups = make_groups(group_ids, rewards.numel(), group_size=group_size, min_group_size=2)
    sizes = groups.sizes.to(torch.float64)
    others_mean = (_group_sums(rewards, groups)[groups.index] - rewards) / (sizes[groups.index] - 1)
    return (rewards - others_mean).float()

