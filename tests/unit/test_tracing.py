"""Trace context in gRPC metadata (services/common/tracing.py, the SDK's ChannelSettings.metadata):
nothing added while tracing is off; on, what a caller injects a server extracts as its span's parent."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rlfleet.client.channel import ChannelSettings, trace_metadata
from rlfleet.services.common import tracing
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.trajectory.traces import GroupTraces
from tests.trajectories import groups, make_trajectories


@pytest.fixture
def exported():
    exporter = InMemorySpanExporter()
    tracing.setup("test", None, exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def by_name(exporter: InMemorySpanExporter) -> dict:
    return {span.name: span for span in exporter.get_finished_spans()}


def test_off_adds_nothing():
    assert not tracing.enabled()
    assert ChannelSettings().metadata() == ()
    assert ChannelSettings(auth_token="t").metadata() == (("authorization", "Bearer t"),)
    with tracing.span("group", {"rlfleet.prompt_id": "p"}) as span:
        assert span is None
        assert trace_metadata() == ()
        assert tracing.traceparent() == ""
    assert tracing.traced_rpc("/rlfleet.v1.GenerationService/Generate", ()) is None


def test_round_trip_through_metadata(exported):
    with tracing.span("generate") as client:
        metadata = ChannelSettings(auth_token="t").metadata()
    assert metadata[0] == ("authorization", "Bearer t")
    keys = dict(metadata)
    assert keys["traceparent"] == tracing.traceparent(client)
    parent = tracing.traced_rpc("/rlfleet.v1.GenerationService/Generate", metadata)
    assert parent is not None
    with tracing.rpc_span("/rlfleet.v1.GenerationService/Generate", parent):
        pass
    tracing.shutdown()  # flushes
    spans = by_name(exported)
    server = spans["rlfleet.v1.GenerationService/Generate"]
    assert server.context.trace_id == client.get_span_context().trace_id
    assert server.parent.span_id == client.get_span_context().span_id
    assert server.kind.name == "SERVER"


def test_untraced_calls(exported):
    # Probes never; polls only inside a caller's trace.
    assert tracing.traced_rpc("/grpc.health.v1.Health/Check", ()) is None
    assert tracing.traced_rpc("/rlfleet.v1.CollectorService/GetStatus", ()) is None
    with tracing.span("caller"):
        metadata = trace_metadata()
    assert tracing.traced_rpc("/rlfleet.v1.CollectorService/GetStatus", metadata) is not None
    # A call without a caller's context is a trace of its own.
    assert tracing.traced_rpc("/rlfleet.v1.CollectorService/SubmitPrompts", ()) is not None


def test_shared_call_lives_in_the_first_trace_linked_to_the_others(exported):
    with tracing.span("reference") as first:
        pass
    with tracing.span("reference") as second:
        pass
    with tracing.shared_call("ScoreLogProbs call", [first, second]):
        inner = dict(trace_metadata())["traceparent"]
    tracing.shutdown()
    call = by_name(exported)["ScoreLogProbs call"]
    assert call.context.trace_id == first.get_span_context().trace_id
    assert call.parent.span_id == first.get_span_context().span_id
    assert [link.context.span_id for link in call.links] == [second.get_span_context().span_id]
    assert inner.split("-")[2] == f"{call.context.span_id:016x}"  # the service's span goes under the call


def test_record_continues_a_traceparent(exported):
    with tracing.span("group") as group:
        parent = tracing.traceparent()
    tracing.record("lease", parent, tracing.now_ns(), {"rlfleet.lease_id": "l"})
    tracing.shutdown()
    lease = by_name(exported)["lease"]
    assert lease.context.trace_id == group.get_span_context().trace_id
    assert lease.parent.span_id == group.get_span_context().span_id


def test_the_trajectory_service_puts_lease_and_ack_into_each_groups_trace(exported):
    contexts = []
    for prompt in ("a", "b"):
        with tracing.span("group", {"rlfleet.prompt_id": prompt}):
            contexts.append(tracing.traceparent())
    traces = GroupTraces()
    appended = make_trajectories(groups(7, 2, 2))  # groups 7 and 8, two rows each
    with pytest.raises(InvalidArgument, match="trace_contexts: 1 for the 2 groups"):
        traces.appended(appended, contexts[:1])
    traces.appended(appended, contexts)
    traces.leased("lease-1", make_trajectories(groups(8, 1, 2)), tracing.now_ns(), "trainer#1")  # group 8 only
    traces.settled("lease-1", "ack", tracing.now_ns(), applied=True)
    traces.settled("lease-1", "ack", tracing.now_ns(), applied=True)  # settled once: no second span
    tracing.shutdown()
    spans = exported.get_finished_spans()
    group_b, = [s for s in spans if s.name == "group" and s.attributes["rlfleet.prompt_id"] == "b"]
    for name in ("lease", "ack"):
        span, = [s for s in spans if s.name == name]
        assert span.context.trace_id == group_b.context.trace_id and span.parent.span_id == group_b.context.span_id
        assert span.attributes["rlfleet.lease_id"] == "lease-1"


def test_trace_contexts_are_checked_but_not_kept_while_tracing_is_off():
    traces = GroupTraces()
    with pytest.raises(InvalidArgument):
        traces.appended(make_trajectories(groups(7, 2, 2)), ["00-" + "1" * 32 + "-" + "2" * 16 + "-01"])
    traces.appended(make_trajectories(groups(7, 1, 2)), ["00-" + "1" * 32 + "-" + "2" * 16 + "-01"])
    traces.leased("lease-1", make_trajectories(groups(7, 1, 2)), 0, "trainer#1")
    traces.settled("lease-1", "ack", 0, applied=True)  # nothing to emit, nothing raised
