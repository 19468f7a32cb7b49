"""What trainers measured of the train/inference mismatch, and the circuit breaker on it.

A trainer reports, per batch, the mismatch the SDK (``rlfleet.client.offpolicy``) measured per version lag
(``ReportMismatch``). Lag 0 is the tokens sampled by the very weights the trainer holds: there the
mismatch is the engine's numerics against the trainer's, which staleness cannot explain. A broken
push (weights the replicas did not get, a dtype mix-up, a quantization bug) shows there first. With a
threshold set, ``trip_batches`` reports in a row whose lag-0 k3 KL is above it open the breaker: the
collector admits no new group (what it has stays, nothing is discarded) and refuses trainer calls with
FAILED_PRECONDITION naming the measured value, the threshold and the version where it started, until
an operator closes it. A report without lag-0 tokens neither counts nor resets the count.

With a KL target, the same reports bound admission (``admission_staleness``): the staleness bound is
the largest lag, at most ``max_staleness`` (the ceiling), below the smallest lag >= 1 whose measured k3
KL is above the target. Lag 0 never lowers it (staleness cannot help there; the breaker acts on it). A
lag's measurement is kept for ``horizon`` reports after it was last measured, then forgotten: with the
bound lowered no more samples of that lag are made, so the bound goes back up after the horizon and
the lag is measured again. Until the run's first report nothing is measured: admission starts low, at
``STARTING_STALENESS`` (under the ceiling), not at the ceiling, so a run whose mismatch grows fast with
lag is not fed its stalest groups before it could say so. Admission only: groups already generated are
never discarded for it. The measurements are kept in the state directory at every report, so a
restarted collector admits by them from its first group rather than from the start.

A report is taken once: a retried ``ReportMismatch`` carries the same ``report_id``, and an id among the
last ``REMEMBERED_REPORTS`` taken (kept with the measurements across a restart) changes nothing.
"""

from __future__ import annotations

import dataclasses

import logging
import math
from dataclasses import dataclass, field

from rlfleet.services.common.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

MAX_LAGS = 1024
MAX_REPORT_ID = 128
REMEMBERED_REPORTS = 256
"""Report ids remembered to take a retried report once: far more than a trainer retries across."""


STARTING_STALENESS = 1
"""With a KL target, the staleness bound until the run's first report (lag 1: one step behind)."""


@dataclass(frozen=True)
class LagMismatch:
    lag: int
    kl_k3: float
    kl_k1: float
    ess_token: float
    tokens: int


@dataclass
class MismatchBreaker:
    """The latest reports and the breaker's state (see the module docstring)."""

    threshold: float | None
    """Lag-0 k3 KL above which a report counts; None: reports are kept, the breaker never opens."""
    trip_batches: int = 3
    kl_target: float | None = None
    """The k3 KL admission keeps each lag >= 1 under; None: ``max_staleness`` alone bounds it."""
    horizon: int = 8
    """Reports a lag's measurement is kept after it was last measured."""
    consecutive_over: int = 0
    reports: int = 0
    latest: dict[int, LagMismatch] = field(default_factory=dict)
    reason: str = ""
    """Why the breaker is open; empty while closed."""
    measured: dict[int, tuple[LagMismatch, int]] = field(default_factory=dict)
    """Per lag, its last measurement and the report number it came in (for the horizon)."""
    taken: list[str] = field(default_factory=list)
    """The ids of the last ``REMEMBERED_REPORTS`` reports taken, oldest first."""
    _first_over_version: int | None = None

    def admission_staleness(self, ceiling: int) -> int:
        """The staleness bound admission may use under ``ceiling`` (the module docstring)."""
        if self.kl_target is None:
            return ceiling
        if self.reports == 0:
            return min(STARTING_STALENESS, ceiling)
        for lag in sorted(self.measured):
            if 1 <= lag <= ceiling and self.measured[lag][0].kl_k3 > self.kl_target:
                return lag - 1
        return ceiling

    @property
    def open(self) -> bool:
        return bool(self.reason)

    def report(self, policy_version: int, lags: list[LagMismatch], report_id: str = "") -> bool | None:
        """Take one batch's report (checked: ``InvalidArgument`` names the field); True when this
        report opened the breaker, None when its ``report_id`` was taken already (nothing changes)."""
        _check(lags)
        if len(report_id) > MAX_REPORT_ID:
            raise InvalidArgument(f"report_id: {len(report_id)} characters, at most {MAX_REPORT_ID}")
        if report_id:
            if report_id in self.taken:
                log.info("report %s was taken already (a retry): counted once", report_id)
                return None
            self.taken = [*self.taken[-(REMEMBERED_REPORTS - 1):], report_id]
        self.reports += 1
        self.latest = {entry.lag: entry for entry in sorted(lags, key=lambda entry: entry.lag)}
        self.measured.update((entry.lag, (entry, self.reports)) for entry in lags)
        self.measured = {lag: kept for lag, kept in self.measured.items() if self.reports - kept[1] < self.horizon}
        fresh = self.latest.get(0)
        if self.threshold is None or fresh is None or self.open:
            return False
        if fresh.kl_k3 <= self.threshold:
            self.consecutive_over, self._first_over_version = 0, None
            return False
        self.consecutive_over += 1
        if self._first_over_version is None:
            self._first_over_version = policy_version
        if self.consecutive_over < self.trip_batches:
            return False
        self.reason = (f"the mismatch breaker is open: trainers measured a lag-0 k3 KL of {fresh.kl_k3:.4g} "
                       f"(threshold {self.threshold:g}) in {self.consecutive_over} batches in a row, since policy "
                       f"version {self._first_over_version}; an operator closes it with CloseMismatchBreaker")
        log.error("%s", self.reason)
        return True

    def measurements(self) -> dict:
        """What admission by divergence acts on, to keep across a restart (``restore_measurements``)."""
        return {"reports": self.reports, "taken": self.taken,
                "measured": [[dataclasses.asdict(entry), at] for entry, at in self.measured.values()]}

    def restore_measurements(self, state: dict) -> None:
        self.reports = int(state["reports"])
        self.taken = [str(report_id) for report_id in state.get("taken", [])]
        self.measured = {entry["lag"]: (LagMismatch(**entry), int(at)) for entry, at in state["measured"]}

    def check(self) -> None:
        """FAILED_PRECONDITION naming the measurement while the breaker is open."""
        if self.reason:
            raise FailedPrecondition(self.reason)

    def close(self) -> bool:
        """Close it (and start counting again); whether it was open."""
        was_open = self.open
        if was_open:
            log.warning("the mismatch breaker was closed by an operator (%s)", self.reason)
        self.reason, self.consecutive_over, self._first_over_version = "", 0, None
        return was_open


def _check(lags: list[LagMismatch]) -> None:
    if len(lags) > MAX_LAGS:
        raise InvalidArgument(f"lags: {len(lags)} entries, at most {MAX_LAGS}")
    seen = set()
    for index, entry in enumerate(lags):
        where = f"lags[{index}]"
        if entry.lag in seen:
            raise InvalidArgument(f"{where}.lag: lag {entry.lag} is reported twice")
        seen.add(entry.lag)
        for name in ("kl_k3", "kl_k1", "ess_token"):
            if not math.isfinite(getattr(entry, name)):
                raise InvalidArgument(f"{where}.{name}: not a finite number ({getattr(entry, name)})")
        if entry.tokens <= 0:
            raise InvalidArgument(f"{where}.tokens: a lag with no token measured nothing")
