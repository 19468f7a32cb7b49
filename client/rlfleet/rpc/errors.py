"""One typed exception family for everything the SDK can raise.

Every ``grpc.RpcError`` is translated by ``from_rpc_error``; callers never see
raw gRPC errors.
"""

from __future__ import annotations

import grpc

from rlfleet.v1 import errors_pb2
from rlfleet.wire.error_details import sample_error_of


class RlfleetClientError(Exception):
    """Base of all SDK errors. ``code`` is the gRPC status name, ``details`` the server's message."""

    code: str = "UNKNOWN"
    #: Whether retrying the same call may succeed (transport problems only).
    retryable: bool = False

    def __init__(self, details: str, *, method: str = "", sample_error: errors_pb2.SampleError | None = None):
        self.details = details
        self.method = method
        self.sample_error = sample_error
        """Which sample (or task) of the request the server refused, and why, typed
        (``rlfleet.v1.SampleError``); None when the error is not about one sample."""
        super().__init__(f"{method}: {details}" if method else details)


class InvalidArgumentError(RlfleetClientError):
    """The request was malformed; the message names the field or sample."""
    code = "INVALID_ARGUMENT"


class FailedPreconditionError(RlfleetClientError):
    """The service state refuses the request (e.g. a weight version not newer than the current one)."""
    code = "FAILED_PRECONDITION"


class ResourceExhaustedError(RlfleetClientError):
    """A bounded queue or buffer is full, or a message exceeded the size limit."""
    code = "RESOURCE_EXHAUSTED"


class AbortedError(RlfleetClientError):
    """The operation was interrupted and nothing was applied (e.g. a cut-off weight push)."""
    code = "ABORTED"


class NotFoundError(RlfleetClientError):
    """A named entity does not exist."""
    code = "NOT_FOUND"


class UnauthenticatedError(RlfleetClientError):
    """Missing or wrong auth token."""
    code = "UNAUTHENTICATED"


class PermissionDeniedError(RlfleetClientError):
    """Authenticated but not allowed."""
    code = "PERMISSION_DENIED"


class UnavailableError(RlfleetClientError):
    """The service is unreachable, loading, or swapping weights. Retried automatically."""
    code = "UNAVAILABLE"
    retryable = True


class DeadlineExceededError(RlfleetClientError):
    """The call's deadline passed. Retried automatically for idempotent calls."""
    code = "DEADLINE_EXCEEDED"
    retryable = True


class CancelledError(RlfleetClientError):
    """The call was cancelled."""
    code = "CANCELLED"


class InternalError(RlfleetClientError):
    """A bug on the server side (it was logged there with a traceback)."""
    code = "INTERNAL"


class UnimplementedError(RlfleetClientError):
    """The server does not implement this RPC (version mismatch?)."""
    code = "UNIMPLEMENTED"


_BY_CODE: dict[grpc.StatusCode, type[RlfleetClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: FailedPreconditionError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.DATA_LOSS: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
}


def from_rpc_error(error: grpc.RpcError, method: str = "") -> RlfleetClientError:
    """The typed SDK exception for a gRPC error."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    return _BY_CODE.get(code, InternalError)(details, method=method, sample_error=sample_error_of(trailers))


__all__ = [
    "AbortedError", "CancelledError", "DeadlineExceededError", "FailedPreconditionError", "InternalError",
    "InvalidArgumentError", "NotFoundError", "PermissionDeniedError", "ResourceExhaustedError", "RlfleetClientError",
    "UnauthenticatedError", "UnavailableError", "UnimplementedError", "from_rpc_error",
]
