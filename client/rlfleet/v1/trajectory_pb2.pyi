from rlfleet.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SampleFilter(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLE_FILTER_UNSPECIFIED: _ClassVar[SampleFilter]
    SAMPLE_FILTER_DELIVERED: _ClassVar[SampleFilter]
    SAMPLE_FILTER_FILTERED: _ClassVar[SampleFilter]
SAMPLE_FILTER_UNSPECIFIED: SampleFilter
SAMPLE_FILTER_DELIVERED: SampleFilter
SAMPLE_FILTER_FILTERED: SampleFilter

class AppendRequest(_message.Message):
    __slots__ = ("trajectories", "idempotency_key", "group_keys", "filtered_groups", "committed_version", "trace_contexts")
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEYS_FIELD_NUMBER: _ClassVar[int]
    FILTERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    trajectories: _tensor_pb2.TensorDict
    idempotency_key: str
    group_keys: _containers.RepeatedScalarFieldContainer[str]
    filtered_groups: _containers.RepeatedScalarFieldContainer[bool]
    committed_version: int
    trace_contexts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, trajectories: _Optional[_Union[_tensor_pb2.TensorDict, _Mapping]] = ..., idempotency_key: _Optional[str] = ..., group_keys: _Optional[_Iterable[str]] = ..., filtered_groups: _Optional[_Iterable[bool]] = ..., committed_version: _Optional[int] = ..., trace_contexts: _Optional[_Iterable[str]] = ...) -> None: ...

class AppendResponse(_message.Message):
    __slots__ = ("appended", "buffered", "duplicate_groups", "filtered_groups")
    APPENDED_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    FILTERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    appended: int
    buffered: int
    duplicate_groups: _containers.RepeatedScalarFieldContainer[bool]
    filtered_groups: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, appended: _Optional[int] = ..., buffered: _Optional[int] = ..., duplicate_groups: _Optional[_Iterable[bool]] = ..., filtered_groups: _Optional[_Iterable[bool]] = ...) -> None: ...

class OpenBatchStream(_message.Message):
    __slots__ = ("batch_size", "whole_groups", "min_policy_version", "lease_seconds", "prefetch", "consumer")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    WHOLE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    whole_groups: bool
    min_policy_version: int
    lease_seconds: float
    prefetch: int
    consumer: str
    def __init__(self, batch_size: _Optional[int] = ..., whole_groups: _Optional[bool] = ..., min_policy_version: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., prefetch: _Optional[int] = ..., consumer: _Optional[str] = ...) -> None: ...

class AckBatch(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class NackBatch(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class StreamBatchesRequest(_message.Message):
    __slots__ = ("open", "ack", "nack")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    NACK_FIELD_NUMBER: _ClassVar[int]
    open: OpenBatchStream
    ack: AckBatch
    nack: NackBatch
    def __init__(self, open: _Optional[_Union[OpenBatchStream, _Mapping]] = ..., ack: _Optional[_Union[AckBatch, _Mapping]] = ..., nack: _Optional[_Union[NackBatch, _Mapping]] = ...) -> None: ...

class StreamBatchesResponse(_message.Message):
    __slots__ = ("lease_id", "batch", "lease_expires_at", "redelivered", "settled")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    batch: _tensor_pb2.TensorDict
    lease_expires_at: float
    redelivered: bool
    settled: Settled
    def __init__(self, lease_id: _Optional[str] = ..., batch: _Optional[_Union[_tensor_pb2.TensorDict, _Mapping]] = ..., lease_expires_at: _Optional[float] = ..., redelivered: _Optional[bool] = ..., settled: _Optional[_Union[Settled, _Mapping]] = ...) -> None: ...

class Settled(_message.Message):
    __slots__ = ("lease_id", "nack", "applied", "trajectories", "reason")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NACK_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    nack: bool
    applied: bool
    trajectories: int
    reason: str
    def __init__(self, lease_id: _Optional[str] = ..., nack: _Optional[bool] = ..., applied: _Optional[bool] = ..., trajectories: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("ready", "leased", "acked", "capacity", "appended", "redelivered_batches", "dropped_stale", "buffered_bytes", "capacity_bytes", "filtered_groups", "filtered_trajectories")
    READY_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    APPENDED_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILTERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    FILTERED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    ready: int
    leased: int
    acked: int
    capacity: int
    appended: int
    redelivered_batches: int
    dropped_stale: int
    buffered_bytes: int
    capacity_bytes: int
    filtered_groups: int
    filtered_trajectories: int
    def __init__(self, ready: _Optional[int] = ..., leased: _Optional[int] = ..., acked: _Optional[int] = ..., capacity: _Optional[int] = ..., appended: _Optional[int] = ..., redelivered_batches: _Optional[int] = ..., dropped_stale: _Optional[int] = ..., buffered_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., filtered_groups: _Optional[int] = ..., filtered_trajectories: _Optional[int] = ...) -> None: ...

class DropStaleRequest(_message.Message):
    __slots__ = ("below_policy_version",)
    BELOW_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    below_policy_version: int
    def __init__(self, below_policy_version: _Optional[int] = ...) -> None: ...

class DropStaleResponse(_message.Message):
    __slots__ = ("dropped", "group_ids", "prompt_ids")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    group_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, dropped: _Optional[int] = ..., group_ids: _Optional[_Iterable[int]] = ..., prompt_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetVersionStatsRequest(_message.Message):
    __slots__ = ("min_version", "limit")
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    min_version: int
    limit: int
    def __init__(self, min_version: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class VersionStats(_message.Message):
    __slots__ = ("version", "groups", "trajectories", "filtered_groups", "mean_score", "mean_kl", "mean_response_tokens", "mean_staleness", "max_staleness")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    FILTERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_SCORE_FIELD_NUMBER: _ClassVar[int]
    MEAN_KL_FIELD_NUMBER: _ClassVar[int]
    MEAN_RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    version: int
    groups: int
    trajectories: int
    filtered_groups: int
    mean_score: float
    mean_kl: float
    mean_response_tokens: float
    mean_staleness: float
    max_staleness: int
    def __init__(self, version: _Optional[int] = ..., groups: _Optional[int] = ..., trajectories: _Optional[int] = ..., filtered_groups: _Optional[int] = ..., mean_score: _Optional[float] = ..., mean_kl: _Optional[float] = ..., mean_response_tokens: _Optional[float] = ..., mean_staleness: _Optional[float] = ..., max_staleness: _Optional[int] = ...) -> None: ...

class GetVersionStatsResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionStats]
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionStats, _Mapping]]] = ...) -> None: ...

class ListSamplesRequest(_message.Message):
    __slots__ = ("min_version", "max_version", "min_score", "max_score", "filter", "limit", "before_cursor")
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_VERSION_FIELD_NUMBER: _ClassVar[int]
    MIN_SCORE_FIELD_NUMBER: _ClassVar[int]
    MAX_SCORE_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    BEFORE_CURSOR_FIELD_NUMBER: _ClassVar[int]
    min_version: int
    max_version: int
    min_score: float
    max_score: float
    filter: SampleFilter
    limit: int
    before_cursor: int
    def __init__(self, min_version: _Optional[int] = ..., max_version: _Optional[int] = ..., min_score: _Optional[float] = ..., max_score: _Optional[float] = ..., filter: _Optional[_Union[SampleFilter, str]] = ..., limit: _Optional[int] = ..., before_cursor: _Optional[int] = ...) -> None: ...

class SampleSummary(_message.Message):
    __slots__ = ("trajectory_id", "prompt_id", "group_id", "sample_index", "policy_version_start", "policy_version_end", "score", "advantage", "kl_mean", "response_tokens", "filtered", "staleness", "appended_at", "cursor", "turns")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_START_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_END_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    KL_MEAN_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FILTERED_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    APPENDED_AT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    prompt_id: str
    group_id: int
    sample_index: int
    policy_version_start: int
    policy_version_end: int
    score: float
    advantage: float
    kl_mean: float
    response_tokens: int
    filtered: bool
    staleness: int
    appended_at: float
    cursor: int
    turns: int
    def __init__(self, trajectory_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., group_id: _Optional[int] = ..., sample_index: _Optional[int] = ..., policy_version_start: _Optional[int] = ..., policy_version_end: _Optional[int] = ..., score: _Optional[float] = ..., advantage: _Optional[float] = ..., kl_mean: _Optional[float] = ..., response_tokens: _Optional[int] = ..., filtered: _Optional[bool] = ..., staleness: _Optional[int] = ..., appended_at: _Optional[float] = ..., cursor: _Optional[int] = ..., turns: _Optional[int] = ...) -> None: ...

class ListSamplesResponse(_message.Message):
    __slots__ = ("samples", "next_cursor", "logged", "matching")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NEXT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    LOGGED_FIELD_NUMBER: _ClassVar[int]
    MATCHING_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[SampleSummary]
    next_cursor: int
    logged: int
    matching: int
    def __init__(self, samples: _Optional[_Iterable[_Union[SampleSummary, _Mapping]]] = ..., next_cursor: _Optional[int] = ..., logged: _Optional[int] = ..., matching: _Optional[int] = ...) -> None: ...

class GetSampleRequest(_message.Message):
    __slots__ = ("cursor",)
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    cursor: int
    def __init__(self, cursor: _Optional[int] = ...) -> None: ...

class GetSampleResponse(_message.Message):
    __slots__ = ("summary", "trajectory")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    summary: SampleSummary
    trajectory: _tensor_pb2.TensorDict
    def __init__(self, summary: _Optional[_Union[SampleSummary, _Mapping]] = ..., trajectory: _Optional[_Union[_tensor_pb2.TensorDict, _Mapping]] = ...) -> None: ...
