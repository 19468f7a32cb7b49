"""KL-coefficient controllers (the beta in ``reward = score - beta * KL``).

``AdaptiveKLController`` is the proportional controller of Ziegler et al. 2019
(arXiv:1909.08593, sec. 2.2), with the same update as TRL's / OpenRLHF's::

    proportional_error = clip(current_kl / target - 1, -0.2, 0.2)
    mult = 1 + proportional_error * n_steps / horizon
    coef = coef * mult

``current_kl`` here is the **raw** KL (e.g. the batch mean of the per-sequence
KL). TorchRL's ``AdaptiveKLController.update(kl_values)`` takes the KL *reward
terms* ``-coef * KL`` instead and divides them back by ``-coef``; use
:meth:`KLController.update_from_values` for its ``n_steps = len(values)`` form,
but pass raw KL values.

The controller state (coef, steps, history) is saved to a JSON file with an
atomic write (temp file + fsync + rename), so a restarted reward service picks
up where it stopped and a crash mid-write never leaves a truncated file.
"""

from __future__ import annotations

import abc
import json
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from rlfleet.services.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.services.common.files import write_atomically

STATE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class KLUpdate:
    """One controller update, kept in the history for inspection."""

    step: int
    """Controller step count after this update."""
    kl: float
    """The KL value the update was given."""
    n_steps: int
    """How many steps the update accounted for."""
    coef: float
    """The coefficient after the update."""


_UPDATE_FIELDS = tuple(f.name for f in fields(KLUpdate))


class KLController(abc.ABC):
    """Base: holds ``coef``, ``steps`` and a bounded ``history``; thread-safe updates."""

    kind: ClassVar[str] = "base"

    def __init__(self, init_kl_coef: float, *, max_history: int = 1000) -> None:
        if not math.isfinite(init_kl_coef) or init_kl_coef < 0:
            raise InvalidArgument(f"init_kl_coef must be finite and >= 0, got {init_kl_coef}")
        if max_history < 0:
            raise InvalidArgument(f"max_history must be >= 0, got {max_history}")
        self.coef = float(init_kl_coef)
        self.steps = 0
        self.updates = 0
        """Number of :meth:`update` calls applied (``steps`` counts the steps they accounted for)."""
        self.history: list[KLUpdate] = []
        self.max_history = max_history
        self._lock = threading.Lock()

    @abc.abstractmethod
    def _next_coef(self, current_kl: float, n_steps: int) -> float:
        """The coefficient after ``n_steps`` steps at ``current_kl`` (called under the lock)."""

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        """Account for ``n_steps`` steps at KL ``current_kl``; return the new coefficient."""
        if not math.isfinite(current_kl):
            raise InvalidArgument(f"current_kl must be finite, got {current_kl}")
        if n_steps < 1:
            raise InvalidArgument(f"n_steps must be >= 1, got {n_steps}")
        with self._lock:
            self.coef = self._next_coef(float(current_kl), int(n_steps))
            self.steps += n_steps
            self.updates += 1
            self.history.append(KLUpdate(self.steps, float(current_kl), int(n_steps), self.coef))
            del self.history[: max(0, len(self.history) - self.max_history)]
            return self.coef

    def update_from_values(self, kl_values: Sequence[float]) -> float:
        """TorchRL-style update: ``current_kl = mean(kl_values)``, ``n_steps = len(kl_values)``."""
        if len(kl_values) == 0:
            raise InvalidArgument("kl_values must not be empty")
        return self.update(math.fsum(kl_values) / len(kl_values), len(kl_values))

    # ------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state. ``settings`` is recorded for inspection only: on load the
        constructor's settings win, so an operator can retune ``target`` across a restart."""
        with self._lock:
            return {
                "format_version": STATE_FORMAT_VERSION,
                "kind": self.kind,
                "settings": self._settings(),
                "coef": self.coef,
                "steps": self.steps,
                "updates": self.updates,
                # Not dataclasses.asdict: it deep-copies each entry, milliseconds for a full history.
                "history": [{name: getattr(update, name) for name in _UPDATE_FIELDS} for update in self.history],
            }

    def snapshot(self) -> tuple[float, int, int, list[KLUpdate]]:
        """What ``restore`` puts back (cheap: the history's entries are immutable and shared)."""
        with self._lock:
            return self.coef, self.steps, self.updates, list(self.history)

    def restore(self, snapshot: tuple[float, int, int, list[KLUpdate]]) -> None:
        """Undo the updates since ``snapshot`` was taken."""
        with self._lock:
            self.coef, self.steps, self.updates, self.history = snapshot[0], snapshot[1], snapshot[2], list(snapshot[3])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``coef``, ``steps`` and ``history``; refuse state of another kind/format."""
        if state.get("format_version") != STATE_FORMAT_VERSION:
            raise FailedPrecondition(
                f"KL controller state has format_version {state.get('format_version')!r}, "
                f"expected {STATE_FORMAT_VERSION}"
            )
        if state.get("kind") != self.kind:
            raise FailedPrecondition(
                f"KL controller state is for a {state.get('kind')!r} controller, not {self.kind!r}"
            )
        try:
            coef = float(state["coef"])
            steps = int(state["steps"])
            history = [KLUpdate(**update) for update in state["history"]]
            # Files written before "updates" was recorded: the (then unbounded-enough) history.
            updates = int(state.get("updates", len(history)))
        except (KeyError, TypeError, ValueError) as exc:
            raise FailedPrecondition(f"KL controller state is malformed: {exc}") from exc
        with self._lock:
            self.coef, self.steps, self.updates = coef, steps, updates
            self.history = history[len(history) - min(len(history), self.max_history) :]

    def save(self, path: str | os.PathLike[str]) -> None:
        """Atomically write the state to ``path`` (temp file in the same dir, fsync, rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(self.state_dict(), indent=2, sort_keys=True))

    def load(self, path: str | os.PathLike[str]) -> bool:
        """Restore from ``path`` if it exists. Returns whether a state was loaded."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return False
        try:
            state = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FailedPrecondition(f"KL controller state file {path} is not valid JSON: {exc}") from exc
        if not isinstance(state, dict):
            raise FailedPrecondition(f"KL controller state file {path} does not hold an object")
        self.load_state_dict(state)
        return True

    def _settings(self) -> dict[str, Any]:
        return {}


class ConstantKLController(KLController):
    """A fixed coefficient; updates only count steps and record history."""

    kind = "constant"

    def _next_coef(self, current_kl: float, n_steps: int) -> float:
        return self.coef


class AdaptiveKLController(KLController):
    """Ziegler et al. proportional controller steering the KL towards ``target``."""

    kind = "adaptive"

    def __init__(
        self, init_kl_coef: float, target: float, horizon: float, *, max_history: int = 1000
    ) -> None:
        super().__init__(init_kl_coef, max_history=max_history)
        if not (math.isfinite(target) and target > 0):
            raise InvalidArgument(f"target must be finite and > 0, got {target}")
        if not (math.isfinite(horizon) and horizon > 0):
            raise InvalidArgument(f"horizon must be finite and > 0, got {horizon}")
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        # With n_steps >= 5 * horizon a KL below target would give mult <= 0: a zero or
        # negative beta that rewards drifting away from the reference. Refuse it.
        if n_steps >= 5 * self.horizon:
            raise InvalidArgument(
                f"n_steps={n_steps} must be < 5 * horizon ({5 * self.horizon:g}) "
                "or the coefficient could turn non-positive"
            )
        return super().update(current_kl, n_steps)

    def _next_coef(self, current_kl: float, n_steps: int) -> float:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        mult = 1.0 + proportional_error * n_steps / self.horizon
        return self.coef * mult

    def _settings(self) -> dict[str, Any]:
        return {"target": self.target, "horizon": self.horizon}
