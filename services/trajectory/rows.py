"""Row surgery on TensorDict messages: split a batch into rows, concatenate rows.

The buffer stores each trajectory as its own serialized single-row TensorDict
message and builds a delivered batch by concatenating rows. Both directions work
on the wire messages directly (byte slices, no torch), so a delivered row is
byte-for-byte what was appended, and ragged, string and nested entries need no
padding or re-encoding. Inputs must already have passed ``decode_tensordict``:
byte lengths and ragged lengths are trusted here.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from rlfleet.v1 import tensor_pb2
from rlfleet.wire.dtypes import BY_WIRE

#: A batch's schema: key -> ["tensor", dtype, trailing dims] | ["ragged", dtype,
#: trailing dims] | ["strings"] | ["nested", extra batch dims, sub-schema].
#: Plain lists and dicts so it round-trips through JSON unchanged.
Schema = dict[str, list[Any]]


def split_rows(msg: tensor_pb2.TensorDict) -> list[bytes]:
    """One serialized single-row TensorDict per batch row, in row order."""
    return [row.SerializeToString(deterministic=True) for row in _split(msg)]


def _split(msg: tensor_pb2.TensorDict) -> list[tensor_pb2.TensorDict]:
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
            for row, sub in zip(rows, _split(value.nested)):
                row.entries[key].nested.CopyFrom(sub)
        else:  # pragma: no cover - decode_tensordict rejects empty values
            raise ValueError(f"entries[{key}]: empty value")
    return rows


def concat_rows(rows: Sequence[bytes]) -> tensor_pb2.TensorDict:
    """One TensorDict message holding ``rows`` (serialized, same schema) in order."""
    messages = []
    for raw in rows:
        msg = tensor_pb2.TensorDict()
        msg.ParseFromString(raw)
        messages.append(msg)
    return _concat(messages)


def _concat(parts: Sequence[tensor_pb2.TensorDict]) -> tensor_pb2.TensorDict:
    first = parts[0]
    out = tensor_pb2.TensorDict(batch_size=[sum(p.batch_size[0] for p in parts), *first.batch_size[1:]])
    for key, value in first.entries.items():
        kind = value.WhichOneof("kind")
        if any(key not in p.entries or p.entries[key].WhichOneof("kind") != kind for p in parts):
            # The store admits one schema at a time, so this is a bug, not bad input.
            raise ValueError(f"entries[{key}]: rows to concatenate do not share a schema")
        entries = [p.entries[key] for p in parts]
        if kind == "tensor":
            tensors = [e.tensor for e in entries]
            target = out.entries[key].tensor
            target.dtype = value.tensor.dtype
            target.shape[:] = [sum(t.shape[0] for t in tensors), *value.tensor.shape[1:]]
            target.data = b"".join(t.data for t in tensors)
        elif kind == "ragged":
            ragged = [e.ragged for e in entries]
            target = out.entries[key].ragged
            target.values.dtype = value.ragged.values.dtype
            target.values.shape[:] = [sum(r.values.shape[0] for r in ragged), *value.ragged.values.shape[1:]]
            target.values.data = b"".join(r.values.data for r in ragged)
            for r in ragged:
                target.lengths.extend(r.lengths)
        elif kind == "strings":
            target = out.entries[key].strings
            for e in entries:
                target.values.extend(e.strings.values)
        else:
            out.entries[key].nested.CopyFrom(_concat([e.nested for e in entries]))
    return out


def row_string(raw: bytes, key: str) -> str | None:
    """The value of the top-level string column ``key`` of one serialized row, or None without one."""
    row = tensor_pb2.TensorDict.FromString(raw)
    value = row.entries.get(key)
    if value is None or value.WhichOneof("kind") != "strings" or not value.strings.values:
        return None
    return value.strings.values[0]


def schema_of(msg: tensor_pb2.TensorDict) -> Schema:
    """What rows must share to be concatenated: keys, kinds, dtypes, trailing dims."""
    batch_dims = len(msg.batch_size)
    schema: Schema = {}
    for key in sorted(msg.entries):
        value = msg.entries[key]
        kind = value.WhichOneof("kind")
        if kind == "tensor":
            schema[key] = ["tensor", value.tensor.dtype, list(value.tensor.shape[batch_dims:])]
        elif kind == "ragged":
            schema[key] = ["ragged", value.ragged.values.dtype, list(value.ragged.values.shape[1:])]
        elif kind == "strings":
            schema[key] = ["strings"]
        else:
            nested = value.nested
            schema[key] = ["nested", list(nested.batch_size[batch_dims:]), schema_of(nested)]
    return schema


def schema_mismatch(expected: Schema, got: Schema, prefix: str = "trajectories") -> str | None:
    """The first difference between two schemas as "<field>: <problem>", or None."""
    for key in sorted(set(expected) | set(got)):
        where = f"{prefix}.entries[{key}]"
        if key not in got:
            return f"{where}: missing (the buffered trajectories have it)"
        if key not in expected:
            return f"{where}: not in the buffered trajectories"
        want, have = expected[key], got[key]
        if want[0] == have[0] == "nested" and want[1] == have[1]:
            nested = schema_mismatch(want[2], have[2], f"{where}.nested")
            if nested:
                return nested
        elif want != have:
            return f"{where}: {_describe(have)} does not match the buffered trajectories' {_describe(want)}"
    return None


def schema_violation(documented: Schema, got: Schema, prefix: str = "trajectories") -> str | None:
    """The first key of ``got`` that ``documented`` lacks or describes otherwise, as "<field>: <problem>",
    or None. Keys of ``documented`` that ``got`` leaves out are not a violation."""
    for key in sorted(got):
        where = f"{prefix}.entries[{key}]"
        want, have = documented.get(key), got[key]
        if want is None:
            return (f"{where}: not a key of the batch schema (docs/batch-schema.md); documented keys here: "
                    f"{', '.join(sorted(documented))}")
        if want[0] == have[0] == "nested" and want[1] == have[1]:
            nested = schema_violation(want[2], have[2], f"{where}.nested")
            if nested:
                return nested
        elif want != have:
            return f"{where}: {_describe(have)}, but the batch schema (docs/batch-schema.md) says {_describe(want)}"
    return None


def _describe(entry: list[Any]) -> str:
    kind = entry[0]
    if kind in ("tensor", "ragged"):
        return f"{kind} {tensor_pb2.Dtype.Name(entry[1])} with trailing dims {entry[2]}"
    if kind == "nested":
        return f"nested TensorDict with extra batch dims {entry[1]}"
    return kind
