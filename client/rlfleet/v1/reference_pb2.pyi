from rlfleet.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreLogProbsRequest(_message.Message):
    __slots__ = ("token_ids", "response_starts", "with_entropy")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_STARTS_FIELD_NUMBER: _ClassVar[int]
    WITH_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    token_ids: _tensor_pb2.RaggedTensor
    response_starts: _containers.RepeatedScalarFieldContainer[int]
    with_entropy: bool
    def __init__(self, token_ids: _Optional[_Union[_tensor_pb2.RaggedTensor, _Mapping]] = ..., response_starts: _Optional[_Iterable[int]] = ..., with_entropy: _Optional[bool] = ...) -> None: ...

class ScoreLogProbsResponse(_message.Message):
    __slots__ = ("ref_log_probs", "entropies", "model")
    REF_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    ENTROPIES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ref_log_probs: _tensor_pb2.RaggedTensor
    entropies: _tensor_pb2.RaggedTensor
    model: str
    def __init__(self, ref_log_probs: _Optional[_Union[_tensor_pb2.RaggedTensor, _Mapping]] = ..., entropies: _Optional[_Union[_tensor_pb2.RaggedTensor, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...
