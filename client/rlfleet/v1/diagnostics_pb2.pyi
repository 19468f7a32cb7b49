from rlfleet.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EchoRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: _tensor_pb2.TensorDict
    def __init__(self, payload: _Optional[_Union[_tensor_pb2.TensorDict, _Mapping]] = ...) -> None: ...

class EchoResponse(_message.Message):
    __slots__ = ("payload", "decoded_bytes")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    DECODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    payload: _tensor_pb2.TensorDict
    decoded_bytes: int
    def __init__(self, payload: _Optional[_Union[_tensor_pb2.TensorDict, _Mapping]] = ..., decoded_bytes: _Optional[int] = ...) -> None: ...
