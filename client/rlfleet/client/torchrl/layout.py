"""rlfleet batches in TorchRL's LLM layout (torchrl 0.14): a lazy stack of per-sample TensorDicts.

TorchRL's consumers read variable-length fields with ``td.get(key, as_padded_tensor=True,
padding_side="left")`` / ``as_list=True``, which act only on a ``LazyStackedTensorDict`` whose
per-sample leaves are unpadded (``docs/reference/torchrl-0.14-layout.md`` §0). The wire batch is dense with
jagged nested tensors (``Batch.td``, the ragged form); ``to_torchrl`` re-shapes it, sample by
sample, into what ``LLMCollector`` + ``vLLMWrapper`` + ``RetrieveKL`` + ``MCAdvantage`` produce:

========================================  ===============  =====================================
key (per sample ``i``)                    shape            value
========================================  ===============  =====================================
``tokens/{prompt,response,full}``         ``(P|R|T,)``     int64 token ids, ``full = prompt + response``
``masks/all_attention_mask``              ``(T,)``         bool, all True
``masks/all_assistant_mask``              ``(T,)``         bool, True over the response
``log_probs/response``                    ``(R,)``         behaviour log-probs (engine, of ``logits / temperature``)
``log_probs/full``                        ``(T,)``         NaN over the prompt (not scored, as vLLM without
                                                           prompt log-probs), then ``log_probs/response``
``next/ref_log_probs/{response,full}``    ``(R,)|(T,)``    reference log-probs; ``full`` is 0 over the prompt
``advantage``                             ``(1, 1)``       float32, the group-normalised advantage
``next/reward``                           ``(1, 1)``       float32, the (clipped) task score the advantage is of
``next/token_reward``                     ``(R, 1)``       rlfleet's KL-shaped per-token reward
``next/{done,terminated,truncated}``      ``(1,)``         bool (done: True; single-turn)
``{done,terminated,truncated}``           ``(1,)``         bool, False (the state before the step)
``policy_version``, ``next/policy_version``  ``()``        int64: version at generation start / end
``versions/response``                     ``(R,)``         int64: the version that sampled each response token
                                                           (-1 over an episode's observation tokens)
``query``                                 str              the prompt's text (the last user message of a chat),
                                                           or its prompt id for token-id prompts: MCAdvantage's
                                                           group key
``kl``                                    ``(R,)``         per-token KL estimate to the reference
``score``, ``clipped_score``, ``kl_mean``, ``kl_coef``,   ``()``  as in the ragged form
``group_id``, ``group_size``, ``sample_index``, ``generation_seconds``,
``policy_version_{start,end}``, ``sampling/*``, ``trajectory_id``, ``prompt_id``
========================================  ===============  =====================================

Not carried (rlfleet keeps token ids, not text): ``text/*``, ``history/*``, ``log_probs/prompt``.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, TensorDictBase, lazy_stack

from rlfleet.wire import string_list

# Ragged-form keys re-placed or re-shaped below; every other entry is carried per sample as is.
_MOVED = {("tokens",), ("masks",), ("log_probs",), ("ref_log_probs",), ("next",), ("advantage",),
          ("query",)}


def to_torchrl(td: TensorDictBase) -> LazyStackedTensorDict:
    """The ragged batch ``td`` (``Batch.td``) as TorchRL 0.14's lazy stack of per-sample TensorDicts."""
    if isinstance(td, LazyStackedTensorDict):
        return td
    count = int(td.batch_size[0])
    if count == 0:
        raise ValueError("an empty batch has no TorchRL layout (a lazy stack needs at least one sample)")
    rows: list[dict[str, Any]] = [dict() for _ in range(count)]

    def put(key: tuple[str, ...], values) -> None:
        for row, value in zip(rows, values):
            node = row
            for part in key[:-1]:
                node = node.setdefault(part, {})
            node[key[-1]] = value

    tokens = {name: _samples(td.get(("tokens", name))) for name in ("prompt", "response", "full")}
    for name, values in tokens.items():
        put(("tokens", name), values)
    for name in ("all_attention_mask", "all_assistant_mask"):
        put(("masks", name), _samples(td.get(("masks", name))))
    prompt_lengths = [len(p) for p in tokens["prompt"]]
    behaviour = _samples(td.get(("log_probs", "response")))
    put(("log_probs", "response"), behaviour)
    put(("log_probs", "full"), [_after(torch.full((p,), float("nan")), b) for p, b in zip(prompt_lengths, behaviour)])
    reference = _samples(td.get(("ref_log_probs", "response")))
    put(("next", "ref_log_probs", "response"), reference)
    put(("next", "ref_log_probs", "full"), [_after(torch.zeros(p), r) for p, r in zip(prompt_lengths, reference)])

    put(("advantage",), td.get("advantage").to(torch.float32).reshape(count, 1, 1).unbind(0))
    put(("next", "reward"), td.get("clipped_score").to(torch.float32).reshape(count, 1, 1).unbind(0))
    put(("next", "token_reward"), [r.unsqueeze(-1) for r in _samples(td.get(("next", "reward")))])
    for name in ("done", "terminated", "truncated"):
        flags = td.get(("next", name)).reshape(count, 1)
        put(("next", name), flags.unbind(0))
        put((name,), torch.zeros_like(flags).unbind(0))
    put(("policy_version",), td.get("policy_version_start").unbind(0))
    put(("next", "policy_version"), td.get("policy_version_end").unbind(0))
    queries = _strings(td, "query") if "query" in td.keys() else [""] * count
    put(("query",), [q or pid for q, pid in zip(queries, _strings(td, "prompt_id"))])

    for key in td.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf):
        key = key if isinstance(key, tuple) else (key,)
        if key[:1] in _MOVED:
            continue
        value = td.get(key)
        put(key, _strings(td, key) if isinstance(value, NonTensorStack) else _samples(value))
    return lazy_stack([TensorDict(row, batch_size=[]) for row in rows], 0)


def _is_leaf(cls: type) -> bool:
    # String columns (NonTensorStack) are TensorDictBase subclasses: leaves here on every minor.
    return not issubclass(cls, TensorDictBase) or issubclass(cls, (NonTensorStack, NonTensorData))


def _samples(value: torch.Tensor) -> list[torch.Tensor]:
    # A jagged nested tensor unbinds into its unpadded rows; a dense one into its rows.
    return list(value.unbind(0))


def _after(prefix: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.cat([prefix.to(values.dtype), values])


def _strings(td: TensorDictBase, key) -> list[str]:
    return string_list(td.get(key))
