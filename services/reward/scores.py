"""Task scores: pluggable reward functions behind a registry.

A *scorer* maps a batch of :class:`ScoreInput` to one float per sample. Scorers
are built by name with :func:`build_scorer`:

* built-ins for verifiable tasks: ``numeric_match``, ``exact_match``,
  ``regex_match``, ``format_check``, ``length_penalty``;
* ``reward_model``: an HF ``AutoModelForSequenceClassification``, batched and
  loaded on first use (see :mod:`rlfleet.services.reward.reward_model`);
* a user function given as ``"package.module:function"``, called once per
  sample as ``function(sample: ScoreInput, **params) -> float``.

Several scorers combine with :class:`WeightedSum` (e.g. correctness + format).
Every returned score is checked (one finite number per sample), so a broken
reward function fails loudly, naming itself and the sample.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlfleet.services.common.errors import InvalidArgument, NotFound


@dataclass(frozen=True)
class ScoreInput:
    """What a reward function sees of one sample."""

    prompt: str
    """The prompt text."""
    response: str
    """The decoded response text."""
    ground_truth: str | None = None
    """The reference answer from the task metadata, if the task has one."""
    response_length: int | None = None
    """Number of response tokens (the reward service knows it from the token ids)."""


Scorer = Callable[[Sequence[ScoreInput]], list[float]]
ScorerFactory = Callable[..., Scorer]

_REGISTRY: dict[str, ScorerFactory] = {}


def register(name: str) -> Callable[[ScorerFactory], ScorerFactory]:
    """Register a scorer factory under ``name`` (``factory(**params) -> Scorer``)."""

    def decorate(factory: ScorerFactory) -> ScorerFactory:
        if name in _REGISTRY:
            raise ValueError(f"reward function {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorate


def available() -> list[str]:
    """Names of the registered reward functions."""
    return sorted(_REGISTRY)


def factory_signature(name: str) -> inspect.Signature:
    """The parameters the registered factory ``name`` accepts (annotations evaluated)."""
    return inspect.signature(_REGISTRY[name], eval_str=True)


def build_scorer(name: str, params: dict[str, Any] | None = None, *, allow_imports: bool = True) -> Scorer:
    """Build the scorer called ``name`` (a registered name or ``"module:function"``).

    ``allow_imports=False`` refuses import paths: a server should only import code
    named in its own config, never a module named by a remote request.
    """
    params = dict(params or {})
    if name in _REGISTRY:
        factory = _REGISTRY[name]
        try:
            inspect.signature(factory).bind(**params)
        except TypeError as exc:
            raise InvalidArgument(
                f"reward function {name!r}: bad parameters {sorted(params)}: {exc}"
            ) from exc
        return factory(**params)
    if ":" in name:
        if not allow_imports:
            raise InvalidArgument(f"reward function {name!r}: import paths are not allowed here")
        return _per_sample(name, _import_function(name), params)
    raise NotFound(f"reward function {name!r} is not registered; known: {available()}")


def compute_scores(scorer: Scorer, samples: Sequence[ScoreInput], *, name: str = "reward function") -> Tensor:
    """Run ``scorer`` and check it returned one finite number per sample -> float32 ``[B]``."""
    scores = list(scorer(samples))
    if len(scores) != len(samples):
        raise InvalidArgument(f"{name} returned {len(scores)} scores for {len(samples)} samples")
    for index, score in enumerate(scores):
        _check_score(name, index, score)
    return torch.tensor([float(score) for score in scores], dtype=torch.float32)


def clip_scores(scores: Tensor, score_clip: float | None) -> Tensor:
    """Clip to ``[-score_clip, score_clip]``; ``None`` leaves scores unchanged."""
    if score_clip is None:
        return scores
    if not (score_clip > 0):
        raise InvalidArgument(f"score_clip must be > 0, got {score_clip}")
    return scores.clamp(-score_clip, score_clip)


class WeightedSum:
    """``sum_i weight_i * scorer_i(samples)``: combine e.g. correctness and format."""

    def __init__(self, terms: Sequence[tuple[float, Scorer]]) -> None:
        if not terms:
            raise InvalidArgument("WeightedSum needs at least one term")
        self.terms = list(terms)

    def __call__(self, samples: Sequence[ScoreInput]) -> list[float]:
        total = torch.zeros(len(samples), dtype=torch.float64)
        for index, (weight, scorer) in enumerate(self.terms):
            total += weight * compute_scores(scorer, samples, name=f"term {index}").double()
        return total.tolist()


# ------------------------------------------------------------ verifiable tasks

# Last number in a text: optional sign, thousands separators, decimals, exponent.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (``"1,234.5"`` -> 1234.5), or None."""
    matches = _NUMBER.findall(text)
    return float(matches[-1].replace(",", "")) if matches else None


def numeric_match_score(response: str, ground_truth: str, *, tolerance: float = 1e-6) -> float:
    """1.0 if the last number in ``response`` equals the ground truth within ``tolerance``."""
    expected = last_number(ground_truth)
    if expected is None:
        raise InvalidArgument(f"ground truth {ground_truth!r} holds no number")
    answer = last_number(response)
    if answer is None:
        return 0.0
    return float(math.isclose(answer, expected, rel_tol=tolerance, abs_tol=tolerance))


def exact_match_score(
    response: str, ground_truth: str, *, strip: bool = True, ignore_case: bool = False
) -> float:
    """1.0 if the response equals the ground truth (optionally stripped / case-folded)."""
    if strip:
        response, ground_truth = response.strip(), ground_truth.strip()
    if ignore_case:
        response, ground_truth = response.casefold(), ground_truth.casefold()
    return float(response == ground_truth)


def _compile(pattern: str, what: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise InvalidArgument(f"{what}: invalid regex {pattern!r}: {exc}") from exc


def _needs_ground_truth(name: str, index: int, sample: ScoreInput) -> str:
    if sample.ground_truth is None:
        raise InvalidArgument(f"sample {index}: reward function {name!r} needs a ground_truth")
    return sample.ground_truth


@register("numeric_match")
def _numeric_match(tolerance: float = 1e-6) -> Scorer:
    def score(samples: Sequence[ScoreInput]) -> list[float]:
        out = []
        for index, sample in enumerate(samples):
            truth = _needs_ground_truth("numeric_match", index, sample)
            try:
                out.append(numeric_match_score(sample.response, truth, tolerance=tolerance))
            except InvalidArgument as exc:
                raise InvalidArgument(f"sample {index}: {exc}") from exc
        return out

    return score


@register("exact_match")
def _exact_match(strip: bool = True, ignore_case: bool = False) -> Scorer:
    def score(samples: Sequence[ScoreInput]) -> list[float]:
        return [
            exact_match_score(
                sample.response, _needs_ground_truth("exact_match", index, sample),
                strip=strip, ignore_case=ignore_case,
            )
            for index, sample in enumerate(samples)
        ]

    return score


@register("regex_match")
def _regex_match(pattern: str | None = None) -> Scorer:
    """1.0 if ``pattern`` (default: each sample's ground truth, as a regex) is found in the response."""
    fixed = _compile(pattern, "regex_match") if pattern is not None else None

    def score(samples: Sequence[ScoreInput]) -> list[float]:
        out = []
        for index, sample in enumerate(samples):
            regex = fixed or _compile(
                _needs_ground_truth("regex_match", index, sample), f"sample {index}: regex_match"
            )
            out.append(float(regex.search(sample.response) is not None))
        return out

    return score


@register("format_check")
def _format_check(pattern: str, reward: float = 1.0, penalty: float = 0.0) -> Scorer:
    """``reward`` if the whole response matches ``pattern``, else ``penalty``."""
    regex = _compile(pattern, "format_check")

    def score(samples: Sequence[ScoreInput]) -> list[float]:
        return [reward if regex.fullmatch(sample.response) else penalty for sample in samples]

    return score


@register("char_fraction")
def _char_fraction(pattern: str = "[0-9]", ignore_space: bool = True) -> Scorer:
    """Fraction of the response's characters matching the one-character ``pattern``
    (whitespace skipped by default); 0 for an empty response. A dense format reward."""
    regex = _compile(pattern, "char_fraction")

    def score(samples: Sequence[ScoreInput]) -> list[float]:
        out = []
        for sample in samples:
            chars = [c for c in sample.response if not (ignore_space and c.isspace())]
            out.append(sum(1 for c in chars if regex.fullmatch(c)) / len(chars) if chars else 0.0)
        return out

    return score


@register("length_penalty")
def _length_penalty(max_length: int, coef: float = 0.01) -> Scorer:
    """``-coef * max(0, response_length - max_length)``, on response tokens."""
    if max_length < 0 or coef < 0:
        raise InvalidArgument("length_penalty: max_length and coef must be >= 0")

    def score(samples: Sequence[ScoreInput]) -> list[float]:
        out = []
        for index, sample in enumerate(samples):
            if sample.response_length is None:
                raise InvalidArgument(f"sample {index}: length_penalty needs response_length")
            out.append(-coef * max(0, sample.response_length - max_length))
        return out

    return score


@register("reward_model")
def _reward_model(path: str, **options: Any) -> Scorer:
    from rlfleet.services.reward.reward_model import RewardModelScorer

    return RewardModelScorer(path, **options)


# --------------------------------------------------------------- user functions


def _import_function(spec: str) -> Callable[..., Any]:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise InvalidArgument(f"reward function {spec!r}: expected 'module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only "this module does not exist" is NotFound; a missing dependency
        # *inside* the user's module is a real error and propagates.
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise NotFound(f"reward function {spec!r}: no module {module_name!r}") from exc
        raise
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise NotFound(f"reward function {spec!r}: {module_name!r} has no {attr_path!r}") from None
    if not callable(target):
        raise InvalidArgument(f"reward function {spec!r} is not callable")
    return target


def _per_sample(name: str, function: Callable[..., Any], params: dict[str, Any]) -> Scorer:
    def score(samples: Sequence[ScoreInput]) -> list[float]:
        out = []
        for index, sample in enumerate(samples):
            value = function(sample, **params)
            _check_score(f"reward function {name!r}", index, value)
            out.append(float(value))
        return out

    return score


def _check_score(name: str, index: int, value: Any) -> None:
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InvalidArgument(f"sample {index}: {name} returned {value!r}, expected a finite number")
