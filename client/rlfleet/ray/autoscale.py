"""Generation capacity on demand: while trainers wait for rollouts, ask Ray's autoscaler for more.

The collector counts the seconds trainers' batch requests waited (``rlfleet_trainer_wait_seconds_total``,
on its metrics endpoint). ``WaitPolicy`` turns the counter's growth over an interval into a replica
count; ``GenerationAutoscaler`` reads the counter (any callable: ``prometheus_counter`` reads the metrics
endpoint), asks Ray's autoscaler for the resources of that many replicas
(``ray.autoscaler.sdk.request_resources``: on KubeRay or a cluster launcher, nodes are added until they
fit) and scales the fleet to it. Without an autoscaler the request is a no-op and replicas that do not
fit stay pending.
"""

from __future__ import annotations

import math
import time
import urllib.request
from dataclasses import dataclass
from typing import Callable


@dataclass
class WaitPolicy:
    """Replicas from how much of the time trainers waited."""

    min_replicas: int = 1
    max_replicas: int = 8
    scale_up_wait_fraction: float = 0.2
    """Trainers waited more than this fraction of the interval: add replicas (proportionally, at least one)."""
    scale_down_wait_fraction: float = 0.01
    """Waited less than this: one replica fewer (generation outruns the trainers)."""

    def decide(self, waited_seconds: float, interval_seconds: float, replicas: int) -> int:
        """The replica count for the next interval, given the seconds trainers waited in the last one."""
        fraction = max(0.0, waited_seconds) / interval_seconds if interval_seconds > 0 else 0.0
        if fraction > self.scale_up_wait_fraction:
            # Waiting a fraction f of the time: generation delivers (1 - f) of what trainers take.
            wanted = math.ceil(replicas / max(1e-3, 1.0 - min(fraction, 0.999)))
            target = max(replicas + 1, wanted)
        elif fraction < self.scale_down_wait_fraction:
            target = replicas - 1
        else:
            target = replicas
        return max(self.min_replicas, min(self.max_replicas, target))


def prometheus_counter(url: str, name: str = "rlfleet_trainer_wait_seconds_total",
                       timeout: float = 5.0) -> Callable[[], float]:
    """A reader of counter ``name`` (summed over labels) at a Prometheus text endpoint ``url``."""
    def read() -> float:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))
    return read


class GenerationAutoscaler:
    """One ``step()`` per interval: read the wait counter, decide, request resources, scale."""

    def __init__(self, policy: WaitPolicy, waited_seconds_total: Callable[[], float],
                 replicas: Callable[[], int], scale: Callable[[int], object],
                 bundle: dict[str, float], request_resources: Callable[..., object] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self.waited_seconds_total = waited_seconds_total
        self.replicas = replicas
        self.scale = scale
        self.bundle = bundle
        """One replica's resources (``{"GPU": 1}``): what the autoscaler is asked for, once per replica."""
        if request_resources is None:
            from ray.autoscaler.sdk import request_resources
        self.request_resources = request_resources
        self.clock = clock
        self._last: tuple[float, float] | None = None

    def step(self) -> int:
        """The replica count decided (the current one on the first call, which only reads the counter)."""
        now, total = self.clock(), self.waited_seconds_total()
        current = self.replicas()
        if self._last is None:
            self._last = (now, total)
            return current
        (then, before), self._last = self._last, (now, total)
        target = self.policy.decide(total - before, now - then, current)
        if target != current:
            self.request_resources(bundles=[dict(self.bundle) for _ in range(target)])
            self.scale(target)
        return target

    @classmethod
    def for_fleet(cls, fleet, metrics_url: str, policy: WaitPolicy | None = None) -> "GenerationAutoscaler":
        """An autoscaler of ``fleet``'s generation replicas from the collector's metrics at ``metrics_url``."""
        spec = fleet.config.services["generation"]
        bundle = {"CPU": spec.num_cpus, **({"GPU": spec.num_gpus} if spec.num_gpus else {}), **spec.resources}
        return cls(policy or WaitPolicy(), prometheus_counter(metrics_url),
                   lambda: len(fleet.status_of("generation")), lambda n: fleet.scale("generation", n), bundle)
