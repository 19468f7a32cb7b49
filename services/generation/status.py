"""Engine state and status snapshot (what health and GetStatus report)."""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass


class EngineState(str, enum.Enum):
    """Lifecycle of a GenerationEngine; health is SERVING only in SERVING."""

    STOPPED = "stopped"
    STARTING = "starting"
    SERVING = "serving"
    SWAPPING = "swapping"
    """A wait/abort swap: new requests are held until it completes (keep/resume swaps hold them too, SERVING)."""
    FAILED = "failed"
    """A weight swap failed inside vLLM (the weights are undefined), or the engine core died."""


@dataclass(frozen=True)
class EngineStatus:
    """A snapshot for GetStatus and metrics."""

    model: str
    state: EngineState
    policy_version: int
    requests_in_flight: int
    """Admitted ``generate`` calls (waiting + running)."""
    requests_waiting: int
    """Admitted calls that have not produced a token yet."""
    requests_running: int
    max_queued_requests: int
    tokens_per_second: float
    """Generated tokens per second over the last ``tokens_per_second_window_s``."""
    resumed_samples: int = 0
    """Samples continued as a new vLLM request after a ``resume`` swap (a sample resumed twice counts twice)."""
    resumed_tokens: int = 0
    """Sampled tokens those continuations carried over (re-prefilled, not thrown away)."""


class TokenRate:
    """Generated tokens per second over a sliding window."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._started_at = time.monotonic()

    def add(self, num_tokens: int, now: float) -> None:
        self._events.append((now, num_tokens))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self._window_s:
            self._events.popleft()

    def per_second(self) -> float:
        now = time.monotonic()
        self._trim(now)
        # Right after start the window is not full yet: divide by what elapsed.
        span = min(self._window_s, max(now - self._started_at, 1e-3))
        return sum(n for _, n in self._events) / span
