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
UPDATE_MODE_UNSPECIFIED: UpdateMode
UPDATE_MODE_WAIT: UpdateMode
UPDATE_MODE_ABORT: UpdateMode
UPDATE_MODE_KEEP: UpdateMode

class WeightSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _tensor_pb2.Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("version", "tensors", "total_bytes", "checksum", "mode")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[WeightSpec]
    total_bytes: int
    checksum: str
    mode: UpdateMode
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[WeightSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., checksum: _Optional[str] = ..., mode: _Optional[_Union[UpdateMode, str]] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
