"""Dynamic sampling: which groups carry no learning signal, how often that happens, how prompts fare.

A group whose scores do not vary (their range at most ``min_score_range``; 0: constant) has zero
advantage everywhere under GRPO-style baselines: training on it costs a step's compute and moves
nothing but the KL term. With ``dynamic_sampling`` on, the collector stores such a group as filtered
(the trajectory service's filtered log: never delivered, counted) and the prompt ends there; the
version gate admits another group in its place (``VersionGate.settle``), and over-samples ahead of
time by the filter rate measured here, so a trainer's batches stay full without waiting for
replacements to be generated one by one.

Every group, filtered or not, also counts toward its prompt's pass rate (samples scoring at least
``pass_score``): kept in the prompt ledger in the transaction that ends the prompt's row, so each
group counts exactly once across restarts. The curriculum rule reads the most recent group's rate:
a dataset row all of whose latest samples passed, or none, is skipped (except a revisit fraction,
drawn per row and epoch, so its rate is measured again).
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupOutcome:
    """How a finished group scored, as the ledger records it when its prompt ends."""

    key: str
    """The prompt's pass-rate key (``PromptItem.pass_key``)."""
    samples: int
    passed: int
    filtered: bool


@dataclass(frozen=True)
class FilterRule:
    """Which groups dynamic sampling filters, and what passing means."""

    enabled: bool = False
    min_score_range: float = 0.0
    pass_score: float = 0.5

    def outcome(self, key: str, scores: torch.Tensor) -> GroupOutcome:
        scores = scores.float().numpy()  # float32 as before; numpy's reductions cost a third of torch's here
        spread = float(scores.max() - scores.min()) if len(scores) else 0.0
        return GroupOutcome(key=key, samples=len(scores), passed=int((scores >= self.pass_score).sum()),
                            filtered=self.enabled and spread <= self.min_score_range)


class FilterRate:
    """The fraction of recent groups filtered, and the over-sampling it calls for (capped)."""

    def __init__(self, window: int, max_oversampling: float):
        self._recent: collections.deque[bool] = collections.deque(maxlen=max(window, 1))
        self.max_oversampling = max_oversampling

    def record(self, filtered: bool) -> None:
        self._recent.append(filtered)

    @property
    def rate(self) -> float:
        return sum(self._recent) / len(self._recent) if self._recent else 0.0

    @property
    def expected_loss(self) -> float:
        """The fraction of started groups to expect filtered, at most what ``max_oversampling`` allows."""
        return min(self.rate, 1.0 - 1.0 / self.max_oversampling)


def passed_all_or_none(samples: int, passed: int) -> bool:
    """What the curriculum skips: a group all of whose samples passed, or none."""
    return passed in (0, samples)


def revisit(seed: int, epoch: int, row: int, fraction: float) -> bool:
    """Whether the curriculum draws a skippable row anyway this epoch (the same answer after a restart)."""
    return random.Random(f"{seed}:{epoch}:{row}").random() < fraction
