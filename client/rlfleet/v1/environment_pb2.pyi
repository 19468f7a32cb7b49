from rlfleet.v1 import sampling_pb2 as _sampling_pb2
from rlfleet.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenEpisodeRequest(_message.Message):
    __slots__ = ("environment", "prompt", "ground_truth", "metadata", "episode_id")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    environment: str
    prompt: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.ChatMessage]
    ground_truth: str
    metadata: _containers.ScalarMap[str, str]
    episode_id: str
    def __init__(self, environment: _Optional[str] = ..., prompt: _Optional[_Iterable[_Union[_sampling_pb2.ChatMessage, _Mapping]]] = ..., ground_truth: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., episode_id: _Optional[str] = ...) -> None: ...

class OpenEpisodeResponse(_message.Message):
    __slots__ = ("messages", "prompt_token_ids", "tools_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.ChatMessage]
    prompt_token_ids: _tensor_pb2.Tensor
    tools_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, messages: _Optional[_Iterable[_Union[_sampling_pb2.ChatMessage, _Mapping]]] = ..., prompt_token_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., tools_json: _Optional[_Iterable[str]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("episode_id", "token_ids", "text", "finish_reason", "turn", "player")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    PLAYER_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    token_ids: _tensor_pb2.Tensor
    text: str
    finish_reason: str
    turn: int
    player: str
    def __init__(self, episode_id: _Optional[str] = ..., token_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., turn: _Optional[int] = ..., player: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "observation_token_ids", "reward", "has_reward", "done", "truncated", "info", "next_player")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    HAS_REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    NEXT_PLAYER_FIELD_NUMBER: _ClassVar[int]
    observation: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.ChatMessage]
    observation_token_ids: _tensor_pb2.Tensor
    reward: float
    has_reward: bool
    done: bool
    truncated: bool
    info: _containers.ScalarMap[str, str]
    next_player: str
    def __init__(self, observation: _Optional[_Iterable[_Union[_sampling_pb2.ChatMessage, _Mapping]]] = ..., observation_token_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., reward: _Optional[float] = ..., has_reward: _Optional[bool] = ..., done: _Optional[bool] = ..., truncated: _Optional[bool] = ..., info: _Optional[_Mapping[str, str]] = ..., next_player: _Optional[str] = ...) -> None: ...

class CloseEpisodeRequest(_message.Message):
    __slots__ = ("episode_id",)
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    def __init__(self, episode_id: _Optional[str] = ...) -> None: ...

class CloseEpisodeResponse(_message.Message):
    __slots__ = ("final_reward", "has_final_reward")
    FINAL_REWARD_FIELD_NUMBER: _ClassVar[int]
    HAS_FINAL_REWARD_FIELD_NUMBER: _ClassVar[int]
    final_reward: float
    has_final_reward: bool
    def __init__(self, final_reward: _Optional[float] = ..., has_final_reward: _Optional[bool] = ...) -> None: ...
