"""One sample of a service's Prometheus endpoint, as a test reads it."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape_metric(port: int | str, name: str, **labels: str) -> float:
    """The sample ``name{labels}`` at ``http://127.0.0.1:PORT/metrics`` (0 when there is none yet)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0
