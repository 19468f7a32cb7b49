"""Channels and calls: options, TLS, auth, deadlines, bounded retries.

Retries cover only UNAVAILABLE and DEADLINE_EXCEEDED (transport problems);
client errors won't fix themselves on retry.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import grpc

from rlfleet.rpc.errors import RlfleetClientError, from_rpc_error

try:  # optional: the SDK's base install does not need OpenTelemetry
    from opentelemetry import trace as _otel_trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator as _TraceContext
except ImportError:  # pragma: no cover - exercised where opentelemetry-api is not installed
    _otel_trace = None

T = TypeVar("T")
RUN_METADATA = "rlfleet-run-id"
"""The call metadata a joined trainer sends its run id in (the collector checks it: ``services/collector/run.py``)."""


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
    """Use TLS (system roots unless ``root_certificates`` is given); the server's certificate is verified."""
    root_certificates: bytes | None = None
    """PEM roots for TLS (e.g. the deployment's CA)."""
    certificate_chain: bytes | None = None
    """PEM client certificate, for servers that require one (mTLS); with ``private_key``."""
    private_key: bytes | None = None
    """PEM private key of ``certificate_chain``."""
    server_name: str | None = None
    """The name the server's certificate must hold when it differs from the address's host (an IP
    address, a tunnel): gRPC's ``ssl_target_name_override``."""
    keepalive_seconds: float = 30.0
    """Client keepalive ping interval."""
    run_id: str | None = None
    """The training run a trainer joined (``JoinRun``), sent as ``rlfleet-run-id``: the collector refuses the
    calls of another run's trainer."""

    def options(self) -> list[tuple[str, Any]]:
        options: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.enable_retries", 0),  # retries are ours: bounded and typed
        ]
        if self.tls and self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return options

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials (None: plaintext)."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates, private_key=self.private_key,
                                            certificate_chain=self.certificate_chain)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata of a call: the token, the run, and the current trace context (``trace_metadata``)."""
        auth = (("authorization", f"Bearer {self.auth_token}"),) if self.auth_token else ()
        run = ((RUN_METADATA, self.run_id),) if self.run_id else ()
        return auth + run + trace_metadata()


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """The current OpenTelemetry span's W3C context (``traceparent``) as call metadata, so that the
    service's spans join the caller's trace; () without a recording span or without opentelemetry-api."""
    if _otel_trace is None or not _otel_trace.get_current_span().get_span_context().is_valid:
        return ()
    carrier: dict[str, str] = {}
    _TraceContext().inject(carrier)
    return tuple(carrier.items())


def credentials_from(directory: str | Path, name: str = "trainer", role: str | None = None,
                     run: str | None = None) -> dict[str, Any]:
    """``connect`` keywords from a deployment's credentials directory (``rlfleet.services.credentials``;
    compose's ``credentials`` volume copied out): TLS roots ``ca.pem``, the client certificate
    ``<name>.pem`` / ``<name>.key``, and the token in ``token-<role>`` (``role`` defaults to ``name``:
    ``trainer``; ``reader`` or ``operator`` for a reader or an operator with the trainer's certificate).
    ``run``: the credentials of one run of a shared fleet, ``<name>-<run>.pem`` and
    ``token-<role>-<run>`` (docs/concepts/many-runs.md).

        client = connect("localhost:50050", **credentials_from("./credentials"))
    """
    directory = Path(directory)
    suffix = f"-{run}" if run else ""
    token_file = directory / f"token-{role or name}{suffix}"
    return {"root_certificates": (directory / "ca.pem").read_bytes(),
            "certificate_chain": (directory / f"{name}{suffix}.pem").read_bytes(),
            "private_key": (directory / f"{name}{suffix}.key").read_bytes(),
            "auth_token": token_file.read_text().strip()}


def aio_channel(address: str, settings: ChannelSettings = ChannelSettings()) -> grpc.aio.Channel:
    """An asyncio channel to ``address`` (``host:port`` or a ``dns:///`` target)."""
    credentials = settings.credentials()
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=settings.options())
    return grpc.aio.insecure_channel(address, options=settings.options())


async def call_with_retry(
    call: Callable[..., Awaitable[T]], request: Any, *, method: str,
    settings: ChannelSettings, timeout: float | None = None, idempotent: bool = True,
) -> T:
    """One unary call with deadline, auth metadata, typed errors and bounded retries.

    ``idempotent=False`` retries UNAVAILABLE only: after DEADLINE_EXCEEDED the
    server may have applied the call, and repeating it would apply it twice.
    """
    attempt = 0
    while True:
        try:
            return await call(request, timeout=timeout or settings.timeout, metadata=settings.metadata())
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, method)
            retry = error.retryable and (idempotent or error.code == "UNAVAILABLE")
            if not retry or attempt >= settings.retries:
                raise error from None
        await asyncio.sleep(backoff(attempt, settings.backoff_seconds))
        attempt += 1


_CORE_WRITE_FAILURE = "Internal error from Core"
_STATUS_GRACE_SECONDS = 1.0
_CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class _Status(grpc.RpcError):
    """A finished call's status, in the shape ``from_rpc_error`` reads."""

    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


try:  # grpc.aio leaks its core's exception from done_writing() when the call ended meanwhile
    from grpc._cython.cygrpc import ExecuteBatchError as _ExecuteBatchError
except ImportError:  # pragma: no cover - moved or fixed upstream
    _ExecuteBatchError = grpc.RpcError

STREAM_WRITE_ERRORS: tuple[type[BaseException], ...] = (grpc.RpcError, asyncio.InvalidStateError, _ExecuteBatchError)
"""What ``write``/``done_writing`` on a request stream raise once the call has ended (a deadline, the
server's answer, a cancel): the call's own status, read next, is the real outcome."""


def is_core_write_failure(code: grpc.StatusCode, details: str) -> bool:
    """Whether a streaming call's status is grpc.aio's INTERNAL "Internal error from Core" for a write
    that raced the call's end (see ``StatusWatch``): the server's own status is hidden behind it."""
    return code == grpc.StatusCode.INTERNAL and details == _CORE_WRITE_FAILURE


class StatusWatch:
    """Remembers the first status grpc.aio records on a streaming call.

    grpc.aio (grpc/grpc#36066, up to at least 1.85) marks a call INTERNAL
    "Internal error from Core" when a write fails because the call has ended,
    overwriting the status the server had already sent (NOT_FOUND,
    UNAUTHENTICATED, ...). Done callbacks run when the first status is set,
    before any overwrite, so this keeps the server's. It reads a private
    attribute and simply records nothing where that is gone (fixed versions).
    """

    def __init__(self, call: Any):
        self.first: tuple[grpc.StatusCode, str] | None = None
        call.add_done_callback(self._on_done)

    def _on_done(self, call: Any) -> None:
        status = getattr(getattr(call, "_cython_call", None), "_status", None)
        code = _CODE_BY_VALUE.get(getattr(status, "code", lambda: None)())
        if code is not None:
            self.first = (code, status.details() or "")


async def stream_error(call: Any, exc: grpc.RpcError, method: str,
                       watch: StatusWatch | None = None) -> RlfleetClientError:
    """The typed error of a streaming call that failed with ``exc``.

    Undoes grpc.aio's INTERNAL "Internal error from Core" for a write that
    raced the end of the call: the server's status is the one seen first
    (``watch``) or, when the failed write came first, the one recorded just
    after it, so wait briefly for that.
    """
    code, details = exc.code(), exc.details()
    if is_core_write_failure(code, details) and watch is not None and watch.first is not None:
        code, details = watch.first
    loop = asyncio.get_running_loop()
    give_up = loop.time() + _STATUS_GRACE_SECONDS
    while is_core_write_failure(code, details) and loop.time() < give_up:
        await asyncio.sleep(0.01)
        code, details = await call.code(), await call.details()
    return from_rpc_error(_Status(code, details), method)


def backoff(attempt: int, base: float) -> float:
    """Exponential backoff with full jitter, capped at 5 s."""
    return random.uniform(0, min(5.0, base * 2**attempt))


__all__ = [
    "ChannelSettings", "RlfleetClientError", "STREAM_WRITE_ERRORS", "StatusWatch", "aio_channel", "backoff",
    "call_with_retry", "credentials_from", "is_core_write_failure", "stream_error", "trace_metadata",
]
