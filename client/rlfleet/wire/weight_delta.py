"""Delta pushes: a push naming only the tensors whose bytes changed since a base version.

A delta's manifest has ``delta.base_version`` set and lists a subset of the base push's tensors
(``weights.proto``). Its bytes are those tensors' bytes concatenated in its own order. Applying it
to the base version's concatenated bytes (the *full* layout: the base push's tensors in the base
push's order) overwrites each named tensor's span in place; every other byte stays. The replicas
(their kept weights) and the collector (its spool) patch with ``patch``; the trainer finds what
changed with ``changed_tensors``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlfleet.v1 import weights_pb2
from rlfleet.wire import WireError
from rlfleet.wire.dtypes import BY_WIRE
from rlfleet.wire.shm import tensor_offsets


@dataclass(frozen=True)
class Span:
    """Where one tensor of a delta lies in the delta's bytes and in the full layout."""

    name: str
    delta_offset: int
    full_offset: int
    size: int


def tensor_sizes(manifest: weights_pb2.WeightManifest) -> list[int]:
    """Each tensor's byte size, in manifest order (dtypes and shapes already validated)."""
    return [math.prod(spec.shape) * BY_WIRE[spec.dtype].torch.itemsize for spec in manifest.tensors]


def layout(manifest: weights_pb2.WeightManifest) -> dict[str, tuple[int, int]]:
    """Name -> (offset, size) of every tensor in a push's concatenated bytes."""
    sizes = tensor_sizes(manifest)
    return {spec.name: where for spec, where in zip(manifest.tensors, zip(tensor_offsets(sizes), sizes))}


def spans(delta: weights_pb2.WeightManifest, full: weights_pb2.WeightManifest) -> list[Span]:
    """The delta's tensors located in ``full`` (the base version's full manifest).

    WireError naming the tensor when the delta names a tensor the base does not hold, or gives one
    another dtype or shape than the base's (its bytes would not fit the span)."""
    base = {spec.name: spec for spec in full.tensors}
    where = layout(full)
    sizes = tensor_sizes(delta)
    result = []
    for i, (spec, size, offset) in enumerate(zip(delta.tensors, sizes, tensor_offsets(sizes))):
        known = base.get(spec.name)
        if known is None:
            raise WireError(f"manifest.tensors[{i}]", f"delta tensor {spec.name!r} is not in version "
                                                      f"{delta.delta.base_version}'s weights")
        if spec.dtype != known.dtype or list(spec.shape) != list(known.shape):
            raise WireError(
                f"manifest.tensors[{i}]", f"delta tensor {spec.name!r} is {BY_WIRE[spec.dtype].name} "
                f"{list(spec.shape)}, version {delta.delta.base_version} has it as "
                f"{BY_WIRE[known.dtype].name} {list(known.shape)} (a delta keeps every dtype and shape)")
        result.append(Span(spec.name, offset, where[spec.name][0], size))
    return result


def patch(full_buffer: memoryview, delta_buffer: memoryview, delta_spans: list[Span]) -> None:
    """Overwrite each span of ``full_buffer`` (the base's bytes) with the delta's bytes, in place."""
    for span in delta_spans:
        full_buffer[span.full_offset:span.full_offset + span.size] = \
            delta_buffer[span.delta_offset:span.delta_offset + span.size]


def full_manifest(full: weights_pb2.WeightManifest, delta: weights_pb2.WeightManifest) -> weights_pb2.WeightManifest:
    """The manifest of the weights after ``delta``: ``full``'s tensors and size at the delta's version
    and mode, no checksum (the patched bytes were never checksummed as a whole), no source; each tensor's
    fingerprint the delta's where the delta carries it (unset where it changed without one)."""
    after = weights_pb2.WeightManifest(version=delta.version, total_bytes=full.total_bytes, mode=delta.mode)
    after.tensors.extend(full.tensors)
    patch_fingerprints(after, delta)
    return after


def patch_fingerprints(full: weights_pb2.WeightManifest, delta: weights_pb2.WeightManifest) -> None:
    """``full``'s tensors that ``delta`` changed take the delta's fingerprints, in place (none where the
    delta carries none)."""
    changed = {spec.name: spec for spec in delta.tensors}
    for spec in full.tensors:
        if spec.name in changed:
            if changed[spec.name].HasField("fingerprint"):
                spec.fingerprint = changed[spec.name].fingerprint
            else:
                spec.ClearField("fingerprint")


def is_delta(manifest: weights_pb2.WeightManifest) -> bool:
    return manifest.HasField("delta")


__all__ = ["Span", "full_manifest", "is_delta", "layout", "patch", "patch_fingerprints", "spans", "tensor_sizes"]
