"""Tracing through real processes: every service exports to an OTLP/gRPC receiver in this process.

A short run (prompts submitted, one batch read and acked, one weight push) must leave one trace per
group holding the collector's, generation's, reference's, reward's and trajectory's spans (append,
lease, ack), parent to child, and one trace per push holding stage and commit per replica and the
replica's UpdateWeights. With RLFLEET_TRACE_OUT set, the spans are written there as JSON
(``scripts/render-trace`` draws them).
"""

from __future__ import annotations

import json
import os
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from rlfleet.client import connect
from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]

TIMEOUT = 300.0
"""Bound on the pipeline's work (two groups through every stage on 2 loaded cores) plus the services'
export delay (spans are batched for a second)."""
SERVICES = ("collector", "generation", "reference", "reward", "trajectory")
GENERATE = "rlfleet.v1.GenerationService/Generate"
UPDATE_WEIGHTS = "rlfleet.v1.GenerationService/UpdateWeights"
SERVED = {"reference": ("ScoreLogProbs call", "rlfleet.v1.ReferenceService/ScoreLogProbs"),
          "reward": ("ComputeRewards call", "rlfleet.v1.RewardService/ComputeRewards"),
          "append": ("Append call", "rlfleet.v1.TrajectoryService/Append")}
"""A group's stage span -> the collector's call span (shared by the groups it carries) -> the service's span."""


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint keeping every span it is sent, flattened."""

    def __init__(self):
        self.spans: list[dict] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                spans += [_flat(span, resource.get("service.name", "")) for span in scope_spans.spans]
        with self._lock:
            self.spans += spans
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.spans)


def _flat(span, service: str) -> dict:
    return {"service": service, "name": span.name, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
            "parent_span_id": span.parent_span_id.hex(), "start_ns": span.start_time_unix_nano,
            "end_ns": span.end_time_unix_nano, "kind": span.kind,
            "attributes": {a.key: _value(a.value) for a in span.attributes},
            "links": [{"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex()} for link in span.links]}


def _value(value):
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    keeper = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(keeper, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield keeper, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def suite(receiver, tiny_model_dir, tmp_path_factory):
    _, endpoint = receiver
    # The services inherit this process's environment: the same setting a deployment sets per service.
    variables = {f"RLFLEET_{service.upper()}_OTLP_ENDPOINT": endpoint for service in SERVICES}
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        procs = start_suite(SuiteOptions(model_dir=tiny_model_dir, collector_args=[
            "--group-size", "2", "--groups-per-step", "2", "--mode", "sync",
            "--sampling", '{"temperature": 1.0, "max_tokens": 8}']), tmp_path_factory.mktemp("tracing-suite"))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    yield procs
    stop_suite(procs)


@pytest.fixture(scope="module")
def spans(receiver, suite, tiny_model_dir):
    """A short run's spans, once every service exported those the assertions need."""
    from transformers import AutoModelForCausalLM

    keeper, _ = receiver
    with connect(suite["collector"].address, timeout=60) as trainer:
        trainer.submit_prompts([{"prompt_id": f"digits-{i}", "prompt": f"write the digits of {i}",
                                 "reward_fn": "char_fraction"} for i in range(2)])
        with trainer.batches(2, whole_groups=True, auto_ack=False) as batches:
            batch = next(iter(batches))
            batch.ack()
            # Held open until the ack's spans are out: closing the stream first would release the lease.
            wait_for(lambda: named(keeper.snapshot(), "ack"), TIMEOUT, "the ack's span")
        trainer.push_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    wait_for(lambda: named(keeper.snapshot(), UPDATE_WEIGHTS) and named(keeper.snapshot(), "push weights")
             and len(named(keeper.snapshot(), "commit")) >= 1, TIMEOUT, "the push's spans")
    acked = named(keeper.snapshot(), "ack")[0]["trace_id"]
    # The group's own spans and the calls that carried it (exported by five processes, each in its time).
    wait_for(lambda: _complete(keeper.snapshot(), acked), TIMEOUT, "the acked group's whole trace")
    found = keeper.snapshot()
    if out := os.environ.get("RLFLEET_TRACE_OUT"):
        Path(out).write_text(json.dumps(found, indent=1))
    return found, acked


def named(spans: list[dict], name: str) -> list[dict]:
    return [span for span in spans if span["name"] == name]


def trace(spans: list[dict], trace_id: str) -> list[dict]:
    return [span for span in spans if span["trace_id"] == trace_id]


def _complete(spans: list[dict], trace_id: str) -> bool:
    names = {span["name"] for span in trace(spans, trace_id)}
    if not {"group", "generate", GENERATE, "reference", "reward", "append", "lease", "ack"} <= names:
        return False
    return all(_served(spans, trace_id, stage) for stage in SERVED)


def _served(spans: list[dict], trace_id: str, stage: str) -> dict | None:
    """The service's SERVER span that answered ``stage`` of the group of ``trace_id``: under the call
    span under the group's stage span, or, for a call that carried several groups and lives in another
    group's trace, under the call span the stage span links to."""
    call_name, server_name = SERVED[stage]
    stage_span, = named(trace(spans, trace_id), stage)
    by_id = {span["span_id"]: span for span in spans}
    calls = [span for span in named(spans, call_name) if span["parent_span_id"] == stage_span["span_id"]]
    calls += [by_id[link["span_id"]] for link in stage_span["links"] if link["span_id"] in by_id]
    for call in calls:
        for server in named(spans, server_name):
            if server["parent_span_id"] == call["span_id"] and server["trace_id"] == call["trace_id"]:
                return server
    return None


def test_a_groups_trace_runs_from_admission_through_every_service_to_the_ack(spans):
    spans, trace_id = spans
    group = trace(spans, trace_id)
    by_id = {span["span_id"]: span for span in group}
    root, = [span for span in group if not span["parent_span_id"]]
    assert (root["service"], root["name"]) == ("rlfleet-collector", "group")
    assert root["attributes"]["rlfleet.prompt_id"].startswith("digits-")
    assert "rlfleet.policy_version" in root["attributes"] and "rlfleet.group_id" in root["attributes"]
    # Every span hangs off another of the same trace.
    assert all(span["parent_span_id"] in by_id for span in group if span is not root)

    def parent(span: dict) -> dict:
        return by_id[span["parent_span_id"]]

    for name in ("generate", "reference", "reward", "append", "lease", "ack"):
        span, = named(group, name)
        assert parent(span) is root, name
    generate, = named(group, "generate")
    server, = named(group, GENERATE)
    assert server["service"] == "rlfleet-generation" and parent(server) is generate
    for stage, service in (("reference", "rlfleet-reference"), ("reward", "rlfleet-reward"),
                           ("append", "rlfleet-trajectory")):
        assert _served(spans, trace_id, stage)["service"] == service
    for name in ("lease", "ack"):
        span, = named(group, name)
        assert span["service"] == "rlfleet-trajectory"
    ack, = named(group, "ack")
    lease, = named(group, "lease")
    assert ack["attributes"]["rlfleet.lease_id"] == lease["attributes"]["rlfleet.lease_id"]
    assert ack["attributes"]["rlfleet.applied"] is True
    assert {span["service"] for span in group} >= {"rlfleet-collector", "rlfleet-generation", "rlfleet-trajectory"}


def test_a_pushs_trace_holds_stage_and_commit_per_replica_and_the_replicas_update(spans):
    spans, _ = spans
    push, = named(spans, "push weights")
    pushed = trace(spans, push["trace_id"])
    by_id = {span["span_id"]: span for span in pushed}
    caller = by_id[push["parent_span_id"]]  # the trainer's call, as the collector served it
    assert caller["name"] == "rlfleet.v1.CollectorService/PushWeights"
    stage, = named(pushed, "stage")
    commit, = named(pushed, "commit")
    assert stage["parent_span_id"] == commit["parent_span_id"] == push["span_id"]
    assert stage["attributes"]["rlfleet.replica"] == commit["attributes"]["rlfleet.replica"]
    update, = named(pushed, UPDATE_WEIGHTS)
    assert update["service"] == "rlfleet-generation" and update["parent_span_id"] == stage["span_id"]
    assert push["attributes"]["rlfleet.policy_version"] == 1
