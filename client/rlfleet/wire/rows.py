"""Row surgery on wire messages: slice rows out of, and concatenate rows of, Tensor, RaggedTensor
and TensorDict messages, on their bytes (no torch, no decode, no re-encode).

Rows are the first dimension (a ragged's rows are its lengths). A sliced or concatenated row is
byte-for-byte what it was, so data that passes through (log-probs, rewards) stays exact. Inputs
must already be valid (``check_tensordict`` / ``check_ragged`` / ``decode_tensor`` passed on them,
or built by us): byte lengths and ragged lengths are trusted here.
"""

from __future__ import annotations

import math
from typing import Sequence

from rlfleet.v1 import tensor_pb2
from rlfleet.wire.dtypes import BY_WIRE


def slice_tensor(msg: tensor_pb2.Tensor, start: int, stop: int,
                 out: tensor_pb2.Tensor | None = None) -> tensor_pb2.Tensor:
    """Rows ``start:stop`` of a dense tensor (first dimension)."""
    out = tensor_pb2.Tensor() if out is None else out
    rows = msg.shape[0]
    data = msg.data
    stride = len(data) // rows if rows else 0
    out.dtype = msg.dtype
    out.shape[:] = [stop - start, *msg.shape[1:]]
    out.data = data[start * stride:stop * stride]
    return out


def slice_ragged(msg: tensor_pb2.RaggedTensor, start: int, stop: int,
                 out: tensor_pb2.RaggedTensor | None = None) -> tensor_pb2.RaggedTensor:
    """Rows ``start:stop`` of a ragged."""
    out = tensor_pb2.RaggedTensor() if out is None else out
    lengths = msg.lengths
    first, count = sum(lengths[:start]), sum(lengths[start:stop])
    trailing = list(msg.values.shape[1:])
    row_bytes = math.prod(trailing) * BY_WIRE[msg.values.dtype].itemsize
    out.values.dtype = msg.values.dtype
    out.values.shape[:] = [count, *trailing]
    out.values.data = msg.values.data[first * row_bytes:(first + count) * row_bytes]
    out.lengths[:] = lengths[start:stop]
    return out


def concat_tensors(parts: Sequence[tensor_pb2.Tensor], out: tensor_pb2.Tensor | None = None) -> tensor_pb2.Tensor:
    """Dense tensors of one dtype and trailing shape, stacked along the first dimension."""
    out = tensor_pb2.Tensor() if out is None else out
    out.dtype = parts[0].dtype
    out.shape[:] = [sum(p.shape[0] for p in parts), *parts[0].shape[1:]]
    out.data = b"".join(p.data for p in parts)
    return out


def concat_raggeds(parts: Sequence[tensor_pb2.RaggedTensor],
                   out: tensor_pb2.RaggedTensor | None = None) -> tensor_pb2.RaggedTensor:
    """Raggeds of one dtype and trailing shape: their rows, in order."""
    out = tensor_pb2.RaggedTensor() if out is None else out
    concat_tensors([p.values for p in parts], out=out.values)
    out.lengths[:] = [length for p in parts for length in p.lengths]
    return out


def split_tensordict(msg: tensor_pb2.TensorDict) -> list[tensor_pb2.TensorDict]:
    """One single-row TensorDict message per row of ``msg``, in row order."""
    count = msg.batch_size[0]
    rows = [tensor_pb2.TensorDict(batch_size=[1, *msg.batch_size[1:]]) for _ in range(count)]
    for key, value in msg.entries.items():
        kind = value.WhichOneof("kind")
        if kind == "tensor":
            tensor, data = value.tensor, value.tensor.data  # read `data` once: each access copies
            stride = len(data) // count if count else 0
            for i, row in enumerate(rows):
                out = row.entries[key].tensor
                out.dtype = tensor.dtype
                out.shape[:] = [1, *tensor.shape[1:]]
                out.data = data[i * stride:(i + 1) * stride]
        elif kind == "ragged":
            values, data = value.ragged.values, value.ragged.values.data
            trailing = list(values.shape[1:])
            row_bytes = math.prod(trailing) * BY_WIRE[values.dtype].itemsize
            offset = 0
            for row, length in zip(rows, value.ragged.lengths):
                out = row.entries[key].ragged
                out.values.dtype = values.dtype
                out.values.shape[:] = [length, *trailing]
                out.values.data = data[offset * row_bytes:(offset + length) * row_bytes]
                out.lengths.append(length)
                offset += length
        elif kind == "strings":
            for row, text in zip(rows, value.strings.values):
                row.entries[key].strings.values.append(text)
        elif kind == "nested":
            for row, sub in zip(rows, split_tensordict(value.nested)):
                row.entries[key].nested.CopyFrom(sub)
        else:  # pragma: no cover - check_tensordict rejects empty values
            raise ValueError(f"entries[{key}]: empty value")
    return rows


def concat_tensordicts(parts: Sequence[tensor_pb2.TensorDict]) -> tensor_pb2.TensorDict:
    """One TensorDict message holding the rows of ``parts`` (same schema), in order."""
    first = parts[0]
    out = tensor_pb2.TensorDict(batch_size=[sum(p.batch_size[0] for p in parts), *first.batch_size[1:]])
    for key, value in first.entries.items():
        kind = value.WhichOneof("kind")
        if any(key not in p.entries or p.entries[key].WhichOneof("kind") != kind for p in parts):
            # Our callers concatenate rows of one schema, so this is a bug, not bad input.
            raise ValueError(f"entries[{key}]: rows to concatenate do not share a schema")
        entries = [p.entries[key] for p in parts]
        if kind == "tensor":
            concat_tensors([e.tensor for e in entries], out=out.entries[key].tensor)
        elif kind == "ragged":
            concat_raggeds([e.ragged for e in entries], out=out.entries[key].ragged)
        elif kind == "strings":
            target = out.entries[key].strings
            for e in entries:
                target.values.extend(e.strings.values)
        else:
            out.entries[key].nested.CopyFrom(concat_tensordicts([e.nested for e in entries]))
    return out
