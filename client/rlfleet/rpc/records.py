"""Plain, immutable views of the services' replies (no protobuf types leak to callers).

A record whose fields are its message's, by name, is defined once, here: the services build it and send
it with ``to_message``, the SDK reads it back with ``from_message``. Reading by name, never by position, a
field reordered or added in the proto cannot land in the wrong attribute.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rlfleet.v1 import collector_pb2, trajectory_pb2

R = TypeVar("R")


def from_message(cls: type[R], message: Any, **given: Any) -> R:
    """``cls`` with each field read from ``message``'s field of the same name (a repeated one as a tuple),
    except those ``given``."""
    values = {}
    for item in dataclasses.fields(cls):
        if item.name in given:
            values[item.name] = given[item.name]
            continue
        value = getattr(message, item.name)
        values[item.name] = tuple(value) if not isinstance(value, (str, bytes, int, float, bool)) else value
    return cls(**values)


def to_message(record: Any, message_cls: type, **extra: Any):
    """``record``'s fields as the message ``message_cls`` of the same field names (plus ``extra``)."""
    return message_cls(**{item.name: getattr(record, item.name) for item in dataclasses.fields(record)}, **extra)


@dataclass(frozen=True)
class ReplicaPushResult:
    """Outcome of a weight push on one generation replica."""

    address: str
    applied: bool
    """True if the replica now serves the new version."""
    error: str
    """Why it was not applied (empty when applied)."""
    transport: str = ""
    """How the bytes reached it: "shm", "grpc", "relay" (from the replica before it: another host's
    replicas, one copy from the collector through all of them) or "nccl"."""
    stage_seconds: float = 0.0
    """From the start of the push until the replica held and verified every byte."""
    apply_seconds: float = 0.0
    """The replica's swap of the staged weights."""
    sent_bytes: int = 0
    """Bytes the collector itself sent it (0 over shm; over a relay, only the first replica's)."""


@dataclass(frozen=True)
class PushResult:
    """Outcome of ``push_weights`` or ``push_adapter``."""

    version: int
    """The committed policy version."""
    replicas: tuple[ReplicaPushResult, ...]
    bytes: int
    """Bytes the collector received."""
    seconds: float
    """Client-side wall time of the push (manifest checksum, streaming, fan-out, commit)."""
    server_seconds: float
    """The collector's wall time of the push."""
    attempts: int
    """1 unless the push was retried after an early UNAVAILABLE."""
    transport: str = ""
    """How the bytes left the trainer: "shm" (a segment the collector mapped) or "grpc" (chunks)."""
    base_version: int | None = None
    """A delta push: the version it patched (only the tensors that changed since then were sent); None
    for a full push."""
    tensors: int = 0
    """Tensors sent (a delta: those that changed)."""
    adapter_rank: int = 0
    """A LoRA adapter push (``push_adapter``): the adapter's rank; 0 for a weight push."""
    sent_bytes: int = 0
    """Bytes the collector sent to the replicas (its egress): a copy per replica reached over grpc, one
    for all the replicas of a relay, none over shm."""

    @property
    def replica_transport(self) -> str:
        """How the bytes reached the replicas that applied it ("shm", "grpc", or "grpc+shm"): a
        replica on the collector's host maps the collector's segment even for a grpc push."""
        return "+".join(sorted({r.transport for r in self.replicas if r.applied and r.transport}))

    @property
    def megabytes_per_second(self) -> float:
        """Throughput in MB/s (10^6 bytes) over ``seconds``."""
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else float("inf")

    @property
    def all_applied(self) -> bool:
        """True if every replica applied the push."""
        return all(r.applied for r in self.replicas)

    @classmethod
    def from_proto(cls, reply: collector_pb2.PushWeightsResponse, seconds: float, attempts: int,
                   transport: str = "", base_version: int | None = None, tensors: int = 0) -> "PushResult":
        return cls(version=reply.version, bytes=reply.received_bytes, seconds=seconds,
                   server_seconds=reply.seconds, attempts=attempts, transport=transport,
                   base_version=base_version, tensors=tensors, sent_bytes=reply.sent_bytes,
                   replicas=tuple(ReplicaPushResult(r.address, r.applied, r.error, r.transport, r.stage_seconds,
                                                    r.apply_seconds, r.sent_bytes) for r in reply.replicas))


@dataclass(frozen=True)
class StageStatus:
    """One pipeline stage of the collector."""

    name: str
    queued: int
    in_flight: int
    items_per_second: float


@dataclass(frozen=True)
class ReplicaStatus:
    """One generation replica as the collector sees it."""

    address: str
    healthy: bool
    policy_version: int
    in_flight: int
    """Samples outstanding on it (a group of n counts n)."""
    draining: bool = False
    """A rolling update is draining it: no new work; what it runs finishes."""


@dataclass(frozen=True)
class MismatchStatus:
    """What trainers reported of the train/inference mismatch, and the collector's breaker on it."""

    breaker_open: bool = False
    """No new group is admitted and trainer calls answer ``FailedPreconditionError`` until an operator
    closes it (``close_mismatch_breaker``)."""
    reason: str = ""
    """Why it opened: the measured lag-0 k3 KL, the threshold, the version where it started."""
    threshold: float = 0.0
    """The lag-0 k3 KL threshold (0: no breaker)."""
    trip_batches: int = 0
    consecutive_over: int = 0
    reports: int = 0
    latest: dict[int, dict[str, float]] = field(default_factory=dict)
    """The latest report: lag -> kl_k3, kl_k1, ess_token, tokens."""
    kl_target: float = 0.0
    """The k3 KL admission keeps every lag >= 1 under (0: none)."""
    admission_staleness: int = 0
    """The staleness bound admission applies now (``max_staleness``, or less while a lag is over the target)."""
    measured: dict[int, dict[str, float]] = field(default_factory=dict)
    """Per lag, its last measurement within the horizon (what admission acts on)."""

    @classmethod
    def from_proto(cls, status: collector_pb2.MismatchStatus) -> "MismatchStatus":
        def by_lag(entries):
            return {m.lag: {"kl_k3": m.kl_k3, "kl_k1": m.kl_k1, "ess_token": m.ess_token, "tokens": m.tokens}
                    for m in entries}
        return cls(status.breaker_open, status.reason, status.threshold, status.trip_batches,
                   status.consecutive_over, status.reports, by_lag(status.latest), status.kl_target,
                   status.admission_staleness, by_lag(status.measured))


@dataclass(frozen=True)
class DynamicSamplingStatus:
    """Groups the collector filtered for constant scores, and its curriculum (``GetStatus``)."""

    enabled: bool = False
    min_score_range: float = 0.0
    filtered_groups: int = 0
    """Since the state directory was created, each once across restarts."""
    filtered_samples: int = 0
    filter_rate: float = 0.0
    """Fraction of the recent groups filtered."""
    oversampling: float = 1.0
    """Groups started per group expected to reach the trainer."""
    curriculum_skipped: int = 0
    curriculum: bool = False

    @classmethod
    def from_proto(cls, status: collector_pb2.DynamicSamplingStatus) -> "DynamicSamplingStatus":
        return from_message(cls, status, oversampling=status.oversampling or 1.0)


@dataclass(frozen=True)
class RollingUpdateStatus:
    """The rolling update in progress, else the last one (``push_weights(strategy="rolling")``)."""

    in_progress: bool = False
    from_version: int = 0
    to_version: int = 0
    replicas_switched: int = 0
    replicas_total: int = 0
    window_seconds: float = 0.0
    """Seconds two versions served (so far, or in all once over)."""
    max_window_seconds: float = 0.0
    """The bound on that window (the collector's ``rolling_max_seconds``)."""
    committed: bool = False
    pinned_groups: int = 0
    """Since the collector started: groups pinned to a version because they started during a rolling update."""
    pin_violations: int = 0
    """Samples that ran on another version than their pin (must stay 0; their groups generated again)."""
    pins_retired: int = 0
    """Pinned groups generated again because no replica served their version any more."""

    @classmethod
    def from_proto(cls, status: collector_pb2.RollingUpdateStatus) -> "RollingUpdateStatus":
        return from_message(cls, status)


@dataclass(frozen=True)
class PassRate:
    """How one prompt's groups scored (``GetPassRates``): samples, and how many scored at least the
    collector's ``pass_score``."""

    prompt_key: str
    groups: int
    samples: int
    passed: int
    filtered_groups: int
    recent_samples: int
    """The latest group's samples and passes (what the curriculum reads)."""
    recent_passed: int
    updated_at: float

    @property
    def rate(self) -> float:
        return self.passed / self.samples if self.samples else 0.0

    @classmethod
    def from_proto(cls, rate: collector_pb2.PassRate) -> "PassRate":
        return cls(rate.prompt_key, rate.groups, rate.samples, rate.passed, rate.filtered_groups,
                   rate.recent_samples, rate.recent_passed, rate.updated_at)


@dataclass(frozen=True)
class Run:
    """A training run as a trainer holds it: the run's id and the policy version of its weights.

    ``connect(..., run=Run(run_id, version))`` resumes it; ``client.run`` is the run joined, its
    ``version`` following this client's pushes: keep ``str(client.run)`` with each checkpoint."""

    run_id: str
    version: int = 0
    """The policy version of the weights the trainer holds (the collector's committed version when joined)."""
    created_at: float = 0.0
    """When the collector made the run (Unix seconds; 0 when not read from it)."""
    resumed: bool = False
    """The collector process found this run in its durable state (False: it created it)."""
    name: str = ""
    """The run's name where runs share a fleet (what its credentials name); "" in a fleet of one run."""

    def __str__(self) -> str:
        return f"{self.run_id}@{self.version}"

    def describe(self) -> str:
        """In words, as the collector holds it: "run X: new", or "run X: resumed at version N"."""
        named = f" ({self.name})" if self.name else ""
        return f"run {self.run_id}{named}: " + (f"resumed at version {self.version}" if self.resumed else "new")

    @classmethod
    def parse(cls, text: str) -> "Run":
        """``RUN_ID@VERSION`` (what ``str(run)`` gives) as a ``Run``."""
        run_id, at, version = text.rpartition("@")
        if not at or not run_id or not version.isdigit():
            raise ValueError(f"a run is RUN_ID@VERSION (str(client.run)), got {text!r}")
        return cls(run_id, int(version))

    @classmethod
    def from_proto(cls, info: collector_pb2.RunInfo) -> "Run":
        return cls(info.run_id, info.policy_version, info.created_at, info.resumed, info.name)


@dataclass(frozen=True)
class Status:
    """The collector's pipeline state (``GetStatus``)."""

    policy_version: int
    mode: str
    """"sync" or "async"."""
    max_staleness: int
    stages: tuple[StageStatus, ...]
    replicas: tuple[ReplicaStatus, ...]
    staleness_histogram: tuple[int, ...]
    """``[i]`` = trajectories that were ``i`` versions stale when appended."""
    trajectories: int
    discarded_samples: int
    group_size: int = 0
    """Samples generated per prompt (unless a prompt overrides ``n``)."""
    groups_per_step: int = 0
    """Groups per trainer step (the unit of staleness)."""
    pending_prompts: int = 0
    """Prompts admitted that have not yet ended as a group or a dead letter."""
    failed_prompts: int = 0
    """Dead letters so far (``client.failures()`` lists them)."""
    serving: bool = True
    """False while the collector starts (waiting for its upstream services or replicas), and later
    while an upstream service is down or no generation replica is in rotation."""
    not_serving_reason: str = ""
    """What it waits for, or which upstream is down, while not serving."""
    failed: bool = False
    """It stopped working for good (a background task died; ``not_serving_reason`` says which and
    why): every trainer call answers ``FailedPreconditionError`` until it is restarted."""
    spool_error: str = ""
    """Why the weight spool does not hold the committed version (disk full, I/O error): replicas
    that restart cannot be re-synced until a later push spools; "" when it is current."""
    episodes: int = 0
    """Multi-turn episodes appended since the collector started (also counted in ``trajectories``)."""
    episode_turns: int = 0
    """Their assistant turns (``episode_turns / episodes``: mean turns per episode)."""
    mismatch: MismatchStatus = field(default_factory=MismatchStatus)
    """The train/inference mismatch trainers reported, and the breaker on it."""
    dynamic_sampling: DynamicSamplingStatus = field(default_factory=DynamicSamplingStatus)
    """Groups filtered for constant scores, and the curriculum."""
    discarded_tokens: int = 0
    """Sampled tokens thrown away: of ``discarded_samples``, and of multi-turn turns aborted by a push."""
    rolling_update: RollingUpdateStatus | None = None
    """The rolling update in progress, else the last one; None before the first."""
    run: Run | None = None
    """The run the collector holds (None from a collector older than run ids)."""

    @classmethod
    def from_proto(cls, reply: collector_pb2.GetStatusResponse) -> "Status":
        return cls(
            policy_version=reply.policy_version, mode=reply.mode, max_staleness=reply.max_staleness,
            stages=tuple(StageStatus(s.name, s.queued, s.in_flight, s.items_per_second) for s in reply.stages),
            replicas=tuple(ReplicaStatus(r.address, r.healthy, r.policy_version, r.in_flight, r.draining)
                           for r in reply.replicas),
            staleness_histogram=tuple(reply.staleness_histogram), trajectories=reply.trajectories,
            discarded_samples=reply.discarded_samples, group_size=reply.group_size,
            groups_per_step=reply.groups_per_step, pending_prompts=reply.pending_prompts,
            failed_prompts=reply.failed_prompts, serving=reply.serving,
            not_serving_reason=reply.not_serving_reason, failed=reply.failed,
            spool_error=reply.spool_error, episodes=reply.episodes, episode_turns=reply.episode_turns,
            mismatch=MismatchStatus.from_proto(reply.mismatch),
            dynamic_sampling=DynamicSamplingStatus.from_proto(reply.dynamic_sampling),
            discarded_tokens=reply.discarded_tokens,
            rolling_update=RollingUpdateStatus.from_proto(reply.rolling_update)
            if reply.HasField("rolling_update") else None,
            run=Run.from_proto(reply.run) if reply.HasField("run") else None,
        )


@dataclass(frozen=True)
class BufferStats:
    """Trajectory buffer occupancy and counters (``GetStats``)."""

    ready: int
    leased: int
    acked: int
    capacity: int
    appended: int
    redelivered_batches: int
    dropped_stale: int
    """Trajectories deleted by DropStale (never by a reader)."""
    buffered_bytes: int = 0
    capacity_bytes: int = 0
    filtered_groups: int = 0
    """Groups stored as filtered (dynamic sampling), ever: never delivered."""
    filtered_trajectories: int = 0

    @classmethod
    def from_proto(cls, reply: trajectory_pb2.GetStatsResponse) -> "BufferStats":
        return from_message(cls, reply)


@dataclass(frozen=True)
class DroppedStale:
    """What ``drop_stale`` deleted (``DropStaleResponse``; the trajectory store's record too)."""

    dropped: int
    """Trajectories deleted."""
    group_ids: tuple[int, ...]
    """The groups they belonged to, each once, oldest policy version first."""
    prompt_ids: tuple[str, ...]
    """Their distinct ``prompt_id`` values; empty when the trajectories carry none."""

    @classmethod
    def from_proto(cls, reply: trajectory_pb2.DropStaleResponse) -> "DroppedStale":
        return from_message(cls, reply)


@dataclass(frozen=True)
class PromptFailure:
    """A prompt that failed for good: a dead letter (``ListFailures``; the collector's ledger records it so)."""

    seq: int
    """Increasing number (pass the last one seen as ``after_seq``)."""
    prompt_id: str
    stage: str
    """"generation", "reference", "reward" or "trajectory"."""
    code: str
    """Status code name of the last failure, e.g. "INVALID_ARGUMENT"."""
    error: str
    attempts: int
    """Transient failures before it (0: refused at first sight)."""
    failed_at: float

    @classmethod
    def from_proto(cls, failure: collector_pb2.PromptFailure) -> "PromptFailure":
        return from_message(cls, failure)


__all__ = [
    "BufferStats", "DroppedStale", "DynamicSamplingStatus", "MismatchStatus", "PassRate", "PromptFailure",
    "PushResult", "ReplicaPushResult", "ReplicaStatus", "RollingUpdateStatus", "Run", "StageStatus", "Status",
    "from_message", "to_message",
]
