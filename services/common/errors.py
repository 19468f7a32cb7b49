"""Domain exceptions. Domain code raises these; one interceptor maps them to gRPC codes.

Nothing here imports grpc: the mapping lives in ``interceptors.py``.
"""

from __future__ import annotations

from typing import TypeVar


class RlfleetError(Exception):
    """Base of every error a service deliberately reports to its caller."""

    #: Name of the ``grpc.StatusCode`` this error maps to.
    code: str = "INTERNAL"
    #: The request's sample (or task) this error is about, when ``about_sample`` made it: the caller
    #: gets it typed, with ``description`` (an ``rlfleet.v1.SampleError`` detail), not only in words.
    sample: int | None = None
    description: str = ""


class InvalidArgument(RlfleetError):
    """The request is malformed; the message names the offending field/sample."""

    code = "INVALID_ARGUMENT"


class OutOfRange(RlfleetError):
    """A value past the range it may take (e.g. a policy version beyond int64)."""

    code = "OUT_OF_RANGE"


class FailedPrecondition(RlfleetError):
    """The request is well-formed but the service state refuses it (e.g. stale version)."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(RlfleetError):
    """A bounded queue or buffer is full; retry later."""

    code = "RESOURCE_EXHAUSTED"


class Aborted(RlfleetError):
    """The operation was interrupted (e.g. a push cut off mid-stream); nothing was applied."""

    code = "ABORTED"


class NotFound(RlfleetError):
    """A named entity (reward function, lease, replica) does not exist."""

    code = "NOT_FOUND"


class Unavailable(RlfleetError):
    """The service (or a dependency) is not ready or is shutting down."""

    code = "UNAVAILABLE"


class DataLoss(RlfleetError):
    """Data this service holds is not what it was given (e.g. weights in an engine that differ from the push
    loaded into it): what it serves from them cannot be trusted."""

    code = "DATA_LOSS"


class Unauthenticated(RlfleetError):
    """Missing or wrong credentials."""

    code = "UNAUTHENTICATED"


class UpstreamError(RlfleetError):
    """A dependency answered with an error status that the caller should see as is."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


E = TypeVar("E", bound=RlfleetError)


def about_sample(error_type: type[E], sample: int, description: str) -> E:
    """``error_type("sample <sample>: <description>")`` that carries ``sample`` and ``description``
    too: a caller that sent many samples (or tasks) learns which one was refused from them, typed,
    never by parsing the message."""
    error = error_type(f"sample {sample}: {description}")
    error.sample, error.description = sample, description
    return error


class StartupError(Exception):
    """The service cannot do its job with this configuration (a setting, a file it names): it refuses
    to start, with a message naming the setting (and the file and line where there is one)."""
