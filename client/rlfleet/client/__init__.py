"""rlfleet client SDK: what a trainer imports.

    from rlfleet.client import connect

    with connect("collector:50050", run="new", **credentials_from("./credentials")) as client:  # a new run
        with client.batches(batch_size=64) as batches:
            for batch in batches:
                tokens, mask = batch.padded("tokens/full")
                ...
                client.push_weights(model)

``connect`` returns the blocking ``Client``; ``connect_async`` the ``AsyncClient``
(same methods, awaited). Both share one implementation, raise only typed
``RlfleetClientError`` subclasses for RPC failures, put a deadline on every
unary call and retry only UNAVAILABLE / DEADLINE_EXCEEDED, a bounded number of
times. The building blocks (channels, retries, errors) are shared with the services.
"""

from rlfleet.client.aio import AsyncClient, connect_async
from rlfleet.client.batches import Batch, BatchStream
from rlfleet.rpc.channel import ChannelSettings, aio_channel, call_with_retry, credentials_from
from rlfleet.rpc.errors import (
    AbortedError, CancelledError, DeadlineExceededError, FailedPreconditionError, InternalError,
    InvalidArgumentError, NotFoundError, PermissionDeniedError, ResourceExhaustedError, RlfleetClientError,
    UnauthenticatedError, UnavailableError, UnimplementedError, from_rpc_error,
)
from rlfleet.client.prompts import to_prompt_specs
from rlfleet.rpc.records import (
    BufferStats, DroppedStale, DynamicSamplingStatus, MismatchStatus, PassRate, PromptFailure, PushResult,
    ReplicaPushResult, ReplicaStatus, RollingUpdateStatus, Run, StageStatus, Status,
)
from rlfleet.client.sync import BatchIterator, Client, connect
from rlfleet.wire import Ragged

__all__ = [
    "AbortedError", "AsyncClient", "Batch", "BatchIterator", "BatchStream", "BufferStats", "CancelledError",
    "ChannelSettings", "Client", "DeadlineExceededError", "DroppedStale", "DynamicSamplingStatus", "FailedPreconditionError",
    "InternalError", "MismatchStatus", "PassRate", "PromptFailure",
    "InvalidArgumentError", "NotFoundError", "PermissionDeniedError", "PushResult", "Ragged",
    "ReplicaPushResult", "ReplicaStatus", "ResourceExhaustedError", "RlfleetClientError", "RollingUpdateStatus", "Run",
    "StageStatus", "Status", "UnauthenticatedError", "UnavailableError", "UnimplementedError", "aio_channel",
    "call_with_retry", "connect", "connect_async", "credentials_from", "from_rpc_error", "to_prompt_specs",
]
