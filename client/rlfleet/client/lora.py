"""LoRA adapter pushes, trainer side: an adapter's tensors and hyper-parameters as a push sends them.

A trainer that trains a LoRA adapter pushes only the adapter's factors (``push_adapter``); the
generation replicas serve the model's weights as they are plus this adapter (``weights.proto``,
``LoraAdapter``). Tensors are named as ``peft.get_peft_model_state_dict`` names them
(``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``). peft is imported only when
given a ``PeftModel`` (if peft was never imported, nothing can be one), so the SDK runs without it.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

import torch

from rlfleet.client.push import named_tensors
from rlfleet.v1 import weights_pb2
from rlfleet.wire.lora_factors import PEFT_PREFIX, check_factors, check_hyper_parameters, peft_name, split_factor

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
        modules = list(dict.fromkeys(split_factor(name)[1] for name, _ in pairs))
    elif isinstance(adapter, torch.nn.Module):
        raise TypeError(f"push_adapter takes a peft.PeftModel or adapter tensors, got {type(adapter).__name__} "
                        f"(a whole model's weights go by push_weights)")
    else:
        missing = [name for name, value in (("rank", rank), ("alpha", alpha), ("target_modules", target_modules))
                   if value is None]
        if missing:
            raise ValueError(f"adapter tensors need {', '.join(missing)} (peft's r, lora_alpha, target_modules); "
                             f"a PeftModel brings its own")
        pairs = [(peft_name(name), tensor) for name, tensor in named_tensors(adapter)]
        modules = _module_names(target_modules)
    rank, alpha, modules = check_hyper_parameters(rank, alpha, modules)
    check_factors(((name, tensor.dtype, tuple(tensor.shape)) for name, tensor in pairs), rank, modules)
    return pairs, weights_pb2.LoraAdapter(rank=rank, alpha=alpha, target_modules=modules)


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
    return [(peft_name(key), tensor) for key, tensor in pairs], config.r, config.lora_alpha


def _module_names(target_modules: Iterable[str]) -> list[str]:
    """The SDK's convenience over the wire's strict list: one module name as a string, repeats dropped."""
    modules = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if all(isinstance(module, str) for module in modules):
        modules = list(dict.fromkeys(modules))
    return modules


__all__ = ["PEFT_PREFIX", "adapter_tensors", "is_peft_model"]
