"""The time one ComputeRewards call may take, shared by the event loop and the worker thread.

A Python thread cannot be stopped mid-call, so the bound is kept from both sides:
the event loop answers when time is up (:meth:`TimeBudget.expire`, then
:meth:`TimeBudget.exceeded` names the step that was running, e.g. the reward
function), and the worker stops at its next checkpoint (:meth:`TimeBudget.enter`
before each step: decoding, each reward function). The one state change a request makes, the KL-controller update, is
guarded by :meth:`TimeBudget.commit`: either the worker commits first and the
event loop waits for the (short) rest, or time is up first and nothing is applied.
"""

from __future__ import annotations

import math
import threading
import time

from rlfleet.services.common.errors import ResourceExhausted


class TimeBudget:
    """``seconds`` from now (``None``: unbounded, for direct callers of the engine)."""

    def __init__(self, seconds: float | None = None) -> None:
        self.seconds = seconds
        self.deadline = math.inf if seconds is None else time.monotonic() + seconds
        self.step = "waiting for a free worker thread (all compute_threads busy)"
        """What the request is doing now (read by the event loop when time is up)."""
        self._lock = threading.Lock()
        self._state = "open"  # -> "committed" (the worker applies its result) or "expired"

    def remaining(self) -> float | None:
        """Seconds left (>= 0), or ``None`` when unbounded."""
        return None if self.seconds is None else max(0.0, self.deadline - time.monotonic())

    def enter(self, step: str) -> None:
        """The worker starts ``step`` (e.g. ``"running reward function 'x'"``): stop here if time is up."""
        self.check()
        self.step = step

    def check(self) -> None:
        """Raise :meth:`exceeded` if time is up (or the event loop has already answered)."""
        if self._state == "expired" or time.monotonic() > self.deadline:
            raise self.exceeded()

    def commit(self) -> None:
        """The worker is about to change state: after this, :meth:`expire` refuses. Raises if time is up."""
        with self._lock:
            if self._state == "expired" or time.monotonic() > self.deadline:
                self._state = "expired"
                raise self.exceeded()
            self._state = "committed"

    def expire(self) -> bool:
        """The event loop gives up waiting; ``False`` if the worker already committed (wait for it)."""
        with self._lock:
            if self._state == "committed":
                return False
            self._state = "expired"
            return True

    def exceeded(self) -> ResourceExhausted:
        return ResourceExhausted(
            f"ComputeRewards ran past its time limit (reward_time_limit_seconds={self.seconds}) "
            f"while {self.step}")
