"""OpenTelemetry tracing, off unless a service's ``otlp_endpoint`` is set.

``setup`` (in the shared lifecycle, ``server.serve``) installs a tracer provider that batches spans
to an OTLP/gRPC endpoint (an OpenTelemetry Collector, Jaeger), resource ``service.name=rlfleet-<service>``;
``shutdown`` flushes it when the service stops. W3C trace context travels in gRPC metadata
(``traceparent``): the server side is the shared interceptor (``rpc_span``: one SERVER span per RPC,
named like the method), the client side ``rlfleet.rpc.channel.ChannelSettings.metadata``, which
injects the current span's context into every call a service (or a traced trainer) makes.

Off (no endpoint), every helper here returns at once (``span`` yields None, ``traceparent`` is "") and
the interceptor wraps nothing: the hot path only reads one module global.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator, Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

__all__ = ["Status", "StatusCode", "SpanKind"]  # re-exported: callers set a span's status without the API
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("rlfleet.tracing")

PROPAGATOR = TraceContextTextMapPropagator()
"""W3C trace context (``traceparent``, ``tracestate``): the one format on the wire, both directions."""

_UNTRACED_SERVICES = ("/grpc.health.", "/grpc.reflection.")
"""Never traced: probes and reflection would bury the rollouts' traces."""
_POLLS = ("/GetStatus", "/GetEngineStatus", "/GetStats", "/GetVersionStats", "/ListSamples", "/GetSample")
"""Traced only inside a caller's trace: alone, a monitor's poll every few seconds is noise."""

_tracer: trace.Tracer | None = None
_provider: Any = None


def setup(service_name: str, endpoint: str | None, sample_ratio: float = 1.0, insecure: bool = True,
          exporter: Any = None) -> None:
    """Export this process's spans to ``endpoint`` (OTLP/gRPC ``host:port``; or to ``exporter``, a span
    exporter of the SDK: tests); neither: tracing stays off. The global tracer provider is left alone:
    only rlfleet's own spans are made, and a library's tracing is the application's business."""
    global _tracer, _provider
    if not endpoint and exporter is None:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    _provider = TracerProvider(resource=Resource.create({"service.name": f"rlfleet-{service_name}"}),
                               sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
    _provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
    _tracer = _provider.get_tracer("rlfleet")
    log.info("tracing on", extra={"otlp_endpoint": endpoint, "sample_ratio": sample_ratio})


def shutdown() -> None:
    """Flush the spans still batched and stop exporting (the service is stopping)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def extract(metadata: Sequence[tuple[str, Any]] | None) -> otel_context.Context:
    """The caller's trace context from gRPC metadata (an empty context when it sent none)."""
    carrier = {key: value for key, value in metadata or () if key in ("traceparent", "tracestate")}
    return PROPAGATOR.extract(carrier)


def inject(span: trace.Span | None = None) -> dict[str, str]:
    """``span``'s (default: the current span's) context as metadata entries; {} when there is none."""
    carrier: dict[str, str] = {}
    context = trace.set_span_in_context(span) if span is not None else None
    PROPAGATOR.inject(carrier, context=context)
    return carrier


def traceparent(span: trace.Span | None = None) -> str:
    """``span``'s (default: the current one's) W3C traceparent; "" when tracing is off."""
    if _tracer is None:
        return ""
    return inject(span).get("traceparent", "")


def traced_rpc(method: str, metadata: Sequence[tuple[str, Any]] | None) -> otel_context.Context | None:
    """The parent context of a SERVER span for ``method``, or None: tracing off, or a call not traced."""
    if _tracer is None or method.startswith(_UNTRACED_SERVICES):
        return None
    parent = extract(metadata)
    if method.endswith(_POLLS) and not trace.get_current_span(parent).get_span_context().is_valid:
        return None
    return parent


@contextlib.contextmanager
def rpc_span(method: str, parent: otel_context.Context) -> Iterator[trace.Span]:
    """A SERVER span for one RPC, current while the handler runs; an exception marks it an error."""
    with _tracer.start_as_current_span(method.lstrip("/"), context=parent, kind=SpanKind.SERVER,
                                       attributes={"rpc.system": "grpc", "rpc.method": method}) as span:
        yield span


_OFF = contextlib.nullcontext()
"""What ``span`` and ``shared_call`` are with tracing off: one shared block that does nothing (a
generator-made one costs ~1.5 us, and a group passes through a dozen)."""


def span(name: str, attributes: Mapping[str, Any] | None = None, *, parent: str | None = None,
         links: Sequence[trace.Span | None] = (), kind: SpanKind = SpanKind.INTERNAL
         ) -> contextlib.AbstractContextManager[trace.Span | None]:
    """A span, current inside the block (None when tracing is off). ``parent``: a traceparent to
    continue instead of the current span; ``links``: spans of other traces this one serves too."""
    return _OFF if _tracer is None else _span(name, attributes, parent, links, kind)


@contextlib.contextmanager
def _span(name: str, attributes: Mapping[str, Any] | None, parent: str | None, links: Sequence[trace.Span | None],
          kind: SpanKind) -> Iterator[trace.Span]:
    context = PROPAGATOR.extract({"traceparent": parent}) if parent else None
    with _tracer.start_as_current_span(name, context=context, kind=kind, attributes=attributes,
                                       links=_links(links)) as current:
        yield current


def start_span(name: str, attributes: Mapping[str, Any] | None = None) -> trace.Span | None:
    """A span started now under the current one, ended by ``end`` (for a phase that spans calls)."""
    return None if _tracer is None else _tracer.start_span(name, attributes=attributes)


def end(span_: trace.Span | None, error: str = "") -> None:
    if span_ is not None:
        if error:
            span_.set_status(Status(StatusCode.ERROR, error))
        span_.end()


def current() -> trace.Span | None:
    """The current span (None when tracing is off, or there is none)."""
    if _tracer is None:
        return None
    current_span = trace.get_current_span()
    return current_span if current_span.get_span_context().is_valid else None


def set_attributes(attributes: Mapping[str, Any]) -> None:
    """Add ``attributes`` to the current span (nothing when tracing is off)."""
    if (current_span := current()) is not None:
        current_span.set_attributes(attributes)


@contextlib.contextmanager
def using(span_: trace.Span | None) -> Iterator[None]:
    """``span_`` current inside the block (not ended by it); nothing when it is None."""
    if span_ is None:
        yield
        return
    with trace.use_span(span_, end_on_exit=False):
        yield


def shared_call(name: str, waiting: Sequence[trace.Span | None]) -> contextlib.AbstractContextManager[None]:
    """One call made for several groups (the collector's coalesced calls): its span lives in the
    first group's trace, linked to the others' waiting spans, and each of those gets a link back,
    so each group's trace leads to the call (and the service's SERVER span under it)."""
    spans = [s for s in waiting if s is not None] if _tracer is not None else []
    return _shared_call(name, spans, len(waiting)) if spans else _OFF


@contextlib.contextmanager
def _shared_call(name: str, spans: Sequence[trace.Span], groups: int) -> Iterator[None]:
    first, others = spans[0], spans[1:]
    with _tracer.start_as_current_span(name, context=trace.set_span_in_context(first), kind=SpanKind.CLIENT,
                                       links=_links(others), attributes={"rlfleet.groups": groups}) as call:
        for other in others:
            other.add_link(call.get_span_context(), {"rlfleet.shared_call": name})
        yield


def record(name: str, parent: str, started_ns: int, attributes: Mapping[str, Any] | None = None) -> None:
    """A span that began at ``started_ns`` (``time.time_ns``) and ends now, in ``parent``'s trace."""
    if _tracer is None or not parent:
        return
    context = PROPAGATOR.extract({"traceparent": parent})
    _tracer.start_span(name, context=context, attributes=attributes, start_time=started_ns).end()


def now_ns() -> int:
    return time.time_ns()


def _links(spans: Sequence[trace.Span | None]) -> list[Link]:
    return [Link(s.get_span_context()) for s in spans if s is not None]
