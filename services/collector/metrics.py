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
EPISODE_PROMPT_TOKENS = Counter("rlfleet_episode_prompt_tokens_total",
                                "Tokens an episode's turns were sampled from (collector), by turn: first (the "
                                "opening prompt) or later (the history: prompt, earlier turns, observations)",
                                ["turn"])
EPISODE_CACHED_TOKENS = Counter("rlfleet_episode_cached_prompt_tokens_total",
                                "Of rlfleet_episode_prompt_tokens_total, those whose KV the replica took from its "
                                "prefix cache (collector), by turn; cached / prompt tokens of the later turns is "
                                "the history's prefix-cache hit rate", ["turn"])
WEIGHT_PUSH_SENT_BYTES = Counter("rlfleet_weight_push_sent_bytes_total",
                                 "Bytes of weight pushes and re-syncs the collector sent to generation replicas "
                                 "(its egress), by transport: grpc (a copy per replica), relay (one copy, to the "
                                 "first replica of the relay); shm sends none", ["transport"])
