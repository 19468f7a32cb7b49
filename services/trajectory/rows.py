"""Rows as the buffer stores them, and the schema every append keeps to.

The buffer stores each trajectory as its own serialized single-row TensorDict
message and builds a delivered batch by concatenating rows (``rlfleet.wire.rows``:
byte slices, no torch), so a delivered row is byte-for-byte what was appended.
Inputs must already have passed ``check_tensordict``.
"""

from __future__ import annotations

from typing import Any, Sequence

from rlfleet.v1 import tensor_pb2
from rlfleet.wire.rows import concat_tensordicts, split_tensordict

#: A batch's schema: key -> ["tensor", dtype, trailing dims] | ["ragged", dtype,
#: trailing dims] | ["strings"] | ["nested", extra batch dims, sub-schema].
#: Plain lists and dicts so it round-trips through JSON unchanged.
Schema = dict[str, list[Any]]


def split_rows(msg: tensor_pb2.TensorDict) -> list[bytes]:
    """One serialized single-row TensorDict per batch row, in row order."""
    return [row.SerializeToString(deterministic=True) for row in split_tensordict(msg)]


def concat_rows(rows: Sequence[bytes]) -> tensor_pb2.TensorDict:
    """One TensorDict message holding ``rows`` (serialized, same schema) in order."""
    messages = []
    for raw in rows:
        msg = tensor_pb2.TensorDict()
        msg.ParseFromString(raw)
        messages.append(msg)
    return concat_tensordicts(messages)


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
