"""What a LoRA adapter push may hold: its hyper-parameters and factor tensors, checked the same on both sides.

An adapter push (``WeightManifest.lora``) carries peft's ``r`` (``rank``), ``lora_alpha`` (``alpha``) and
``target_modules``, and only the adapter's factors, named as ``peft.get_peft_model_state_dict`` names them
(``base_model.model.<module path>.lora_A.weight`` / ``.lora_B.weight``). The SDK checks a push with these
rules before sending it; each replica checks what arrives with the same rules, then against the model it
serves (each factor's in/out features, which only it knows). Both raise ``WireError`` naming the field or
the tensor; a replica answers it with INVALID_ARGUMENT.

The wire form is strict: ``target_modules`` a non-empty list of distinct module names. The SDK's own
convenience (a single string, repeats dropped) is the SDK's (``rlfleet.client.lora``), not the wire's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from rlfleet.wire.errors import WireError

PEFT_PREFIX = "base_model.model."
"""peft's prefix of adapter tensor names (its PeftModel + LoraModel wrappers); vLLM strips it too."""
FACTOR_SUFFIXES = {".lora_A.weight": "lora_A", ".lora_B.weight": "lora_B"}
LAYOUTS = {"lora_A": "[rank, in_features]", "lora_B": "[out_features, rank]"}
"""Each factor's shape: the update is lora_B @ lora_A, scaled by alpha / rank."""


def peft_name(name: str) -> str:
    """``name`` with peft's ``base_model.model.`` prefix, the form an adapter file holds."""
    return name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name


def split_factor(name: str) -> tuple[str, str, str]:
    """(module path, module name, "lora_A" | "lora_B") of an adapter tensor's name, prefixed or not."""
    body = name.removeprefix(PEFT_PREFIX)
    for suffix, factor in FACTOR_SUFFIXES.items():
        if body.endswith(suffix) and len(body) > len(suffix):
            path = body[:-len(suffix)]
            return path, path.rsplit(".", 1)[-1], factor
    raise WireError(f"adapter[{peft_name(name)}]", "not a LoRA factor of a linear layer (names end in "
                                                   ".lora_A.weight or .lora_B.weight, as "
                                                   "peft.get_peft_model_state_dict gives them)")


def check_hyper_parameters(rank: Any, alpha: Any, target_modules: Any) -> tuple[int, float, tuple[str, ...]]:
    """``(rank, alpha, target_modules)`` as the wire carries them, or WireError naming the one that is not:
    rank a positive integer, alpha a positive finite number, target_modules a non-empty sequence of distinct
    module names (``q_proj``, not ``self_attn.q_proj``)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise WireError("lora.rank", f"must be a positive integer (peft's r), got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise WireError("lora.alpha", f"must be a positive number (peft's lora_alpha), got {alpha!r}")
    if isinstance(target_modules, str) or not isinstance(target_modules, Sequence) or not target_modules:
        raise WireError("lora.target_modules", f"must be a non-empty list of module names, got {target_modules!r}")
    for module in target_modules:
        if not isinstance(module, str) or not module.isidentifier():
            raise WireError("lora.target_modules", f"{module!r} is not a module name (like 'q_proj')")
    if len(set(target_modules)) != len(target_modules):
        raise WireError("lora.target_modules", f"{list(target_modules)} repeat a name")
    return rank, float(alpha), tuple(target_modules)


def check_factors(tensors: Iterable[tuple[str, torch.dtype, Sequence[int]]], rank: int,
                  target_modules: Sequence[str],
                  also: Callable[[str, str, str, Sequence[int]], None] | None = None) -> list[str]:
    """The tensors' names in peft's form, or WireError naming (in that form) the first that is no factor here.

    ``tensors``: ``(name, dtype, shape)`` each. Each must be a LoRA factor of a module in
    ``target_modules``, floating point, two-dimensional with ``rank`` where its layout puts it
    (``LAYOUTS``), given once (with and without the prefix is the same tensor), with its partner.
    ``also(name, module path, factor, shape)``, the receiver's checks against its model, runs on each
    tensor that passes, before any partner is looked for.
    """
    names: list[str] = []
    factors: dict[str, set[str]] = {}
    for name, dtype, shape in tensors:
        path, module, factor = split_factor(name)
        field = f"adapter[{peft_name(name)}]"
        if factor in factors.get(path, ()):
            raise WireError(field, f"given twice (with and without the {PEFT_PREFIX} prefix is the same tensor)")
        factors.setdefault(path, set()).add(factor)
        if module not in target_modules:
            raise WireError(field, f"module {module!r} is not in target_modules {list(target_modules)}")
        if not dtype.is_floating_point:
            raise WireError(field, f"dtype {str(dtype).removeprefix('torch.')} is not floating point")
        at = 0 if factor == "lora_A" else 1
        if len(shape) != 2 or shape[at] != rank:
            shown = f"shape {list(shape)}" if len(shape) <= 8 else f"{len(shape)} dimensions"
            raise WireError(field, f"{shown} is not {factor}'s {LAYOUTS[factor]} with rank {rank}")
        names.append(peft_name(name))
        if also is not None:
            also(names[-1], path, factor, shape)
    if not names:
        raise WireError("adapter", "no tensors: an adapter push holds lora_A and lora_B factors")
    for path, present in factors.items():
        if len(present) < 2:
            factor = next(iter(present))
            raise WireError(f"adapter[{peft_name(path)}.{factor}.weight]",
                            f"has no {'lora_B' if factor == 'lora_A' else 'lora_A'} partner")
    return names


__all__ = ["FACTOR_SUFFIXES", "LAYOUTS", "PEFT_PREFIX", "check_factors", "check_hyper_parameters", "peft_name",
           "split_factor"]
