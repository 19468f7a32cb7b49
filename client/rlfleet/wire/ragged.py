"""Ragged tensors: one flat values tensor plus per-sample lengths.

``Ragged`` is the in-memory form; it converts to a list of tensors, a nested
(jagged) tensor, or a padded tensor + mask. Lengths are carried explicitly:
masks never come from sentinel pad values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from rlfleet.v1 import tensor_pb2
from rlfleet.wire.errors import WireError
from rlfleet.wire.tensor import checked_tensor, decode_tensor, encode_tensor


_FEW_SAMPLES = 128
"""Up to this many samples a Ragged checks its lengths as a list (quicker; tensor reductions beyond)."""


@dataclass(frozen=True)
class Ragged:
    """``values[offsets[i]:offsets[i+1]]`` is sample ``i``."""

    values: torch.Tensor
    lengths: torch.Tensor  # int64, [B]

    def __post_init__(self):
        if self.values.dim() < 1:
            raise WireError("values", "must be at least 1-D")
        if self.lengths.dim() != 1:
            raise WireError("lengths", "must be 1-D")
        if self.lengths.numel() <= _FEW_SAMPLES:
            lengths = self.lengths.tolist()
            negative, total = min(lengths, default=0) < 0, int(sum(lengths))
        else:
            negative, total = int(self.lengths.min()) < 0, int(self.lengths.sum())
        if negative:
            bad = int((self.lengths < 0).nonzero()[0])
            raise WireError(f"lengths[{bad}]", f"negative length {int(self.lengths[bad])}")
        if total != self.values.shape[0]:
            raise WireError(
                "lengths", f"sum to {total} but values has {self.values.shape[0]} rows"
            )

    # --- constructors -------------------------------------------------------
    @classmethod
    def from_list(cls, tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> "Ragged":
        """From per-sample tensors sharing trailing dims (plain lists are accepted)."""
        tensors = [torch.as_tensor(t, dtype=dtype) for t in tensors]
        lengths = torch.tensor([t.shape[0] if t.dim() else 1 for t in tensors], dtype=torch.int64)
        if not tensors:
            return cls(torch.empty(0, dtype=dtype or torch.float32), lengths)
        return cls(torch.cat([t.reshape(t.shape[0] if t.dim() else 1, *t.shape[1:]) for t in tensors]), lengths)

    @classmethod
    def from_padded(cls, padded: torch.Tensor, lengths: torch.Tensor | Sequence[int] | None = None,
                    mask: torch.Tensor | None = None, side: str = "right") -> "Ragged":
        """From a [B, T, ...] padded tensor with either lengths or a [B, T] bool mask."""
        if mask is not None:
            mask = mask.to(torch.bool)
            return cls(padded[mask], mask.sum(dim=1).to(torch.int64))
        if lengths is None:
            raise ValueError("from_padded needs lengths or mask")
        lengths = torch.as_tensor(lengths, dtype=torch.int64)
        return cls.from_padded(padded, mask=_mask_from_lengths(lengths, padded.shape[1], side))

    @classmethod
    def from_nested(cls, nested: torch.Tensor) -> "Ragged":
        """From a jagged nested tensor (``torch.nested``, layout=torch.jagged)."""
        if nested.layout == torch.jagged:
            offsets = nested.offsets()
            return cls(nested.values(), (offsets[1:] - offsets[:-1]).to(torch.int64))
        return cls.from_list(list(nested.unbind()))

    # --- views ----------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.lengths.numel())

    @property
    def offsets(self) -> torch.Tensor:
        """[B+1] int64 start offsets, offsets[0] = 0."""
        out = torch.zeros(self.batch_size + 1, dtype=torch.int64)
        torch.cumsum(self.lengths, 0, out=out[1:])
        return out

    def to_list(self) -> list[torch.Tensor]:
        """Per-sample views into ``values`` (no copy)."""
        return list(torch.split(self.values, self.lengths.tolist()))

    def to_nested(self) -> torch.Tensor:
        """A jagged nested tensor sharing ``values``."""
        return torch.nested.nested_tensor_from_jagged(self.values, self.offsets)

    def to_padded(self, pad_value=0, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
        """(padded [B, T, ...], bool mask [B, T]) with T the longest length."""
        max_len = int(self.lengths.max()) if self.batch_size else 0
        mask = _mask_from_lengths(self.lengths, max_len, side)
        padded = self.values.new_full((self.batch_size, max_len, *self.values.shape[1:]), pad_value)
        padded[mask] = self.values
        return padded, mask

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.lengths[:i].sum())
        return self.values[start:start + int(self.lengths[i])]

    def __len__(self) -> int:
        return self.batch_size


def _mask_from_lengths(lengths: torch.Tensor, max_len: int, side: str) -> torch.Tensor:
    positions = torch.arange(max_len).unsqueeze(0)
    if side == "right":
        return positions < lengths.unsqueeze(1)
    if side == "left":
        return positions >= (max_len - lengths).unsqueeze(1)
    raise ValueError(f"side must be 'left' or 'right', got {side!r}")


def encode_ragged(ragged: Ragged | Sequence[torch.Tensor] | torch.Tensor,
                  out: tensor_pb2.RaggedTensor | None = None) -> tensor_pb2.RaggedTensor:
    """Encode a Ragged, a list of tensors or a nested tensor."""
    if isinstance(ragged, torch.Tensor):
        ragged = Ragged.from_nested(ragged)
    elif not isinstance(ragged, Ragged):
        ragged = Ragged.from_list(ragged)
    msg = tensor_pb2.RaggedTensor() if out is None else out
    encode_tensor(ragged.values, out=msg.values)
    msg.lengths[:] = ragged.lengths.tolist()
    return msg


def decode_ragged(msg: tensor_pb2.RaggedTensor, field: str = "", *, max_elements: int | None = None,
                  max_samples: int | None = None) -> Ragged:
    """Decode and validate a RaggedTensor message.

    ``max_elements`` bounds the values' element count, ``max_samples`` the number
    of samples; both are checked before anything is built from them.
    """
    prefix = f"{field}." if field else ""
    if not msg.HasField("values"):
        raise WireError(f"{prefix}values", "missing")
    values = decode_tensor(msg.values, f"{prefix}values", max_elements=max_elements)
    lengths = _checked_lengths(msg, list(values.shape), prefix, max_samples)
    return Ragged(values, torch.from_numpy(lengths))


def check_ragged(msg: tensor_pb2.RaggedTensor, field: str = "") -> int:
    """Validate a RaggedTensor message as ``decode_ragged`` does, building no tensor; its values' bytes."""
    prefix = f"{field}." if field else ""
    if not msg.HasField("values"):
        raise WireError(f"{prefix}values", "missing")
    _, shape, data = checked_tensor(msg.values, f"{prefix}values")
    _checked_lengths(msg, shape, prefix, None)
    return len(data)


_CHUNK = 1 << 20
"""Lengths checked per step: the temporaries of the check stay a few MiB whatever the batch."""


def _checked_lengths(msg: tensor_pb2.RaggedTensor, values_shape: list[int], prefix: str,
                     max_samples: int | None) -> np.ndarray:
    """The lengths as one int64 array (never a list of Python ints: there may be millions),
    each non-negative, summing to the values' rows."""
    if not values_shape:
        raise WireError(f"{prefix}values.shape", "must be at least 1-D")
    if max_samples is not None and len(msg.lengths) > max_samples:
        raise WireError(f"{prefix}lengths", f"has {len(msg.lengths)} samples, at most {max_samples} are allowed")
    lengths = np.array(msg.lengths, dtype=np.int64).reshape(-1)
    rows, total = values_shape[0], 0
    for start in range(0, len(lengths), _CHUNK):
        part = lengths[start:start + _CHUNK]
        negative = part < 0
        if negative.any():
            i = start + int(negative.argmax())
            raise WireError(f"{prefix}lengths[{i}]", f"negative length {int(lengths[i])}")
        # Non-negative lengths: the running sum only grows until it passes the end; a sum past
        # 2**63-1 wraps to a negative number, flagged just the same.
        offsets = np.cumsum(part)
        past = (offsets > rows - total) | (offsets < 0)
        if past.any():
            j = int(past.argmax())
            offset = total + (int(offsets[j - 1]) if j else 0) + int(part[j])
            raise WireError(f"{prefix}lengths[{start + j}]",
                            f"runs past the end of values (offset {offset} > {rows} rows)")
        total += int(offsets[-1])
    if total != rows:
        raise WireError(f"{prefix}lengths", f"sum to {total} but values has {rows} rows")
    return lengths
