"""How the requests of several groups become one call, and its answer one answer per group
(``coalescer.Coalescer`` decides when). Byte surgery on the messages (``rlfleet.wire.rows``):
nothing is decoded, so what passes through stays exact.
"""

from __future__ import annotations

from typing import Sequence

from rlfleet.v1 import reference_pb2, reward_pb2, tensor_pb2, trajectory_pb2
from rlfleet.wire import WireError
from rlfleet.wire.rows import concat_raggeds, concat_tensordicts, split_ragged, split_tensor

_PER_SAMPLE_TENSORS = ("scores", "clipped_scores", "advantages", "kl_mean", "kl_sum")
_PER_SAMPLE_RAGGEDS = ("kl", "rewards")


def merge_reference_requests(requests: Sequence[reference_pb2.ScoreLogProbsRequest]
                             ) -> reference_pb2.ScoreLogProbsRequest:
    """One ScoreLogProbs request for the sequences of ``requests`` (the same ``with_entropy``)."""
    merged = reference_pb2.ScoreLogProbsRequest(with_entropy=requests[0].with_entropy)
    concat_raggeds([r.token_ids for r in requests], out=merged.token_ids)
    for request in requests:
        merged.response_starts.extend(request.response_starts)
    return merged


def split_reference_response(reply: reference_pb2.ScoreLogProbsResponse,
                             sizes: Sequence[int]) -> list[tensor_pb2.RaggedTensor]:
    """The reference log-probs of ``merge_reference_requests``' answer, per request of ``sizes`` sequences."""
    _check_rows(reply.ref_log_probs, "ref_log_probs", sum(sizes), "reference")
    return split_ragged(reply.ref_log_probs, sizes)


def merge_reward_requests(requests: Sequence[reward_pb2.ComputeRewardsRequest]) -> reward_pb2.ComputeRewardsRequest:
    """One ComputeRewards request for the groups of ``requests``: each one group with its samples'
    ``group_ids`` and one task (or one per sample); all with the same fields set, the same
    estimator, advantage mode and controller flag (as one collector's requests are).

    ``environment_rewards``: when any request has them, one per sample of the merged request (a request
    without them, 0 for each of its samples); when none has them, none. A request with neither none
    nor one per sample is a WireError: merged, its values would land on other groups' samples (the
    caller sends the groups one by one and the reward service refuses that one, naming it)."""
    first = requests[0]
    merged = reward_pb2.ComputeRewardsRequest(kl_estimator=first.kl_estimator, advantage_mode=first.advantage_mode,
                                              update_kl_controller=first.update_kl_controller, run_id=first.run_id)
    for field in ("response_token_ids", "behavior_log_probs", "ref_log_probs", "response_mask"):
        if first.HasField(field):
            concat_raggeds([getattr(r, field) for r in requests], out=getattr(merged, field))
    for request in requests:
        n = len(request.group_ids)
        merged.prompt_texts.extend(request.prompt_texts)
        merged.response_texts.extend(request.response_texts)
        merged.group_ids.extend(request.group_ids)
        merged.tasks.extend(request.tasks if len(request.tasks) == n else [request.tasks[0]] * n)
    if any(request.environment_rewards for request in requests):
        for request in requests:
            n, values = len(request.group_ids), request.environment_rewards
            if values and len(values) != n:
                raise WireError("environment_rewards", f"{len(values)} entries for a group of {n} samples")
            merged.environment_rewards.extend(values or [0.0] * n)
    return merged


def split_reward_response(reply: reward_pb2.ComputeRewardsResponse,
                          sizes: Sequence[int]) -> list[reward_pb2.ComputeRewardsResponse]:
    """The answer to ``merge_reward_requests`` as one answer per group of ``sizes`` samples (WireError
    if its per-sample fields do not have one row per sample)."""
    total = sum(sizes)
    for field in _PER_SAMPLE_TENSORS:
        if not getattr(reply, field).shape or getattr(reply, field).shape[0] != total:
            raise WireError(field, f"the reward service answered {list(getattr(reply, field).shape)} for {total} samples")
    for field in _PER_SAMPLE_RAGGEDS:
        _check_rows(getattr(reply, field), field, total, "reward")
    answers = [reward_pb2.ComputeRewardsResponse(kl_coef=reply.kl_coef) for _ in sizes]
    for field in _PER_SAMPLE_TENSORS:
        split_tensor(getattr(reply, field), sizes, outs=[getattr(answer, field) for answer in answers])
    for field in _PER_SAMPLE_RAGGEDS:
        split_ragged(getattr(reply, field), sizes, outs=[getattr(answer, field) for answer in answers])
    return answers


def append_request(groups: Sequence[tuple[str, tensor_pb2.TensorDict, bool]],
                   committed_version: int, trace_contexts: Sequence[str] = ()) -> trajectory_pb2.AppendRequest:
    """One Append for ``(key, rows, filtered)`` groups, each deduplicated on its own key, made while
    ``committed_version`` is committed (the store records the groups' staleness with it);
    ``trace_contexts``: each group's traceparent (sent only when some group has one: traced)."""
    request = trajectory_pb2.AppendRequest(group_keys=[key for key, _, _ in groups],
                                           committed_version=committed_version)
    if any(trace_contexts):
        request.trace_contexts.extend(trace_contexts)
    if any(filtered for _, _, filtered in groups):
        request.filtered_groups.extend(filtered for _, _, filtered in groups)
    if len(groups) == 1:
        request.trajectories.CopyFrom(groups[0][1])
    else:
        concat_tensordicts([rows for _, rows, _ in groups], out=request.trajectories)
    return request


def _check_rows(ragged: tensor_pb2.RaggedTensor, field: str, total: int, service: str) -> None:
    if len(ragged.lengths) != total:
        raise WireError(field, f"the {service} service answered {len(ragged.lengths)} rows for {total} sequences")

