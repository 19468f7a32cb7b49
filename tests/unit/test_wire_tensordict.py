"""TensorDict codec: nested keys, batch sizes, strings, ragged entries, fuzzing."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from rlfleet.v1 import tensor_pb2
from rlfleet.wire import Ragged, WireError, decode_tensordict, encode_tensordict, get_ragged, string_list
from rlfleet.wire.tensordict import check_tensordict, parse_tensordict


def sample_td(batch: int = 3) -> TensorDict:
    td = TensorDict(
        {
            "score": torch.randn(batch),
            "tokens": Ragged.from_list([torch.arange(i + 1) for i in range(batch)]).to_nested(),
            "weights": torch.randn(batch, 2, dtype=torch.bfloat16),
        },
        batch_size=[batch],
    )
    td["next", "done"] = torch.zeros(batch, 1, dtype=torch.bool)
    td["next", "reward"] = Ragged.from_list([torch.ones(i + 1) for i in range(batch)]).to_nested()
    td["trajectory_id"] = NonTensorStack.from_list([f"t{i}" for i in range(batch)])
    return td


def assert_td_equal(a: TensorDict, b: TensorDict) -> None:
    assert a.batch_size == b.batch_size
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for key in a.keys(True, True):
        x, y = a.get(key), b.get(key)
        if isinstance(x, NonTensorStack):
            assert x.tolist() == y.tolist()
        elif x.is_nested:
            assert [t.tolist() for t in get_ragged(a, key).to_list()] == [t.tolist() for t in get_ragged(b, key).to_list()]
        else:
            assert x.dtype == y.dtype and torch.equal(x, y)


def test_tensordict_round_trip_with_nested_keys_strings_and_ragged():
    td = sample_td()
    decoded = decode_tensordict(tensor_pb2.TensorDict.FromString(encode_tensordict(td).SerializeToString()))
    assert_td_equal(td, decoded)
    assert list(decoded["trajectory_id"]) == ["t0", "t1", "t2"]
    assert get_ragged(decoded, ("next", "reward")).lengths.tolist() == [1, 2, 3]


def test_a_string_entry_reads_back_as_a_plain_list_of_str():
    for strings in (["a", "b", "c"], ["p"] * 3, ["solo"]):
        decoded = decode_tensordict(encode_tensordict({"prompt_id": strings}, batch_size=[len(strings)]))
        back = string_list(decoded.get("prompt_id"))
        assert type(back) is list and back == strings and all(type(s) is str for s in back)
    assert string_list(NonTensorData("p", batch_size=[2])) == ["p", "p"]  # equal strings, collapsed
    assert string_list(NonTensorStack(batch_size=[0])) == []
    assert string_list(torch.zeros(2)) is None and string_list(sample_td()) is None


def test_plain_mapping_and_multi_dim_batch():
    msg = encode_tensordict({"x": torch.ones(2, 3, 4)}, batch_size=[2, 3])
    td = decode_tensordict(msg)
    assert td.batch_size == torch.Size([2, 3]) and td["x"].shape == (2, 3, 4)


def test_empty_batch_round_trips():
    td = TensorDict({"x": torch.zeros(0, 3)}, batch_size=[0])
    assert decode_tensordict(encode_tensordict(td))["x"].shape == (0, 3)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda m: m.batch_size.__setitem__(0, 4), "entries[next].nested.batch_size"),  # first key in order
        (lambda m: m.entries["score"].tensor.shape.__setitem__(0, 4), "entries[score].tensor"),
        (lambda m: m.entries["tokens"].ragged.lengths.append(0), "entries[tokens].ragged.lengths"),
        (lambda m: m.entries["trajectory_id"].strings.values.append("x"), "entries[trajectory_id].strings"),
        (lambda m: m.entries["next"].nested.batch_size.__setitem__(0, 9), "entries[next].nested.entries[done].tensor.shape"),
        (lambda m: m.entries["empty"].Clear(), "entries[empty]"),
        (lambda m: m.entries["a.b"].tensor.CopyFrom(m.entries["score"].tensor), "entries[a.b]"),
        (lambda m: m.batch_size.__setitem__(0, -1), "batch_size[0]"),
    ],
)
def test_malformed_tensordict_raises_naming_field(mutate, field):
    msg = encode_tensordict(sample_td())
    mutate(msg)
    with pytest.raises(WireError) as err:
        decode_tensordict(msg, "batch")
    assert err.value.field.startswith(f"batch.{field}"), err.value


def test_unparseable_bytes_raise_wire_error():
    with pytest.raises(WireError):
        parse_tensordict(b"\xff\xff\xff\xff")


def corrupted(data, message: bytes) -> bytearray:
    """``message`` with 1 to 4 random byte corruptions."""
    raw = bytearray(message)
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "set", "truncate", "insert"]))
        if not raw:
            break
        pos = data.draw(st.integers(0, len(raw) - 1))
        if kind == "flip":
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set":
            raw[pos] = data.draw(st.integers(0, 255))
        elif kind == "truncate":
            del raw[pos:]
        else:
            raw[pos:pos] = bytes([data.draw(st.integers(0, 255))])
    return raw


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_messages_decode_consistently_or_raise_typed_error(data):
    """Random byte corruptions never crash or hang: WireError, or a valid TensorDict
    that re-encodes to exactly the (corrupted) message it came from. A corruption
    that leaves the message equal decodes to the original tensors."""
    original_td = sample_td(data.draw(st.integers(1, 4)))
    raw = corrupted(data, encode_tensordict(original_td).SerializeToString())
    try:
        decoded = decode_tensordict(parse_tensordict(bytes(raw)))
    except WireError:
        return
    reparsed = parse_tensordict(bytes(raw))
    reparsed.DiscardUnknownFields()  # unknown fields are ignored (forward compatibility)
    assert encode_tensordict(decoded) == reparsed
    if reparsed == encode_tensordict(original_td):
        assert_td_equal(original_td, decoded)


def tensor_bytes_of(td: TensorDict) -> int:
    total = 0
    for key in td.keys(True, True):
        value = td.get(key)
        if isinstance(value, NonTensorStack):
            continue
        values = get_ragged(td, key).values if value.is_nested else value
        total += values.numel() * values.element_size()
    return total


def test_check_tensordict_validates_without_building_and_counts_tensor_bytes():
    td = sample_td()
    assert check_tensordict(encode_tensordict(td)) == tensor_bytes_of(td)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_check_tensordict_agrees_with_decode_on_fuzzed_messages(data):
    """The check (Echo's) and the decode (a real request's) are one validation: same verdict, same field."""
    raw = corrupted(data, encode_tensordict(sample_td(data.draw(st.integers(1, 4)))).SerializeToString())
    try:
        msg = parse_tensordict(bytes(raw))
    except WireError:
        return
    try:
        decoded = decode_tensordict(msg, "payload")
    except WireError as err:
        with pytest.raises(WireError) as checked:
            check_tensordict(msg, "payload")
        assert checked.value.field == err.field and checked.value.problem == err.problem
        return
    assert check_tensordict(msg, "payload") == tensor_bytes_of(decoded)


def test_zero_element_entries_with_overflowing_strides_are_refused():
    msg = encode_tensordict({"x": torch.zeros(1, 0)}, batch_size=[1])
    msg.entries["x"].tensor.shape[:] = [1, 0, 2**62, 2**62]
    for check in (decode_tensordict, check_tensordict):
        with pytest.raises(WireError, match="overflows int64") as err:
            check(msg, "payload")
        assert err.value.field == "payload.entries[x].tensor.shape"
