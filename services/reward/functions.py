"""Which reward function scores which sample.

A request's ``Task.reward_fn`` may name:

* nothing: the service's ``default_reward_fn``;
* a built-in (``numeric_match``, ``exact_match``, ``regex_match``, ``format_check``,
  ``length_penalty``, ``char_fraction``, ``none``: 0 for every sample, or the names the
  proto documents for them, see ``ALIASES``),
  with ``Task.args`` as its parameters (strings, converted to the parameter's type
  and checked against its bounds by :func:`scores.build_scorer`);
* a key of the config's ``reward_functions``.

Import paths and ``reward_model`` are honoured only from the config (built at
startup with imports allowed); a request naming one is refused, so a remote
caller can never make the service import code or load a model.
"""

from __future__ import annotations

import collections
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from rlfleet.services.common.errors import InvalidArgument, NotFound, RlfleetError, about_sample
from rlfleet.services.reward import scores
from rlfleet.services.reward.budget import TimeBudget
from rlfleet.services.reward.config import RewardFunctionConfig
from rlfleet.services.reward.scores import Scorer, ScoreInput

ALIASES: dict[str, str] = {"numeric_answer": "numeric_match", "regex": "regex_match", "format": "format_check"}
"""Names used in the proto's documentation -> registry names."""

CONFIG_ONLY: frozenset[str] = frozenset({"reward_model"})
"""Built-ins that load a model: a request may use them only through a config entry."""

_SAMPLE = re.compile(r"\bsample (\d+)")


@dataclass(frozen=True)
class TaskSpec:
    """How to score one sample (the domain twin of the proto ``Task``)."""

    reward_fn: str = ""
    """Function name; empty means the service default."""
    ground_truth: str | None = None
    """Reference answer, if any."""
    args: Mapping[str, str] = field(default_factory=dict)
    """String parameters for a built-in function."""


def expand_tasks(tasks: Sequence[TaskSpec], batch_size: int) -> list[TaskSpec]:
    """One task per sample: ``tasks`` holds one per sample, exactly one for all, or none (default)."""
    if len(tasks) == batch_size:
        return list(tasks)
    if len(tasks) == 0:
        return [TaskSpec()] * batch_size
    if len(tasks) == 1:
        return [tasks[0]] * batch_size
    raise InvalidArgument(
        f"tasks has {len(tasks)} entries for {batch_size} samples: send one per sample or exactly one for all"
    )


class RewardFunctions:
    """Resolves task names to scorers and scores a batch, one scorer call per distinct function."""

    def __init__(
        self,
        default_fn: str,
        default_params: Mapping[str, Any] | None = None,
        configured: Mapping[str, RewardFunctionConfig] | None = None,
        *,
        max_cached: int = 128,
    ) -> None:
        self.default_fn = default_fn
        self.default_params = dict(default_params or {})
        self.configured_specs = dict(configured or {})
        self.max_cached = max_cached
        self._configured: dict[str, Scorer] | None = None
        self._default: Scorer | None = None
        canonical_default = ALIASES.get(default_fn, default_fn)
        # Request args may tune the default only when it is a plain built-in.
        self._default_is_builtin = (
            canonical_default in scores.available()
            and canonical_default not in CONFIG_ONLY
            and default_fn not in self.configured_specs
        )
        self._cache: collections.OrderedDict[tuple, Scorer] = collections.OrderedDict()
        self._lock = threading.Lock()

    def load(self) -> None:
        """Build every configured scorer (imports allowed here) and load reward models."""
        configured = {}
        for name, spec in self.configured_specs.items():
            configured[name] = self._build_from_config(
                f"reward_functions[{name}]", spec.function, spec.params, label=name)
        if self.default_fn in configured:
            default = configured[self.default_fn]
        else:
            default = self._build_from_config("default_reward_fn", self.default_fn, self.default_params,
                                              label=self.default_fn)
        for scorer in (*configured.values(), default):
            load = getattr(scorer, "load", None)
            if callable(load):
                load()  # e.g. a reward model: NOT_SERVING until it is in memory
        self._configured, self._default = configured, default

    @staticmethod
    def _build_from_config(where: str, function: str, params: Mapping[str, Any], label: str) -> Scorer:
        try:
            return scores.build_scorer(ALIASES.get(function, function), dict(params), allow_imports=True,
                                       label=label)
        except RlfleetError as exc:
            raise type(exc)(f"{where}: {exc}") from exc

    def names(self) -> list[str]:
        """Names a request may use."""
        builtins = [name for name in scores.available() if name not in CONFIG_ONLY]
        return sorted({*builtins, *ALIASES, *self.configured_specs})

    # ------------------------------------------------------------------ resolve

    def resolve(self, task: TaskSpec, sample: int) -> tuple[tuple, str, Scorer]:
        """``(cache key, display name, scorer)`` for ``task``; errors name ``sample`` (``about_sample``:
        the collector reads which prompt's task was refused from them)."""
        if self._configured is None or self._default is None:
            raise RuntimeError("RewardFunctions.load() has not run")
        name, args = task.reward_fn, dict(task.args)
        if not name or name == self.default_fn:
            if not args:
                return ("default",), self.default_fn, self._default
            if not self._default_is_builtin:
                raise self._args_refused(self.default_fn, sample)
            canonical = ALIASES.get(self.default_fn, self.default_fn)
            return self._builtin(canonical, {**self.default_params, **args}, sample, display=self.default_fn)
        if name in self._configured:
            if args:
                raise self._args_refused(name, sample)
            return ("configured", name), name, self._configured[name]
        canonical = ALIASES.get(name, name)
        if canonical in CONFIG_ONLY:
            raise about_sample(
                NotFound, sample, f"reward function {name!r} is not configured here: models are loaded only "
                f"from the service config (reward_functions); configured: {sorted(self.configured_specs)}"
            )
        if canonical in scores.available():
            return self._builtin(canonical, args, sample, display=name)
        if ":" in name:
            raise about_sample(
                InvalidArgument, sample, f"reward function {name!r}: import paths are accepted only in the "
                "service config (reward_functions), never from a request"
            )
        raise about_sample(NotFound, sample, f"reward function {name!r} is not registered; known: {self.names()}")

    def _args_refused(self, name: str, sample: int) -> InvalidArgument:
        return about_sample(
            InvalidArgument, sample, f"reward function {name!r} is configured on the service; "
            "its parameters come from the config, so Task.args must be empty"
        )

    def _builtin(self, canonical: str, params: Mapping[str, Any], sample: int, display: str):
        key = ("builtin", canonical, tuple(sorted((k, repr(v)) for k, v in params.items())))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return key, display, self._cache[key]
        try:
            scorer = scores.build_scorer(canonical, dict(params), allow_imports=False)
        except RlfleetError as exc:
            raise about_sample(type(exc), sample, str(exc)) from exc
        with self._lock:
            self._cache[key] = scorer
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return key, display, scorer

    # -------------------------------------------------------------------- score

    def score(self, samples: Sequence[ScoreInput], tasks: Sequence[TaskSpec], budget: TimeBudget | None = None
              ) -> Tensor:
        """Raw ``[B]`` float32 scores; ``tasks`` has one entry per sample (see :func:`expand_tasks`)
        and supplies each sample's ground truth. ``budget`` is checked before each function runs."""
        budget = budget or TimeBudget()
        if len(tasks) != len(samples):
            raise InvalidArgument(f"{len(tasks)} tasks for {len(samples)} samples")
        samples = [replace(sample, ground_truth=task.ground_truth)
                   for sample, task in zip(samples, tasks)]
        groups: dict[tuple, tuple[str, Scorer, list[int]]] = {}
        resolved: dict[tuple, tuple] = {}
        for index, task in enumerate(tasks):
            lookup = (task.reward_fn, tuple(sorted(task.args.items())))
            if lookup not in resolved:
                resolved[lookup] = self.resolve(task, index)
            key, name, scorer = resolved[lookup]
            groups.setdefault(key, (name, scorer, []))[2].append(index)
        out = torch.empty(len(samples), dtype=torch.float32)
        for name, scorer, indices in groups.values():
            budget.enter(f"running reward function {name!r}")
            try:
                values = scores.compute_scores(
                    scorer, [samples[i] for i in indices], name=f"reward function {name!r}")
            except RlfleetError as exc:
                raise _renumbered(exc, indices) from exc
            out[indices] = values
        return out


def _renumbered(exc: RlfleetError, indices: list[int]) -> RlfleetError:
    """Scorers number samples within the sub-batch they got: name the request's index instead."""

    def to_request_index(match: re.Match[str]) -> str:
        local = int(match.group(1))
        return f"sample {indices[local]}" if local < len(indices) else match.group(0)

    return type(exc)(_SAMPLE.sub(to_request_index, str(exc), count=1))
