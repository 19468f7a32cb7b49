"""How a group that failed ends: generated again after a backoff, dead-lettered — or, for what
nobody expected, the collector fails (a bug must not pass for a bad prompt).

- The input was refused (INVALID_ARGUMENT / NOT_FOUND from a stage, or a stage's reply that does
  not decode for this prompt): retrying cannot fix it, the prompt is dead-lettered at once.
- Anything else a stage answers (an upstream unavailable past its retries, a deadline, a replica
  failing over and over): transient, retried with backoff up to ``prompt_attempts``, then
  dead-lettered.
- Any other exception is a bug of the collector: ``verdict`` returns None and the caller re-raises
  it, which takes the service to NOT_SERVING with the traceback in the log.
"""

from __future__ import annotations

from typing import Literal

from rlfleet.client.errors import InvalidArgumentError, NotFoundError, RlfleetClientError, UnavailableError
from rlfleet.wire import WireError

Verdict = Literal["retry", "dead"]


class Discard(Exception):
    """The group cannot become a trajectory (aborted by a weight update, too stale at append): its
    prompt is generated again at once, not counted as a failure."""


class GenerationFailed(Exception):
    """No replica generated the group within its attempts (replicas failing or going away)."""


def verdict(exc: BaseException) -> Verdict | None:
    """What becomes of a prompt whose group raised ``exc`` (None: not an expected failure)."""
    if isinstance(exc, (InvalidArgumentError, NotFoundError, WireError)):
        return "dead"
    if isinstance(exc, (RlfleetClientError, GenerationFailed)):
        return "retry"
    return None


def pauses_admission(exc: BaseException, stage: str) -> bool:
    """An upstream service (not a replica: replicas have their own pool) found unavailable: no prompt
    is drawn until its health check answers again, so an outage costs a prompt one attempt."""
    return isinstance(exc, UnavailableError) and stage != "generation"


def error_code(exc: BaseException) -> str:
    """The code a dead letter records: the gRPC status name, else the exception's type."""
    if isinstance(exc, RlfleetClientError):
        return exc.code
    if isinstance(exc, WireError):
        return "INVALID_ARGUMENT"
    return type(exc).__name__
