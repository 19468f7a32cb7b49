"""A replica's shared state (its vLLM engine, lifecycle, served version, admission) and the status snapshot
health and GetStatus report."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlfleet.services.common.errors import FailedPrecondition, Unavailable

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


class EngineState(str, enum.Enum):
    """Lifecycle of a GenerationEngine; health is SERVING only in SERVING."""

    STOPPED = "stopped"
    STARTING = "starting"
    SERVING = "serving"
    SWAPPING = "swapping"
    """A wait/abort swap: new requests are held until it completes (keep/resume swaps hold them too, SERVING)."""
    FAILED = "failed"
    """A weight swap failed inside vLLM (the weights are undefined), or the engine core died."""


_TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    EngineState.STOPPED: frozenset({EngineState.STARTING, EngineState.STOPPED}),
    EngineState.STARTING: frozenset({EngineState.SERVING, EngineState.STOPPED}),
    EngineState.SERVING: frozenset({EngineState.SWAPPING, EngineState.SERVING, EngineState.FAILED,
                                    EngineState.STOPPED}),
    EngineState.SWAPPING: frozenset({EngineState.SERVING, EngineState.FAILED, EngineState.STOPPED}),
    EngineState.FAILED: frozenset({EngineState.SWAPPING, EngineState.SERVING, EngineState.FAILED,
                                   EngineState.STOPPED}),
}
"""A replica's lifecycle, whole: a FAILED replica takes pushes (one that applies serves again); anything
stops."""


class ReplicaState:
    """What the parts of a replica share: the vLLM engine, its lifecycle state, the policy version it
    serves, and whether new requests may enter vLLM (cleared for the whole of a weight swap).
    ``GenerationEngine`` starts and stops it and admits requests; ``WeightSwaps`` moves the version. The
    lifecycle state changes only here (``move_to``, along ``_TRANSITIONS``); the others read it."""

    def __init__(self, policy_version: int, max_model_len: int) -> None:
        self.vllm: AsyncLLM | None = None
        self.vocab_size = 0
        """The model's vocabulary, and ``max_model_len``, as vLLM reports them once started."""
        self.max_model_len = max_model_len
        self._state = EngineState.STOPPED
        self.policy_version = policy_version
        self.admission_open = asyncio.Event()
        self.requests_in_flight = 0
        """Admitted ``generate`` calls (``GenerationEngine`` counts them)."""
        self.version_bound_requests = 0
        """Calls in flight with a ``required_version``: a ``keep`` swap runs as ``resume`` (which ends them)."""

    @property
    def state(self) -> EngineState:
        return self._state

    def move_to(self, state: EngineState) -> None:
        """The lifecycle's next state; FailedPrecondition for a move it does not make (a start of an engine
        that is not stopped), naming both."""
        if state not in _TRANSITIONS[self._state]:
            raise FailedPrecondition(f"generation engine is {self._state.value}, cannot become {state.value}")
        self._state = state

    @property
    def ready(self) -> bool:
        """The engine is up and its weights are well-defined."""
        return self.state in (EngineState.SERVING, EngineState.SWAPPING)

    def check_alive(self) -> None:
        """An engine core that died (crash, OOM kill) fails the engine for good: health goes NOT_SERVING."""
        if self.vllm is not None and self.ready and self.vllm.errored:
            logger.error("vLLM engine core is dead; this replica stops serving")
            self.move_to(EngineState.FAILED)

    def require(self) -> AsyncLLM:
        """The vLLM engine; Unavailable unless it serves."""
        self.check_alive()
        if self.vllm is None or not self.ready:
            raise Unavailable(f"generation engine is {self.state.value}")
        return self.vllm

    def takes_pushes(self) -> AsyncLLM:
        """The vLLM engine, once started; a FAILED one takes pushes too (one that applies makes the
        weights well-defined again). Unavailable while stopped or starting."""
        if self.vllm is None or self.state in (EngineState.STOPPED, EngineState.STARTING):
            raise Unavailable(f"generation engine is {self.state.value}")
        return self.vllm

    def check_version(self, version: int) -> None:
        """FailedPrecondition unless ``version`` is newer than the serving one."""
        if version <= self.policy_version:
            raise FailedPrecondition(f"weights version {version} is not newer than current {self.policy_version}")


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
    runs: tuple[RunStatus, ...] = ()
    """The named runs sharing the replica."""
    max_runs: int = 0


@dataclass(frozen=True)
class RunStatus:
    """A named run on the replica (``served_runs``)."""

    run_id: str
    policy_version: int
    requests_in_flight: int
    requests_waiting: int
    """Calls waiting for the run's fair share of the batch."""
    generated_tokens: int
    name: str = ""


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
