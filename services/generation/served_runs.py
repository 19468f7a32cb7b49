"""The runs that share a replica (``GenerateRequest.run_id``): each samples on the replica's base weights
with its own LoRA adapter, at its own versions.

A named run takes one of the replica's ``max_runs`` slots at its first request or push and keeps it until
its collector ends it (``EndRun``), or until it has been idle (no call in flight, no request nor push)
for ``run_idle_seconds`` and a new run needs its slot: a run whose collector went away (started anew
under another run id) does not hold a slot for ever. Only an idle run's slot is taken, never one with a
request running; should its collector come back, it finds the run at version 0 on this replica and
re-syncs it from its spool, as it does a restarted replica. Its version starts at 0 (the base weights, no adapter). An adapter push
of the run (``WeightManifest.run_id``) moves that run's version alone and acts on that run's requests
alone, whatever its mode; vLLM is never paused for it, so no other run's requests wait:

- ``keep``: new requests take the pushed adapter; those running finish on the one they were pinned to;
- ``wait``: the run's new requests wait until its running ones end, then take the pushed adapter;
- ``abort``: the run's running requests end with "abort"; ``resume``: they are continued on the pushed
  adapter (``rollout.py``), as the replica's own run's are after a swap.

A run may give a name (``GenerateRequest.run_name``, ``WeightManifest.run_name``: its collector's
``run_name``), and another run's call may then sample on that run's policy (``policy_run``: several
policies in one episode, ``named``): on its current adapter, as one of its requests (its pushes' modes
act on it), while the call counts as the caller's (its slot, its fair share). The latest run to give a
name holds it (a run started anew under the same name takes it over).

The replica's own run (``run_id`` empty) is the one a replica always had; its full and delta pushes
replace the base weights the named runs' adapters sit on, so they are refused while named runs share the
replica (``WeightSwaps.stage``). Knows nothing of gRPC; errors are domain exceptions.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

from rlfleet.choices import SwapModeName
from rlfleet.services.common.errors import (
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
)
from rlfleet.services.common.run_ids import check_run_id
from rlfleet.services.generation.served_adapters import AdapterSet


@dataclass(eq=False)
class ServedRun:
    """One named run on this replica: its version, its adapters, and its requests."""

    run_id: str
    adapters: AdapterSet
    name: str = ""
    """The name other runs' calls ask for its policy by ("": none given)."""
    admission_open: asyncio.Event = field(default_factory=asyncio.Event)
    """Cleared while a ``wait``, ``abort`` or ``resume`` push of this run switches its adapter."""
    serial: int = 0
    mode: SwapModeName | None = None
    """Pushes of this run applied so far, and the latest's mode: tells a resume push's aborts (``resumes``)."""
    requests: set[str] = field(default_factory=set)
    """vLLM request ids of this run in flight (what an ``abort`` push aborts)."""
    calls: int = 0
    """Generate calls of the run in flight."""
    generated_tokens: int = 0
    last_used: float = field(default_factory=time.monotonic)
    """When the run last had a call or a push here (``ServedRuns.take``)."""
    ended: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One push of the run at a time."""
    _drained: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.admission_open.set()
        self._drained.set()

    @property
    def version(self) -> int:
        """The run's version new requests run on: its current adapter's (0: none yet, the base weights)."""
        return 0 if self.adapters.current is None else self.adapters.current.version

    def resumes(self, swap_serial: int) -> bool:
        """Whether an abort of a request opened at ``swap_serial`` is a ``resume`` push's (``WeightSwaps.resumes``)."""
        return self.serial > swap_serial and self.mode == "resume"

    def check_version(self, version: int) -> None:
        if version <= self.version:
            raise FailedPrecondition(f"run {self.run_id}: weights version {version} is not newer than its "
                                     f"current {self.version}")

    def opened(self, request_id: str) -> None:
        self.requests.add(request_id)
        self._drained.clear()

    def closed(self, request_id: str) -> None:
        self.requests.discard(request_id)
        if not self.requests:
            self._drained.set()

    async def drained(self) -> None:
        """Until none of the run's requests is in vLLM."""
        await self._drained.wait()


log = logging.getLogger("rlfleet.generation.runs")


class ServedRuns:
    """The named runs this replica serves, at most ``max_runs`` at once."""

    def __init__(self, max_runs: int, idle_seconds: float = 600.0) -> None:
        self.max_runs = max_runs
        self.idle_seconds = idle_seconds
        self._runs: dict[str, ServedRun] = {}
        self._named: dict[str, ServedRun] = {}
        """Name -> the run that gave it last."""
        self.adapter_serials = itertools.count(1)
        """Every adapter this replica loads, whatever its run, gets its own serial: vLLM's id and name."""

    def __bool__(self) -> bool:
        return bool(self._runs)

    def __iter__(self):
        return iter(list(self._runs.values()))

    def names(self) -> list[str]:
        return sorted(self._runs)

    def take(self, run_id: str, engine=None, name: str = "") -> ServedRun:
        """The run ``run_id`` (INVALID_ARGUMENT for an id of another shape), marked used now and known by
        ``name`` if one is given; a run served for the first time takes a slot: a free one, or the longest
        idle run's past ``idle_seconds`` (RESOURCE_EXHAUSTED naming the runs that hold them when none is)."""
        if name:
            check_run_id(name, "run_name")
        run = self._runs.get(run_id)
        if run is None:
            run = self._new(run_id, engine)
        elif run.ended:
            raise FailedPrecondition(f"run {run_id} ended on this replica (EndRun)")
        run.last_used = time.monotonic()
        if name and self._named.get(name) is not run:
            if self._named.get(run.name) is run:
                del self._named[run.name]
            run.name = name
            self._named[name] = run
        return run

    def named(self, name: str) -> ServedRun:
        """The run known by ``name`` (its policy samples another run's call); FAILED_PRECONDITION when no
        run here gave that name, or the one that did ended."""
        check_run_id(name, "policy_run")
        run = self._named.get(name)
        if run is None or run.ended:
            known = ", ".join(sorted(self._named)) or "none"
            raise FailedPrecondition(f"policy_run {name!r}: no run of that name on this replica (its collector has "
                                     f"neither pushed nor generated here yet, or it ended; names here: {known})")
        return run

    def _new(self, run_id: str, engine) -> ServedRun:
        check_run_id(run_id)
        if self.max_runs == 0:
            raise FailedPrecondition(f"run {run_id}: this replica serves no runs but its own (start it with "
                                     f"max_runs and max_lora_rank to share it between runs)")
        if len(self._runs) >= self.max_runs and not self._reclaim_idle(engine):
            raise ResourceExhausted(f"run {run_id}: this replica serves max_runs={self.max_runs} runs at once "
                                    f"({', '.join(self.names())}); it gets a slot when one of them ends (EndRun) "
                                    f"or has been idle for run_idle_seconds={self.idle_seconds:g}")
        run = self._runs[run_id] = ServedRun(run_id, AdapterSet(serials=self.adapter_serials))
        return run

    def _reclaim_idle(self, engine) -> bool:
        """End the longest idle run past ``idle_seconds`` (no call in flight, no push under way); whether one was."""
        now = time.monotonic()
        idle = [run for run in self._runs.values()
                if run.calls == 0 and not run.lock.locked() and now - run.last_used >= self.idle_seconds]
        if not idle:
            return False
        run = min(idle, key=lambda r: r.last_used)
        log.info("run %s idle for %.0f s: its slot goes to a new run", run.run_id, now - run.last_used)
        self.end(run.run_id, engine)
        return True

    def get(self, run_id: str) -> ServedRun:
        """A run this replica serves; NOT_FOUND otherwise."""
        run = self._runs.get(run_id)
        if run is None:
            raise NotFound(f"run {run_id[:160]!r} is not served by this replica")
        return run

    def end(self, run_id: str, engine) -> ServedRun:
        """``run_id`` ends here: new requests refused, its slot freed once its calls end (``release``)."""
        run = self.get(run_id)
        run.ended = True
        run.admission_open.set()  # callers waiting on a push of it see it ended
        self.release(run, engine)
        return run

    def release(self, run: ServedRun, engine) -> None:
        """An ended run with no call left leaves: its adapters go (once unpinned) and its slot is free."""
        if run.ended and run.calls == 0 and self._runs.get(run.run_id) is run:
            del self._runs[run.run_id]
            if self._named.get(run.name) is run:
                del self._named[run.name]
            run.adapters.drop(engine)

    def close(self) -> None:
        for run in self._runs.values():
            run.adapters.close()
        self._runs.clear()
        self._named.clear()
