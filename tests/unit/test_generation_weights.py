"""Weight-push validation and tensor (de)coding, without vLLM."""

from __future__ import annotations

import pytest
import torch

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.generation.weights import (
    TensorSpec,
    decode_tensor,
    encode_tensor,
    read_checkpoint_specs,
    validate_weight_push,
)

CHECKPOINT = {
    "embed.weight": TensorSpec("float32", (4, 3)),
    "norm.weight": TensorSpec("bfloat16", (3,)),
}


def good_push():
    return [
        encode_tensor("embed.weight", torch.randn(4, 3)),
        encode_tensor("norm.weight", torch.ones(3, dtype=torch.bfloat16)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_encode_decode_round_trip(dtype):
    tensor = (torch.randn(2, 5) * 10).to(dtype)
    name, dtype_name, shape, data = encode_tensor("t", tensor)
    assert (name, shape, len(data)) == ("t", (2, 5), tensor.numel() * tensor.element_size())
    assert torch.equal(decode_tensor(dtype_name, shape, data), tensor)


def test_decode_scalar_and_empty():
    assert decode_tensor(*encode_tensor("s", torch.tensor(2.5))[1:]).item() == 2.5
    assert decode_tensor("float32", (0, 3), b"").shape == (0, 3)


def test_read_checkpoint_specs_single_and_sharded(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
    assert read_checkpoint_specs(tmp_path) == {
        "a": TensorSpec("float32", (2, 3)),
        "b": TensorSpec("bfloat16", (4,)),
    }

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a": torch.zeros(2)}, sharded / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(3)}, sharded / "model-00002-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", '
        '"b": "model-00002-of-00002.safetensors"}}'
    )
    assert set(read_checkpoint_specs(sharded)) == {"a", "b"}


def test_valid_push_passes_and_may_change_float_dtype():
    validate_weight_push(good_push(), CHECKPOINT)
    bf16_embed = encode_tensor("embed.weight", torch.randn(4, 3, dtype=torch.bfloat16))
    validate_weight_push([bf16_embed, good_push()[1]], CHECKPOINT)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p + [("extra.weight", "float32", (1,), bytes(4))], "unknown tensor 'extra.weight'"),
        (lambda p: p[:1], "missing tensors 'norm.weight'"),
        (lambda p: p + p[:1], "'embed.weight' sent twice"),
        (lambda p: [("embed.weight", "float32", (3, 4), p[0][3]), p[1]], "'embed.weight' has shape"),
        (lambda p: [("embed.weight", "float32", (4, 3), p[0][3][:-4]), p[1]], "'embed.weight' has 44 bytes"),
        (lambda p: [("embed.weight", "int32", (4, 3), p[0][3]), p[1]], "'embed.weight' has dtype int32"),
        (lambda p: [("embed.weight", "complex64", (4, 3), p[0][3]), p[1]], "unknown dtype 'complex64'"),
    ],
)
def test_bad_push_names_the_tensor(mutate, message):
    with pytest.raises(InvalidArgument, match=message):
        validate_weight_push(mutate(good_push()), CHECKPOINT)
