"""LoRA adapter pushes, trainer side: an adapter's tensors and hyper-parameters as a push sends them.

A trainer that trains a LoRA adapter pushes only the adapter's factors (``push_adapter``); the
generation replicas serve the model's weights as they are plus this adapter (``weights.proto``,
``LoraAdapter``). Tensors are named as ``peft.get_peft_model_state_dict`` names them
(``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``). peft is imported only when
given a ``PeftModel`` (if peft was never imported, nothing can be one), so the SDK runs without it.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Iterable

import torch

from rlfleet.client.push import named_tensors
from rlfleet.v1 import weights_pb2

PEFT_PREFIX = "base_model.model."
"""peft's prefix of adapter tensor names (its PeftModel + LoraModel wrappers)."""
FACTOR_SUFFIXES = {".lora_A.weight": "lora_A", ".lora_B.weight": "lora_B"}

# LoraConfig options (any truthy value is refused) that vLLM cannot serve or a push cannot carry, with what each needs.
_UNSERVABLE = (
    ("use_dora", "DoRA's magnitude vectors"),
    ("use_rslora", "rsLoRA's alpha / sqrt(r) scaling"),
    ("modules_to_save", "fully trained copies of whole modules"),
    ("rank_pattern", "a rank per module"),
    ("alpha_pattern", "an alpha per module"),
    ("lora_bias", "a bias on lora_B"),
    ("target_parameters", "LoRA on bare parameters"),
    ("trainable_token_indices", "trained embedding rows"),
    ("layer_replication", "replicated layers"),
)


def adapter_tensors(adapter: Any, *, rank: int | None = None, alpha: float | None = None,
                    target_modules: Iterable[str] | None = None,
                    ) -> tuple[list[tuple[str, torch.Tensor]], weights_pb2.LoraAdapter]:
    """The ``(name, tensor)`` pairs of a LoRA adapter push and its ``LoraAdapter`` hyper-parameters.

    ``adapter``: a ``peft.PeftModel`` (its active LoRA adapter: tensors from
    ``get_peft_model_state_dict``, ``r`` and ``lora_alpha`` from its ``LoraConfig``; the target modules
    are the modules that hold factors, since peft's ``target_modules`` may be a regex or
    ``"all-linear"``), or a ``{name: tensor}`` mapping / ``(name, tensor)`` pairs of adapter factors
    with ``rank``, ``alpha`` and ``target_modules`` given. Names get peft's ``base_model.model.``
    prefix when they lack it. Only references are collected: no tensor is copied.

    ValueError for what vLLM cannot serve (DoRA, a ``bias`` other than "none", ``modules_to_save``,
    ``rank_pattern`` / ``alpha_pattern``, rsLoRA, ...: naming the option), for a tensor that is not a
    floating ``lora_A`` [rank, in] / ``lora_B`` [out, rank] factor of a target module, and for
    hyper-parameters missing (tensors) or given twice (a PeftModel).
    """
    if is_peft_model(adapter):
        if rank is not None or alpha is not None or target_modules is not None:
            raise ValueError("rank, alpha and target_modules come from the PeftModel's LoraConfig: "
                             "pass them only with adapter tensors")
        pairs, rank, alpha = _peft_adapter(adapter)
        modules = list(dict.fromkeys(_split_factor(name)[1] for name, _ in pairs))
    elif isinstance(adapter, torch.nn.Module):
        raise TypeError(f"push_adapter takes a peft.PeftModel or adapter tensors, got {type(adapter).__name__} "
                        f"(a whole model's weights go by push_weights)")
    else:
        missing = [name for name, value in (("rank", rank), ("alpha", alpha), ("target_modules", target_modules))
                   if value is None]
        if missing:
            raise ValueError(f"adapter tensors need {', '.join(missing)} (peft's r, lora_alpha, target_modules); "
                             f"a PeftModel brings its own")
        pairs = [(_with_prefix(name), tensor) for name, tensor in named_tensors(adapter)]
        modules = _module_names(target_modules)
    lora = weights_pb2.LoraAdapter(rank=_checked_rank(rank), alpha=_checked_alpha(alpha), target_modules=modules)
    _check_factors(pairs, lora)
    return pairs, lora


def is_peft_model(adapter: Any) -> bool:
    """Whether ``adapter`` is a ``peft.PeftModel``, without importing peft."""
    peft = sys.modules.get("peft")  # not imported: whatever this is, it is no PeftModel
    return peft is not None and isinstance(adapter, peft.PeftModel)


def _peft_adapter(model: Any) -> tuple[list[tuple[str, torch.Tensor]], int, float]:
    from peft import get_peft_model_state_dict

    active = model.active_adapters
    if len(active) != 1:
        raise ValueError(f"the PeftModel has {len(active)} active adapters {list(active)}: push one "
                         f"(model.set_adapter(name))")
    name = active[0]
    config = model.peft_config[name]
    if getattr(config, "peft_type", None) != "LORA":
        raise ValueError(f"adapter {name!r} is {config.peft_type}, not LoRA: only LoRA adapters are served")
    if config.bias != "none":
        raise ValueError(f"adapter {name!r}: LoraConfig bias={config.bias!r} trains the base model's biases, "
                         f"which a LoRA adapter cannot carry to vLLM; use bias='none'")
    for option, what in _UNSERVABLE:
        if getattr(config, option, None):
            raise ValueError(f"adapter {name!r}: LoraConfig {option}={getattr(config, option)!r} needs {what}, "
                             f"which vLLM does not serve")
    # The parameters' own storage, renamed. Embeddings are never saved: "auto" would read the base model's
    # config.json (or ask the Hub) on every push, and vLLM takes no embedding rows from an adapter anyway.
    state = get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)
    pairs = named_tensors(state.items())
    return [(_with_prefix(key), tensor) for key, tensor in pairs], config.r, config.lora_alpha


def _with_prefix(name: str) -> str:
    return name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name


def _split_factor(name: str) -> tuple[str, str, str]:
    """(module path, module name, "lora_A" | "lora_B") of an adapter tensor's (prefixed) name."""
    for suffix, factor in FACTOR_SUFFIXES.items():
        if name.endswith(suffix):
            path = name[len(PEFT_PREFIX):-len(suffix)]
            if path:
                return path, path.rsplit(".", 1)[-1], factor
    raise ValueError(f"adapter[{name}]: not a LoRA factor of a linear layer (names end in .lora_A.weight or "
                     f".lora_B.weight, as peft.get_peft_model_state_dict gives them)")


def _module_names(target_modules: Iterable[str]) -> list[str]:
    modules = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if not modules:
        raise ValueError("target_modules must name at least one module")
    for module in modules:
        if not isinstance(module, str) or not module.isidentifier():
            raise ValueError(f"target_modules: {module!r} is not a module name (like 'q_proj')")
    return list(dict.fromkeys(modules))


def _checked_rank(rank: Any) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    return rank


def _checked_alpha(alpha: Any) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a positive number, got {alpha!r}")
    return float(alpha)


def _check_factors(pairs: list[tuple[str, torch.Tensor]], lora: weights_pb2.LoraAdapter) -> None:
    """Each tensor a floating, 2-D factor of a target module, at the adapter's rank, with its partner."""
    factors: dict[str, set[str]] = {}
    for name, tensor in pairs:
        path, module, factor = _split_factor(name)
        if factor in factors.get(path, ()):
            raise ValueError(f"adapter[{name}]: given twice (with and without the {PEFT_PREFIX} prefix)")
        factors.setdefault(path, set()).add(factor)
        if module not in lora.target_modules:
            raise ValueError(f"adapter[{name}]: module {module!r} is not in target_modules {list(lora.target_modules)}")
        if not tensor.is_floating_point():
            raise ValueError(f"adapter[{name}]: dtype {tensor.dtype} is not floating point")
        at = 0 if factor == "lora_A" else 1
        if tensor.dim() != 2 or tensor.shape[at] != lora.rank:
            layout = "[rank, in_features]" if factor == "lora_A" else "[out_features, rank]"
            raise ValueError(f"adapter[{name}]: shape {list(tensor.shape)} is not {layout} with rank {lora.rank}")
    for path, present in factors.items():
        if len(present) < 2:
            raise ValueError(f"adapter: module {path!r} has {next(iter(present))} without its partner")


__all__ = ["PEFT_PREFIX", "adapter_tensors", "is_peft_model"]
