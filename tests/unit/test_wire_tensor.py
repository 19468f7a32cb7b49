"""Tensor and ragged codec: bit-exact round trips and typed errors."""

import contextlib
import random
import struct
import warnings

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.v1 import tensor_pb2
from rlfleet.wire import SUPPORTED_DTYPES, Ragged, WireError, decode_ragged, decode_tensor, encode_ragged, encode_tensor
from rlfleet.wire.tensor import encode_values

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4)


def random_tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Random bits for floats (NaN payloads, infs, -0.0 included), random values otherwise."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(SUPPORTED_DTYPES), shape=shapes, seed=st.integers(0, 2**31))
def test_tensor_round_trip_is_bit_exact(dtype, shape, seed):
    tensor = random_tensor(dtype, shape, seed)
    msg = tensor_pb2.Tensor.FromString(encode_tensor(tensor).SerializeToString())
    decoded = decode_tensor(msg)
    assert same_bits(decoded, tensor)


def test_non_contiguous_and_scalar_tensors():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert torch.equal(decode_tensor(encode_tensor(base.t())), base.t())
    assert torch.equal(decode_tensor(encode_tensor(base[:, ::2])), base[:, ::2])
    scalar = decode_tensor(encode_tensor(torch.tensor(7, dtype=torch.int8)))
    assert scalar.shape == () and scalar.item() == 7


def test_decode_views_the_message_bytes_without_copy():
    msg = encode_tensor(torch.arange(1024, dtype=torch.float32))
    data = msg.data  # one bytes object, as gRPC hands it to the deserialized message
    msg2 = tensor_pb2.Tensor(dtype=msg.dtype, shape=msg.shape)
    msg2.data = data
    out = decode_tensor(msg2)
    assert out.untyped_storage().nbytes() == len(data)


def test_decode_warns_nothing_and_sets_no_warning_filter_once_torch_said_its_warning(monkeypatch):
    msg = encode_tensor(torch.arange(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "buffer is not writable" would raise here
        decode_tensor(msg)  # the first: torch's one warning, filtered
        filters = []
        monkeypatch.setattr(warnings, "catch_warnings", lambda *a, **k: filters.append(1) or contextlib.nullcontext())
        assert decode_tensor(msg).tolist() == [0, 1, 2, 3]
        assert filters == []  # torch warns once only: no filter (~3 us) per decode
        torch.set_warn_always(True)  # then it warns every time: filtered again
        try:
            assert decode_tensor(msg).tolist() == [0, 1, 2, 3]
        finally:
            torch.set_warn_always(False)
        assert filters == [1]


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(SUPPORTED_DTYPES),
    lengths=st.lists(st.integers(0, 6), min_size=0, max_size=6),
    trailing=st.lists(st.integers(1, 3), max_size=2),
    seed=st.integers(0, 2**31),
)
def test_ragged_round_trip_is_bit_exact(dtype, lengths, trailing, seed):
    samples = [random_tensor(dtype, [n, *trailing], seed + i) for i, n in enumerate(lengths)]
    msg = tensor_pb2.RaggedTensor.FromString(encode_ragged(samples).SerializeToString())
    ragged = decode_ragged(msg)
    assert ragged.lengths.tolist() == lengths
    assert all(same_bits(a, b) for a, b in zip(ragged.to_list(), samples))
    assert len(ragged.to_list()) == len(samples)


def test_ragged_padded_and_nested_views():
    samples = [torch.tensor([1, 2, 3]), torch.tensor([], dtype=torch.int64), torch.tensor([4])]
    ragged = Ragged.from_list(samples)
    padded, mask = ragged.to_padded(pad_value=-1)
    assert padded.tolist() == [[1, 2, 3], [-1, -1, -1], [4, -1, -1]]
    assert mask.sum(1).tolist() == [3, 0, 1]
    left, left_mask = ragged.to_padded(pad_value=0, side="left")
    assert left.tolist() == [[1, 2, 3], [0, 0, 0], [0, 0, 4]]
    assert Ragged.from_padded(left, mask=left_mask).to_list()[2].tolist() == [4]
    assert Ragged.from_padded(padded, lengths=[3, 0, 1]).values.tolist() == [1, 2, 3, 4]
    nested = ragged.to_nested()
    assert Ragged.from_nested(nested).lengths.tolist() == [3, 0, 1]
    # Token id equal to the pad value is kept: masks come from lengths, not sentinels.
    with_pad_id = Ragged.from_list([torch.tensor([0, 0, 5])])
    assert Ragged.from_padded(*with_pad_id.to_padded(pad_value=0)[:1], lengths=[3]).values.tolist() == [0, 0, 5]


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda m: setattr(m, "data", m.data[:-1]), "data"),
        (lambda m: setattr(m, "dtype", 99), "dtype"),
        (lambda m: setattr(m, "dtype", 0), "dtype"),
        (lambda m: m.shape.__setitem__(0, -2), "shape[0]"),
        (lambda m: m.shape.extend([2**40, 2**40]), "shape"),
    ],
)
def test_malformed_tensor_raises_typed_error_naming_field(mutate, field):
    msg = encode_tensor(torch.zeros(2, 3))
    mutate(msg)
    with pytest.raises(WireError) as err:
        decode_tensor(msg, "x")
    assert err.value.field == f"x.{field}"


def test_bool_bytes_other_than_zero_one_are_rejected():
    msg = encode_tensor(torch.tensor([True, False]))
    msg.data = b"\x01\x07"
    with pytest.raises(WireError, match="bool"):
        decode_tensor(msg)


@pytest.mark.parametrize(
    "lengths, field",
    [([2, -1, 3], "lengths[1]"), ([2, 5], "lengths[1]"), ([1, 1], "lengths")],
)
def test_malformed_ragged_raises_naming_field(lengths, field):
    msg = encode_ragged([torch.arange(2), torch.arange(2)])
    msg.lengths[:] = lengths
    with pytest.raises(WireError) as err:
        decode_ragged(msg, "tokens")
    assert err.value.field == f"tokens.{field}"


# --- bounds: strides, dimensions, element and sample counts --------------------------------------

HUGE_DIMS = [0, 1, 2, 3, 2**31, 2**32, 2**61, 2**62, 2**63 - 1]


@pytest.mark.parametrize("shape", [[0, 2**62, 2**62], [0, 2**31, 2**32], [0, 2**61, 4], [2**62, 2, 0, 2]])
def test_zero_element_shapes_whose_strides_overflow_are_refused_naming_the_field(shape):
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=shape)
    with pytest.raises(WireError, match="overflows int64") as err:
        decode_tensor(msg, "x")
    assert err.value.field == "x.shape"


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.sampled_from(HUGE_DIMS), max_size=4), dtype=st.sampled_from(SUPPORTED_DTYPES))
def test_every_shape_the_codec_accepts_is_one_torch_can_build(shape, dtype):
    msg = tensor_pb2.Tensor(dtype=encode_tensor(torch.empty(0, dtype=dtype)).dtype, shape=shape)
    if 0 not in shape:
        return  # with elements, the data's length bounds the shape
    try:
        decoded = decode_tensor(msg)
    except WireError as err:  # conservative: the product of all non-zero dims must fit
        assert "overflows int64" in err.problem
        return
    assert list(decoded.shape) == shape and decoded.numel() == 0
    assert encode_tensor(decoded).shape == shape  # and it goes back on the wire


def test_too_many_dimensions_are_refused_before_they_are_read():
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_UINT8, shape=[1] * 65, data=b"\x01")
    with pytest.raises(WireError, match="65 dimensions, at most 64") as err:
        decode_tensor(msg, "x")
    assert err.value.field == "x.shape"
    assert decode_tensor(tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_UINT8, shape=[1] * 64, data=b"\x01")).dim() == 64


def test_optional_element_bound():
    msg = encode_tensor(torch.arange(10))
    assert decode_tensor(msg, max_elements=10).numel() == 10
    with pytest.raises(WireError, match="10 elements, at most 9") as err:
        decode_tensor(msg, "prompt", max_elements=9)
    assert err.value.field == "prompt.shape"


def test_ragged_bounds_on_values_and_samples():
    msg = encode_ragged([torch.arange(3), torch.arange(4)])
    assert decode_ragged(msg, max_elements=7, max_samples=2).batch_size == 2
    with pytest.raises(WireError, match="at most 6") as err:
        decode_ragged(msg, "tokens", max_elements=6)
    assert err.value.field == "tokens.values.shape"
    with pytest.raises(WireError, match="2 samples, at most 1") as err:
        decode_ragged(msg, "tokens", max_samples=1)
    assert err.value.field == "tokens.lengths"


def test_ragged_lengths_whose_sum_wraps_int64_are_caught():
    msg = encode_ragged([torch.arange(5)])
    msg.lengths[:] = [5, 2**63 - 1, 2**63 - 1]
    with pytest.raises(WireError, match="runs past the end") as err:
        decode_ragged(msg, "tokens")
    assert err.value.field == "tokens.lengths[1]"


def test_ragged_lengths_are_checked_in_chunks_and_named_by_global_index():
    count = (1 << 20) + 5  # past the first chunk of the length check
    msg = tensor_pb2.RaggedTensor(values=encode_tensor(torch.arange(3)), lengths=[0] * count + [2, 2])
    with pytest.raises(WireError, match=r"offset 4 > 3 rows") as err:
        decode_ragged(msg, "tokens")
    assert err.value.field == f"tokens.lengths[{count + 1}]"
    msg.lengths[-1] = 1
    ragged = decode_ragged(msg)
    assert ragged.batch_size == count + 2 and ragged.lengths[-2:].tolist() == [2, 1]
    msg.lengths[5] = -1
    with pytest.raises(WireError, match="negative length -1") as err:
        decode_ragged(msg, "tokens")
    assert err.value.field == "tokens.lengths[5]"


@pytest.mark.parametrize("samples", [4, 128, 129, 1000])  # lengths checked as a list up to 128, as a tensor beyond
def test_a_ragged_refuses_negative_lengths_and_a_wrong_total_at_any_batch_size(samples):
    lengths = torch.ones(samples, dtype=torch.int64)
    assert Ragged(torch.arange(samples), lengths).batch_size == samples
    with pytest.raises(WireError, match=f"sum to {samples} but values has {samples + 1} rows"):
        Ragged(torch.arange(samples + 1), lengths)
    lengths[samples - 2], lengths[samples - 1] = -1, 3
    with pytest.raises(WireError, match="negative length -1") as err:
        Ragged(torch.arange(samples), lengths)
    assert err.value.field == f"lengths[{samples - 2}]"


def test_check_ragged_validates_like_decode_ragged_and_counts_bytes():
    from rlfleet.wire.ragged import check_ragged

    msg = encode_ragged([torch.arange(3), torch.arange(4)])
    assert check_ragged(msg) == 7 * 8
    msg.lengths[:] = [3, 5]
    for check in (check_ragged, decode_ragged):
        with pytest.raises(WireError) as err:
            check(msg, "tokens")
        assert err.value.field == "tokens.lengths[1]"


def _float32_edges() -> list[float]:
    """Doubles that round differently to float32 if a conversion truncated instead of rounding to nearest."""
    out = [0.0, -0.0, -1e-45, -3.4028234663852886e38, -float("inf"), 1.0 + 2.0 ** -24, 1.0 + 3 * 2.0 ** -24]
    generator = random.Random(0)
    out += [-generator.expovariate(0.5) for _ in range(200)]
    return out


def test_encode_values_matches_encode_tensor_bytes():
    ids = [0, 1, 511, 2 ** 31, 2 ** 63 - 1, -(2 ** 63)] + [random.Random(1).randrange(1 << 40) for _ in range(64)]
    log_probs = _float32_edges()
    columns = [(ids, torch.int64), (log_probs, torch.float32), ([[True], [False], [True]], torch.bool),
               ([[1, 2], [3, 4]], torch.int32), ([0.5, -2.25], torch.float64)]
    for values, dtype in columns:
        fast = encode_values(values, dtype)
        assert fast.SerializeToString() == encode_tensor(torch.tensor(values, dtype=dtype)).SerializeToString()
    array = numpy.array([True, False])
    assert encode_values(array, torch.bool) == encode_tensor(torch.tensor([True, False]))
    empty = encode_values([], torch.int64)
    assert decode_tensor(empty).shape == (0,) and decode_tensor(empty).dtype == torch.int64
    # Little-endian on the wire whatever the host.
    assert encode_values([1], torch.int64).data == struct.pack("<q", 1)
    with pytest.raises(WireError, match="cannot encode torch.bfloat16 from numbers"):
        encode_values([1.0], torch.bfloat16)
