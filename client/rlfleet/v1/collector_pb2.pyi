from rlfleet.v1 import sampling_pb2 as _sampling_pb2
from rlfleet.v1 import weights_pb2 as _weights_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetPassRatesRequest(_message.Message):
    __slots__ = ("prompt_keys", "after_key", "limit")
    PROMPT_KEYS_FIELD_NUMBER: _ClassVar[int]
    AFTER_KEY_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    prompt_keys: _containers.RepeatedScalarFieldContainer[str]
    after_key: str
    limit: int
    def __init__(self, prompt_keys: _Optional[_Iterable[str]] = ..., after_key: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class GetPassRatesResponse(_message.Message):
    __slots__ = ("pass_rates", "total")
    PASS_RATES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    pass_rates: _containers.RepeatedCompositeFieldContainer[PassRate]
    total: int
    def __init__(self, pass_rates: _Optional[_Iterable[_Union[PassRate, _Mapping]]] = ..., total: _Optional[int] = ...) -> None: ...

class PassRate(_message.Message):
    __slots__ = ("prompt_key", "groups", "samples", "passed", "filtered_groups", "recent_samples", "recent_passed", "updated_at")
    PROMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    FILTERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    RECENT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RECENT_PASSED_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    prompt_key: str
    groups: int
    samples: int
    passed: int
    filtered_groups: int
    recent_samples: int
    recent_passed: int
    updated_at: float
    def __init__(self, prompt_key: _Optional[str] = ..., groups: _Optional[int] = ..., samples: _Optional[int] = ..., passed: _Optional[int] = ..., filtered_groups: _Optional[int] = ..., recent_samples: _Optional[int] = ..., recent_passed: _Optional[int] = ..., updated_at: _Optional[float] = ...) -> None: ...

class LagMismatch(_message.Message):
    __slots__ = ("lag", "kl_k3", "kl_k1", "ess_token", "tokens")
    LAG_FIELD_NUMBER: _ClassVar[int]
    KL_K3_FIELD_NUMBER: _ClassVar[int]
    KL_K1_FIELD_NUMBER: _ClassVar[int]
    ESS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    lag: int
    kl_k3: float
    kl_k1: float
    ess_token: float
    tokens: int
    def __init__(self, lag: _Optional[int] = ..., kl_k3: _Optional[float] = ..., kl_k1: _Optional[float] = ..., ess_token: _Optional[float] = ..., tokens: _Optional[int] = ...) -> None: ...

class ReportMismatchRequest(_message.Message):
    __slots__ = ("policy_version", "lags", "report_id")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAGS_FIELD_NUMBER: _ClassVar[int]
    REPORT_ID_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    lags: _containers.RepeatedCompositeFieldContainer[LagMismatch]
    report_id: str
    def __init__(self, policy_version: _Optional[int] = ..., lags: _Optional[_Iterable[_Union[LagMismatch, _Mapping]]] = ..., report_id: _Optional[str] = ...) -> None: ...

class ReportMismatchResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: MismatchStatus
    def __init__(self, status: _Optional[_Union[MismatchStatus, _Mapping]] = ...) -> None: ...

class CloseMismatchBreakerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseMismatchBreakerResponse(_message.Message):
    __slots__ = ("was_open",)
    WAS_OPEN_FIELD_NUMBER: _ClassVar[int]
    was_open: bool
    def __init__(self, was_open: _Optional[bool] = ...) -> None: ...

class MismatchStatus(_message.Message):
    __slots__ = ("breaker_open", "reason", "threshold", "trip_batches", "consecutive_over", "reports", "latest", "kl_target", "admission_staleness", "measured")
    BREAKER_OPEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    TRIP_BATCHES_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_OVER_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    KL_TARGET_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    breaker_open: bool
    reason: str
    threshold: float
    trip_batches: int
    consecutive_over: int
    reports: int
    latest: _containers.RepeatedCompositeFieldContainer[LagMismatch]
    kl_target: float
    admission_staleness: int
    measured: _containers.RepeatedCompositeFieldContainer[LagMismatch]
    def __init__(self, breaker_open: _Optional[bool] = ..., reason: _Optional[str] = ..., threshold: _Optional[float] = ..., trip_batches: _Optional[int] = ..., consecutive_over: _Optional[int] = ..., reports: _Optional[int] = ..., latest: _Optional[_Iterable[_Union[LagMismatch, _Mapping]]] = ..., kl_target: _Optional[float] = ..., admission_staleness: _Optional[int] = ..., measured: _Optional[_Iterable[_Union[LagMismatch, _Mapping]]] = ...) -> None: ...

class ListFailuresRequest(_message.Message):
    __slots__ = ("after_seq", "limit")
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    limit: int
    def __init__(self, after_seq: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class PromptFailure(_message.Message):
    __slots__ = ("seq", "prompt_id", "stage", "code", "error", "attempts", "failed_at")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_AT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    prompt_id: str
    stage: str
    code: str
    error: str
    attempts: int
    failed_at: float
    def __init__(self, seq: _Optional[int] = ..., prompt_id: _Optional[str] = ..., stage: _Optional[str] = ..., code: _Optional[str] = ..., error: _Optional[str] = ..., attempts: _Optional[int] = ..., failed_at: _Optional[float] = ...) -> None: ...

class ListFailuresResponse(_message.Message):
    __slots__ = ("failures", "total")
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    failures: _containers.RepeatedCompositeFieldContainer[PromptFailure]
    total: int
    def __init__(self, failures: _Optional[_Iterable[_Union[PromptFailure, _Mapping]]] = ..., total: _Optional[int] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: _weights_pb2.WeightManifest
    chunk: _weights_pb2.WeightChunk
    def __init__(self, manifest: _Optional[_Union[_weights_pb2.WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[_weights_pb2.WeightChunk, _Mapping]] = ...) -> None: ...

class ReplicaPushResult(_message.Message):
    __slots__ = ("address", "applied", "error", "transport", "stage_seconds", "apply_seconds", "sent_bytes")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    address: str
    applied: bool
    error: str
    transport: str
    stage_seconds: float
    apply_seconds: float
    sent_bytes: int
    def __init__(self, address: _Optional[str] = ..., applied: _Optional[bool] = ..., error: _Optional[str] = ..., transport: _Optional[str] = ..., stage_seconds: _Optional[float] = ..., apply_seconds: _Optional[float] = ..., sent_bytes: _Optional[int] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("version", "replicas", "received_bytes", "seconds", "sent_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaPushResult]
    received_bytes: int
    seconds: float
    sent_bytes: int
    def __init__(self, version: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaPushResult, _Mapping]]] = ..., received_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., sent_bytes: _Optional[int] = ...) -> None: ...

class JoinRunRequest(_message.Message):
    __slots__ = ("run_id", "policy_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class JoinRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: RunInfo
    def __init__(self, run: _Optional[_Union[RunInfo, _Mapping]] = ...) -> None: ...

class RunInfo(_message.Message):
    __slots__ = ("run_id", "created_at", "resumed", "policy_version", "name")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    created_at: float
    resumed: bool
    policy_version: int
    name: str
    def __init__(self, run_id: _Optional[str] = ..., created_at: _Optional[float] = ..., resumed: _Optional[bool] = ..., policy_version: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class GetPolicyVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPolicyVersionResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class PromptSpec(_message.Message):
    __slots__ = ("prompt_id", "prompt", "reward_fn", "ground_truth", "reward_args", "sampling", "environment")
    class RewardArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FN_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    REWARD_ARGS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    prompt: _sampling_pb2.Prompt
    reward_fn: str
    ground_truth: str
    reward_args: _containers.ScalarMap[str, str]
    sampling: _sampling_pb2.SamplingParams
    environment: str
    def __init__(self, prompt_id: _Optional[str] = ..., prompt: _Optional[_Union[_sampling_pb2.Prompt, _Mapping]] = ..., reward_fn: _Optional[str] = ..., ground_truth: _Optional[str] = ..., reward_args: _Optional[_Mapping[str, str]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., environment: _Optional[str] = ...) -> None: ...

class SubmitPromptsRequest(_message.Message):
    __slots__ = ("prompts",)
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[PromptSpec]
    def __init__(self, prompts: _Optional[_Iterable[_Union[PromptSpec, _Mapping]]] = ...) -> None: ...

class SubmitPromptsResponse(_message.Message):
    __slots__ = ("prompt_ids",)
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prompt_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("name", "queued", "in_flight", "items_per_second")
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ITEMS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    name: str
    queued: int
    in_flight: int
    items_per_second: float
    def __init__(self, name: _Optional[str] = ..., queued: _Optional[int] = ..., in_flight: _Optional[int] = ..., items_per_second: _Optional[float] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("address", "healthy", "policy_version", "in_flight", "weight_transfer_world_size", "draining")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSFER_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    address: str
    healthy: bool
    policy_version: int
    in_flight: int
    weight_transfer_world_size: int
    draining: bool
    def __init__(self, address: _Optional[str] = ..., healthy: _Optional[bool] = ..., policy_version: _Optional[int] = ..., in_flight: _Optional[int] = ..., weight_transfer_world_size: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("policy_version", "mode", "max_staleness", "stages", "replicas", "staleness_histogram", "trajectories", "discarded_samples", "group_size", "groups_per_step", "pending_prompts", "failed_prompts", "serving", "not_serving_reason", "failed", "spool_error", "episodes", "episode_turns", "mismatch", "dynamic_sampling", "discarded_tokens", "rolling_update", "run")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    PENDING_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    NOT_SERVING_REASON_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    SPOOL_ERROR_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    EPISODE_TURNS_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROLLING_UPDATE_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    mode: str
    max_staleness: int
    stages: _containers.RepeatedCompositeFieldContainer[StageStatus]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    staleness_histogram: _containers.RepeatedScalarFieldContainer[int]
    trajectories: int
    discarded_samples: int
    group_size: int
    groups_per_step: int
    pending_prompts: int
    failed_prompts: int
    serving: bool
    not_serving_reason: str
    failed: bool
    spool_error: str
    episodes: int
    episode_turns: int
    mismatch: MismatchStatus
    dynamic_sampling: DynamicSamplingStatus
    discarded_tokens: int
    rolling_update: RollingUpdateStatus
    run: RunInfo
    def __init__(self, policy_version: _Optional[int] = ..., mode: _Optional[str] = ..., max_staleness: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StageStatus, _Mapping]]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., staleness_histogram: _Optional[_Iterable[int]] = ..., trajectories: _Optional[int] = ..., discarded_samples: _Optional[int] = ..., group_size: _Optional[int] = ..., groups_per_step: _Optional[int] = ..., pending_prompts: _Optional[int] = ..., failed_prompts: _Optional[int] = ..., serving: _Optional[bool] = ..., not_serving_reason: _Optional[str] = ..., failed: _Optional[bool] = ..., spool_error: _Optional[str] = ..., episodes: _Optional[int] = ..., episode_turns: _Optional[int] = ..., mismatch: _Optional[_Union[MismatchStatus, _Mapping]] = ..., dynamic_sampling: _Optional[_Union[DynamicSamplingStatus, _Mapping]] = ..., discarded_tokens: _Optional[int] = ..., rolling_update: _Optional[_Union[RollingUpdateStatus, _Mapping]] = ..., run: _Optional[_Union[RunInfo, _Mapping]] = ...) -> None: ...

class RollingUpdateStatus(_message.Message):
    __slots__ = ("in_progress", "from_version", "to_version", "replicas_switched", "replicas_total", "window_seconds", "max_window_seconds", "committed", "pin_violations", "pins_retired", "pinned_groups")
    IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_SWITCHED_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    PIN_VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    PINS_RETIRED_FIELD_NUMBER: _ClassVar[int]
    PINNED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    in_progress: bool
    from_version: int
    to_version: int
    replicas_switched: int
    replicas_total: int
    window_seconds: float
    max_window_seconds: float
    committed: bool
    pin_violations: int
    pins_retired: int
    pinned_groups: int
    def __init__(self, in_progress: _Optional[bool] = ..., from_version: _Optional[int] = ..., to_version: _Optional[int] = ..., replicas_switched: _Optional[int] = ..., replicas_total: _Optional[int] = ..., window_seconds: _Optional[float] = ..., max_window_seconds: _Optional[float] = ..., committed: _Optional[bool] = ..., pin_violations: _Optional[int] = ..., pins_retired: _Optional[int] = ..., pinned_groups: _Optional[int] = ...) -> None: ...

class DynamicSamplingStatus(_message.Message):
    __slots__ = ("enabled", "min_score_range", "filtered_groups", "filtered_samples", "filter_rate", "oversampling", "curriculum_skipped", "curriculum")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    MIN_SCORE_RANGE_FIELD_NUMBER: _ClassVar[int]
    FILTERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    FILTERED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FILTER_RATE_FIELD_NUMBER: _ClassVar[int]
    OVERSAMPLING_FIELD_NUMBER: _ClassVar[int]
    CURRICULUM_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    CURRICULUM_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    min_score_range: float
    filtered_groups: int
    filtered_samples: int
    filter_rate: float
    oversampling: float
    curriculum_skipped: int
    curriculum: bool
    def __init__(self, enabled: _Optional[bool] = ..., min_score_range: _Optional[float] = ..., filtered_groups: _Optional[int] = ..., filtered_samples: _Optional[int] = ..., filter_rate: _Optional[float] = ..., oversampling: _Optional[float] = ..., curriculum_skipped: _Optional[int] = ..., curriculum: _Optional[bool] = ...) -> None: ...
