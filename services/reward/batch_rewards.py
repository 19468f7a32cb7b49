"""One ComputeRewards batch, top to bottom, as plain functions on tensors.

    validate -> per-token KL (k1/k2/k3, 0 outside the mask) -> kl_mean / kl_sum
    -> task scores: the reward function's (an injected callable, run only once the
       inputs are valid) plus the sample's environment reward
    -> clip -> shaped per-token rewards (clipped score at the last counted token
       minus kl_coef * KL at every counted token)
    -> group advantages of the clipped scores (GRPO / GRPO without std / RLOO)

Inputs are ragged: one 1-D tensor per sample holding only its response tokens.
Once every length is checked the samples are concatenated (flat ``[N]`` plus the
sample of each token) and computed on as such: nothing is padded to
batch x longest, so memory follows the tokens sent (bounded by the service's
``max_tokens_per_request`` before a request gets here).
Nothing here knows about gRPC, the KL controller or where scores come from;
every check names the field and the sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlfleet.choices import ADVANTAGE_MODES, AdvantageModeName, KLEstimatorName
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.reward import advantages as adv
from rlfleet.services.reward import kl, shaping, validation
from rlfleet.services.reward.scores import clip_scores


@dataclass(frozen=True)
class RewardInputs:
    """Per-sample tensors of one batch (ragged: response tokens only)."""

    behavior_log_probs: Sequence[Tensor]
    """Log-probs of the sampled tokens under the policy that generated them."""
    ref_log_probs: Sequence[Tensor]
    """Log-probs of the same tokens under the frozen reference model."""
    response_token_ids: Sequence[Tensor] | None = None
    """The response tokens (only checked for matching lengths here)."""
    response_masks: Sequence[Tensor] | None = None
    """Bool per token: which tokens count. ``None``: all of them."""
    group_ids: Sequence[int] | None = None
    """Group of each sample (samples of one prompt share it). ``None`` or empty: one group per sample."""
    environment_rewards: Tensor | None = None
    """``[B]`` float64: each sample's reward from its environment (a multi-turn episode's per-turn rewards
    plus its final one), added to the reward function's score. ``None``: 0 for each. The service checks it
    (one per sample, finite: :func:`validation.check_environment_rewards`) before anything is decoded."""

    @property
    def batch_size(self) -> int:
        return len(self.behavior_log_probs)


@dataclass(frozen=True)
class RewardOutputs:
    """Everything ComputeRewards answers; per-token fields are ragged like the inputs."""

    kl: list[Tensor]
    """Per-token KL estimate, 0 at tokens outside the mask."""
    rewards: list[Tensor]
    """Shaped per-token reward."""
    scores: Tensor
    """``[B]`` raw task scores: reward function score + environment reward."""
    clipped_scores: Tensor
    """``[B]`` scores clipped to ``+-score_clip``."""
    advantages: Tensor
    """``[B]`` sequence-level advantages of the clipped scores within each group."""
    kl_mean: Tensor
    """``[B]`` mean KL over each sample's counted tokens."""
    kl_sum: Tensor
    """``[B]`` sum of KL over each sample's counted tokens."""
    kl_coef: float
    """The KL coefficient the rewards were shaped with."""

    @property
    def batch_kl(self) -> float:
        """Batch mean of the per-sequence (summed) KL: what the adaptive controller steers."""
        return float(self.kl_sum.double().mean()) if self.kl_sum.numel() else 0.0


@dataclass(frozen=True)
class _Checked:
    behavior: Tensor  # [N]: every sample's response tokens, back to back
    ref: Tensor  # [N]
    mask: Tensor  # [N] bool: tokens that count
    sample_ids: Tensor  # [N] int64: the sample of each token
    counted: Tensor  # [B] int64: tokens that count, per sample
    lengths: list[int]
    group_ids: list[int]


def validate_inputs(inputs: RewardInputs, advantage_mode: str = "grpo") -> _Checked:
    """Check lengths, dtypes, finiteness, masks and groups; return the flat (concatenated) views."""
    if advantage_mode not in ADVANTAGE_MODES:
        raise InvalidArgument(f"unknown advantage mode {advantage_mode!r}; expected one of {list(ADVANTAGE_MODES)}")
    behavior = validation.as_ragged("behavior_log_probs", inputs.behavior_log_probs)
    ref = validation.as_ragged("ref_log_probs", inputs.ref_log_probs)
    validation.check_same_lengths("behavior_log_probs", behavior, "ref_log_probs", ref)
    batch_size = len(behavior)
    lengths = [row.numel() for row in behavior]

    if inputs.response_token_ids is not None:
        token_ids = _rows_1d("response_token_ids", inputs.response_token_ids)
        for index, row in enumerate(token_ids):
            if row.is_floating_point() or row.is_complex() or row.dtype == torch.bool:
                raise InvalidArgument(f"response_token_ids: sample {index} must hold integers, got {row.dtype}")
        validation.check_same_lengths("response_token_ids", token_ids, "behavior_log_probs", behavior)
    masks: list[Tensor] = []
    if inputs.response_masks is not None:
        masks = _rows_1d("response_mask", inputs.response_masks)
        for index, row in enumerate(masks):
            if row.dtype != torch.bool:
                raise InvalidArgument(f"response_mask: sample {index} must be bool, got {row.dtype}")
        validation.check_same_lengths("response_mask", masks, "behavior_log_probs", behavior)

    # Every length is checked: only now are the samples concatenated (never padded).
    behavior_flat, ref_flat = _concat(behavior), _concat(ref)
    mask = torch.cat(masks) if masks else torch.ones(behavior_flat.shape, dtype=torch.bool)
    # Only tokens that count must be finite: a masked-out token may carry -inf.
    validation.check_finite_tokens("behavior_log_probs", behavior_flat, lengths, mask)
    validation.check_finite_tokens("ref_log_probs", ref_flat, lengths, mask)
    sample_ids = kl.sample_ids_of(torch.tensor(lengths, dtype=torch.long))
    counted = torch.bincount(sample_ids[mask], minlength=batch_size)
    if bool((counted == 0).any()):
        index = int((counted == 0).nonzero()[0])
        why = "the response is empty" if lengths[index] == 0 else "response_mask is all False"
        raise InvalidArgument(f"sample {index}: no response token to put the score on ({why})")

    group_ids = list(inputs.group_ids) if inputs.group_ids else list(range(batch_size))
    adv.make_groups(group_ids, batch_size, min_group_size=2 if advantage_mode == "rloo" else 1)
    return _Checked(behavior_flat, ref_flat, mask, sample_ids, counted, lengths, group_ids)


def compute_rewards(
    inputs: RewardInputs,
    score_batch: Callable[[], Tensor],
    *,
    kl_coef: float,
    kl_estimator: KLEstimatorName = "k1",
    advantage_mode: AdvantageModeName = "grpo",
    score_clip: float | None = None,
    grpo_eps: float = 1e-6,
) -> RewardOutputs:
    """Run the whole chain. ``score_batch()`` returns the reward function's ``[B]`` scores; it is
    called only after every input check passed (reward models are expensive). The task score is
    that plus ``inputs.environment_rewards``, before clipping: everything after follows from the sum."""
    checked = validate_inputs(inputs, advantage_mode)
    batch_size = inputs.batch_size
    # The whole batch as one row of N tokens: the estimators are per token.
    per_token = kl.per_token_kl(checked.behavior[None], checked.ref[None], checked.mask[None], kl_estimator)[0]
    kl_sum = kl.sample_sums(per_token, checked.sample_ids, batch_size)
    kl_mean = kl_sum / checked.counted.clamp_min(1)

    scores = torch.as_tensor(score_batch())
    if scores.shape != (batch_size,):
        raise InvalidArgument(f"scores have shape {tuple(scores.shape)}, expected [{batch_size}]")
    validation.check_finite("score", scores)
    if inputs.environment_rewards is not None:
        # Summed in float64 and rounded once, to float32 (or the scores' wider float dtype).
        dtype = torch.promote_types(scores.dtype, torch.float32)
        scores = (scores.double() + inputs.environment_rewards.double()).to(dtype)
        validation.check_finite("score (reward function score + environment reward)", scores)
    clipped = clip_scores(scores, score_clip)
    shaped = shaping.shape_rewards_flat(scores, per_token, checked.mask, checked.sample_ids,
                                        kl_coef=kl_coef, score_clip=score_clip)

    if advantage_mode == "rloo":
        advantages = adv.rloo_advantages(clipped, checked.group_ids)
    else:
        advantages = adv.grpo_advantages(
            clipped, checked.group_ids, scale_by_std=advantage_mode == "grpo", eps=grpo_eps
        )

    return RewardOutputs(
        kl=list(per_token.split(checked.lengths)),
        rewards=list(shaped.rewards.split(checked.lengths)),
        scores=scores,
        clipped_scores=clipped,
        advantages=advantages,
        kl_mean=kl_mean,
        kl_sum=kl_sum,
        kl_coef=float(kl_coef),
    )


def _concat(rows: list[Tensor]) -> Tensor:
    return torch.cat(rows) if rows else torch.zeros(0)


def _rows_1d(name: str, rows: Sequence[Tensor]) -> list[Tensor]:
    out = list(rows)
    for index, row in enumerate(out):
        if row.ndim != 1:
            raise InvalidArgument(f"{name}: sample {index} must be 1-D, got shape {tuple(row.shape)}")
    return out
