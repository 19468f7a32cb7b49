"""A real Prometheus (Debian's ``prometheus``, installed by scripts/bootstrap) scraping a metrics
endpoint of the services' kind through the suite's file discovery (``rlfleet.services.prometheus``),
without the suite: the discovery file, the job and service labels, a name with a colon as declared,
and a bad query's error. The whole suite under a Prometheus, with the dashboard's queries:
tests/integration/test_demo.py."""

from __future__ import annotations

import threading
import time
from wsgiref.simple_server import make_server

import pytest
from prometheus_client import CollectorRegistry, Gauge

from rlfleet.services.common.metrics import metrics_app
from rlfleet.services.launch import free_port
from rlfleet.services.prometheus import Prometheus, PrometheusError, write_targets


@pytest.fixture
def endpoint():
    """A /metrics endpoint as the services serve it, on a free port, with a vLLM-style name."""
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "a name with a colon", ["engine"], registry=registry).labels("0").set(3)
    server = make_server("127.0.0.1", free_port(), metrics_app(registry))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port
    server.shutdown()
    server.server_close()


def test_prometheus_scrapes_the_targets_the_suite_lists_with_their_labels(endpoint, tmp_path):
    write_targets(tmp_path, {"generation-0": ("generation", endpoint)})
    prometheus = Prometheus(tmp_path, free_port(), scrape_interval=0.5).start()
    try:
        deadline = time.monotonic() + 60
        while not (result := prometheus.query('vllm:num_requests_running{job="generation"}')):
            assert time.monotonic() < deadline, prometheus.targets()
            time.sleep(0.5)
        ((sample,),) = [result]
        assert sample["metric"] == {"__name__": "vllm:num_requests_running", "job": "generation",
                                    "service": "generation-0", "engine": "0", "instance": f"127.0.0.1:{endpoint}"}
        assert sample["value"][1] == "3"
        (target,) = prometheus.targets()
        assert target["health"] == "up" and target["labels"]["job"] == "generation"
        with pytest.raises(PrometheusError, match="parse error"):
            prometheus.query("sum(")
    finally:
        prometheus.stop()
    assert prometheus.process is None
