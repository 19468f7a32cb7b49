"""The mismatch breaker as the collector keeps it: trainers' reports move it, the collector's database
keeps what it acted on (a restarted collector keeps it open, and admission bounded), admission follows it.

``MismatchBreaker`` (``mismatch.py``) decides; this part persists and applies what it decided."""

from __future__ import annotations

import json
import logging

from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.ledger import PromptLedger
from rlfleet.services.collector.mismatch import LagMismatch, MismatchBreaker
from rlfleet.v1 import collector_pb2

log = logging.getLogger("rlfleet.collector")


class BreakerState:
    def __init__(self, breaker: MismatchBreaker, gate: VersionGate, ledger: PromptLedger):
        self._breaker, self._gate, self._ledger = breaker, gate, ledger

    @property
    def open(self) -> bool:
        return self._breaker.open

    def check(self) -> None:
        """FAILED_PRECONDITION naming the measurement while the breaker is open."""
        self._breaker.check()

    async def restore(self) -> None:
        """The breaker's state as the database keeps it (``mismatch_breaker`` while open: what it opened on;
        ``mismatch_measured``: the mismatch per lag, with ``mismatch_kl_target``)."""
        breaker = self._breaker
        measured = await self._ledger.meta("mismatch_measured")
        if breaker.kl_target is not None:  # by what was measured; with no report yet, it starts low
            if measured is not None:
                breaker.restore_measurements(json.loads(measured))
            await self._gate.bound_admission(breaker.admission_staleness(self._gate.max_staleness))
        opened = await self._ledger.meta("mismatch_breaker")
        if opened is not None:
            breaker.reason = json.loads(opened)["reason"]
            log.error("the mismatch breaker is open since before this start: %s", breaker.reason)
            await self._gate.hold(True)

    async def report(self, policy_version: int, lags: list[LagMismatch], report_id: str = "") -> None:
        """A trainer's measurement: opening the breaker holds admission (durably: a restarted collector
        keeps it open); the KL target bounds it. A report whose id was taken already changes nothing."""
        breaker = self._breaker
        saved: dict[str, str | None] = {}
        opened = breaker.report(policy_version, lags, report_id)
        if opened is None:
            return
        if opened:
            saved["mismatch_breaker"] = json.dumps({"reason": breaker.reason})
        if breaker.kl_target is not None:  # what admission acts on survives a restart
            saved["mismatch_measured"] = json.dumps(breaker.measurements())
        if saved:
            await self._ledger.set_meta(saved)  # before admission is held: a restart keeps what it acted on
        if opened:
            await self._gate.hold(True)
        await self._gate.bound_admission(breaker.admission_staleness(self._gate.max_staleness))

    async def close(self) -> bool:
        """Closed (durably first: a restart keeps it closed); whether it was open."""
        await self._ledger.set_meta({"mismatch_breaker": None})
        was_open = self._breaker.close()
        await self._gate.hold(False)
        return was_open

    def status(self) -> collector_pb2.MismatchStatus:
        breaker = self._breaker
        return collector_pb2.MismatchStatus(
            breaker_open=breaker.open, reason=breaker.reason, threshold=breaker.threshold or 0.0,
            trip_batches=breaker.trip_batches, consecutive_over=breaker.consecutive_over, reports=breaker.reports,
            kl_target=breaker.kl_target or 0.0, admission_staleness=self._gate.admission_staleness,
            measured=[_lag(m) for m, _ in sorted(breaker.measured.values(), key=lambda kept: kept[0].lag)],
            latest=[_lag(m) for m in breaker.latest.values()])


def _lag(measured: LagMismatch) -> collector_pb2.LagMismatch:
    return collector_pb2.LagMismatch(lag=measured.lag, kl_k3=measured.kl_k3, kl_k1=measured.kl_k1,
                                     ess_token=measured.ess_token, tokens=measured.tokens)
