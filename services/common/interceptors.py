"""Domain errors -> gRPC status codes, in one place; plus auth and RPC metrics.

Servicers stay thin and never call ``context.abort`` for domain problems: they
let ``RlfleetError`` / ``WireError`` propagate and this interceptor maps them.
Anything unexpected becomes INTERNAL and is logged with its traceback.

Requests arrive as bytes and are parsed here, after the auth check, inside the
error mapping: a message that is not valid protobuf is INVALID_ARGUMENT naming
the RPC, on unary and streaming RPCs alike (grpc's own deserializer would answer
UNKNOWN or INTERNAL, and before authentication).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from typing import Any, AsyncIterator, Callable

import grpc

from rlfleet.services.common import metrics, tracing
from rlfleet.services.common.errors import InvalidArgument, RlfleetError
from rlfleet.services.common.security import AccessPolicy, certificate_runs
from rlfleet.wire import WireError
from rlfleet.wire.error_details import sample_error_metadata

log = logging.getLogger("rlfleet.rpc")

def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status a domain exception maps to, or None for an unexpected one."""
    if isinstance(exc, WireError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, RlfleetError):
        return getattr(grpc.StatusCode, exc.code), str(exc)
    return None


MAX_DETAILS_BYTES = 2048
"""An error message's bound in UTF-8 bytes. grpc sends it percent-encoded (a byte outside printable
ASCII takes 3) in the trailers, and clients refuse trailers past 8 KiB (soft) / 16 KiB (hard): a
message that quoted a huge request field whole would turn the precise status into
RESOURCE_EXHAUSTED "Stream removed". 2 KiB stays under the soft limit even fully escaped."""


def bounded_details(details: str, limit: int = MAX_DETAILS_BYTES) -> str:
    """``details`` as is, or its head and tail with the middle cut, under ``limit`` UTF-8 bytes."""
    raw = details.encode()
    if len(raw) <= limit:
        return details
    keep = (limit - 64) // 2
    head = raw[:keep].decode(errors="ignore")
    tail = raw[-keep:].decode(errors="ignore")
    return f"{head} [... {len(raw) - 2 * keep} bytes cut ...] {tail}"


async def _abort_for(exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    mapped = status_for(exc)
    if mapped is None and type(exc) is NotImplementedError:  # a generated base servicer's stub
        mapped = (grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented by this service")
    if mapped is None:
        log.error("unexpected error in %s", method, exc_info=exc)
        mapped = (grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}")
    metrics.RPC_ERRORS.labels(method=method, code=mapped[0].name).inc()
    await context.abort(mapped[0], bounded_details(mapped[1]), detail_metadata(exc))


def detail_metadata(exc: BaseException) -> tuple[tuple[str, bytes], ...]:
    """The typed details of a domain error, as the trailing metadata of its status."""
    if not isinstance(exc, RlfleetError) or exc.sample is None:
        return ()
    # Half the message's bound: the message (2 KiB, up to 6 KiB percent-encoded) and this detail
    # (base64 in the trailers: 1 KiB takes ~1.4) stay under the clients' 8 KiB soft limit together.
    return sample_error_metadata(exc.sample, bounded_details(exc.description, MAX_DETAILS_BYTES // 2))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions to statuses, checks the caller's token, its role and its run
    (``security.AccessPolicy``), records RPC metrics."""

    def __init__(self, policy: AccessPolicy | None = None):
        self._policy = policy or AccessPolicy()

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        return _wrap_handler(handler, method, self._policy, tracing.traced_rpc(method, details.invocation_metadata))


async def _check_access(policy: AccessPolicy, method: str, context: grpc.aio.ServicerContext) -> None:
    """Aborts the call unless the policy lets it through; before its request is parsed: a caller
    without the right credentials learns nothing about its bytes."""
    if not (policy.enabled or policy.reads_certificates):
        return  # local development: nothing to check
    runs = None
    if policy.reads_certificates:
        runs = certificate_runs(context.auth_context().get("peer_uri", ()))
    verdict = policy.check(method, context.invocation_metadata(), runs)
    if verdict.code is not None:
        code = getattr(grpc.StatusCode, verdict.code)
        metrics.RPC_ERRORS.labels(method=method, code=code.name).inc()
        await context.abort(code, verdict.message)


def _parser(handler: grpc.RpcMethodHandler, method: str) -> Callable[[bytes], Any]:
    deserialize = handler.request_deserializer

    def parse(raw: bytes) -> Any:
        if deserialize is None:
            return raw
        try:
            return deserialize(raw)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise InvalidArgument(f"{method}: the request is not a valid protobuf message "
                                  f"({type(exc).__name__}: {exc})") from None
    return parse


async def _parsed(requests: AsyncIterator[bytes], parse: Callable[[bytes], Any]) -> AsyncIterator[Any]:
    async for raw in requests:
        yield parse(raw)


def _wrap_handler(handler: grpc.RpcMethodHandler, method: str, policy: AccessPolicy,
                  trace_parent=None) -> grpc.RpcMethodHandler:
    """``trace_parent``: the caller's trace context when the call is traced (a SERVER span around the
    handler, ``tracing.rpc_span``), None when not (tracing off: nothing added)."""
    parse = _parser(handler, method)

    def traced():
        return contextlib.nullcontext() if trace_parent is None else tracing.rpc_span(method, trace_parent)
    streaming_request = handler.request_streaming

    def request_of(raw_or_iterator):
        return _parsed(raw_or_iterator, parse) if streaming_request else parse(raw_or_iterator)

    if handler.unary_unary or handler.stream_unary:
        behavior = handler.unary_unary or handler.stream_unary

        async def unary_response(request_or_iterator, context):
            await _check_access(policy, method, context)
            started = time.perf_counter()
            try:
                with traced():
                    return await behavior(request_of(request_or_iterator), context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - the one place errors become statuses
                await _abort_for(exc, context, method)
            finally:
                metrics.RPC_SECONDS.labels(method=method).observe(time.perf_counter() - started)

        factory = (grpc.unary_unary_rpc_method_handler if handler.unary_unary
                   else grpc.stream_unary_rpc_method_handler)
    else:
        behavior = handler.unary_stream or handler.stream_stream

        async def unary_response(request_or_iterator, context):  # streams responses
            await _check_access(policy, method, context)
            started = time.perf_counter()
            try:
                with traced():
                    result = behavior(request_of(request_or_iterator), context)
                    if inspect.isasyncgen(result):
                        async for item in result:
                            yield item
                    else:  # a coroutine using context.write
                        await result
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001
                await _abort_for(exc, context, method)
            finally:
                metrics.RPC_SECONDS.labels(method=method).observe(time.perf_counter() - started)

        factory = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
                   else grpc.stream_stream_rpc_method_handler)
    return factory(unary_response, request_deserializer=None, response_serializer=handler.response_serializer)
