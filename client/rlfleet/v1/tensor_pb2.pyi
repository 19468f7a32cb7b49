from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]
    DTYPE_FLOAT64: _ClassVar[Dtype]
    DTYPE_INT64: _ClassVar[Dtype]
    DTYPE_INT32: _ClassVar[Dtype]
    DTYPE_INT16: _ClassVar[Dtype]
    DTYPE_INT8: _ClassVar[Dtype]
    DTYPE_UINT8: _ClassVar[Dtype]
    DTYPE_BOOL: _ClassVar[Dtype]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_BFLOAT16: Dtype
DTYPE_FLOAT64: Dtype
DTYPE_INT64: Dtype
DTYPE_INT32: Dtype
DTYPE_INT16: Dtype
DTYPE_INT8: Dtype
DTYPE_UINT8: Dtype
DTYPE_BOOL: Dtype

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RaggedTensor(_message.Message):
    __slots__ = ("values", "lengths")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    values: Tensor
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Union[Tensor, _Mapping]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class StringList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class TensorDictValue(_message.Message):
    __slots__ = ("tensor", "ragged", "strings", "nested")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    RAGGED_FIELD_NUMBER: _ClassVar[int]
    STRINGS_FIELD_NUMBER: _ClassVar[int]
    NESTED_FIELD_NUMBER: _ClassVar[int]
    tensor: Tensor
    ragged: RaggedTensor
    strings: StringList
    nested: TensorDict
    def __init__(self, tensor: _Optional[_Union[Tensor, _Mapping]] = ..., ragged: _Optional[_Union[RaggedTensor, _Mapping]] = ..., strings: _Optional[_Union[StringList, _Mapping]] = ..., nested: _Optional[_Union[TensorDict, _Mapping]] = ...) -> None: ...

class TensorDict(_message.Message):
    __slots__ = ("batch_size", "entries")
    class EntriesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TensorDictValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TensorDictValue, _Mapping]] = ...) -> None: ...
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    batch_size: _containers.RepeatedScalarFieldContainer[int]
    entries: _containers.MessageMap[str, TensorDictValue]
    def __init__(self, batch_size: _Optional[_Iterable[int]] = ..., entries: _Optional[_Mapping[str, TensorDictValue]] = ...) -> None: ...
