"""Building the trajectory TensorDict of one finished GRPO group (TorchRL LLM layout)."""

from __future__ import annotations

from typing import Sequence

import torch
from tensordict import NonTensorStack, TensorDict

from rlfleet.v1 import generation_pb2, reward_pb2, sampling_pb2
from rlfleet.wire import Ragged, decode_ragged, decode_tensor


def group_tensordict(
    *, samples: Sequence[generation_pb2.GenerateResponse], ref_log_probs: Sequence[torch.Tensor],
    rewards: reward_pb2.ComputeRewardsResponse, group_id: int, prompt_id: str, kl_coef: float,
    query: str = "",
) -> TensorDict:
    """One row per sample; ragged per-token entries become jagged nested tensors."""
    n = len(samples)
    prompts = [decode_tensor(s.prompt_token_ids).to(torch.int64) for s in samples]
    responses = [decode_tensor(s.response_token_ids).to(torch.int64) for s in samples]
    behavior = [decode_tensor(s.behavior_log_probs).to(torch.float32) for s in samples]
    full = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    finish = [s.finish_reason for s in samples]
    nested = lambda tensors: Ragged.from_list(list(tensors)).to_nested()  # noqa: E731

    td = TensorDict(
        {
            "score": decode_tensor(rewards.scores).clone(),
            "clipped_score": decode_tensor(rewards.clipped_scores).clone(),
            "advantage": decode_tensor(rewards.advantages).clone(),
            "kl_mean": decode_tensor(rewards.kl_mean).clone(),
            "kl_coef": torch.full((n,), kl_coef, dtype=torch.float32),
            "policy_version_start": torch.tensor([s.policy_version_start for s in samples], dtype=torch.int64),
            "policy_version_end": torch.tensor([s.policy_version_end for s in samples], dtype=torch.int64),
            "group_id": torch.full((n,), group_id, dtype=torch.int64),
            "group_size": torch.full((n,), n, dtype=torch.int64),
            "sample_index": torch.tensor([s.sample_index for s in samples], dtype=torch.int64),
            "generation_seconds": torch.tensor([s.timing.total_seconds for s in samples], dtype=torch.float32),
        },
        batch_size=[n],
    )
    td["tokens", "prompt"] = nested(prompts)
    td["tokens", "response"] = nested(responses)
    td["tokens", "full"] = nested(full)
    td["masks", "all_attention_mask"] = nested(torch.ones(len(f), dtype=torch.bool) for f in full)
    td["masks", "all_assistant_mask"] = nested(
        torch.cat([torch.zeros(len(p), dtype=torch.bool), torch.ones(len(r), dtype=torch.bool)])
        for p, r in zip(prompts, responses))
    td["log_probs", "response"] = nested(behavior)
    td["ref_log_probs", "response"] = nested(t.to(torch.float32) for t in ref_log_probs)
    td["kl"] = nested(decode_ragged(rewards.kl, "kl").to_list())
    td["next", "reward"] = nested(decode_ragged(rewards.rewards, "rewards").to_list())
    td["next", "done"] = torch.ones(n, 1, dtype=torch.bool)
    td["next", "terminated"] = torch.tensor([[f == sampling_pb2.FINISH_REASON_STOP] for f in finish])
    td["next", "truncated"] = torch.tensor([[f == sampling_pb2.FINISH_REASON_LENGTH] for f in finish])
    params = samples[0].sampling
    td["sampling", "temperature"] = torch.full((n,), params.temperature, dtype=torch.float32)
    td["sampling", "top_p"] = torch.full((n,), params.top_p, dtype=torch.float32)
    td["sampling", "top_k"] = torch.full((n,), params.top_k, dtype=torch.int64)
    td["sampling", "max_tokens"] = torch.full((n,), params.max_tokens, dtype=torch.int64)
    td["trajectory_id"] = NonTensorStack.from_list([f"{group_id:x}-{s.sample_index}" for s in samples])
    td["prompt_id"] = NonTensorStack.from_list([prompt_id] * n)
    td["query"] = NonTensorStack.from_list([query] * n)
    return td
