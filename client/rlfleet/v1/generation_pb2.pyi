from rlfleet.v1 import sampling_pb2 as _sampling_pb2
from rlfleet.v1 import tensor_pb2 as _tensor_pb2
from rlfleet.v1 import weights_pb2 as _weights_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling", "policy_version", "run_id", "share_weight", "run_name", "policy_run")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SHARE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    RUN_NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_RUN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: _sampling_pb2.Prompt
    sampling: _sampling_pb2.SamplingParams
    policy_version: int
    run_id: str
    share_weight: float
    run_name: str
    policy_run: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[_sampling_pb2.Prompt, _Mapping]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., policy_version: _Optional[int] = ..., run_id: _Optional[str] = ..., share_weight: _Optional[float] = ..., run_name: _Optional[str] = ..., policy_run: _Optional[str] = ...) -> None: ...

class SampleTiming(_message.Message):
    __slots__ = ("queued_seconds", "first_token_seconds", "total_seconds")
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queued_seconds: float
    first_token_seconds: float
    total_seconds: float
    def __init__(self, queued_seconds: _Optional[float] = ..., first_token_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "sample_index", "prompt_token_ids", "response_token_ids", "behavior_log_probs", "finish_reason", "stop_reason", "policy_version_start", "policy_version_end", "sampling", "timing", "policy_version_spans", "cached_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOR_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_START_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_END_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample_index: int
    prompt_token_ids: _tensor_pb2.Tensor
    response_token_ids: _tensor_pb2.Tensor
    behavior_log_probs: _tensor_pb2.Tensor
    finish_reason: _sampling_pb2.FinishReason
    stop_reason: str
    policy_version_start: int
    policy_version_end: int
    sampling: _sampling_pb2.SamplingParams
    timing: SampleTiming
    policy_version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    cached_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., prompt_token_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., response_token_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., behavior_log_probs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., finish_reason: _Optional[_Union[_sampling_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., policy_version_start: _Optional[int] = ..., policy_version_end: _Optional[int] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., timing: _Optional[_Union[SampleTiming, _Mapping]] = ..., policy_version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("version", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: int
    start: int
    end: int
    def __init__(self, version: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("manifest", "chunk", "commit")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    manifest: _weights_pb2.WeightManifest
    chunk: _weights_pb2.WeightChunk
    commit: _weights_pb2.WeightCommit
    def __init__(self, manifest: _Optional[_Union[_weights_pb2.WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[_weights_pb2.WeightChunk, _Mapping]] = ..., commit: _Optional[_Union[_weights_pb2.WeightCommit, _Mapping]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "received_bytes", "receive_seconds", "apply_seconds", "aborted_requests", "phase", "engine_weight_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    received_bytes: int
    receive_seconds: float
    apply_seconds: float
    aborted_requests: int
    phase: _weights_pb2.WeightPhase
    engine_weight_version: str
    def __init__(self, version: _Optional[int] = ..., received_bytes: _Optional[int] = ..., receive_seconds: _Optional[float] = ..., apply_seconds: _Optional[float] = ..., aborted_requests: _Optional[int] = ..., phase: _Optional[_Union[_weights_pb2.WeightPhase, str]] = ..., engine_weight_version: _Optional[str] = ...) -> None: ...

class GetEngineStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetEngineStatusResponse(_message.Message):
    __slots__ = ("model", "policy_version", "running_requests", "waiting_requests", "tokens_per_second", "swapping", "max_queued_requests", "weight_transports", "weight_transfer_world_size", "max_push_bytes", "resumed_samples", "resumed_tokens", "runs", "max_runs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SWAPPING_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSFER_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_PUSH_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESUMED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNS_FIELD_NUMBER: _ClassVar[int]
    model: str
    policy_version: int
    running_requests: int
    waiting_requests: int
    tokens_per_second: float
    swapping: bool
    max_queued_requests: int
    weight_transports: _containers.RepeatedScalarFieldContainer[str]
    weight_transfer_world_size: int
    max_push_bytes: int
    resumed_samples: int
    resumed_tokens: int
    runs: _containers.RepeatedCompositeFieldContainer[ServedRun]
    max_runs: int
    def __init__(self, model: _Optional[str] = ..., policy_version: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., swapping: _Optional[bool] = ..., max_queued_requests: _Optional[int] = ..., weight_transports: _Optional[_Iterable[str]] = ..., weight_transfer_world_size: _Optional[int] = ..., max_push_bytes: _Optional[int] = ..., resumed_samples: _Optional[int] = ..., resumed_tokens: _Optional[int] = ..., runs: _Optional[_Iterable[_Union[ServedRun, _Mapping]]] = ..., max_runs: _Optional[int] = ...) -> None: ...

class ServedRun(_message.Message):
    __slots__ = ("run_id", "policy_version", "requests_in_flight", "requests_waiting", "generated_tokens", "name")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    requests_in_flight: int
    requests_waiting: int
    generated_tokens: int
    name: str
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., requests_in_flight: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class EndRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class EndRunResponse(_message.Message):
    __slots__ = ("requests_in_flight",)
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    requests_in_flight: int
    def __init__(self, requests_in_flight: _Optional[int] = ...) -> None: ...

class RelayWeightsRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: RelayHeader
    chunk: _weights_pb2.WeightChunk
    def __init__(self, header: _Optional[_Union[RelayHeader, _Mapping]] = ..., chunk: _Optional[_Union[_weights_pb2.WeightChunk, _Mapping]] = ...) -> None: ...

class RelayHeader(_message.Message):
    __slots__ = ("push_id", "version", "downstream", "downstream_tls_names")
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_TLS_NAMES_FIELD_NUMBER: _ClassVar[int]
    push_id: str
    version: int
    downstream: _containers.RepeatedScalarFieldContainer[str]
    downstream_tls_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, push_id: _Optional[str] = ..., version: _Optional[int] = ..., downstream: _Optional[_Iterable[str]] = ..., downstream_tls_names: _Optional[_Iterable[str]] = ...) -> None: ...

class ShareWeightsRequest(_message.Message):
    __slots__ = ("push_id", "version", "downstream", "downstream_tls_names")
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_TLS_NAMES_FIELD_NUMBER: _ClassVar[int]
    push_id: str
    version: int
    downstream: _containers.RepeatedScalarFieldContainer[str]
    downstream_tls_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, push_id: _Optional[str] = ..., version: _Optional[int] = ..., downstream: _Optional[_Iterable[str]] = ..., downstream_tls_names: _Optional[_Iterable[str]] = ...) -> None: ...

class ShareWeightsResponse(_message.Message):
    __slots__ = ("sent_bytes", "cut")
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    sent_bytes: int
    cut: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sent_bytes: _Optional[int] = ..., cut: _Optional[_Iterable[str]] = ...) -> None: ...

class RelayWeightsResponse(_message.Message):
    __slots__ = ("received_bytes", "done", "cut")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    done: bool
    cut: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, received_bytes: _Optional[int] = ..., done: _Optional[bool] = ..., cut: _Optional[_Iterable[str]] = ...) -> None: ...
