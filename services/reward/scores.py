"""Task scores: pluggable reward functions behind a registry.

A *scorer* maps a batch of :class:`ScoreInput` to one float per sample. Scorers
are built by name with :func:`build_scorer`:

* built-ins for verifiable tasks: ``numeric_match``, ``exact_match``,
  ``regex_match``, ``format_check``, ``length_penalty``, ``char_fraction``;
* ``none``: 0 for every sample, for tasks rewarded by their environment alone
  (the reward service adds each sample's environment reward to its score);
* ``reward_model``: an HF ``AutoModelForSequenceClassification``, batched and
  loaded on first use (see :mod:`rlfleet.services.reward.reward_model`);
* a user function given as ``"package.module:function"``, called once per
  sample as ``function(sample: ScoreInput, **params) -> float``.

Several scorers combine with :class:`WeightedSum` (e.g. correctness + format).
Every returned score is checked (one finite number per sample), so a broken
reward function fails loudly, naming itself and the sample.

Parameters are checked against the factory's annotations before a scorer is
built (a negative ``tolerance`` is refused, naming it), whether they come from a
request (strings, converted) or from the config. A per-sample function that
raises answers ``InvalidArgument`` naming the sample, the function and the
exception: the caller's input or the configured function is at fault, not us.

Patterns (``regex_match``, ``format_check``, ``char_fraction``) come from requests,
so they are compiled with RE2 (``google-re2``): matching is linear in the text,
whatever the pattern, and releases the GIL. RE2 syntax has no backreferences or
lookaround, ``\\d``/``\\w``/``\\s`` are ASCII-only and ``$`` matches only at the very
end (``(?m)`` for lines); ``.`` matches newlines here (Python's ``re.DOTALL``).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import re2
import torch
from pydantic import Field, TypeAdapter, ValidationError
from torch import Tensor

from rlfleet.services.common.errors import InvalidArgument, NotFound, ResourceExhausted, RlfleetError
from rlfleet.services.reward.validation import describe_exception, shorten

log = logging.getLogger("rlfleet.reward")

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
NonNegativeInt = Annotated[int, Field(ge=0)]


@dataclass(frozen=True)
class ScoreInput:
    """What a reward function sees of one sample."""

    prompt: str
    """The prompt text: from the collector, the prompt's raw text or its chat's last message ('' for a
    prompt given as token ids)."""
    response: str
    """The response text, decoded from the sampled token ids with special tokens skipped (in a multi-turn
    episode: everything after the prompt, the assistant turns and the observations between them)."""
    ground_truth: str | None = None
    """The task's ground truth (``ground_truth`` of the prompt), if it has one."""
    response_length: int | None = None
    """Number of response tokens (the reward service counts them from the token ids)."""


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


def build_scorer(
    name: str, params: dict[str, Any] | None = None, *, allow_imports: bool = True, label: str | None = None
) -> Scorer:
    """Build the scorer called ``name`` (a registered name or ``"module:function"``).

    ``params`` are checked and converted to the factory's annotated types (strings from a
    request included). ``allow_imports=False`` refuses import paths: a server should only
    import code named in its own config, never a module named by a remote request.
    ``label`` is the name errors of a user function use (default: ``name``).
    """
    params = dict(params or {})
    if name in _REGISTRY:
        return _REGISTRY[name](**_validated_params(name, params))
    if ":" in name:
        if not allow_imports:
            raise InvalidArgument(f"reward function {name!r}: import paths are not allowed here")
        return _per_sample(label or name, _import_function(name), params)
    raise NotFound(f"reward function {name!r} is not registered; known: {available()}")


def _validated_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Bind ``params`` to the factory's signature and validate each against its annotation."""
    signature = factory_signature(name)
    try:
        signature.bind(**params)
    except TypeError as exc:
        names = shorten(sorted(params))
        raise InvalidArgument(f"reward function {name!r}: bad parameters {names}: {exc}") from exc
    out = {}
    for key, value in params.items():
        parameter = signature.parameters.get(key)
        if parameter is None or parameter.kind is inspect.Parameter.VAR_KEYWORD or (
                parameter.annotation is inspect.Parameter.empty):
            out[key] = value  # e.g. reward_model's pass-through options (config only)
            continue
        try:
            out[key] = TypeAdapter(parameter.annotation).validate_python(value)
        except ValidationError as exc:
            reason = "; ".join(error["msg"] for error in exc.errors())
            raise InvalidArgument(f"reward function {name!r}: argument {key}={shorten(value)}: {reason}") from None
    return out


def compute_scores(scorer: Scorer, samples: Sequence[ScoreInput], *, name: str = "reward function") -> Tensor:
    """Run ``scorer`` and check it returned one finite number per sample -> float32 ``[B]``.

    A batch scorer (a reward model) running out of memory is ``ResourceExhausted``; anything
    else it raises that is not an :class:`RlfleetError` is a bug, left for the INTERNAL path.
    """
    try:
        scores = list(scorer(samples))
    except (MemoryError, torch.OutOfMemoryError) as exc:
        raise ResourceExhausted(f"{name} ran out of memory scoring {len(samples)} samples: "
                                f"{describe_exception(exc)}") from exc
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

def _regex_options() -> re2.Options:
    options = re2.Options()
    options.dot_nl = True  # like re.DOTALL: responses span lines
    options.log_errors = False  # a bad pattern is the caller's error, answered to it, not logged to stderr
    options.max_mem = 2 << 20  # per compiled pattern (program + DFA cache); a bigger one does not compile
    return options


_REGEX_OPTIONS = _regex_options()

# Last number in a text: optional sign, thousands separators, decimals, exponent.
_NUMBER = re2.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+", _REGEX_OPTIONS)


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (``"1,234.5"`` -> 1234.5), or None."""
    matches = _NUMBER.findall(text)
    return float(matches[-1].replace(",", "")) if matches else None


def numeric_match_score(response: str, ground_truth: str, *, tolerance: float = 1e-6) -> float:
    """1.0 if the last number in ``response`` equals the ground truth within ``tolerance`` (>= 0)."""
    expected = last_number(ground_truth)
    if expected is None:
        raise InvalidArgument(f"ground truth {shorten(ground_truth)} holds no number")
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


def compile_pattern(pattern: str, what: str) -> Any:
    """Compile a pattern from a request with RE2 (linear-time matching); ``what`` names it in errors."""
    try:
        return re2.compile(pattern, _REGEX_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise InvalidArgument(
            f"{what}={shorten(pattern)} is an invalid regex: RE2 syntax is required (no backreferences or "
            f"lookaround): {reason}") from None


def _each_sample(name: str, score_one: Callable[[ScoreInput], Any]) -> Scorer:
    """A scorer calling ``score_one`` on every sample: each error and each bad score names the sample."""

    def score(samples: Sequence[ScoreInput]) -> list[float]:
        out = []
        for index, sample in enumerate(samples):
            try:
                value = score_one(sample)
            except RlfleetError as exc:
                raise type(exc)(f"sample {index}: {exc}") from exc
            except MemoryError as exc:
                raise ResourceExhausted(f"sample {index}: reward function {name!r} ran out of memory") from exc
            except Exception as exc:  # noqa: BLE001 - the function failed on this input: the caller's answer
                log.warning("reward function %r raised on a sample", name, exc_info=exc)
                raise InvalidArgument(
                    f"sample {index}: reward function {name!r} raised {describe_exception(exc)}") from exc
            _check_score(f"reward function {name!r}", index, value)
            out.append(float(value.item() if isinstance(value, Tensor) else value))
        return out

    return score


def _needs_ground_truth(name: str, sample: ScoreInput) -> str:
    if sample.ground_truth is None:
        raise InvalidArgument(f"reward function {name!r} needs a ground_truth")
    return sample.ground_truth


@register("numeric_match")
def _numeric_match(tolerance: NonNegativeFloat = 1e-6) -> Scorer:
    """1.0 if the last number written in the response equals the last number in the ground truth, within
    ``tolerance``; else 0.0 (also when the response holds no number).

    A number may have a sign, thousands separators, decimals and an exponent: ``-1,234.5e3``. Needs a
    ground truth that holds a number (INVALID_ARGUMENT otherwise).

    Args:
        tolerance: the relative and the absolute tolerance of the comparison (``math.isclose``).
    """
    return _each_sample("numeric_match", lambda sample: numeric_match_score(
        sample.response, _needs_ground_truth("numeric_match", sample), tolerance=tolerance))


@register("exact_match")
def _exact_match(strip: bool = True, ignore_case: bool = False) -> Scorer:
    """1.0 if the response equals the ground truth, else 0.0. Needs a ground truth.

    Args:
        strip: compare both with their leading and trailing whitespace removed.
        ignore_case: compare both case-folded (``str.casefold``).
    """
    return _each_sample("exact_match", lambda sample: exact_match_score(
        sample.response, _needs_ground_truth("exact_match", sample), strip=strip, ignore_case=ignore_case))


@register("regex_match")
def _regex_match(pattern: str | None = None) -> Scorer:
    """1.0 if ``pattern`` (default: each sample's ground truth, as a regex) is found in the response, else 0.0.

    Found anywhere in the response (a search: anchor the pattern with ``^`` and ``$`` to match it whole).
    Without ``pattern`` it needs a ground truth.

    Args:
        pattern: the RE2 regex to search for; none: each sample's ground truth, compiled as a regex.
    """
    fixed = None if pattern is None else compile_pattern(pattern, "reward function 'regex_match': argument pattern")

    def score_one(sample: ScoreInput) -> float:
        regex = fixed or compile_pattern(
            _needs_ground_truth("regex_match", sample), "reward function 'regex_match': ground_truth")
        return float(regex.search(sample.response) is not None)

    return _each_sample("regex_match", score_one)


@register("format_check")
def _format_check(pattern: str, reward: FiniteFloat = 1.0, penalty: FiniteFloat = 0.0) -> Scorer:
    """``reward`` if the whole response matches ``pattern``, else ``penalty``.

    Args:
        pattern: the RE2 regex the whole response must match.
        reward: the score of a response that matches.
        penalty: the score of a response that does not.
    """
    regex = compile_pattern(pattern, "reward function 'format_check': argument pattern")
    return _each_sample("format_check", lambda sample: reward if regex.fullmatch(sample.response) else penalty)


_CHAR_CACHE_SIZE = 1 << 16
"""Characters whose match one ``char_fraction`` scorer remembers (then it matches the rest each time)."""


@register("char_fraction")
def _char_fraction(pattern: str = "[0-9]", ignore_space: bool = True) -> Scorer:
    """Fraction of the response's characters matching the one-character ``pattern`` (whitespace skipped
    by default); 0.0 for an empty response. A dense format reward.

    Args:
        pattern: the RE2 regex each character must match whole (the default: an ASCII digit).
        ignore_space: leave whitespace characters (``str.isspace``) out of the count.
    """
    regex = compile_pattern(pattern, "reward function 'char_fraction': argument pattern")
    # Whether each character matches, kept across responses: a vocabulary's texts share few characters.
    matching: dict[str, bool] = {}

    def score_one(sample: ScoreInput) -> float:
        chars = [c for c in sample.response if not (ignore_space and c.isspace())]
        fresh = {c: regex.fullmatch(c) is not None for c in set(chars).difference(matching)}
        if fresh and len(matching) < _CHAR_CACHE_SIZE:
            matching.update(fresh)  # never shrinks: a scorer shared by threads reads it without a lock
        return sum(fresh[c] if c in fresh else matching[c] for c in chars) / len(chars) if chars else 0.0

    return _each_sample("char_fraction", score_one)


@register("length_penalty")
def _length_penalty(max_length: NonNegativeInt, coef: NonNegativeFloat = 0.01) -> Scorer:
    """``-coef * max(0, response_length - max_length)``: a penalty on the response tokens past
    ``max_length``, 0.0 up to it.

    Args:
        max_length: the response tokens allowed before the penalty starts.
        coef: the penalty per token past ``max_length``.
    """

    def score_one(sample: ScoreInput) -> float:
        if sample.response_length is None:
            raise InvalidArgument("length_penalty needs response_length")
        return -coef * max(0, sample.response_length - max_length)

    return _each_sample("length_penalty", score_one)


@register("none")
def _none() -> Scorer:
    """0.0 for every sample: the task score is then the sample's environment reward alone."""
    return lambda samples: [0.0] * len(samples)


@register("reward_model")
def _reward_model(path: str, **options: Any) -> Scorer:
    """A learned reward model's score of ``prompt + response``: a Hugging Face
    ``AutoModelForSequenceClassification`` (one label), loaded when the service starts (NOT_SERVING until
    it is in memory) and run in length-sorted batches.

    Args:
        path: the model directory (or hub name) ``from_pretrained`` loads.
        options: keyword options of ``RewardModelScorer`` (``services/reward/reward_model.py``):
            ``batch_size``, ``device``, ``dtype``, ``max_length``, ``label_index``.
    """
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
    return _each_sample(name, lambda sample: function(sample, **params))


def _check_score(name: str, index: int, value: Any) -> None:
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    try:
        finite = isinstance(value, numbers.Real) and math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        finite = False
    if not finite:
        raise InvalidArgument(f"sample {index}: {name} returned {shorten(value)}, expected a finite number")
