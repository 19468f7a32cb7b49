from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SampleError(_message.Message):
    __slots__ = ("sample", "description")
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    sample: int
    description: str
    def __init__(self, sample: _Optional[int] = ..., description: _Optional[str] = ...) -> None: ...
