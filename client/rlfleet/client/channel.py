"""Channels and calls: options, TLS, auth, deadlines, bounded retries.

Retries cover only UNAVAILABLE and DEADLINE_EXCEEDED (transport problems);
client errors won't fix themselves on retry.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import grpc

from rlfleet.client.errors import RlfleetClientError, from_rpc_error

T = TypeVar("T")


@dataclass(frozen=True)
class ChannelSettings:
    """How the SDK (and services calling each other) connect."""

    max_message_bytes: int = 64 * 1024 * 1024
    """grpc.max_send/receive_message_length."""
    timeout: float = 60.0
    """Default deadline of a unary call, in seconds."""
    retries: int = 4
    """Retries after the first attempt, for UNAVAILABLE / DEADLINE_EXCEEDED only."""
    backoff_seconds: float = 0.2
    """First backoff; doubles per retry with jitter, capped at 5 s."""
    auth_token: str | None = None
    """Sent as ``authorization: Bearer <token>``."""
    tls: bool = False
    """Use TLS (system roots unless ``root_certificates`` is given)."""
    root_certificates: bytes | None = None
    """PEM roots for TLS."""
    keepalive_seconds: float = 30.0
    """Client keepalive ping interval."""

    def options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.enable_retries", 0),  # retries are ours: bounded and typed
        ]

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.auth_token}"),) if self.auth_token else ()


def aio_channel(address: str, settings: ChannelSettings = ChannelSettings()) -> grpc.aio.Channel:
    """An asyncio channel to ``address`` (``host:port`` or a ``dns:///`` target)."""
    if settings.tls:
        creds = grpc.ssl_channel_credentials(root_certificates=settings.root_certificates)
        return grpc.aio.secure_channel(address, creds, options=settings.options())
    return grpc.aio.insecure_channel(address, options=settings.options())


async def call_with_retry(
    call: Callable[..., Awaitable[T]], request: Any, *, method: str,
    settings: ChannelSettings, timeout: float | None = None,
) -> T:
    """One unary call with deadline, auth metadata, typed errors and bounded retries."""
    attempt = 0
    while True:
        try:
            return await call(request, timeout=timeout or settings.timeout, metadata=settings.metadata())
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, method)
            if not error.retryable or attempt >= settings.retries:
                raise error from None
        await asyncio.sleep(backoff(attempt, settings.backoff_seconds))
        attempt += 1


def backoff(attempt: int, base: float) -> float:
    """Exponential backoff with full jitter, capped at 5 s."""
    return random.uniform(0, min(5.0, base * 2**attempt))


__all__ = ["ChannelSettings", "RlfleetClientError", "aio_channel", "backoff", "call_with_retry"]
