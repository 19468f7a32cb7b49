"""Trainer-side prompts -> ``PromptSpec`` messages for ``SubmitPrompts``.

A prompt is raw text (``str``), a chat conversation (a list of
``{"role", "content"}`` dicts), or token ids (a list of ints or a 1-D integer
tensor). A dict with a ``"prompt"`` key adds task metadata, sampling
overrides and the ``"environment"`` that runs it as a multi-turn episode. A prompt without an id gets a random one here, so a retried
SubmitPrompts is harmless (the collector does not queue an id twice).
Mistakes raise ``TypeError`` / ``ValueError`` naming the prompt, before
anything is sent.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterable, Mapping, Sequence, Union

import torch

from rlfleet.v1 import collector_pb2, sampling_pb2
from rlfleet.wire.dtypes import TOKEN_ID_DTYPES
from rlfleet.wire.tensor import encode_tensor

ChatMessage = Mapping[str, str]
PromptLike = Union[str, Sequence[ChatMessage], Sequence[int], torch.Tensor]
PromptInput = Union[PromptLike, Mapping[str, Any], collector_pb2.PromptSpec]

SPEC_KEYS = ("prompt", "prompt_id", "ground_truth", "reward_fn", "reward_args", "sampling", "environment")


def to_prompt_specs(prompts: PromptInput | Iterable[PromptInput]) -> list[collector_pb2.PromptSpec]:
    """Convert one prompt or an iterable of prompts into ``PromptSpec`` messages.

    A single ``str``, spec dict, tensor or ``PromptSpec`` counts as one prompt;
    any other iterable is a list of prompts (so a chat is ``[messages]`` and
    token ids are ``[ids]``).
    """
    if isinstance(prompts, (str, Mapping, torch.Tensor, collector_pb2.PromptSpec)):
        prompts = [prompts]
    specs = [_spec(item, f"prompts[{i}]") for i, item in enumerate(prompts)]
    if not specs:
        raise ValueError("prompts: empty; pass at least one prompt")
    return specs


def _spec(item: Any, where: str) -> collector_pb2.PromptSpec:
    if isinstance(item, collector_pb2.PromptSpec):
        if item.prompt_id:
            return item
        spec = collector_pb2.PromptSpec()
        spec.CopyFrom(item)
        spec.prompt_id = uuid.uuid4().hex
        return spec
    if not isinstance(item, Mapping):
        return collector_pb2.PromptSpec(prompt=_prompt(item, where), prompt_id=uuid.uuid4().hex)
    if "prompt" not in item:
        hint = " (a chat must be wrapped in a list: submit_prompts([messages]))" if "role" in item else ""
        raise ValueError(f"{where}: a prompt dict needs a 'prompt' key{hint}")
    unknown = sorted(set(item) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {list(SPEC_KEYS)}")
    spec = collector_pb2.PromptSpec(
        prompt=_prompt(item["prompt"], f"{where}.prompt"),
        prompt_id=str(item.get("prompt_id") or uuid.uuid4().hex),
        ground_truth=str(item.get("ground_truth") or ""),
        reward_fn=str(item.get("reward_fn") or ""),
        environment=str(item.get("environment") or ""),
    )
    for key, value in dict(item.get("reward_args") or {}).items():
        spec.reward_args[str(key)] = value if isinstance(value, str) else str(value)
    sampling = item.get("sampling")
    if sampling is not None:
        spec.sampling.CopyFrom(_sampling(sampling, f"{where}.sampling"))
    return spec


def _prompt(value: Any, where: str) -> sampling_pb2.Prompt:
    if isinstance(value, sampling_pb2.Prompt):
        return value
    if isinstance(value, str):
        return sampling_pb2.Prompt(text=value)
    if isinstance(value, torch.Tensor):
        return sampling_pb2.Prompt(token_ids=encode_tensor(_token_ids(value, where)))
    if isinstance(value, Sequence) and value and all(isinstance(m, Mapping) for m in value):
        return sampling_pb2.Prompt(chat=sampling_pb2.ChatMessages(messages=[
            _chat_message(m, f"{where}[{i}]") for i, m in enumerate(value)]))
    if isinstance(value, Sequence) and value and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in value):
        return sampling_pb2.Prompt(token_ids=encode_tensor(torch.tensor(list(value), dtype=torch.int64)))
    if isinstance(value, int):
        raise TypeError(f"{where}: got a bare int; token ids must be wrapped in a list: submit_prompts([ids])")
    raise TypeError(f"{where}: expected text (str), chat messages (non-empty list of "
                    f"{{'role', 'content'}} dicts) or token ids (non-empty list of ints or a 1-D "
                    f"integer tensor), got {type(value).__name__}")


def _token_ids(tensor: torch.Tensor, where: str) -> torch.Tensor:
    if tensor.dim() != 1 or tensor.numel() == 0 or tensor.dtype not in TOKEN_ID_DTYPES:
        raise ValueError(f"{where}: token ids must be a non-empty 1-D int64/int32 tensor, "
                         f"got shape {list(tensor.shape)} {tensor.dtype}")
    return tensor


def _chat_message(message: Mapping[str, str], where: str) -> sampling_pb2.ChatMessage:
    extra = sorted(set(message) - {"role", "content"})
    if "role" not in message or "content" not in message or extra:
        raise ValueError(f"{where}: a chat message has exactly the keys 'role' and 'content', "
                         f"got {sorted(message)}")
    return sampling_pb2.ChatMessage(role=str(message["role"]), content=str(message["content"]))


def _sampling(value: Any, where: str) -> sampling_pb2.SamplingParams:
    if isinstance(value, sampling_pb2.SamplingParams):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"{where}: expected a dict of SamplingParams fields, got {type(value).__name__}")
    fields = set(sampling_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown sampling fields {unknown}; allowed: {sorted(fields)}")
    try:
        return sampling_pb2.SamplingParams(**value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
