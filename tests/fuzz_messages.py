"""Hypothesis strategies for protobuf requests, built from descriptors alone.

``messages(descriptor)`` builds a message of any descriptor: every scalar type
with its boundary values, enums in and out of range, oneofs, maps, nested
messages, repeated fields empty, short or long, strings and bytes empty, odd or
huge. ``requests(descriptor, seeds)`` mixes that with what an outsider sends:
random bytes, empty bytes, valid messages with a field replaced, and valid
serializations corrupted (bit flips, truncation, junk appended or spliced in,
unknown fields). Used by ``tests/integration/test_fuzz.py``; no sockets here.
"""

from __future__ import annotations

import math
from typing import Sequence

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

MAX_DEPTH = 3
"""Nesting of generated messages (a TensorDict holds TensorDicts): deeper levels are left empty."""
LONG_LENGTHS = (1_000, 100_000, 1_000_000)
"""Lengths of a "long" repeated scalar field: up to ~10 MB serialized, far below the 64 MiB limit."""
LONG_MESSAGES = (100, 2_000)
"""Lengths of a long repeated message field (each element built once, then copied)."""
HUGE_SIZES = (65_536, 1 << 20, 4 << 20)
"""Sizes of a huge string or bytes field."""
MAX_REQUEST_BYTES = 16 << 20
"""What the long and huge fields of one generated request may add up to (about; see ``_Budget``)."""

_I32 = (-(1 << 31), (1 << 31) - 1)
_I64 = (-(1 << 63), (1 << 63) - 1)
_U32 = (0, (1 << 32) - 1)
_U64 = (0, (1 << 64) - 1)
_F32_MAX = 3.4028234663852886e38


def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (0, 1, -1, 2, 7, 255, 256, 65_535, 1 << 31, (1 << 31) - 1, 1 << 32,
                                1 << 53, (1 << 53) + 1, (1 << 63) - 1, 1 << 63, low, high, low + 1, high - 1)
                    if low <= v <= high})
    return st.one_of(st.sampled_from(edges), st.integers(0, 16), st.integers(low, high))


def _floats(width: int) -> st.SearchStrategy[float]:
    top = _F32_MAX if width == 32 else 1.7976931348623157e308
    tiny = 1.401298464324817e-45 if width == 32 else 5e-324
    edges = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, math.nan, math.inf, -math.inf, top, -top, tiny, -tiny, 1e-7, 2.0 ** 53]
    return st.one_of(st.sampled_from(edges), st.floats(width=width))


_UNICODE = st.characters(exclude_categories=("Cs",))  # lone surrogates are not UTF-8: protobuf refuses them
_ODD_STRINGS = ["", " ", "\x00", "a", "é", "𝔘𝔫𝔦", "\u202e", "\ufeff", "../../etc/passwd", "%s%n", "{}", "*",
                ".*", "traj-0", "a" * 257, "🙂" * 300]


def _strings() -> st.SearchStrategy[str]:
    huge = st.tuples(st.sampled_from(HUGE_SIZES), st.sampled_from("aé🙂\x00")).map(lambda p: p[1] * (p[0] // 4))
    return _rarely(huge, st.one_of(st.sampled_from(_ODD_STRINGS), st.text(_UNICODE, max_size=24)))


def _bytes() -> st.SearchStrategy[bytes]:
    huge = st.tuples(st.sampled_from(HUGE_SIZES), st.sampled_from([b"\x00", b"\xff", b"\x7f\x80"])).map(
        lambda p: p[1] * (p[0] // len(p[1])))
    return _rarely(huge, st.one_of(st.sampled_from([b"", b"\x00", b"\xff" * 3, b"\x00" * 8, b"\x01" * 16]),
                                   st.binary(max_size=64)))


def _rarely(rare: st.SearchStrategy, usual: st.SearchStrategy) -> st.SearchStrategy:
    """``rare`` one time in ten: a huge value in every string field would make every request huge."""
    return st.integers(0, 9).flatmap(lambda k: rare if k == 0 else usual)


def scalars(field: FieldDescriptor) -> st.SearchStrategy:
    """Values of one non-message field, boundaries included (enums: out of range too)."""
    t = field.type
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return _ints(*_I32)
    if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        return _ints(*_I64)
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return _ints(*_U32)
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return _ints(*_U64)
    if t == FieldDescriptor.TYPE_DOUBLE:
        return _floats(64)
    if t == FieldDescriptor.TYPE_FLOAT:
        return _floats(32)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return _strings()
    if t == FieldDescriptor.TYPE_BYTES:
        return _bytes()
    if t == FieldDescriptor.TYPE_ENUM:
        known = st.sampled_from([v.number for v in field.enum_type.values])
        # proto3 enums are open: any int32 goes on the wire; a closed (proto2) enum takes only its own values.
        return known if field.enum_type.is_closed else st.one_of(known, _ints(*_I32))
    raise TypeError(f"{field.full_name}: no scalar strategy for field type {t}")


def message_class(descriptor: Descriptor) -> type[Message]:
    return message_factory.GetMessageClass(descriptor)


def _is_map(field: FieldDescriptor) -> bool:
    return (field.is_repeated and field.type == FieldDescriptor.TYPE_MESSAGE
            and field.message_type.GetOptions().map_entry)


class _Budget:
    """Bytes a generated request may still take: long lists and huge strings are cut to fit, so that
    one request stays well below the services' 64 MiB limit and a nested long list of long lists
    cannot multiply into gigabytes."""

    def __init__(self, nbytes: int = MAX_REQUEST_BYTES):
        self.left = nbytes

    def charge(self, nbytes: int) -> None:
        self.left = max(0, self.left - nbytes)

    def count(self, wanted: int, each: int) -> int:
        """How many elements of ``each`` bytes fit, at most ``wanted``; charged."""
        count = min(wanted, self.left // max(1, each))
        self.charge(count * max(1, each))
        return count


def _scalar(draw, field: FieldDescriptor, budget: _Budget):
    value = draw(scalars(field))
    if isinstance(value, bytes):
        value = value[:budget.left]
        budget.charge(len(value))
    elif isinstance(value, str):
        value = value[:budget.left // 4]  # up to 4 UTF-8 bytes a character
        budget.charge(len(value.encode()))
    return value


def _fill(draw, msg: Message, field: FieldDescriptor, depth: int, budget: _Budget) -> None:
    """Give ``field`` of ``msg`` a generated value (repeated: a generated list, map: entries)."""
    name = field.name
    if _is_map(field):
        key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        target = getattr(msg, name)
        for _ in range(draw(st.integers(0, 3))):
            key = _scalar(draw, key_field, budget)
            if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                target[key].CopyFrom(_build(draw, value_field.message_type, depth + 1, budget))
            else:
                target[key] = _scalar(draw, value_field, budget)
        return
    is_message = field.type == FieldDescriptor.TYPE_MESSAGE

    def element():
        return _build(draw, field.message_type, depth + 1, budget) if is_message else _scalar(draw, field, budget)

    if not field.is_repeated:
        if is_message:
            getattr(msg, name).CopyFrom(element())
        else:
            setattr(msg, name, element())
        return
    shape = draw(st.integers(0, 11))  # 0: long, 1: empty, else short
    if shape == 0:
        value = element()
        size = (value.ByteSize() if is_message else len(value) if isinstance(value, bytes)
                else len(value.encode()) if isinstance(value, str) else 10)
        wanted = draw(st.sampled_from(LONG_MESSAGES if is_message else LONG_LENGTHS))
        values = [value] * (1 + budget.count(wanted - 1, size + 2))
    elif shape == 1:
        values = []
    else:
        values = [element() for _ in range(draw(st.integers(1, 4)))]
    target = getattr(msg, name)
    if is_message:
        for value in values:
            target.add().CopyFrom(value)
    else:
        target.extend(values)


def _build(draw, descriptor: Descriptor, depth: int, budget: _Budget) -> Message:
    msg = message_class(descriptor)()
    if depth >= MAX_DEPTH:  # only what must be set to serialize
        for field in descriptor.fields:
            if field.is_required and field.type != FieldDescriptor.TYPE_MESSAGE:
                _fill(draw, msg, field, depth, budget)
        return msg
    for oneof in descriptor.oneofs:
        choice = draw(st.sampled_from([None, *oneof.fields]))
        if choice is not None:
            _fill(draw, msg, choice, depth, budget)
    for field in descriptor.fields:  # a proto2 required field is always set: the message must serialize
        if field.containing_oneof is None and (field.is_required or draw(st.booleans())):
            _fill(draw, msg, field, depth, budget)
    return msg


@st.composite
def messages(draw, descriptor: Descriptor) -> Message:
    """Any message of ``descriptor``: each field set or not, with the values of ``scalars``."""
    return _build(draw, descriptor, 0, _Budget())


# ------------------------------------------------------------------ mutation


def _slots(msg: Message, depth: int = 0) -> list[tuple[Message, FieldDescriptor, int]]:
    """Every (message, field, depth) reachable in ``msg``: set or unset fields of every present message."""
    found = [(msg, field, depth) for field in msg.DESCRIPTOR.fields]
    for field in msg.DESCRIPTOR.fields:
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        if _is_map(field):
            value_field = field.message_type.fields_by_name["value"]
            if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                for value in getattr(msg, field.name).values():
                    found += _slots(value, depth + 1)
        elif field.is_repeated:
            for value in getattr(msg, field.name)[:8]:
                found += _slots(value, depth + 1)
        elif msg.HasField(field.name):
            found += _slots(getattr(msg, field.name), depth + 1)
    return found


@st.composite
def mutated(draw, seeds: Sequence[Message]) -> Message:
    """A valid ``seed`` with one to three fields (anywhere in it) cleared or given generated values."""
    budget = _Budget()
    msg = message_class(seeds[0].DESCRIPTOR)()
    msg.CopyFrom(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(msg)
        if not slots:  # a message without fields
            break
        parent, field, depth = slots[draw(st.integers(0, len(slots) - 1))]
        parent.ClearField(field.name)
        if draw(st.integers(0, 4)):  # mostly a new value; sometimes just cleared
            _fill(draw, parent, field, min(depth, MAX_DEPTH - 1), budget)
    return msg


# ------------------------------------------------------------------ raw bytes


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@st.composite
def unknown_field(draw) -> bytes:
    """A well-formed field whose number the message does not declare (or does, with another wire type)."""
    number = draw(st.sampled_from([1, 2, 3, 15, 16, 99, 2047, (1 << 29) - 1]))
    wire_type = draw(st.sampled_from([0, 1, 2, 5]))
    tag = _varint(number << 3 | wire_type)
    if wire_type == 0:
        return tag + _varint(draw(st.integers(0, (1 << 64) - 1)))
    if wire_type == 1:
        return tag + draw(st.binary(min_size=8, max_size=8))
    if wire_type == 5:
        return tag + draw(st.binary(min_size=4, max_size=4))
    payload = draw(st.binary(max_size=32))
    return tag + _varint(len(payload)) + payload


@st.composite
def corrupted(draw, raw: bytes) -> bytes:
    """``raw`` with bits flipped, truncated, with junk appended or spliced in, or an unknown field added."""
    how = draw(st.sampled_from(["flip", "truncate", "append", "splice", "unknown", "length"]))
    data = bytearray(raw)
    if how == "flip" and data:
        for index, bit in draw(st.sets(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 7)),
                                       min_size=1, max_size=8)):
            data[index] ^= 1 << bit
    elif how == "truncate" and data:
        del data[draw(st.integers(0, len(data) - 1)):]
    elif how == "splice":
        index = draw(st.integers(0, len(data)))
        data[index:index] = draw(st.binary(min_size=1, max_size=16))
    elif how == "unknown":
        data += draw(unknown_field())
    elif how == "length":  # a length-delimited field claiming more bytes than follow
        data += b"\x0a" + _varint(draw(st.sampled_from([1 << 20, (1 << 31) - 1, (1 << 32) + 5, (1 << 63)])))
    else:
        data += draw(st.binary(min_size=1, max_size=64))
    return bytes(data)


def random_bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=256),
                     st.sampled_from([b"", b"\x00", b"\xff" * 64, b"\x0a\xff\xff\xff\x0f\x01"]))


def requests(descriptor: Descriptor, seeds: Sequence[Message]) -> st.SearchStrategy[bytes]:
    """Serialized requests for a method taking ``descriptor``: every kind above, ``seeds`` being valid examples.

    Weighted towards requests that parse (generated and mutated messages): those reach the services' own
    validation; bytes that do not parse all stop at the same place."""
    seeds = list(seeds) or [message_class(descriptor)()]
    # Partial: a mutation may clear a proto2 required field, and that is a request an outsider can send.
    serialized = st.sampled_from(seeds).map(lambda m: m.SerializePartialToString())
    kinds = [
        (1, random_bytes()),
        (1, st.just(b"")),  # the empty message
        (3, messages(descriptor).map(lambda m: m.SerializePartialToString())),
        (4, mutated(seeds).map(lambda m: m.SerializePartialToString())),
        (2, serialized.flatmap(corrupted)),
        (1, serialized),
    ]
    return st.sampled_from([kind for weight, kind in kinds for _ in range(weight)]).flatmap(lambda kind: kind)
