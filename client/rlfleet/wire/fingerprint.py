"""Weight fingerprints: what a replica checks the weights it stages and loads against.

A tensor's fingerprint is the sum, modulo 2**64, of its elements' bit patterns, each read as a signed
integer of the element's width (an fp32 element as an int32, a bf16 one as an int16). The trainer's
SDK puts each tensor's fingerprint in the push's manifest (``WeightSpec.fingerprint``); a replica
checks its staged bytes against them before it commits, and the weights in its engine after it loaded
them (``services/generation/transfer.py``).

Why a sum and not a hash: it is additive over any split of a tensor's elements, so a parameter the
engine fuses from several checkpoint tensors (q, k and v rows in one ``qkv_proj``) has the sum of its
parts' fingerprints, and padding with zeros adds nothing. It changes with any single changed element
(and with a wrong or stale tensor); it does not see elements moved within a tensor, which a byte
corrupted in transit or in memory never does. One read of the tensor where it lies (on the GPU for a
GPU engine): no copy of the tensor is made.
"""

from __future__ import annotations

import numpy
import torch

MASK = (1 << 64) - 1
CHUNK_ELEMENTS = 1 << 24
"""Elements summed at once on a GPU: bounds the widened temporary a sum may make (128 MiB)."""
_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensor: torch.Tensor) -> int:
    """The fingerprint of ``tensor`` (see the module's docstring): an int in [0, 2**64)."""
    flat = tensor.detach()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    flat = flat.reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.view(_SIGNED[flat.element_size()])
    if bits.device.type == "cpu":  # numpy widens as it goes: ~9x torch's integer sum on a CPU
        return int(bits.numpy().sum(dtype=numpy.int64)) & MASK
    total = 0
    for start in range(0, bits.numel(), CHUNK_ELEMENTS):
        total += int(bits[start:start + CHUNK_ELEMENTS].sum(dtype=torch.int64))
    return total & MASK


def of_manifest(manifest) -> list[int | None]:
    """Each tensor's fingerprint in a ``WeightManifest``, in its order; None where unset."""
    return [spec.fingerprint if spec.HasField("fingerprint") else None for spec in manifest.tensors]


def listed(mismatches: list[str], shown: int = 4) -> str:
    """What differs, as one message names it: the first ``shown``, then how many more."""
    more = len(mismatches) - shown
    return "; ".join(mismatches[:shown]) + (f"; and {more} more" if more > 0 else "")


def combine(fingerprints) -> int:
    """The fingerprint of tensors' elements taken together (a fused parameter's, from its parts')."""
    return sum(fingerprints) & MASK
