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


def split_tensor(msg: tensor_pb2.Tensor, sizes: Sequence[int],
                 outs: Sequence[tensor_pb2.Tensor] | None = None) -> list[tensor_pb2.Tensor]:
    """A dense tensor's rows (first dimension) in consecutive parts of ``sizes`` rows, written into
    ``outs`` if given. The bytes are read once (each access of ``data`` copies them)."""
    outs = [tensor_pb2.Tensor() for _ in sizes] if outs is None else outs
    data, rows, dtype = msg.data, msg.shape[0], msg.dtype
    stride = len(data) // rows if rows else 0
    trailing = list(msg.shape[1:])
    start = 0
    for size, out in zip(sizes, outs):
        out.dtype = dtype
        out.shape[:] = [size, *trailing]
        out.data = data[start * stride:(start + size) * stride]
        start += size
    return list(outs)


def split_ragged(msg: tensor_pb2.RaggedTensor, sizes: Sequence[int],
                 outs: Sequence[tensor_pb2.RaggedTensor] | None = None) -> list[tensor_pb2.RaggedTensor]:
    """A ragged's rows in consecutive parts of ``sizes`` rows, written into ``outs`` if given. The
    bytes and lengths are read once."""
    outs = [tensor_pb2.RaggedTensor() for _ in sizes] if outs is None else outs
    values, lengths = msg.values, list(msg.lengths)
    data, dtype = values.data, values.dtype
    trailing = list(values.shape[1:])
    row_bytes = math.prod(trailing) * BY_WIRE[dtype].itemsize
    row = offset = 0
    for size, out in zip(sizes, outs):
        part = lengths[row:row + size]
        count = sum(part)
        out_values = out.values  # each access of a sub-message costs a lookup
        out_values.dtype = dtype
        out_values.shape[:] = [count, *trailing]
        out_values.data = data[offset * row_bytes:(offset + count) * row_bytes]
        out.lengths[:] = part
        row, offset = row + size, offset + count
    return list(outs)


def concat_tensors(parts: Sequence[tensor_pb2.Tensor], out: tensor_pb2.Tensor | None = None) -> tensor_pb2.Tensor:
    """Dense tensors of one dtype and trailing shape, stacked along the first dimension."""
    out = tensor_pb2.Tensor() if out is None else out
    rows, data = 0, []
    for part in parts:  # one loop, no generators: a batch concatenates a few hundred tensors
        rows += part.shape[0]
        data.append(part.data)
    out.dtype = parts[0].dtype
    out.shape[:] = [rows, *parts[0].shape[1:]]
    out.data = b"".join(data)
    return out


def concat_raggeds(parts: Sequence[tensor_pb2.RaggedTensor],
                   out: tensor_pb2.RaggedTensor | None = None) -> tensor_pb2.RaggedTensor:
    """Raggeds of one dtype and trailing shape: their rows, in order."""
    out = tensor_pb2.RaggedTensor() if out is None else out
    concat_tensors([p.values for p in parts], out=out.values)
    for part in parts:
        out.lengths.extend(part.lengths)
    return out


def split_tensordict(msg: tensor_pb2.TensorDict, sizes: Sequence[int] | None = None,
                     outs: Sequence[tensor_pb2.TensorDict] | None = None) -> list[tensor_pb2.TensorDict]:
    """``msg``'s rows in consecutive parts of ``sizes`` rows (default: one message per row), in row
    order, written into ``outs`` (empty messages) if given."""
    sizes = [1] * msg.batch_size[0] if sizes is None else list(sizes)
    parts = [tensor_pb2.TensorDict() for _ in sizes] if outs is None else list(outs)
    trailing = list(msg.batch_size[1:])
    for part, size in zip(parts, sizes):
        part.batch_size[:] = [size, *trailing]
    entries, maps = msg.entries, [part.entries for part in parts]
    for key in entries:  # keys, then one lookup each: a map's items() view costs twice as much
        value = entries[key]
        kind = value.WhichOneof("kind")
        if kind == "tensor":
            split_tensor(value.tensor, sizes, outs=[entries_of_part[key].tensor for entries_of_part in maps])
        elif kind == "ragged":
            split_ragged(value.ragged, sizes, outs=[entries_of_part[key].ragged for entries_of_part in maps])
        elif kind == "strings":
            texts, start = list(value.strings.values), 0
            for entries_of_part, size in zip(maps, sizes):
                entries_of_part[key].strings.values.extend(texts[start:start + size])
                start += size
        elif kind == "nested":
            split_tensordict(value.nested, sizes, outs=[entries_of_part[key].nested for entries_of_part in maps])
        else:  # pragma: no cover - check_tensordict rejects empty values
            raise ValueError(f"entries[{key}]: empty value")
    return parts


def concat_tensordicts(parts: Sequence[tensor_pb2.TensorDict],
                       out: tensor_pb2.TensorDict | None = None) -> tensor_pb2.TensorDict:
    """One TensorDict message holding the rows of ``parts`` (same schema), in order, written into
    ``out`` (an empty message) if given."""
    out = tensor_pb2.TensorDict() if out is None else out
    out.batch_size[:] = [sum(p.batch_size[0] for p in parts), *parts[0].batch_size[1:]]
    maps = [p.entries for p in parts]
    for key in maps[0]:  # keys, then one lookup each: a map's items() view costs twice as much
        kind = maps[0][key].WhichOneof("kind")
        entries = []
        for entries_of_part in maps:
            entry = entries_of_part[key] if key in entries_of_part else None
            if entry is None or entry.WhichOneof("kind") != kind:
                # Our callers concatenate rows of one schema, so this is a bug, not bad input.
                raise ValueError(f"entries[{key}]: rows to concatenate do not share a schema")
            entries.append(entry)
        if kind == "tensor":
            concat_tensors([e.tensor for e in entries], out=out.entries[key].tensor)
        elif kind == "ragged":
            concat_raggeds([e.ragged for e in entries], out=out.entries[key].ragged)
        elif kind == "strings":
            target = out.entries[key].strings.values
            for e in entries:
                target.extend(e.strings.values)
        else:
            concat_tensordicts([e.nested for e in entries], out=out.entries[key].nested)
    return out
