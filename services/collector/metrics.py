"""The collector's own Prometheus metrics: the generation replicas it balances over and the time trainers
wait for batches (the status-derived ones: ``status_metrics.py``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

REPLICA_OUTSTANDING = Gauge("rlfleet_replica_outstanding_samples",
                            "Samples a generation replica has outstanding (collector; one series per member)",
                            ["replica"])
REPLICA_HEALTHY = Gauge("rlfleet_replicas_in_rotation", "Generation replicas in rotation (collector)")
REPLICA_MEMBERS = Gauge("rlfleet_replicas", "Generation replicas discovery lists (collector)")
TRAINER_WAIT_SECONDS = Counter("rlfleet_trainer_wait_seconds_total",
                               "Seconds trainers' batch requests waited for a batch (collector): trainers idle "
                               "for want of rollouts; its rate over time is the fraction of time they wait")
