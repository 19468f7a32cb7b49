"""Sending a weight push: a manifest then ~1 MiB chunks of the concatenated tensor bytes.

The receiving side (validation, preallocated buffer, checksum) lives in the
services; this is what a trainer-side pusher needs.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from typing import Iterator, Sequence

import torch

from rlfleet.v1 import weights_pb2
from rlfleet.wire.dtypes import dtype_to_wire
from rlfleet.wire.fingerprint import fingerprint

DEFAULT_CHUNK_BYTES = 1 << 20


def checksum(data: bytes | memoryview, algo: str = "crc32") -> str:
    """``"<algo>:<hex>"`` of ``data``, the manifest's checksum format."""
    if algo == "sha256":
        return "sha256:" + hashlib.sha256(data).hexdigest()
    return f"crc32:{zlib.crc32(data):08x}"


def host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, flat uint8 on the host: a view when it is already contiguous on CPU."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a memoryview, without a copy when it is already contiguous on CPU."""
    flat = host_bytes(tensor)
    return memoryview(flat.numpy()) if flat.numel() else memoryview(b"")


def iter_push_messages(
    named_tensors: Sequence[tuple[str, torch.Tensor]], *, version: int,
    mode: int = weights_pb2.UPDATE_MODE_KEEP, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    checksum_algo: str | None = "crc32", base_version: int | None = None,
    lora: weights_pb2.LoraAdapter | None = None, strategy: int = weights_pb2.UPDATE_STRATEGY_UNSPECIFIED,
    fingerprints: bool = True,
) -> Iterator[tuple[str, object]]:
    """Yield ``("manifest", WeightManifest)`` then ``("chunk", WeightChunk)`` pairs (``base_version``:
    a delta push, ``named_tensors`` being the tensors that changed since that version; ``lora``: a LoRA
    adapter push, ``named_tensors`` being the adapter's factors; not both).

    ``fingerprints``: each tensor's fingerprint in its spec (``rlfleet.wire.fingerprint``), which the
    replicas check what they stage and load against (one read of each tensor where it lies).

    Chunks are cut straight out of each tensor's memory (one copy per chunk,
    the floor for gRPC in Python), so no second full copy of the weights is
    ever materialised. A chunk may span tensor boundaries.
    """
    if lora is not None and base_version is not None:
        raise ValueError("a push is a delta (base_version) or a LoRA adapter (lora), not both")
    specs, total = [], 0
    crc, sha = 0, (hashlib.sha256() if checksum_algo == "sha256" else None)
    for name, tensor in named_tensors:
        specs.append(weights_pb2.WeightSpec(name=name, dtype=dtype_to_wire(tensor.dtype), shape=list(tensor.shape)))
        if fingerprints:
            specs[-1].fingerprint = fingerprint(tensor)
        total += math.prod(tensor.shape) * tensor.element_size()
        if checksum_algo:
            view = _byte_view(tensor)
            if sha is not None:
                sha.update(view)
            else:
                crc = zlib.crc32(view, crc)
    digest = ""
    if checksum_algo:
        digest = f"sha256:{sha.hexdigest()}" if sha is not None else f"crc32:{crc:08x}"
    manifest = weights_pb2.WeightManifest(version=version, tensors=specs, total_bytes=total, checksum=digest, mode=mode,
                                           strategy=strategy)
    if base_version is not None:  # a delta push: only the tensors that changed since base_version
        manifest.delta.base_version = base_version
    if lora is not None:  # a LoRA adapter push: served on top of the model's weights as they are
        manifest.lora.CopyFrom(lora)
    yield "manifest", manifest

    offset, pending = 0, bytearray()
    for _, tensor in named_tensors:
        view = _byte_view(tensor)
        start = 0
        if pending:  # top up the chunk left over from the previous tensor
            take = min(chunk_bytes - len(pending), len(view))
            pending += view[:take]
            start = take
            if len(pending) < chunk_bytes:
                continue
            yield "chunk", weights_pb2.WeightChunk(offset=offset, data=bytes(pending))
            offset += len(pending)
            pending = bytearray()
        while len(view) - start >= chunk_bytes:
            yield "chunk", weights_pb2.WeightChunk(offset=offset, data=bytes(view[start:start + chunk_bytes]))
            offset += chunk_bytes
            start += chunk_bytes
        pending += view[start:]
    if pending:
        yield "chunk", weights_pb2.WeightChunk(offset=offset, data=bytes(pending))
