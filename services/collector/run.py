"""Run identity: which training run the collector's durable state belongs to, and who may join it.

A run is born with the collector's state (a new state directory or database: ``fresh`` or never used)
and keeps its id across restarts, in the ``meta`` row ``run``. A trainer joins it (``JoinRun``) saying
what it holds: nothing yet (it starts a run: its weights are version 0) or a run id and the version of
its weights (it resumes). A mismatch is refused with FAILED_PRECONDITION naming both sides, so a fresh
trainer is never fed another run's batches, nor a resumed one batches of weights it does not have.
After joining, every trainer call carries the run id (metadata ``rlfleet-run-id``) and a call from
another run is refused (``check_call``): a collector started fresh under a running trainer says so
instead of streaming the new run's batches to it.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass

from rlfleet.rpc.channel import RUN_METADATA
from rlfleet.services.common.errors import FailedPrecondition, InvalidArgument

RUN_ID = re.compile(r"run-[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")
"""What ``new_run_id`` makes: a claimed run id of another shape was never a run's."""

FRESH_HINTS = "rlfleet-suite --fresh, rlfleet-ray up --fresh, or docker compose down -v before up"
"""How each deployment starts a new run (named in refusals)."""


@dataclass(frozen=True)
class Run:
    """The run a collector holds."""

    run_id: str
    created_at: float
    resumed: bool
    """This process found the run in its state (False: it created it)."""

    def describe(self, version: int) -> str:
        made = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.created_at))
        return f"run {self.run_id} (created {made}, committed version {version})"


def new_run_id(now: float | None = None) -> str:
    now = time.time() if now is None else now
    return f"run-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}-{secrets.token_hex(3)}"


def load(stored: str | None, had_state: bool, now: float | None = None) -> tuple[Run, str | None]:
    """The run from the ``meta`` row ``run`` (``stored``); without one, a new run, and the row to write.
    ``had_state``: the database held a committed version before (a collector older than run ids):
    its run is adopted under a new id, as resumed."""
    if stored is not None:
        record = json.loads(stored)
        return Run(record["run_id"], float(record["created_at"]), resumed=True), None
    now = time.time() if now is None else now
    run = Run(new_run_id(now), now, resumed=had_state)
    return run, json.dumps({"run_id": run.run_id, "created_at": run.created_at})


def check_join(run: Run, committed: int, claimed_run_id: str, claimed_version: int) -> None:
    """FAILED_PRECONDITION unless a trainer holding ``claimed_run_id`` ("": none, it starts a run) at
    ``claimed_version`` may join ``run`` at ``committed``."""
    if claimed_run_id and not RUN_ID.fullmatch(claimed_run_id):
        raise InvalidArgument(f"run_id: not a run id (run-YYYYMMDD-HHMMSS-xxxxxx), got {_shown(claimed_run_id)}")
    held = run.describe(committed)
    if not claimed_run_id:
        if committed != 0:
            raise FailedPrecondition(
                f"this trainer starts a new run, but the collector holds {held}: its batches come from weights "
                f"this trainer does not have. Resume that run with run id {run.run_id} and the weights of version "
                f"{committed}, or start the fleet on a new run ({FRESH_HINTS})")
        return
    if claimed_run_id != run.run_id:
        raise FailedPrecondition(
            f"this trainer resumes run {claimed_run_id} at version {claimed_version}, but the collector holds "
            f"{held}: another run's state. Point the trainer at run {claimed_run_id}'s fleet, or start a new "
            f"run (the trainer with run='new'; the fleet with {FRESH_HINTS})")
    if claimed_version != committed:
        raise FailedPrecondition(
            f"this trainer resumes run {run.run_id} holding the weights of version {claimed_version}, but the "
            f"collector committed version {committed}: batches would come from weights the trainer does not "
            f"hold. Resume from the checkpoint of version {committed}")


def check_call(run: Run, metadata) -> None:
    """FAILED_PRECONDITION when a call's ``rlfleet-run-id`` names another run (absent: taken)."""
    for key, value in metadata or ():
        if key == RUN_METADATA and value != run.run_id:
            value = _shown(value)
            raise FailedPrecondition(
                f"this trainer joined run {value}, but the collector now holds run {run.run_id} (its state was "
                f"started anew): its batches and versions are not the trainer's run. Join run {run.run_id} "
                f"(run='new' or resume it), or bring back run {value}'s state")


def _shown(value: str, limit: int = 64) -> str:
    """A caller's value in a message: bounded (an error's message travels in the call's trailers)."""
    return value if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"
