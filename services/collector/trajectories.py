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

import numpy
import torch

from rlfleet.v1 import generation_pb2, reward_pb2, sampling_pb2, tensor_pb2
from rlfleet.wire import Ragged, decode_ragged, decode_tensor, encode_ragged

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
    _column(entries["kl_coef"], [rewards.kl_coef] * n, numpy.float32)
    _column(entries["policy_version_start"], [s.policy_version_start for s in samples], numpy.int64)
    _column(entries["policy_version_end"], [s.policy_version_end for s in samples], numpy.int64)
    _column(entries["group_id"], [group_id] * n, numpy.int64)
    _column(entries["group_size"], [n] * n, numpy.int64)
    _column(entries["sample_index"], [s.sample_index for s in samples], numpy.int64)
    _column(entries["generation_seconds"], [s.timing.total_seconds for s in samples], numpy.float32)
    tokens = _nested(entries["tokens"], n)
    encode_ragged(group.prompts, out=tokens.entries["prompt"].ragged)
    tokens.entries["response"].ragged.CopyFrom(group.responses_message)
    tokens.entries["full"].ragged.CopyFrom(group.full_message)
    masks = _nested(entries["masks"], n)
    prompt_lengths, response_lengths = group.prompts.lengths.tolist(), group.responses.lengths.tolist()
    total = sum(prompt_lengths) + sum(response_lengths)
    _ragged_column(masks.entries["all_attention_mask"], numpy.ones(total, dtype=numpy.bool_), group.full.lengths)
    assistant = numpy.zeros(total, dtype=numpy.bool_)
    start = 0
    for prompt_length, response_length in zip(prompt_lengths, response_lengths):
        assistant[start + prompt_length:start + prompt_length + response_length] = True
        start += prompt_length + response_length
    _ragged_column(masks.entries["all_assistant_mask"], assistant, group.full.lengths)
    _nested(entries["log_probs"], n).entries["response"].ragged.CopyFrom(group.behavior_message)
    _nested(entries["ref_log_probs"], n).entries["response"].ragged.CopyFrom(_float32(ref_log_probs))
    entries["kl"].ragged.CopyFrom(rewards.kl)
    after = _nested(entries["next"], n)
    after.entries["reward"].ragged.CopyFrom(rewards.rewards)
    finish = [s.finish_reason for s in samples]
    _column(after.entries["done"], [[True]] * n, numpy.bool_)
    _column(after.entries["terminated"], [[f == sampling_pb2.FINISH_REASON_STOP] for f in finish], numpy.bool_)
    _column(after.entries["truncated"], [[f == sampling_pb2.FINISH_REASON_LENGTH] for f in finish], numpy.bool_)
    params = samples[0].sampling
    sampling = _nested(entries["sampling"], n)
    _column(sampling.entries["temperature"], [params.temperature] * n, numpy.float32)
    _column(sampling.entries["top_p"], [params.top_p] * n, numpy.float32)
    _column(sampling.entries["top_k"], [params.top_k] * n, numpy.int64)
    _column(sampling.entries["max_tokens"], [params.max_tokens] * n, numpy.int64)
    entries["trajectory_id"].strings.values[:] = [f"{group_id:x}-{s.sample_index}" for s in samples]
    entries["prompt_id"].strings.values[:] = [prompt_id] * n
    entries["query"].strings.values[:] = [query] * n
    return msg


_WIRE = {numpy.dtype(numpy.int64): tensor_pb2.DTYPE_INT64, numpy.dtype(numpy.float32): tensor_pb2.DTYPE_FLOAT32,
         numpy.dtype(numpy.bool_): tensor_pb2.DTYPE_BOOL}
"""The few dtypes of a group's small columns: built with numpy, a fraction of a torch tensor's cost."""


def _column(entry: tensor_pb2.TensorDictValue, values, dtype) -> None:
    """A small dense column, written straight into its message (little-endian, as the wire wants)."""
    array = numpy.asarray(values, dtype=numpy.dtype(dtype).newbyteorder("<"))
    entry.tensor.dtype = _WIRE[numpy.dtype(dtype)]
    entry.tensor.shape[:] = array.shape
    entry.tensor.data = array.tobytes()


def _ragged_column(entry: tensor_pb2.TensorDictValue, values: numpy.ndarray, lengths: torch.Tensor) -> None:
    entry.ragged.values.dtype = _WIRE[values.dtype]
    entry.ragged.values.shape[:] = values.shape
    entry.ragged.values.data = values.tobytes()
    entry.ragged.lengths[:] = lengths.tolist()


def _nested(entry: tensor_pb2.TensorDictValue, n: int) -> tensor_pb2.TensorDict:
    entry.nested.batch_size[:] = [n]
    return entry.nested


def _float32(ragged: tensor_pb2.RaggedTensor) -> tensor_pb2.RaggedTensor:
    """The ragged as float32 (the reference sends float32: passed through as received)."""
    if ragged.values.dtype == FLOAT32:
        return ragged
    decoded = decode_ragged(ragged, "ref_log_probs")
    return encode_ragged(Ragged(decoded.values.to(torch.float32), decoded.lengths))
