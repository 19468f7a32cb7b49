"""Rows as the buffer stores them, and the schema every append keeps to.

The buffer stores each group (a unit: the rows one append carried under one group_id) as one
serialized TensorDict message holding its rows, and builds a delivered batch by concatenating
groups, or rows sliced out of them (``rlfleet.wire.rows``: byte slices, no torch), so a delivered
row is byte-for-byte what was appended. Files written before stored each row as its own message;
those rows are read as they are. Inputs must already have passed ``check_tensordict``.
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


def split_units(msg: tensor_pb2.TensorDict, units: Sequence[Sequence[int]]) -> list[bytes]:
    """One serialized TensorDict per unit (``units``: row indices), holding its rows in order."""
    sizes = [len(indices) for indices in units]
    start, contiguous = 0, True
    for indices in units:
        contiguous = contiguous and list(indices) == list(range(start, start + len(indices)))
        start += len(indices)
    if contiguous and start == msg.batch_size[0]:
        parts = [msg] if len(units) == 1 else split_tensordict(msg, sizes)
    else:  # interleaved groups (no client of ours appends them so): row by row
        rows = split_tensordict(msg)
        parts = [concat_tensordicts([rows[i] for i in indices]) for indices in units]
    return [part.SerializeToString(deterministic=True) for part in parts]


def rows_of(part: tensor_pb2.TensorDict, indices: Sequence[int]) -> list[tensor_pb2.TensorDict]:
    """The rows ``indices`` of a unit's message, as parts to concatenate: the whole message when
    they are all its rows in order, else one message per row."""
    if list(indices) == list(range(part.batch_size[0])):
        return [part]
    rows = split_tensordict(part)
    return [rows[i] for i in indices]


def concat_rows(rows: Sequence[bytes]) -> tensor_pb2.TensorDict:
    """One TensorDict message holding ``rows`` (serialized, same schema) in order."""
    return concat_tensordicts([tensor_pb2.TensorDict.FromString(raw) for raw in rows])


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
