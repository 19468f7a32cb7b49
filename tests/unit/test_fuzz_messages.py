"""The fuzz suite's message strategies (tests/fuzz_messages.py): every field type, boundaries, sizes."""

from __future__ import annotations

import math

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, struct_pb2
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from rlfleet.v1 import reward_pb2, tensor_pb2, trajectory_pb2
from tests import fuzz_messages

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

F = descriptor_pb2.FieldDescriptorProto
SCALAR_TYPES = [F.TYPE_DOUBLE, F.TYPE_FLOAT, F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_INT32, F.TYPE_FIXED64,
                F.TYPE_FIXED32, F.TYPE_BOOL, F.TYPE_STRING, F.TYPE_BYTES, F.TYPE_UINT32, F.TYPE_SFIXED32,
                F.TYPE_SFIXED64, F.TYPE_SINT32, F.TYPE_SINT64]


def _every_type():
    """A proto3 message with one singular and one repeated field of each scalar type, an enum, a
    nested message (itself), a oneof and a map."""
    file = descriptor_pb2.FileDescriptorProto(name="fuzz_every_type.proto", package="fuzztest", syntax="proto3")
    file.enum_type.add(name="Color", value=[descriptor_pb2.EnumValueDescriptorProto(name="COLOR_0", number=0),
                                            descriptor_pb2.EnumValueDescriptorProto(name="COLOR_1", number=1)])
    message = file.message_type.add(name="Every")
    number = iter(range(1, 100))
    for t in SCALAR_TYPES:
        name = F.Type.Name(t).removeprefix("TYPE_").lower()
        message.field.add(name=name, number=next(number), type=t, label=F.LABEL_OPTIONAL)
        message.field.add(name=f"many_{name}", number=next(number), type=t, label=F.LABEL_REPEATED)
    message.field.add(name="color", number=next(number), type=F.TYPE_ENUM, type_name=".fuzztest.Color")
    message.field.add(name="child", number=next(number), type=F.TYPE_MESSAGE, type_name=".fuzztest.Every")
    message.oneof_decl.add(name="choice")
    message.field.add(name="text", number=next(number), type=F.TYPE_STRING, oneof_index=0)
    message.field.add(name="other", number=next(number), type=F.TYPE_MESSAGE, type_name=".fuzztest.Every",
                      oneof_index=0)
    entry = message.nested_type.add(name="ByNameEntry", options=descriptor_pb2.MessageOptions(map_entry=True))
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, type_name=".fuzztest.Every", label=F.LABEL_OPTIONAL)
    message.field.add(name="by_name", number=next(number), type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                      type_name=".fuzztest.Every.ByNameEntry")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return pool.FindMessageTypeByName("fuzztest.Every")


EVERY = _every_type()
FIND = settings(max_examples=500, phases=[Phase.generate], database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
"""For find(): the first match is enough (shrinking a megabyte message takes minutes)."""
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("descriptor", [
    EVERY, struct_pb2.Struct.DESCRIPTOR, descriptor_pb2.UninterpretedOption.DESCRIPTOR,  # proto2, required fields
    trajectory_pb2.AppendRequest.DESCRIPTOR, reward_pb2.ComputeRewardsRequest.DESCRIPTOR], ids=lambda d: d.name)
def test_generated_messages_serialize_parse_back_and_stay_below_the_limit(descriptor):
    @SETTINGS
    @given(fuzz_messages.messages(descriptor))
    def check(msg):
        raw = msg.SerializeToString(deterministic=True)  # map order
        assert len(raw) < 2 * fuzz_messages.MAX_REQUEST_BYTES
        back = fuzz_messages.message_class(descriptor).FromString(raw)
        assert back.SerializeToString(deterministic=True) == raw
    check()


@pytest.mark.parametrize("field,wanted", [
    ("int32", [-(1 << 31), (1 << 31) - 1, -1, 0]), ("int64", [-(1 << 63), (1 << 63) - 1, -1]),
    ("uint64", [(1 << 64) - 1, 1 << 63]), ("uint32", [(1 << 32) - 1]), ("sint64", [-(1 << 63)]),
    ("fixed64", [(1 << 64) - 1]), ("sfixed32", [-(1 << 31)]),
    ("double", [math.inf, -math.inf, 1.7976931348623157e308, -0.0]), ("float", [3.4028234663852886e38, math.inf]),
])
def test_boundary_values_are_generated(field, wanted):
    values = fuzz_messages.scalars(EVERY.fields_by_name[field])
    for value in wanted:  # find() raises if no example matches
        find(values, lambda v, value=value: v == value and math.copysign(1, v) == math.copysign(1, value),
             settings=FIND)
    if field in ("double", "float"):
        find(values, math.isnan, settings=FIND)


def test_open_enums_go_out_of_range_and_strings_bytes_lists_get_huge_and_empty():
    find(fuzz_messages.scalars(EVERY.fields_by_name["color"]), lambda v: v not in (0, 1), settings=FIND)
    for name in ("string", "bytes"):
        values = fuzz_messages.scalars(EVERY.fields_by_name[name])
        find(values, lambda v: len(v) >= 1 << 20, settings=FIND)
        find(values, lambda v: len(v) == 0, settings=FIND)
    tensors = fuzz_messages.messages(tensor_pb2.Tensor.DESCRIPTOR)
    find(tensors, lambda m: len(m.shape) >= 100_000, settings=FIND)
    find(tensors, lambda m: m.dtype not in tensor_pb2.Dtype.values(), settings=FIND)  # an open enum, out of range
    find(fuzz_messages.messages(tensor_pb2.TensorDict.DESCRIPTOR),  # map -> oneof -> nested message
         lambda m: any(v.WhichOneof("kind") == "nested" and v.nested.entries for v in m.entries.values()),
         settings=FIND)


@SETTINGS
@given(fuzz_messages.scalars(descriptor_pb2.FieldDescriptorProto.DESCRIPTOR.fields_by_name["type"]))
def test_closed_enums_stay_in_range(value):
    assert value in descriptor_pb2.FieldDescriptorProto.Type.values()


@SETTINGS
@given(st.data())
def test_corruption_changes_a_valid_serialization(data):
    raw = trajectory_pb2.StreamBatchesRequest(open=trajectory_pb2.OpenBatchStream(batch_size=4)).SerializeToString()
    assert data.draw(fuzz_messages.corrupted(raw)) != raw
