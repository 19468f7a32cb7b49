"""RewardService gRPC adapter: unpack protos, call RewardEngine off the event loop, pack replies."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlfleet.choices import ADVANTAGE_MODES, KL_ESTIMATORS
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.reward import validation
from rlfleet.services.reward.config import RewardServiceConfig
from rlfleet.services.reward.reward_engine import RewardRequest
from rlfleet.services.reward.functions import TaskSpec
from rlfleet.services.reward.batch_rewards import RewardInputs, RewardOutputs
from rlfleet.v1 import reward_pb2, reward_pb2_grpc
from rlfleet.wire import Ragged, decode_ragged, encode_ragged, encode_tensor

if TYPE_CHECKING:
    from rlfleet.services.reward.service import RewardService

# Enum value -> name; UNSPECIFIED: None, the engine applies the configured default.
_ESTIMATORS = {reward_pb2.KL_ESTIMATOR_UNSPECIFIED: None, **{v: name for name, v in KL_ESTIMATORS.items()}}
_ADVANTAGE_MODES = {reward_pb2.ADVANTAGE_MODE_UNSPECIFIED: None, **{v: name for name, v in ADVANTAGE_MODES.items()}}


def _enum(table: dict, value: int, field: str):
    try:
        return table[value]
    except KeyError:
        raise InvalidArgument(f"{field}: unknown value {value}") from None


_RAGGED_FIELDS = ("behavior_log_probs", "ref_log_probs", "response_token_ids", "response_mask")


def check_size(request: reward_pb2.ComputeRewardsRequest, config: RewardServiceConfig) -> None:
    """The service's size bounds, on counts and lengths only (and the plain environment rewards):
    nothing is decoded or allocated yet."""
    for field in _RAGGED_FIELDS:
        if request.HasField(field):
            ragged = getattr(request, field)
            dims = len(ragged.values.shape) if ragged.HasField("values") else None
            validation.check_ragged_size(field, ragged.lengths, dims, config)
    validation.check_count("group_ids", len(request.group_ids), config)
    validation.check_texts("prompt_texts", request.prompt_texts, config)
    validation.check_texts("response_texts", request.response_texts, config)
    validation.check_count("tasks", len(request.tasks), config)
    for index, task in enumerate(request.tasks):
        validation.check_task(index, task.ground_truth, task.args, config)
    if request.HasField("behavior_log_probs"):  # absent: refused, naming it, when decoded
        validation.check_environment_rewards(request.environment_rewards, len(request.behavior_log_probs.lengths))


def _ragged(request, field: str, required: bool) -> list[torch.Tensor] | None:
    if not required and not request.HasField(field):
        return None
    return decode_ragged(getattr(request, field), field).to_list()


def request_from_proto(request: reward_pb2.ComputeRewardsRequest, config: RewardServiceConfig) -> RewardRequest:
    check_size(request, config)
    inputs = RewardInputs(
        behavior_log_probs=_ragged(request, "behavior_log_probs", required=True),
        ref_log_probs=_ragged(request, "ref_log_probs", required=True),
        response_token_ids=_ragged(request, "response_token_ids", required=False),
        response_masks=_ragged(request, "response_mask", required=False),
        group_ids=list(request.group_ids),
        environment_rewards=torch.tensor(request.environment_rewards, dtype=torch.float64)
        if request.environment_rewards else None,
    )
    # proto3 cannot tell an empty ground truth from none: empty means none.
    tasks = [TaskSpec(task.reward_fn, task.ground_truth or None, dict(task.args)) for task in request.tasks]
    return RewardRequest(
        inputs=inputs,
        prompt_texts=list(request.prompt_texts),
        response_texts=list(request.response_texts),
        tasks=tasks,
        kl_estimator=_enum(_ESTIMATORS, request.kl_estimator, "kl_estimator"),
        advantage_mode=_enum(_ADVANTAGE_MODES, request.advantage_mode, "advantage_mode"),
        update_kl_controller=request.update_kl_controller,
        run_id=request.run_id,
    )


def response_to_proto(outputs: RewardOutputs) -> reward_pb2.ComputeRewardsResponse:
    response = reward_pb2.ComputeRewardsResponse(kl_coef=outputs.kl_coef)
    encode_ragged(Ragged.from_list([row.float() for row in outputs.kl], torch.float32), out=response.kl)
    encode_ragged(Ragged.from_list([row.float() for row in outputs.rewards], torch.float32), out=response.rewards)
    for name in ("scores", "clipped_scores", "advantages", "kl_mean", "kl_sum"):
        encode_tensor(getattr(outputs, name).float(), out=getattr(response, name))
    return response


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, service: RewardService):
        self.service = service

    async def ComputeRewards(self, request, context):
        reward_request = request_from_proto(request, self.service.config)
        outputs = await self.service.compute(reward_request)
        return response_to_proto(outputs)

    async def CheckTasks(self, request, context):
        config = self.service.config
        validation.check_count("tasks", len(request.tasks), config)
        for index, task in enumerate(request.tasks):
            validation.check_task(index, task.ground_truth, task.args, config)
        tasks = [TaskSpec(task.reward_fn, task.ground_truth or None, dict(task.args)) for task in request.tasks]
        await self.service.run_blocking(self.service.engine.check_tasks, tasks)  # builds scorers: regexes
        return reward_pb2.CheckTasksResponse()

    async def GetKLController(self, request, context):
        state = self.service.engine.controller_state(request.run_id)
        return reward_pb2.GetKLControllerResponse(
            kind=state.kind, coef=state.coef, target=state.target, horizon=state.horizon, updates=state.updates)
