"""Typed error details (``protos/rlfleet/v1/errors.proto``) in an error status's trailing metadata.

The services' interceptor attaches them and the SDK's ``from_rpc_error`` reads them, both through
this module, so a caller learns which sample a refusal is about without parsing the message.
"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.message import DecodeError

from rlfleet.v1 import errors_pb2

SAMPLE_ERROR_KEY = "rlfleet-sample-error-bin"
"""Trailing-metadata key of an ``rlfleet.v1.SampleError`` (``-bin``: a binary value, base64 on the wire)."""


def sample_error_metadata(sample: int, description: str) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that tells the caller which ``sample`` was refused, and why."""
    detail = errors_pb2.SampleError(sample=sample, description=description)
    return ((SAMPLE_ERROR_KEY, detail.SerializeToString()),)


def sample_error_of(trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> errors_pb2.SampleError | None:
    """The ``SampleError`` among a status's trailing metadata; None if there is none (or it does not
    parse: the status message still says what happened)."""
    for key, value in trailing_metadata or ():
        if key == SAMPLE_ERROR_KEY and isinstance(value, bytes):
            try:
                return errors_pb2.SampleError.FromString(value)
            except DecodeError:
                return None
    return None
