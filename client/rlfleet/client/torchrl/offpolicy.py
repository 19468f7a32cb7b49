"""``CorrectedGRPOLoss``: TorchRL 0.14's ``GRPOLoss`` with an rlfleet importance-sampling correction.

    loss_fn = CorrectedGRPOLoss(policy, correction="icepop", masking_strategy="sft",
                                trainer_version=lambda: collector.last_push.version)
    out = loss_fn(data)     # TorchRL's loss_* and diagnostics, plus offpolicy/kl_k3, offpolicy/lag1/ess_token, ...

``GRPOLoss`` takes its PPO ratio against the behaviour log-probs (``log_probs/full``) and has no
per-token weight. This subclass makes it decoupled PPO, as ``examples/train_grpo.py
--is-correction`` and AReaL do: the ratio is taken against the proximal policy, the current
log-probs detached at the forward (one optimizer step per batch: the policy the step starts from),
and the behaviour-to-proximal mismatch is corrected by ``rlfleet.client.offpolicy.importance_weights``
(the same function, so the same presets), multiplying the clipped objective per token before
TorchRL's own aggregation. The tokens the correction masks leave TorchRL's mask, as tokens beyond
``kl_mask_threshold`` do: out of the objective, entropy and KL terms and their token counts.

TorchRL internals relied on (0.14): ``_log_weight(td, adv_shape)`` returns ``(log_weight, dist,
kl_approx, mask)`` with ``log_weight = log π_current - log π_behaviour`` [B, T, 1] (0 off the
mask) and ``mask`` [B, T]; ``forward`` then calls ``_compute_policy_objective(log_weight,
advantage)`` once and uses that mask for ``kl_mask_threshold``, ESS, aggregation and the KL terms.
Its tensors are left-padded over ``tokens/full``: a sample's response ends its row.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from torchrl.objectives.llm import GRPOLoss

from rlfleet.client.offpolicy import PRESETS, Corrected, Correction, importance_weights

VERSIONS_KEY = ("versions", "response")


class CorrectedGRPOLoss(GRPOLoss):
    """``GRPOLoss`` as decoupled PPO with rlfleet's IS correction (module docstring).

    Args:
        actor_network: as ``GRPOLoss``'s.
        correction: a preset of ``rlfleet.client.offpolicy`` (none, token_tis, seq_tis, seq_mis,
            geo_mis, icepop) or a ``Correction``.
        trainer_version: the policy version of the weights being trained (an int, or a callable read
            at each forward, e.g. ``lambda: collector.last_push.version``). With it and
            ``versions/response`` in the batch the metrics are also given per version lag.
        **kwargs: ``GRPOLoss``'s (clip_epsilon, aggregation, kl_to_ref_coeff, kl_mask_threshold, ...).

    The output is a ``TensorDict``: ``GRPOLoss``'s entries (read them by key) plus the correction's
    metrics, ``Corrected.flat_metrics()``, as scalars. TorchRL's ``ESS`` and ``clip_fraction`` now
    describe the proximal ratio (1 and 0 at the forward); ``kl_approx`` is still behaviour-to-current.
    """

    def __init__(self, actor_network=None, *, correction: str | Correction = "token_tis",
                 trainer_version: int | Callable[[], int] | None = None, **kwargs):
        if not isinstance(correction, Correction) and correction not in PRESETS:
            raise ValueError(f"unknown correction {correction!r}; the presets are {', '.join(PRESETS)}")
        super().__init__(actor_network, **kwargs)
        self.correction = correction
        self.trainer_version = trainer_version
        self.last: Corrected | None = None
        """The last forward's ``Corrected`` (weights, mask, metrics, ``by_lag`` for ``client.report_mismatch``)."""

    def _log_weight(self, tensordict: TensorDictBase, adv_shape: torch.Size):
        log_weight, dist, kl_approx, mask = super()._log_weight(tensordict, adv_shape)
        # The weights depend on the log-ratio alone: handing importance_weights (log r, 0) is handing it
        # (current, behaviour). log_weight's gradient is the current log-prob's (behaviour is data).
        log_ratio = log_weight.squeeze(-1)
        version = self.trainer_version() if callable(self.trainer_version) else self.trainer_version
        versions = self._token_versions(tensordict, log_ratio.shape[-1]) if version is not None else None
        self.last = importance_weights(log_ratio, torch.zeros_like(log_ratio), mask, self.correction,
                                       versions=versions, trainer_version=None if versions is None else version)
        return log_weight - log_weight.detach(), dist, kl_approx, self.last.mask

    def _compute_policy_objective(self, log_weight: torch.Tensor, advantage: torch.Tensor):
        loss, clip_fraction = super()._compute_policy_objective(log_weight, advantage)
        return loss * self.last.weights.unsqueeze(-1).to(loss.dtype), clip_fraction

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        out = super().forward(tensordict).to_tensordict()
        device = out.get("loss_objective").device
        for key, value in self.last.flat_metrics().items():
            out.set(key, torch.tensor(float(value), device=device))
        return out

    @staticmethod
    def _token_versions(tensordict: TensorDictBase, tokens: int) -> torch.Tensor | None:
        """``versions/response`` aligned with the loss's [B, T] tensors (the response ends each row)."""
        if VERSIONS_KEY not in tensordict.keys(include_nested=True):
            return None
        versions = tensordict.get(VERSIONS_KEY, as_padded_tensor=True, padding_side="left", padding_value=-1)
        return F.pad(versions, (tokens - versions.shape[-1], 0), value=-1)
