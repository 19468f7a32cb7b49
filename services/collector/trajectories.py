"""One finished GRPO group: its samples decoded once, and the trajectory message appended for it
(TorchRL's LLM layout, the keys of the batch schema ``rlfleet.wire.batch_schema``).

Nothing is decoded twice and nothing that does not change is re-encoded: the samples' token ids
and log-probs are decoded once into raggeds (``GroupSamples``), each encoded once and copied
into every request that carries it; the reference's log-probs and the reward service's tensors
go into the trajectory message as the bytes they arrived as.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from rlfleet.v1 import generation_pb2, reward_pb2, sampling_pb2, tensor_pb2
from rlfleet.wire import Ragged, decode_ragged, decode_tensor, encode_ragged, encode_tensor

FLOAT32 = tensor_pb2.DTYPE_FLOAT32


@dataclass
class GroupSamples:
    """A group's samples (sorted by ``sample_index``), their per-token data decoded once."""

    samples: Sequence[generation_pb2.GenerateResponse]
    prompts: Ragged
    responses: Ragged
    behavior_log_probs: Ragged

    @classmethod
    def decode(cls, samples: Sequence[generation_pb2.GenerateResponse]) -> "GroupSamples":
        prompts = [decode_tensor(s.prompt_token_ids, "prompt_token_ids").to(torch.int64) for s in samples]
        responses = [decode_tensor(s.response_token_ids, "response_token_ids").to(torch.int64) for s in samples]
        behavior = [decode_tensor(s.behavior_log_probs, "behavior_log_probs").to(torch.float32) for s in samples]
        return cls(samples, Ragged.from_list(prompts, torch.int64), Ragged.from_list(responses, torch.int64),
                   Ragged.from_list(behavior, torch.float32))

    def __len__(self) -> int:
        return len(self.samples)

    @cached_property
    def full(self) -> Ragged:
        """Prompt then response tokens of each sample: the sequence the trainer scores."""
        pieces = [piece for p, r in zip(self.prompts.to_list(), self.responses.to_list()) for piece in (p, r)]
        return Ragged(torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64),
                      self.prompts.lengths + self.responses.lengths)

    @cached_property
    def full_message(self) -> tensor_pb2.RaggedTensor:
        return encode_ragged(self.full)

    @cached_property
    def responses_message(self) -> tensor_pb2.RaggedTensor:
        return encode_ragged(self.responses)

    @cached_property
    def behavior_message(self) -> tensor_pb2.RaggedTensor:
        return encode_ragged(self.behavior_log_probs)

    @property
    def start_version(self) -> int:
        return min(s.policy_version_start for s in self.samples)

    @property
    def end_version(self) -> int:
        return max(s.policy_version_end for s in self.samples)


def group_message(*, group: GroupSamples, ref_log_probs: tensor_pb2.RaggedTensor,
                  rewards: reward_pb2.ComputeRewardsResponse, group_id: int, prompt_id: str,
                  query: str = "") -> tensor_pb2.TensorDict:
    """The group's rows as one TensorDict message (batch size = group size)."""
    n, samples = len(group), group.samples
    msg = tensor_pb2.TensorDict(batch_size=[n])
    entries = msg.entries
    for key, tensor in (("score", rewards.scores), ("clipped_score", rewards.clipped_scores),
                        ("advantage", rewards.advantages), ("kl_mean", rewards.kl_mean)):
        entries[key].tensor.CopyFrom(tensor)
    _tensor(entries["kl_coef"], torch.full((n,), rewards.kl_coef, dtype=torch.float32))
    _tensor(entries["policy_version_start"], torch.tensor([s.policy_version_start for s in samples]))
    _tensor(entries["policy_version_end"], torch.tensor([s.policy_version_end for s in samples]))
    _tensor(entries["group_id"], torch.full((n,), group_id, dtype=torch.int64))
    _tensor(entries["group_size"], torch.full((n,), n, dtype=torch.int64))
    _tensor(entries["sample_index"], torch.tensor([s.sample_index for s in samples], dtype=torch.int64))
    _tensor(entries["generation_seconds"], torch.tensor([s.timing.total_seconds for s in samples],
                                                        dtype=torch.float32))
    tokens = _nested(entries["tokens"], n)
    encode_ragged(group.prompts, out=tokens.entries["prompt"].ragged)
    tokens.entries["response"].ragged.CopyFrom(group.responses_message)
    tokens.entries["full"].ragged.CopyFrom(group.full_message)
    masks = _nested(entries["masks"], n)
    total = int(group.full.lengths.sum())
    encode_ragged(Ragged(torch.ones(total, dtype=torch.bool), group.full.lengths),
                  out=masks.entries["all_attention_mask"].ragged)
    assistant = torch.cat([piece for p, r in zip(group.prompts.lengths.tolist(), group.responses.lengths.tolist())
                           for piece in (torch.zeros(p, dtype=torch.bool), torch.ones(r, dtype=torch.bool))]) \
        if total else torch.empty(0, dtype=torch.bool)
    encode_ragged(Ragged(assistant, group.full.lengths), out=masks.entries["all_assistant_mask"].ragged)
    _nested(entries["log_probs"], n).entries["response"].ragged.CopyFrom(group.behavior_message)
    _nested(entries["ref_log_probs"], n).entries["response"].ragged.CopyFrom(_float32(ref_log_probs))
    entries["kl"].ragged.CopyFrom(rewards.kl)
    after = _nested(entries["next"], n)
    after.entries["reward"].ragged.CopyFrom(rewards.rewards)
    finish = [s.finish_reason for s in samples]
    _tensor(after.entries["done"], torch.ones(n, 1, dtype=torch.bool))
    _tensor(after.entries["terminated"], torch.tensor([[f == sampling_pb2.FINISH_REASON_STOP] for f in finish]))
    _tensor(after.entries["truncated"], torch.tensor([[f == sampling_pb2.FINISH_REASON_LENGTH] for f in finish]))
    params = samples[0].sampling
    sampling = _nested(entries["sampling"], n)
    _tensor(sampling.entries["temperature"], torch.full((n,), params.temperature, dtype=torch.float32))
    _tensor(sampling.entries["top_p"], torch.full((n,), params.top_p, dtype=torch.float32))
    _tensor(sampling.entries["top_k"], torch.full((n,), params.top_k, dtype=torch.int64))
    _tensor(sampling.entries["max_tokens"], torch.full((n,), params.max_tokens, dtype=torch.int64))
    entries["trajectory_id"].strings.values[:] = [f"{group_id:x}-{s.sample_index}" for s in samples]
    entries["prompt_id"].strings.values[:] = [prompt_id] * n
    entries["query"].strings.values[:] = [query] * n
    return msg


def _tensor(entry: tensor_pb2.TensorDictValue, tensor: torch.Tensor) -> None:
    encode_tensor(tensor, out=entry.tensor)


def _nested(entry: tensor_pb2.TensorDictValue, n: int) -> tensor_pb2.TensorDict:
    entry.nested.batch_size[:] = [n]
    return entry.nested


def _float32(ragged: tensor_pb2.RaggedTensor) -> tensor_pb2.RaggedTensor:
    """The ragged as float32 (the reference sends float32: passed through as received)."""
    if ragged.values.dtype == FLOAT32:
        return ragged
    decoded = decode_ragged(ragged, "ref_log_probs")
    return encode_ragged(Ragged(decoded.values.to(torch.float32), decoded.lengths))
