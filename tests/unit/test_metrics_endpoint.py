"""The services' /metrics endpoint (``rlfleet.services.common.metrics``): the classic text format
whatever the scraper asks for, so that names with a colon (vLLM's) reach every Prometheus as declared."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Gauge

from rlfleet.services.common.metrics import CLASSIC_TEXT, metrics_app, serve_metrics
from rlfleet.services.launch import free_port

# What Prometheus 2.42 (Debian's) sends: OpenMetrics first, with no escaping scheme.
PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                       "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_a_name_with_a_colon_is_served_as_declared_to_a_prometheus_2():
    registry = CollectorRegistry()
    Gauge("vllm:kv_cache_usage_perc", "a vLLM-style name", registry=registry).set(0.25)
    answered = {}
    body = b"".join(metrics_app(registry)(
        {"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "QUERY_STRING": "", "HTTP_ACCEPT": PROMETHEUS_2_ACCEPT},
        lambda status, headers: answered.update(status=status, headers=dict(headers))))
    assert answered["status"].startswith("200")
    assert answered["headers"]["Content-Type"].startswith(CLASSIC_TEXT)
    assert "vllm:kv_cache_usage_perc 0.25" in body.decode()
    assert "vllm_kv_cache_usage_perc" not in body.decode()


def test_serve_metrics_answers_over_http_with_the_default_registry():
    port = free_port()
    serve_metrics(port)
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_2_ACCEPT})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith(CLASSIC_TEXT)
        text = response.read().decode()
    assert "# TYPE rlfleet_ready gauge" in text and "process_cpu_seconds_total" in text
