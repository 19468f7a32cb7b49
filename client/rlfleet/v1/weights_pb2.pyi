from rlfleet.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_MODE_UNSPECIFIED: _ClassVar[UpdateMode]
    UPDATE_MODE_WAIT: _ClassVar[UpdateMode]
    UPDATE_MODE_ABORT: _ClassVar[UpdateMode]
    UPDATE_MODE_KEEP: _ClassVar[UpdateMode]
    UPDATE_MODE_RESUME: _ClassVar[UpdateMode]

class UpdateStrategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_STRATEGY_UNSPECIFIED: _ClassVar[UpdateStrategy]
    UPDATE_STRATEGY_PAUSE_ALL: _ClassVar[UpdateStrategy]
    UPDATE_STRATEGY_ROLLING: _ClassVar[UpdateStrategy]

class WeightPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_PHASE_UNSPECIFIED: _ClassVar[WeightPhase]
    WEIGHT_PHASE_STAGED: _ClassVar[WeightPhase]
    WEIGHT_PHASE_APPLIED: _ClassVar[WeightPhase]
UPDATE_MODE_UNSPECIFIED: UpdateMode
UPDATE_MODE_WAIT: UpdateMode
UPDATE_MODE_ABORT: UpdateMode
UPDATE_MODE_KEEP: UpdateMode
UPDATE_MODE_RESUME: UpdateMode
UPDATE_STRATEGY_UNSPECIFIED: UpdateStrategy
UPDATE_STRATEGY_PAUSE_ALL: UpdateStrategy
UPDATE_STRATEGY_ROLLING: UpdateStrategy
WEIGHT_PHASE_UNSPECIFIED: WeightPhase
WEIGHT_PHASE_STAGED: WeightPhase
WEIGHT_PHASE_APPLIED: WeightPhase

class WeightSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "fingerprint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _tensor_pb2.Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    fingerprint: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., fingerprint: _Optional[int] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("version", "tensors", "total_bytes", "checksum", "mode", "shm", "nccl", "relay", "two_phase", "resync", "delta", "lora", "strategy", "run_id", "run_name")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    NCCL_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    TWO_PHASE_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_NAME_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[WeightSpec]
    total_bytes: int
    checksum: str
    mode: UpdateMode
    shm: ShmSegment
    nccl: NcclRendezvous
    relay: WeightRelay
    two_phase: bool
    resync: bool
    delta: WeightDelta
    lora: LoraAdapter
    strategy: UpdateStrategy
    run_id: str
    run_name: str
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[WeightSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., checksum: _Optional[str] = ..., mode: _Optional[_Union[UpdateMode, str]] = ..., shm: _Optional[_Union[ShmSegment, _Mapping]] = ..., nccl: _Optional[_Union[NcclRendezvous, _Mapping]] = ..., relay: _Optional[_Union[WeightRelay, _Mapping]] = ..., two_phase: _Optional[bool] = ..., resync: _Optional[bool] = ..., delta: _Optional[_Union[WeightDelta, _Mapping]] = ..., lora: _Optional[_Union[LoraAdapter, _Mapping]] = ..., strategy: _Optional[_Union[UpdateStrategy, str]] = ..., run_id: _Optional[str] = ..., run_name: _Optional[str] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("rank", "alpha", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class WeightDelta(_message.Message):
    __slots__ = ("base_version",)
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    base_version: int
    def __init__(self, base_version: _Optional[int] = ...) -> None: ...

class ShmSegment(_message.Message):
    __slots__ = ("path", "watermark_path")
    PATH_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    watermark_path: str
    def __init__(self, path: _Optional[str] = ..., watermark_path: _Optional[str] = ...) -> None: ...

class WeightRelay(_message.Message):
    __slots__ = ("push_id",)
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    push_id: str
    def __init__(self, push_id: _Optional[str] = ...) -> None: ...

class NcclRendezvous(_message.Message):
    __slots__ = ("master_address", "master_port", "world_size", "rank_offset", "packed")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    packed: bool
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank_offset: _Optional[int] = ..., packed: _Optional[bool] = ...) -> None: ...

class WeightCommit(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
