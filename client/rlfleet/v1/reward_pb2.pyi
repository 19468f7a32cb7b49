from rlfleet.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KLEstimator(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KL_ESTIMATOR_UNSPECIFIED: _ClassVar[KLEstimator]
    KL_ESTIMATOR_K1: _ClassVar[KLEstimator]
    KL_ESTIMATOR_K2: _ClassVar[KLEstimator]
    KL_ESTIMATOR_K3: _ClassVar[KLEstimator]

class AdvantageMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADVANTAGE_MODE_UNSPECIFIED: _ClassVar[AdvantageMode]
    ADVANTAGE_MODE_GRPO: _ClassVar[AdvantageMode]
    ADVANTAGE_MODE_GRPO_NO_STD: _ClassVar[AdvantageMode]
    ADVANTAGE_MODE_RLOO: _ClassVar[AdvantageMode]
KL_ESTIMATOR_UNSPECIFIED: KLEstimator
KL_ESTIMATOR_K1: KLEstimator
KL_ESTIMATOR_K2: KLEstimator
KL_ESTIMATOR_K3: KLEstimator
ADVANTAGE_MODE_UNSPECIFIED: AdvantageMode
ADVANTAGE_MODE_GRPO: AdvantageMode
ADVANTAGE_MODE_GRPO_NO_STD: AdvantageMode
ADVANTAGE_MODE_RLOO: AdvantageMode

class CheckTasksRequest(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[Task]
    def __init__(self, tasks: _Optional[_Iterable[_Union[Task, _Mapping]]] = ...) -> None: ...

class CheckTasksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Task(_message.Message):
    __slots__ = ("reward_fn", "ground_truth", "args")
    class ArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REWARD_FN_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    reward_fn: str
    ground_truth: str
    args: _containers.ScalarMap[str, str]
    def __init__(self, reward_fn: _Optional[str] = ..., ground_truth: _Optional[str] = ..., args: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ComputeRewardsRequest(_message.Message):
    __slots__ = ("response_token_ids", "behavior_log_probs", "ref_log_probs", "response_mask", "prompt_texts", "response_texts", "tasks", "group_ids", "kl_estimator", "advantage_mode", "update_kl_controller", "environment_rewards", "run_id")
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOR_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    REF_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_MASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXTS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXTS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    KL_ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_MODE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_KL_CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_REWARDS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    response_token_ids: _tensor_pb2.RaggedTensor
    behavior_log_probs: _tensor_pb2.RaggedTensor
    ref_log_probs: _tensor_pb2.RaggedTensor
    response_mask: _tensor_pb2.RaggedTensor
    prompt_texts: _containers.RepeatedScalarFieldContainer[str]
    response_texts: _containers.RepeatedScalarFieldContainer[str]
    tasks: _containers.RepeatedCompositeFieldContainer[Task]
    group_ids: _containers.RepeatedScalarFieldContainer[int]
    kl_estimator: KLEstimator
    advantage_mode: AdvantageMode
    update_kl_controller: bool
    environment_rewards: _containers.RepeatedScalarFieldContainer[float]
    run_id: str
    def __init__(self, response_token_ids: _Optional[_Union[_tensor_pb2.RaggedTensor, _Mapping]] = ..., behavior_log_probs: _Optional[_Union[_tensor_pb2.RaggedTensor, _Mapping]] = ..., ref_log_probs: _Optional[_Union[_tensor_pb2.RaggedTensor, _Mapping]] = ..., response_mask: _Optional[_Union[_tensor_pb2.RaggedTensor, _Mapping]] = ..., prompt_texts: _Optional[_Iterable[str]] = ..., response_texts: _Optional[_Iterable[str]] = ..., tasks: _Optional[_Iterable[_Union[Task, _Mapping]]] = ..., group_ids: _Optional[_Iterable[int]] = ..., kl_estimator: _Optional[_Union[KLEstimator, str]] = ..., advantage_mode: _Optional[_Union[AdvantageMode, str]] = ..., update_kl_controller: _Optional[bool] = ..., environment_rewards: _Optional[_Iterable[float]] = ..., run_id: _Optional[str] = ...) -> None: ...

class ComputeRewardsResponse(_message.Message):
    __slots__ = ("kl", "rewards", "scores", "clipped_scores", "advantages", "kl_mean", "kl_sum", "kl_coef")
    KL_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_SCORES_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    KL_MEAN_FIELD_NUMBER: _ClassVar[int]
    KL_SUM_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    kl: _tensor_pb2.RaggedTensor
    rewards: _tensor_pb2.RaggedTensor
    scores: _tensor_pb2.Tensor
    clipped_scores: _tensor_pb2.Tensor
    advantages: _tensor_pb2.Tensor
    kl_mean: _tensor_pb2.Tensor
    kl_sum: _tensor_pb2.Tensor
    kl_coef: float
    def __init__(self, kl: _Optional[_Union[_tensor_pb2.RaggedTensor, _Mapping]] = ..., rewards: _Optional[_Union[_tensor_pb2.RaggedTensor, _Mapping]] = ..., scores: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., clipped_scores: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., advantages: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., kl_mean: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., kl_sum: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., kl_coef: _Optional[float] = ...) -> None: ...

class GetKLControllerRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetKLControllerResponse(_message.Message):
    __slots__ = ("kind", "coef", "target", "horizon", "updates")
    KIND_FIELD_NUMBER: _ClassVar[int]
    COEF_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    HORIZON_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    coef: float
    target: float
    horizon: float
    updates: int
    def __init__(self, kind: _Optional[str] = ..., coef: _Optional[float] = ..., target: _Optional[float] = ..., horizon: _Optional[float] = ..., updates: _Optional[int] = ...) -> None: ...
