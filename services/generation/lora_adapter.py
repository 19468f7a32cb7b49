"""LoRA weight pushes, replica side: a pushed adapter becomes a vLLM LoRA adapter directory.

A trainer that trains a LoRA adapter pushes only the adapter's tensors, in peft's
naming (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``, the names
``peft.get_peft_model_state_dict`` gives), as one flat buffer: every tensor's raw
little-endian C-contiguous bytes, concatenated in order, no padding. vLLM (0.32)
loads adapters only from a directory (``adapter_config.json`` +
``adapter_model.safetensors``), so each version gets one, written atomically, and
is served under its own name: vLLM's prefix cache keys blocks on the adapter's name
and path, so a name is never reused for other weights.

Nothing here imports vLLM at module level; the functions that need it import it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.common.files import fsync_directory
from rlfleet.services.generation.push_validation import TensorSpec
from rlfleet.wire.dtypes import BY_TORCH
from rlfleet.wire.errors import WireError
from rlfleet.wire.lora_factors import LAYOUTS, check_factors, check_hyper_parameters, peft_name

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_NAME_PREFIX = "rlfleet-v"
# vLLM serves LoRA on linear layers; embeddings would need peft's lora_embedding_A/B tensors.
_NOT_LINEAR = frozenset({"embed_tokens", "lm_head"})


@dataclass(frozen=True)
class LoraAdapterConfig:
    """The adapter's LoRA hyper-parameters, as peft's ``LoraConfig`` names them (r, lora_alpha)."""

    rank: int
    """LoRA rank ``r``: lora_A is [r, in_features], lora_B [out_features, r]."""
    alpha: float
    """``lora_alpha``: the update is scaled by alpha / rank."""
    target_modules: tuple[str, ...]
    """Module names (``q_proj``, ``down_proj``, ...) the adapter may hold factors for."""

    def __post_init__(self) -> None:
        rank, alpha, target_modules = check_hyper_parameters(self.rank, self.alpha, self.target_modules)
        object.__setattr__(self, "target_modules", target_modules)

    def check_served(self, checkpoint_specs: dict[str, TensorSpec], max_lora_rank: int) -> None:
        """InvalidArgument unless the engine (``max_lora_rank``) and model (its checkpoint) can serve it."""
        allowed = supported_max_lora_ranks()
        if max_lora_rank not in allowed:
            raise ValueError(f"max_lora_rank {max_lora_rank} is not one vLLM allows: {list(allowed)}")
        if self.rank > max_lora_rank:
            raise InvalidArgument(
                f"lora adapter: rank {self.rank} is above the engine's max_lora_rank {max_lora_rank}"
            )
        linear = _linear_module_names(checkpoint_specs)
        for module in self.target_modules:
            if module not in linear:
                raise InvalidArgument(
                    f"lora adapter: target module {module!r} is not a linear layer of the served model "
                    f"(it has {sorted(linear)})"
                )

    def peft_config(self) -> dict[str, Any]:
        """The ``adapter_config.json`` contents: a plain peft LoraConfig, the fields vLLM and peft read."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": sorted(self.target_modules),
            "bias": "none",
            "lora_dropout": 0.0,
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "lora_bias": False,
            "modules_to_save": None,
            "init_lora_weights": True,
            "rank_pattern": {},
            "alpha_pattern": {},
            "inference_mode": True,
        }


def supported_max_lora_ranks() -> tuple[int, ...]:
    """The values vLLM accepts as ``max_lora_rank`` (its ``MaxLoRARanks``)."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    return tuple(get_args(MaxLoRARanks))


def _linear_module_names(checkpoint_specs: dict[str, TensorSpec]) -> set[str]:
    names = set()
    for name, spec in checkpoint_specs.items():
        if name.endswith(".weight") and len(spec.shape) == 2:
            module = name.removesuffix(".weight").rsplit(".", 1)[-1]
            if module not in _NOT_LINEAR:
                names.add(module)
    return names


def validate_adapter(names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]],
                     checkpoint_specs: dict[str, TensorSpec], config: LoraAdapterConfig) -> list[str]:
    """Raise InvalidArgument, naming the tensor, unless the tensors form a well-shaped adapter of the model.

    The factors are checked as the SDK checks them (``lora_factors.check_factors``), then against the
    model: each factor's module has a linear base weight ``<module path>.weight`` [out, in] in
    ``checkpoint_specs``, and lora_A is [rank, in], lora_B [out, rank]. Names may come with or without
    ``base_model.model.``; returns them in the prefixed form.
    """
    if not len(names) == len(dtypes) == len(shapes):
        raise InvalidArgument(
            f"lora adapter: {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes differ in count"
        )

    def in_the_model(name: str, module_path: str, factor: str, shape: Sequence[int]) -> None:
        base = checkpoint_specs.get(module_path + ".weight")
        if base is None or len(base.shape) != 2 or module_path.rsplit(".", 1)[-1] in _NOT_LINEAR:
            raise WireError(f"adapter[{name}]", f"names unknown module {module_path!r} (no linear weight "
                                                f"{module_path + '.weight'!r} in the model checkpoint)")
        out_features, in_features = base.shape
        expected = [config.rank, in_features] if factor == "lora_A" else [out_features, config.rank]
        if list(shape) != expected:
            raise WireError(f"adapter[{name}]", f"shape {list(shape)} is not {factor}'s {LAYOUTS[factor]} = "
                                                f"{expected} for {module_path}.weight {list(base.shape)}")

    return check_factors(zip(names, dtypes, shapes), config.rank, config.target_modules, in_the_model)


def _safetensors_header(names: Sequence[str], dtypes: Sequence[torch.dtype],
                        shapes: Sequence[Sequence[int]]) -> tuple[bytes, int]:
    """The safetensors header (length prefix included) of tensors laid out back to back, and their bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        info = BY_TORCH.get(dtype)
        if info is None:
            raise InvalidArgument(f"lora adapter: tensor {name!r} has unsupported dtype {dtype}")
        if any(isinstance(dim, bool) or not isinstance(dim, int) or dim < 0 for dim in shape):
            raise InvalidArgument(f"lora adapter: tensor {name!r} has shape {list(shape)}")
        size = math.prod(shape) * info.itemsize
        if peft_name(name) in header:
            raise InvalidArgument(f"lora adapter: tensor {name!r} sent twice")
        header[peft_name(name)] = {
            "dtype": info.safetensors, "shape": list(shape), "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return len(encoded).to_bytes(8, "little") + encoded, offset


def write_adapter_dir(directory: str | os.PathLike[str], names: Sequence[str], dtypes: Sequence[torch.dtype],
                      shapes: Sequence[Sequence[int]], buffer: Any, config: LoraAdapterConfig) -> Path:
    """Write the adapter as ``directory`` (which must not exist): adapter_config.json + adapter_model.safetensors.

    ``buffer`` (anything with the buffer protocol: a memoryview of a shared-memory
    segment) holds the tensors' bytes back to back, so it *is* the safetensors data
    section: the file is a header plus one write of the buffer, no per-tensor copy.
    Call ``validate_adapter`` first. The directory appears whole or not at all (a
    temp directory beside it, fsync'd, renamed into place).
    """
    directory = Path(directory)
    data = memoryview(buffer).cast("B")
    header, total_bytes = _safetensors_header(names, dtypes, shapes)
    if data.nbytes != total_bytes:
        raise InvalidArgument(f"lora adapter: buffer holds {data.nbytes} bytes, the tensors need {total_bytes}")
    if directory.exists():
        raise FileExistsError(f"{directory} exists: every adapter version gets a directory of its own")
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
    try:
        _write_synced(tmp / CONFIG_FILE, json.dumps(config.peft_config(), indent=2).encode())
        _write_synced(tmp / WEIGHTS_FILE, header, data)
        fsync_directory(tmp)
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_directory(directory.parent)
    return directory


def _write_synced(path: Path, *chunks: bytes | memoryview) -> None:
    with path.open("wb") as file:
        for chunk in chunks:
            file.write(chunk)
        file.flush()
        os.fsync(file.fileno())


def remove_adapter_dir(directory: str | os.PathLike[str]) -> None:
    """Delete an adapter directory (no error if it is gone); renamed away first so no reader sees half of it."""
    directory = Path(directory)
    try:
        doomed = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".removing", dir=directory.parent))
    except FileNotFoundError:
        return
    try:
        os.rename(directory, doomed / directory.name)
    except FileNotFoundError:
        pass
    shutil.rmtree(doomed, ignore_errors=True)


def adapter_name(version: int) -> str:
    """The vLLM adapter name of a policy version: ``rlfleet-v{version}``, never reused for other weights."""
    return f"{ADAPTER_NAME_PREFIX}{version}"


def lora_request(version: int, directory: str | os.PathLike[str], serial: int | None = None) -> LoRARequest:
    """The ``LoRARequest`` serving policy ``version`` from ``directory``. ``serial`` (a replica's count of
    adapters loaded, > 0) makes name and int id unique even if a version comes twice with other bytes (a
    push applied here that never committed, then another of that version): ``rlfleet-v{version}-{serial}``,
    id ``serial``; without it the name is ``rlfleet-v{version}`` and the id ``version + 1`` (ids are > 0)."""
    from vllm.lora.request import LoRARequest

    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"policy version must be a non-negative integer, got {version!r}")
    if serial is None:
        return LoRARequest(lora_name=adapter_name(version), lora_int_id=version + 1, lora_path=str(directory))
    if serial < 1:
        raise ValueError(f"serial must be > 0, got {serial}")
    return LoRARequest(lora_name=f"{adapter_name(version)}-{serial}", lora_int_id=serial, lora_path=str(directory))
