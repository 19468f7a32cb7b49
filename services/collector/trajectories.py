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
from rlfleet.wire import Ragged, WireError, decode_ragged, decode_tensor, encode_ragged
from rlfleet.wire.tensor import checked_tensor, encode_values

FLOAT32 = tensor_pb2.DTYPE_FLOAT32
NOT_SAMPLED = -1
"""``versions/response`` over an episode's observation tokens: no policy sampled them."""


@dataclass
class GroupSamples:
    """A group's samples (by ``sample_index``), their per-token data decoded once. A sample is one
    response (``decode``) or one multi-turn episode (``services/collector/episode_runner.py``), whose
    ``responses`` hold everything after the opening prompt: sampled and observation tokens."""

    prompts: Ragged
    responses: Ragged
    behavior_log_probs: Ragged
    """Per response token; 0 over observation tokens (not sampled: ``response_mask`` is false there)."""
    response_mask: Ragged | None
    """True over sampled tokens; None: every response token was sampled (single turn)."""
    version_start: list[int]
    version_end: list[int]
    sample_index: list[int]
    seconds: list[float]
    terminated: list[bool]
    truncated: list[bool]
    sampling: sampling_pb2.SamplingParams
    """As the replica echoed it (the first turn's for episodes)."""
    turn_versions: Ragged
    """Per sample, one (start, end) policy-version pair per assistant turn: int64 ``[turns, 2]``."""
    versions: Ragged
    """Per response token, the policy version whose weights sampled it; ``NOT_SAMPLED`` over observation tokens."""
    environment_rewards: list[float] | None = None
    """Each episode's reward from its environment (per-turn rewards plus the final one); None: no environment."""

    @classmethod
    def decode(cls, samples: Sequence[generation_pb2.GenerateResponse]) -> "GroupSamples":
        responses = _joined([s.response_token_ids for s in samples], "response_token_ids", torch.int64)
        starts, ends = [s.policy_version_start for s in samples], [s.policy_version_end for s in samples]
        reasons = [s.finish_reason for s in samples]
        return cls(_joined([s.prompt_token_ids for s in samples], "prompt_token_ids", torch.int64), responses,
                   _joined([s.behavior_log_probs for s in samples], "behavior_log_probs", torch.float32), None,
                   starts, ends, [s.sample_index for s in samples], [s.timing.total_seconds for s in samples],
                   [r == sampling_pb2.FINISH_REASON_STOP for r in reasons],
                   [r == sampling_pb2.FINISH_REASON_LENGTH for r in reasons], samples[0].sampling,
                   Ragged(torch.from_numpy(numpy.array([starts, ends], dtype=numpy.int64).T.copy()),
                          torch.ones(len(samples), dtype=torch.int64)),
                   _versions(samples, responses.lengths))

    def __len__(self) -> int:
        return len(self.sample_index)

    @cached_property
    def full(self) -> Ragged:
        """Prompt then response tokens of each sample: the sequence the trainer scores."""
        prompts, responses = self.prompts.values.numpy(), self.responses.values.numpy()  # numpy slices: ~10x cheaper
        pieces, prompt_at, response_at = [], 0, 0
        for prompt_length, response_length in zip(self.prompts.lengths.tolist(), self.responses.lengths.tolist()):
            pieces += (prompts[prompt_at:prompt_at + prompt_length],
                       responses[response_at:response_at + response_length])
            prompt_at, response_at = prompt_at + prompt_length, response_at + response_length
        return Ragged(torch.from_numpy(numpy.concatenate(pieces)) if pieces else torch.empty(0, dtype=torch.int64),
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

    @cached_property
    def response_mask_message(self) -> tensor_pb2.RaggedTensor | None:
        return None if self.response_mask is None else encode_ragged(self.response_mask)

    @property
    def start_version(self) -> int:
        return min(self.version_start)

    @property
    def end_version(self) -> int:
        return max(self.version_end)


def _joined(messages: Sequence[tensor_pb2.Tensor], field: str, dtype: torch.dtype) -> Ragged:
    """The samples' tensors ``messages`` as one ``dtype`` Ragged, each checked as ``decode_tensor`` checks
    it. When all are 1-D ``dtype`` already (what replicas send), their bytes are joined and viewed once
    instead of each one decoded, converted and concatenated: a group's decode is a few tensor calls."""
    checked = [checked_tensor(message, field) for message in messages]
    if any(wire_dtype != dtype or len(shape) != 1 for wire_dtype, shape, _ in checked):
        return Ragged.from_list([decode_tensor(message, field).to(dtype) for message in messages], dtype)
    data = bytearray().join(data for _, _, data in checked)  # writable: a tensor of its own, as cat made
    values = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return Ragged(values, torch.tensor([shape[0] for _, shape, _ in checked], dtype=torch.int64))


def _versions(samples: Sequence[generation_pb2.GenerateResponse], lengths: torch.Tensor) -> Ragged:
    """``versions``: each sample's ``response_versions``; one call for a group whose samples have no spans."""
    if any(s.policy_version_spans for s in samples):
        return Ragged.from_list([response_versions(s, length) for s, length in zip(samples, lengths.tolist())],
                                torch.int64)
    starts = numpy.array([s.policy_version_start for s in samples], dtype=numpy.int64)
    return Ragged(torch.from_numpy(numpy.repeat(starts, lengths.numpy())), lengths.clone())


def response_versions(sample: generation_pb2.GenerateResponse, length: int) -> torch.Tensor:
    """The policy version that sampled each of the sample's ``length`` response tokens, from the
    replica's spans (which must cover the tokens in order); a sample without spans (no token labelled
    by the engine) has its start version throughout. ``WireError`` names a span that does not fit."""
    spans = sample.policy_version_spans
    if not spans:
        return torch.full((length,), sample.policy_version_start, dtype=torch.int64)
    versions = torch.empty(length, dtype=torch.int64)
    position = 0
    for index, span in enumerate(spans):
        if span.start != position or span.end < span.start:
            raise WireError(f"policy_version_spans[{index}]", f"starts at token {span.start}, not {position}"
                            if span.start != position else f"ends at {span.end}, before its start {span.start}")
        versions[span.start:min(span.end, length)] = span.version
        position = span.end
    if position != length:
        raise WireError("policy_version_spans", f"cover tokens [0, {position}) of {length}")
    return versions


def group_message(*, group: GroupSamples, ref_log_probs: tensor_pb2.RaggedTensor,
                  rewards: reward_pb2.ComputeRewardsResponse, group_id: int, prompt_id: str,
                  query: str = "", task: reward_pb2.Task | None = None) -> tensor_pb2.TensorDict:
    """The group's rows as one TensorDict message (batch size = group size)."""
    n = len(group)
    msg = tensor_pb2.TensorDict(batch_size=[n])
    entries = msg.entries
    for key, tensor in (("score", rewards.scores), ("clipped_score", rewards.clipped_scores),
                        ("advantage", rewards.advantages), ("kl_mean", rewards.kl_mean)):
        entries[key].tensor.CopyFrom(tensor)
    _column(entries["kl_coef"], [rewards.kl_coef] * n, torch.float32)
    _column(entries["policy_version_start"], group.version_start, torch.int64)
    _column(entries["policy_version_end"], group.version_end, torch.int64)
    _column(entries["group_id"], [group_id] * n, torch.int64)
    _column(entries["group_size"], [n] * n, torch.int64)
    _column(entries["sample_index"], group.sample_index, torch.int64)
    _column(entries["generation_seconds"], group.seconds, torch.float32)
    versions = _nested(entries["versions"], n)
    _ragged_column(versions.entries["response"], group.versions.values.numpy(), torch.int64, group.versions.lengths)
    turns = _nested(entries["turns"], n)
    _ragged_column(turns.entries["policy_versions"], group.turn_versions.values.numpy(), torch.int64,
                   group.turn_versions.lengths)
    _column(entries["environment_reward"], group.environment_rewards or [0.0] * n, torch.float32)
    tokens = _nested(entries["tokens"], n)
    encode_ragged(group.prompts, out=tokens.entries["prompt"].ragged)
    tokens.entries["response"].ragged.CopyFrom(group.responses_message)
    tokens.entries["full"].ragged.CopyFrom(group.full_message)
    _masks(_nested(entries["masks"], n), group)
    _nested(entries["log_probs"], n).entries["response"].ragged.CopyFrom(group.behavior_message)
    _nested(entries["ref_log_probs"], n).entries["response"].ragged.CopyFrom(_float32(ref_log_probs))
    entries["kl"].ragged.CopyFrom(rewards.kl)
    after = _nested(entries["next"], n)
    after.entries["reward"].ragged.CopyFrom(rewards.rewards)
    _column(after.entries["done"], [[True]] * n, torch.bool)
    _column(after.entries["terminated"], [[t] for t in group.terminated], torch.bool)
    _column(after.entries["truncated"], [[t] for t in group.truncated], torch.bool)
    params = group.sampling
    sampling = _nested(entries["sampling"], n)
    _column(sampling.entries["temperature"], [params.temperature] * n, torch.float32)
    _column(sampling.entries["top_p"], [params.top_p] * n, torch.float32)
    _column(sampling.entries["top_k"], [params.top_k] * n, torch.int64)
    _column(sampling.entries["max_tokens"], [params.max_tokens] * n, torch.int64)
    entries["trajectory_id"].strings.values[:] = [f"{group_id:x}-{i}" for i in group.sample_index]
    entries["prompt_id"].strings.values[:] = [prompt_id] * n
    entries["query"].strings.values[:] = [query] * n
    task = task or reward_pb2.Task()
    entries["reward_fn"].strings.values[:] = [task.reward_fn] * n
    entries["ground_truth"].strings.values[:] = [task.ground_truth] * n
    return msg


def _masks(masks: tensor_pb2.TensorDict, group: GroupSamples) -> None:
    """Over each full sequence: attention (every token) and the assistant's (the sampled tokens: the whole
    response, or in an episode the response mask's)."""
    prompt_lengths, response_lengths = group.prompts.lengths.tolist(), group.responses.lengths.tolist()
    total = sum(prompt_lengths) + sum(response_lengths)
    _ragged_column(masks.entries["all_attention_mask"], numpy.ones(total, dtype=numpy.bool_), torch.bool,
                   group.full.lengths)
    assistant = numpy.zeros(total, dtype=numpy.bool_)
    sampled = None if group.response_mask is None else group.response_mask.values.numpy()
    start, at = 0, 0
    for prompt_length, response_length in zip(prompt_lengths, response_lengths):
        begin = start + prompt_length
        assistant[begin:begin + response_length] = True if sampled is None else sampled[at:at + response_length]
        start, at = begin + response_length, at + response_length
    _ragged_column(masks.entries["all_assistant_mask"], assistant, torch.bool, group.full.lengths)


def _column(entry: tensor_pb2.TensorDictValue, values, dtype: torch.dtype) -> None:
    """A small dense column, written straight into its message."""
    encode_values(values, dtype, entry.tensor)


def _ragged_column(entry: tensor_pb2.TensorDictValue, values: numpy.ndarray, dtype: torch.dtype,
                   lengths: torch.Tensor) -> None:
    encode_values(values, dtype, entry.ragged.values)
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
