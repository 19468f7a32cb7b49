"""Config of the collector."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlfleet.choices import AdvantageModeName, KLEstimatorName, SwapModeName, UpdateStrategyName
from rlfleet.services.common.config import ServiceConfig
from rlfleet.services.common.database import DatabaseUrl, SchemaName
from rlfleet.services.common.run_ids import MAX_SHARE_WEIGHT
from rlfleet.services.common.upstream import UpstreamConfig


class CollectorConfig(ServiceConfig, UpstreamConfig):
    """The collector: prompt source, rollout pipeline, policy versions, weight fan-out."""

    service_name = "collector"

    port: int = Field(50050, ge=0, le=65535)
    """gRPC port the trainer connects to (also serves TrajectoryService.StreamBatches, forwarded)."""
    generation_addresses: list[str] = Field(default_factory=lambda: ["127.0.0.1:50051"])
    """Generation replicas as host:port; with ``resolve_generation_addresses`` a host resolving to several
    IPs (a Kubernetes headless Service) counts once per IP, re-resolved every ``discovery_refresh_seconds``.
    Or one entry ``ray+gcs://GCS_HOST:PORT/FLEET``: the replicas fleet FLEET registered on that Ray
    cluster (``rlfleet.ray``, which sets it; needs the ``ray`` extra), asked every ``discovery_refresh_seconds``."""
    generation_addresses_file: str | None = None
    """A JSON list of ``host:port`` re-read every ``discovery_refresh_seconds`` (written by an autoscaler, a
    registry sidecar, an operator); set, it replaces ``generation_addresses``. A replica that appears is
    re-synced to the committed weights before it gets work; one that goes leaves the rotation, its calls in
    flight finishing or failing over. A missing or malformed file keeps the last list (WARNING)."""
    resolve_generation_addresses: bool = True
    """Resolve each host: one replica per IP, its certificate checked against the host name (a headless
    Service scales with its pods). False: dial the names as given (gRPC resolves them itself)."""
    discovery_refresh_seconds: float = Field(10.0, gt=0)
    """How often the replica list is asked again (the file re-read, the names re-resolved)."""
    reference_address: str = "127.0.0.1:50052"
    """Reference service."""
    reward_address: str = "127.0.0.1:50053"
    """Reward service."""
    trajectory_address: str = "127.0.0.1:50054"
    """Trajectory service."""
    environment_address: str | None = None
    """Environment service, for prompts run as multi-turn episodes; None = single-turn prompts only."""
    dataset_path: str | None = None
    """JSONL/JSON/Parquet file or saved `datasets` directory of prompts; None = only trainer-submitted prompts."""
    prompt_field: str = "prompt"
    """Dataset field holding the prompt (a string, or a list of chat messages)."""
    ground_truth_field: str = "answer"
    """Dataset field holding the ground truth for verifiable rewards."""
    shuffle: bool = True
    """Shuffle the dataset each epoch (seeded)."""
    seed: int = 0
    """Shuffle seed."""
    epochs: int = Field(0, ge=0)
    """Passes over the dataset; 0 cycles forever."""
    max_submitted_prompts: int = Field(10_000, gt=0)
    """Bound of the trainer-submitted prompt queue (RESOURCE_EXHAUSTED beyond it)."""
    max_prompt_bytes: int = Field(1 << 20, gt=0)
    """Largest submitted prompt: its text or chat contents, ground truth and reward args together
    (INVALID_ARGUMENT beyond it)."""
    prompt_attempts: int = Field(5, ge=1)
    """Transient failures (an upstream unavailable past its retries, an unexpected error) a prompt may
    have before it is dead-lettered; retried with backoff meanwhile. A stage refusing the prompt's
    input (INVALID_ARGUMENT / NOT_FOUND) dead-letters it at once. No prompt is drawn while an upstream
    service is down, so an outage costs a prompt at most the attempt it was in."""
    retry_backoff_seconds: float = Field(1.0, gt=0)
    """Base of the exponential backoff (with jitter) before a failed prompt is generated again."""
    max_dead_letters: int = Field(10_000, gt=0)
    """Dead letters kept for ListFailures (the newest; the total is always counted)."""

    group_size: int = Field(4, ge=1)
    """Samples per prompt (the GRPO group, sampling.n)."""
    sampling: dict[str, Any] = Field(default_factory=lambda: {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64})
    """Default SamplingParams fields (temperature, top_p, top_k, max_tokens, stop, seed...); prompts may override."""
    reward_fn: str = "numeric_match"
    """Default reward function name (see the reward service)."""
    environment: str = ""
    """Default environment of a prompt (a name the environment service registers): its samples are
    multi-turn episodes. Empty: one response per sample, unless a prompt (a dataset row's
    ``environment`` field, ``PromptSpec.environment``) names one."""
    max_turns: int = Field(8, ge=1)
    """Most assistant turns of an episode; one still going after them ends truncated."""
    max_episode_tokens: int = Field(1024, ge=2)
    """Token budget of an episode: prompt, sampled and observation tokens together. Each turn may
    sample at most what is left (and ``sampling.max_tokens``); one that reaches it ends truncated.
    Keep it within the replicas' ``max_model_len``."""
    kl_estimator: KLEstimatorName = "k1"
    """Per-token KL estimator for the penalty."""
    advantage_mode: AdvantageModeName = "grpo"
    """Group advantage computation."""
    update_kl_controller: bool = True
    """Feed each group's KL to the reward service's KL controller."""

    mode: Literal["sync", "async"] = "async"
    """sync: no sample from an older version reaches the trainer; async: bounded staleness."""
    max_staleness: int = Field(1, ge=0)
    """async: generation runs at most this many trainer steps ahead of the pushed weights (forced to 0 in sync)."""
    groups_per_step: int = Field(8, ge=1)
    """Groups the trainer consumes per step (its batch size / group_size): the unit of staleness."""
    mismatch_kl_threshold: float | None = Field(None, gt=0)
    """The mismatch breaker: a trainer's report (ReportMismatch) whose lag-0 k3 KL between its own and the
    behaviour log-probs is above this counts; ``mismatch_trip_batches`` in a row stop admission and refuse
    trainer calls until an operator closes it (``mismatch.py``). None: reports are shown, never acted on."""
    mismatch_trip_batches: int = Field(3, ge=1)
    """Reports over ``mismatch_kl_threshold`` in a row that open the mismatch breaker."""
    mismatch_kl_target: float | None = Field(0.005, gt=0)
    """async: admission by measured divergence. Groups start at most as many steps ahead as keeps the k3
    KL trainers report (ReportMismatch) at every lag >= 1 under this; ``max_staleness`` is then the
    ceiling, and finished groups are never discarded for it (``mismatch.py``). Until the run's first
    report it starts low, at staleness 1 (under ``max_staleness``), not at the ceiling: a trainer that
    reports none runs one step behind at most. The default comes from the off-policy experiment
    (docs/guides/off-policy.md, "Which mode when"). None (``null``): max_staleness alone."""
    mismatch_horizon: int = Field(8, ge=1)
    """Reports a lag's measured KL is kept after it was last measured (``mismatch_kl_target``)."""

    shared_replicas: bool = False
    """The generation replicas are shared with other runs (docs/concepts/many-runs.md): this collector's
    run is a named run on them (its run id), sampling on their base weights with its own LoRA adapter at its
    own versions, so the trainer pushes adapters only (a full push is refused with FAILED_PRECONDITION).
    A run started fresh starts at its own version 0, whatever the replicas served other runs. The
    replicas need ``max_runs`` (and ``max_lora_rank``)."""
    share_weight: float = Field(1.0, gt=0, le=MAX_SHARE_WEIGHT)
    """With ``shared_replicas``: the run's weight in each replica's fair share of its batch (the other runs'
    weights are theirs; a run with nothing to generate leaves its share to the others)."""
    players: dict[str, str] = Field(default_factory=dict)
    """With ``shared_replicas``: several policies in one episode (docs/concepts/many-runs.md). A player an
    environment names for a turn (``StepResult.next_player``: an opponent, a teacher) -> the run whose
    policy samples that turn (its ``run_name`` on the shared replicas). The turn is context in this run's
    batch (``response_mask`` false, never trained on; no version of this run's). A player missing here
    fails its prompt (a dead letter naming it); a run not on a replica yet is waited for (the group
    retried). Given to one run by the operator: another run's policy plays in this run's episodes."""

    swap_mode: Literal["", SwapModeName] = ""
    """What every push does to the requests in flight on the replicas, for the whole run: ``wait`` (they
    finish on the old weights first), ``abort`` (thrown away, their prompts generated again), ``keep``
    (continued on the new weights, re-prefilled), ``resume`` (continued as new requests on the new
    weights); docs/guides/off-policy.md compares them. "": each push's own mode (the SDK's default is keep)."""
    update_strategy: UpdateStrategyName = "pause_all"
    """How a push that names no strategy (``WeightManifest.strategy``; the SDK's ``strategy=``) reaches the
    replicas: ``pause_all`` (every replica swaps at once under the push's mode, no group admitted meanwhile)
    or ``rolling`` (``rolling_max_unavailable`` replicas at a time, each drained first, while the others
    serve; requests pinned to their replica's version; the push's mode and ``swap_mode`` unused).
    docs/guides/weight-sync.md, Rolling updates."""
    weight_relay: bool = True
    """Replicas on other hosts (those that cannot map the collector's shared memory) get a push relayed
    from one to the next as its bytes arrive: the collector sends them once, whatever their number, and a
    replica that fails is routed around. False: the collector sends each its own copy.
    docs/guides/weight-sync.md, Relayed pushes."""
    join_from_peers: bool = True
    """A replica that joins or restarts mid-run (re-synced to the committed version) takes the weights from
    a replica serving that version (``GenerationService.ShareWeights``: it sends the copy it keeps, and
    serves on) rather than from this collector's spool, which stays the fallback when no peer can.
    docs/guides/weight-sync.md, Joining from a peer."""
    rolling_max_unavailable: int = Field(1, ge=1)
    """Rolling updates: replicas switched at once (drained, applying, then serving the new version)."""
    rolling_drain_seconds: float = Field(30.0, ge=0)
    """Rolling updates: how long a replica's running requests (and, for the last replica on a version, the
    multi-turn groups pinned to it) may take to finish before the switch aborts them (generated again)."""
    rolling_max_seconds: float = Field(300.0, gt=0)
    """Rolling updates: the bound on the window in which two versions serve; past it the replicas left
    switch together, without draining."""
    rolling_settle_seconds: float = Field(0.0, ge=0)
    """Rolling updates: the wait after a batch switched before the next is drained (Kubernetes'
    ``minReadySeconds``): a replica that fails on the new version shows before more follow."""
    dynamic_sampling: bool = False
    """Filter groups whose scores do not vary (their range at most ``dynamic_sampling_min_score_range``)
    before they reach the trainer: stored as filtered in the trajectory service (never delivered),
    counted (GetStatus), their prompts ended; other groups take their place, started ahead by the
    measured filter rate so batches stay full (``filtering.py``)."""
    dynamic_sampling_min_score_range: float = Field(0.0, ge=0)
    """A group whose highest and lowest score differ by at most this is filtered (0: constant scores)."""
    max_oversampling: float = Field(4.0, ge=1)
    """Dynamic sampling starts at most this many groups per group it expects to deliver (a cap on the
    measured filter rate's effect: at 4, a filter rate above 75 % leaves batches slower to fill)."""
    pass_score: float = 0.5
    """A sample passes when its score (the reward function's plus the environment's) is at least this:
    what the per-prompt pass rates (GetPassRates) and the curriculum count. Default 0.5: a 0/1 reward's
    pass is its 1."""
    curriculum: bool = False
    """Skip a dataset row whose latest group passed all its samples or none (nothing left to learn
    there, or nothing yet), except ``curriculum_revisit_fraction`` of them so their rate is measured
    again; submitted prompts are never skipped."""
    curriculum_revisit_fraction: float = Field(0.1, gt=0, le=1)
    """Of the rows the curriculum would skip, the fraction drawn anyway (per row and epoch, seeded)."""

    max_groups_in_flight: int = Field(32, ge=1)
    """Groups admitted but not yet appended (all stages together)."""
    max_generations_in_flight: int = Field(16, ge=1)
    """Groups generating at once across replicas: a single-turn group is one Generate call (its ``n``
    samples); a multi-turn group's episodes share one slot while any of them generates."""
    max_scoring_in_flight: int = Field(32, ge=1)
    """Groups being scored at once (reference and reward)."""
    max_groups_per_call: int = Field(64, ge=1)
    """Most groups in one reference, reward or trajectory call: the groups that queued for a service
    while its previous calls were in flight go out together (1: one call per group)."""

    state_dir: str = "collector-state"
    """Directory for the resumable state (version, dataset position) and the weight spool used to re-sync replicas.
    With ``database_url`` set, nothing durable is kept here: a collector restarts from the database alone."""
    database_url: DatabaseUrl = ""
    """Empty: the durable state (prompt ledger, dead letters, pass rates, committed version, breaker) is the
    SQLite file ``state_dir/prompts.sqlite3`` and the weight spool a directory beside it.
    ``postgresql://user@host:port/dbname``: all of it, the spooled weights too, is in that PostgreSQL database
    (schema ``database_schema``), so a collector whose node is lost restarts elsewhere from it
    (docs/guides/postgresql.md). A lost connection takes the collector to NOT_SERVING naming the database:
    restart it; nothing acknowledged is lost."""
    database_schema: SchemaName = "rlfleet_collector"
    """PostgreSQL schema holding the collector's tables (created if missing); one collector owns a schema at a
    time (an advisory lock). Unused with SQLite."""
    fresh: bool = False
    """Start a new run: delete the durable state (the tables in ``state_dir/prompts.sqlite3`` or in the
    PostgreSQL schema, and the weight spool) before opening it; the run gets a new id. Off: resume the run the
    state holds (``GetStatus.run``). A start-once switch (``rlfleet-suite --fresh`` and ``rlfleet-ray up
    --fresh`` give it to a first start only): a process restarted with it would throw its run away."""
    max_push_bytes: int | None = Field(None, gt=0)
    """Largest weight push accepted, checked on the manifest before any memory is given to it.
    ``None``: the smallest limit the replicas report (each, by default, 4 x its checkpoint's bytes)."""
    replica_check_seconds: float = Field(2.0, gt=0)
    """How often unhealthy replicas are probed (and re-synced before rejoining), and the upstream
    services' health checked (``Status.serving``)."""
    replica_startup_seconds: float = Field(60.0, ge=0)
    """At start, how long to wait for every replica to answer before starting with the ones that did."""


    @model_validator(mode="after")
    def _ray_registry_alone(self) -> "CollectorConfig":
        from rlfleet.services.collector.discovery import RAY_SCHEME, parse_ray_url

        registries = [a for a in self.generation_addresses if a.startswith(RAY_SCHEME)]
        if registries:
            if len(self.generation_addresses) != 1 or self.generation_addresses_file:
                raise ValueError(f"generation_addresses: {RAY_SCHEME}... must be the only source of replicas")
            parse_ray_url(registries[0])
        return self

    @model_validator(mode="after")
    def _sync_means_no_staleness(self) -> "CollectorConfig":
        if self.mode == "sync":
            self.max_staleness = 0
        return self

    @model_validator(mode="after")
    def _players_on_shared_replicas(self) -> "CollectorConfig":
        from rlfleet.services.common.run_ids import is_run_id

        if self.players and not self.shared_replicas:
            raise ValueError("players: another run's policy plays on replicas shared between runs; set "
                             "shared_replicas (and run_name on every run)")
        for player, run in self.players.items():
            if not player or len(player) > 128 or not player.isprintable():
                raise ValueError(f"players: {player[:160]!r} is not a player's name (1 to 128 printable characters)")
            if not is_run_id(run):
                raise ValueError(f"players[{player!r}]: {run[:160]!r} is not a run name (1 to 128 of [A-Za-z0-9._-])")
        return self

    @model_validator(mode="after")
    def _episodes_need_an_environment_service(self) -> "CollectorConfig":
        if self.environment and not self.environment_address:
            raise ValueError(f"environment: {self.environment!r} needs an environment_address")
        return self

    @model_validator(mode="after")
    def _sampling_as_a_replica_takes_it(self) -> "CollectorConfig":
        """Checked by the generation service's own rules (a typo, a bound) so that a collector that
        could never generate refuses to start, naming the setting."""
        from rlfleet.services.collector.prompt_item import check_sampling
        from rlfleet.services.common.errors import InvalidArgument

        try:
            check_sampling(self.sampling, None, self.group_size, "sampling")
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None
        return self
