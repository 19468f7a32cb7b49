"""Weight-push validation and decoding, independent of vLLM.

A push's manifest names every tensor (Hugging Face checkpoint names) with its
dtype and shape. It is checked against the model's safetensors headers
*before* any byte is received, so a bad push never half-applies.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.v1 import weights_pb2
from rlfleet.wire.dtypes import BY_NAME, BY_SAFETENSORS, dtype_from_wire, dtype_name


@dataclass(frozen=True)
class TensorSpec:
    """Dtype and shape of one checkpoint tensor."""

    dtype: str
    """The dtype's name in ``rlfleet.wire.dtypes`` (``"bfloat16"``)."""
    shape: tuple[int, ...]


def _read_safetensors_header(path: Path) -> dict[str, TensorSpec]:
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    specs = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = BY_SAFETENSORS.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
        specs[name] = TensorSpec(dtype=dtype.name, shape=tuple(entry["shape"]))
    return specs


def read_checkpoint_specs(model_dir: str | Path) -> dict[str, TensorSpec]:
    """Name -> spec of every tensor in a (possibly sharded) safetensors checkpoint.

    Only headers are read, never tensor data.
    """
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / shard for shard in shard_names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors checkpoint in {model_dir}")
    specs: dict[str, TensorSpec] = {}
    for file in files:
        specs.update(_read_safetensors_header(file))
    return specs


def checkpoint_bytes(checkpoint: dict[str, TensorSpec]) -> int:
    """Bytes of the checkpoint's tensors in their own dtypes (the served model's size)."""
    return sum(math.prod(spec.shape) * BY_NAME[spec.dtype].itemsize for spec in checkpoint.values())


def validate_manifest(manifest: weights_pb2.WeightManifest, checkpoint: dict[str, TensorSpec]) -> None:
    """``validate_push`` on a manifest as received, before anything is sized from it."""
    dtypes = []
    for i, spec in enumerate(manifest.tensors):
        dtypes.append(dtype_from_wire(spec.dtype, f"manifest.tensors[{i}].dtype (tensor {spec.name!r})"))
    # The shapes stay the message's own containers: a dim count is compared before any dim is read.
    validate_push([spec.name for spec in manifest.tensors], dtypes, [spec.shape for spec in manifest.tensors],
                  checkpoint)


def validate_push(names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]],
                  checkpoint: dict[str, TensorSpec]) -> None:
    """Raise InvalidArgument, naming the tensor, unless the manifest is a complete,
    well-formed replacement for ``checkpoint`` (checked before any byte arrives).

    A push must carry every checkpoint tensor exactly once: vLLM reloads fused
    layers (qkv, gate_up) as a whole, so a partial push would leave the
    missing slices undefined.
    The dtype may differ from the checkpoint's (a bf16 trainer feeding a
    float32 engine: the worker converts) but not its kind: floating stays floating.
    """
    seen: set[str] = set()
    for name, dtype, shape in zip(names, dtypes, shapes):
        if name in seen:
            raise InvalidArgument(f"weights: tensor {name!r} sent twice")
        seen.add(name)
        spec = checkpoint.get(name)
        if spec is None:
            raise InvalidArgument(f"weights: unknown tensor {name!r} (not in the model checkpoint)")
        if dtype.is_floating_point != BY_NAME[spec.dtype].torch.is_floating_point:
            raise InvalidArgument(
                f"weights: tensor {name!r} has dtype {dtype_name(dtype)}, checkpoint has {spec.dtype}"
            )
        if len(shape) != len(spec.shape) or tuple(shape) != spec.shape:
            shown = f"shape {list(shape)}" if len(shape) <= 8 else f"{len(shape)} dimensions"
            raise InvalidArgument(f"weights: tensor {name!r} has {shown}, checkpoint has shape {list(spec.shape)}")
    missing = sorted(checkpoint.keys() - seen)
    if missing:
        shown = ", ".join(repr(name) for name in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise InvalidArgument(f"weights: push is missing tensors {shown}{more}")
