"""How a group that failed ends: generated again after a backoff, dead-lettered — or, for what
nobody expected, the collector fails (a bug must not pass for a bad prompt).

- The input was refused (INVALID_ARGUMENT / NOT_FOUND from a stage, a stage's reply that does
  not decode for this prompt, or the collector's own rules, e.g. an episode prompt longer than
  ``max_episode_tokens``): retrying cannot fix it, the prompt is dead-lettered at once.
- Anything else a stage answers (an upstream unavailable past its retries, a deadline, a replica
  failing over and over): transient, retried with backoff up to ``prompt_attempts``, then
  dead-lettered.
- Any other exception is a bug of the collector: ``verdict`` returns None and the caller re-raises
  it, which takes the service to NOT_SERVING with the traceback in the log.
"""

from __future__ import annotations

from typing import Literal

from rlfleet.rpc.errors import InvalidArgumentError, NotFoundError, RlfleetClientError, UnavailableError
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.wire import WireError

Verdict = Literal["retry", "dead"]


class Discard(Exception):
    """The group cannot become a trajectory (aborted by a weight update, too stale at append): its
    prompt is generated again at once, not counted as a failure."""


class GenerationFailed(Exception):
    """No replica generated the group within its attempts (replicas failing or going away)."""


class EpisodeLost(Exception):
    """The environment service no longer knows an episode the collector opened (it restarted): the
    group is generated again, with new episodes."""


def verdict(exc: BaseException) -> Verdict | None:
    """What becomes of a prompt whose group raised ``exc`` (None: not an expected failure)."""
    if isinstance(exc, (InvalidArgumentError, NotFoundError, WireError, InvalidArgument)):
        return "dead"
    if isinstance(exc, (RlfleetClientError, GenerationFailed, EpisodeLost)):
        return "retry"
    return None


ENVIRONMENT_METHODS = frozenset({"OpenEpisode", "Step", "CloseEpisode"})
"""The environment service's calls, made while an episode's group is in its generation stage."""


def pauses_admission(exc: BaseException, stage: str) -> bool:
    """An upstream service (not a replica: replicas have their own pool) found unavailable: no prompt
    is drawn until its health check answers again, so an outage costs a prompt one attempt."""
    return isinstance(exc, UnavailableError) and (stage != "generation" or exc.method in ENVIRONMENT_METHODS)


def error_code(exc: BaseException) -> str:
    """The code a dead letter records: the gRPC status name, else the exception's type."""
    if isinstance(exc, RlfleetClientError):
        return exc.code
    if isinstance(exc, (WireError, InvalidArgument)):
        return "INVALID_ARGUMENT"
    return type(exc).__name__
