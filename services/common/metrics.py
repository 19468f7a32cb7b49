"""Prometheus metrics every service has (served on ``metrics_port``), and the endpoint that serves them. A
service's own metrics live in its package (``collector/metrics.py``, ``environment/metrics.py``, the
collector's ``status_metrics.py``, the trajectory service's ``buffer_metrics.py``), so each process exports
its own only."""

from __future__ import annotations

import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app

RPC_SECONDS = Histogram("rlfleet_rpc_seconds", "RPC handling time", ["method"])
RPC_ERRORS = Counter("rlfleet_rpc_errors_total", "RPCs that ended with an error status", ["method", "code"])
READY = Gauge("rlfleet_ready", "1 when the service reports SERVING")

class StatusCollector:
    """A Prometheus collector of families read from a service's status at scrape time (``families``), from
    the one place that computes it; ``status`` None (not wired yet): no family."""

    def __init__(self) -> None:
        self.status = None

    def describe(self):
        return []  # families are known at scrape time only

    def collect(self):
        if self.status is not None:
            yield from self.families(self.status())

    def families(self, status):
        raise NotImplementedError


CLASSIC_TEXT = "text/plain; version=0.0.4"
"""The exposition format served whatever a scraper asks for: Prometheus's classic text, which every
Prometheus reads and which keeps names as declared. Negotiated OpenMetrics would not: prometheus_client
0.26 escapes a ``:`` to ``_`` unless the scraper asks for ``escaping=allow-utf-8`` (Prometheus 3 does,
Prometheus 2 not), so vLLM's ``vllm:generation_tokens_total`` would reach a Prometheus 2 as
``vllm_generation_tokens_total`` and the dashboard's vLLM panels would be empty there."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args):  # a scrape every few seconds is not news
        pass


def metrics_app(registry=None):
    """The /metrics WSGI app: ``registry`` (prometheus_client's default) in ``CLASSIC_TEXT``."""
    app = make_wsgi_app(registry) if registry is not None else make_wsgi_app()

    def classic(environ, start_response):
        return app({**environ, "HTTP_ACCEPT": CLASSIC_TEXT}, start_response)
    return classic


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Start the /metrics HTTP endpoint on ``host`` in a daemon thread (no-op for port 0)."""
    if port:
        server = make_server(host, port, metrics_app(), _Server, handler_class=_Quiet)
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
