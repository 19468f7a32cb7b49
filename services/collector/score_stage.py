"""The pipeline's scoring stages: a group's reference log-probs, then its rewards and advantages.

In: the group's samples (``GroupSamples``). Out: the reference service's log-prob of every response token
(checked against the response lengths), then the reward service's ``ComputeRewardsResponse`` (scores,
advantages, KL penalties). The groups that queue for a service while its calls are in flight go out
together in its next call (``coalescer.py``, ``batched_calls.py``); a refused call that one group may
have caused is made again group by group.
"""

from __future__ import annotations

import asyncio

from rlfleet.rpc.channel import ChannelSettings, call_with_retry
from rlfleet.rpc.errors import ResourceExhaustedError
from rlfleet.services.collector import batched_calls, failures
from rlfleet.services.collector.coalescer import Coalescer
from rlfleet.services.collector.prompt_item import PromptItem
from rlfleet.services.collector.stage_stats import StageStats
from rlfleet.services.collector.trajectories import GroupSamples
from rlfleet.services.common import tracing
from rlfleet.v1 import reference_pb2, reference_pb2_grpc, reward_pb2, reward_pb2_grpc, tensor_pb2
from rlfleet.wire import WireError


def one_group_may_be_why(exc: BaseException) -> bool:
    """A call for several groups failed for something one of them may carry (a refused input, a
    reply that does not decode, too many rows for the buffer): made again group by group."""
    return failures.verdict(exc) == "dead" or isinstance(exc, ResourceExhaustedError)


class ScoreStage:
    def __init__(self, reference: reference_pb2_grpc.ReferenceServiceStub, reward: reward_pb2_grpc.RewardServiceStub,
                 settings: ChannelSettings, *, default_reward_fn: str, kl_estimator: int, advantage_mode: int,
                 update_kl_controller: bool, max_scoring_in_flight: int, max_groups_per_call: int,
                 run_id: str = ""):
        self.reference = reference
        self.reward = reward
        self.settings = settings
        self.default_reward_fn = default_reward_fn
        self.kl_estimator = kl_estimator
        self.advantage_mode = advantage_mode
        self.update_kl_controller = update_kl_controller
        self.run_id = run_id
        """The run the reward service keeps the KL controller of ("": its own; ``ReplicaRun``)."""
        self.reference_stats = StageStats("reference")
        self.reward_stats = StageStats("reward")
        self._scoring = asyncio.Semaphore(max_scoring_in_flight)  # the reference and the reward calls share it
        # Two calls in flight per service keep it busy while the next one gathers; with one group per call,
        # as many calls as groups may be scored at once.
        per_call = max_groups_per_call
        calls = 2 if per_call > 1 else max_scoring_in_flight
        self._references = Coalescer(self._reference_call, split_on=one_group_may_be_why, max_items=per_call,
                                     concurrency=calls, name="ScoreLogProbs call")
        self._rewards = Coalescer(self._reward_call, split_on=one_group_may_be_why, max_items=per_call,
                                  concurrency=calls, name="ComputeRewards call")

    async def reference_log_probs(self, group: GroupSamples) -> tensor_pb2.RaggedTensor:
        """The reference log-probs of each response, as the reference service sent them."""
        request = reference_pb2.ScoreLogProbsRequest(token_ids=group.full_message,
                                                     response_starts=group.prompts.lengths.tolist())
        async with self.reference_stats.track(self._scoring):
            with tracing.span("reference"):
                ref_log_probs = await self._references.submit(request, request.ByteSize())
        if list(ref_log_probs.lengths) != group.responses.lengths.tolist():
            raise WireError("ref_log_probs.lengths", f"{list(ref_log_probs.lengths)} do not match the "
                            f"response lengths {group.responses.lengths.tolist()}")
        return ref_log_probs

    async def _reference_call(self, requests: list[reference_pb2.ScoreLogProbsRequest]
                              ) -> list[tensor_pb2.RaggedTensor]:
        """One ScoreLogProbs for the groups that queued (``_references``)."""
        request = requests[0] if len(requests) == 1 else batched_calls.merge_reference_requests(requests)
        reply = await call_with_retry(self.reference.ScoreLogProbs, request, method="ScoreLogProbs",
                                      settings=self.settings)
        return batched_calls.split_reference_response(reply, [len(r.response_starts) for r in requests])

    def task_of(self, item: PromptItem) -> reward_pb2.Task:
        """What ``item``'s samples are scored against: its reward function (else the collector's default),
        ground truth and arguments; the batch records the first two with each sample."""
        return reward_pb2.Task(reward_fn=item.reward_fn or self.default_reward_fn, ground_truth=item.ground_truth,
                               args=item.reward_args)

    async def rewards(self, item: PromptItem, group: GroupSamples, ref_log_probs: tensor_pb2.RaggedTensor,
                      group_id: int) -> reward_pb2.ComputeRewardsResponse:
        """The group's scores, advantages and KL penalties."""
        n = len(group)
        request = reward_pb2.ComputeRewardsRequest(
            response_token_ids=group.responses_message,
            behavior_log_probs=group.behavior_message,
            ref_log_probs=ref_log_probs,
            response_mask=group.response_mask_message,
            environment_rewards=group.environment_rewards,
            prompt_texts=[item.prompt_text()] * n,
            tasks=[self.task_of(item)],
            group_ids=[group_id] * n,
            kl_estimator=self.kl_estimator,
            advantage_mode=self.advantage_mode,
            update_kl_controller=self.update_kl_controller,
            run_id=self.run_id,
        )
        async with self.reward_stats.track(self._scoring):
            with tracing.span("reward"):
                return await self._rewards.submit(request, request.ByteSize())

    async def _reward_call(self, requests: list[reward_pb2.ComputeRewardsRequest]
                           ) -> list[reward_pb2.ComputeRewardsResponse]:
        """One ComputeRewards for the groups that queued (``_rewards``)."""
        request = requests[0] if len(requests) == 1 else batched_calls.merge_reward_requests(requests)
        reply = await call_with_retry(self.reward.ComputeRewards, request, method="ComputeRewards",
                                      settings=self.settings)
        return batched_calls.split_reward_response(reply, [len(r.group_ids) for r in requests])
