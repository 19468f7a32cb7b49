"""What TorchRL users hold, as the ``{hf_name: tensor}`` state dict the served model knows.

Accepted: a TorchRL LLM wrapper (``TransformersWrapper``: its inner HF model is pushed), any
``nn.Module``, a state dict, or a ``TensorDict`` (``TensorDict.from_module(model)``, nested keys
joined with "."). Names as a wrapper holds them (``model.`` + the HF name, e.g.
``model.model.layers.0...`` and ``model.lm_head.weight``) are mapped to the HF names, as every
TorchRL weight updater does by registering the wrapper's ``.model``.

A ``peft.PeftModel`` (or a wrapper holding one) is a LoRA adapter: ``peft_adapter`` finds it, and the
collector pushes only its factors (``Client.push_adapter``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from rlfleet.client.lora import is_peft_model

WRAPPER_PREFIX = "model."
NON_PERSISTENT_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq",
                          "rotary_emb.cos_cached", "rotary_emb.sin_cached")
"""Buffers ``from_module`` includes but a state dict does not (vLLM's loaders skip them too)."""


def policy_state_dict(weights: Any) -> dict[str, torch.Tensor]:
    """``weights`` (see the module doc) as a flat ``{name: tensor}`` dict with the served model's names."""
    if isinstance(weights, TensorDictModuleBase) and hasattr(weights, "model"):
        inner = weights.model
        if not isinstance(inner, torch.nn.Module):
            raise TypeError(f"{type(weights).__name__}.model is {type(inner).__name__}, not a module: an "
                            f"inference wrapper holds no trainable weights; pass the training model "
                            f"(or its TransformersWrapper)")
        return dict(inner.state_dict())
    if isinstance(weights, torch.nn.Module):
        state = dict(weights.state_dict())
    elif isinstance(weights, TensorDictBase):
        state = {name: value for name, value in weights.flatten_keys(".").items()
                 if not name.endswith(NON_PERSISTENT_BUFFERS)}
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"weights[{name}]: expected a tensor, got {type(value).__name__}")
    elif isinstance(weights, Mapping):
        state = dict(weights)
    else:
        raise TypeError(f"expected a TorchRL LLM wrapper, an nn.Module, a state dict or a TensorDict, "
                        f"got {type(weights).__name__}")
    return strip_wrapper_prefix(state)


def peft_adapter(weights: Any) -> Any | None:
    """The ``peft.PeftModel`` that ``weights`` is, or that a TorchRL wrapper of it holds; else None
    (peft is never imported here: ``is_peft_model``)."""
    if isinstance(weights, TensorDictModuleBase) and hasattr(weights, "model"):
        weights = weights.model
    return weights if is_peft_model(weights) else None


def strip_wrapper_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """Drop the wrapper's ``model.`` when every name carries it and the rest still starts with it.

    A bare causal LM's state dict has top-level names besides ``model.*`` (``lm_head.weight``),
    and a bare base model's names never start with ``model.model.``; a wrapper's do both.
    """
    names = list(state)
    if names and all(name.startswith(WRAPPER_PREFIX) for name in names):
        stripped = [name[len(WRAPPER_PREFIX):] for name in names]
        if any(name.startswith(WRAPPER_PREFIX) for name in stripped):
            return dict(zip(stripped, state.values()))
    return state
