"""Delta pushes' rules: locating a delta in the base's bytes, what the trainer finds changed, which
layers a replica reloads."""

from __future__ import annotations

import pytest
import torch

from rlfleet.client.delta import DeltaBase
from rlfleet.services.generation.transfer import layer_of, loaded_with
from rlfleet.v1 import tensor_pb2, weights_pb2
from rlfleet.wire import WireError, weight_delta

F32, BF16 = tensor_pb2.DTYPE_FLOAT32, tensor_pb2.DTYPE_BFLOAT16


def manifest(tensors, version=1, base=None):
    m = weights_pb2.WeightManifest(version=version)
    for name, dtype, shape in tensors:
        m.tensors.append(weights_pb2.WeightSpec(name=name, dtype=dtype, shape=shape))
    m.total_bytes = sum(weight_delta.tensor_sizes(m))
    if base is not None:
        m.delta.base_version = base
    return m


FULL = manifest([("a", F32, [2]), ("b", BF16, [3]), ("c", F32, [1, 2])])  # bytes 0-8, 8-14, 14-22


def test_a_delta_patches_its_tensors_spans_and_leaves_every_other_byte():
    delta = manifest([("c", F32, [1, 2]), ("a", F32, [2])], version=2, base=1)
    spans = weight_delta.spans(delta, FULL)
    assert [(s.name, s.delta_offset, s.full_offset, s.size) for s in spans] == [("c", 0, 14, 8), ("a", 8, 0, 8)]
    full = bytearray(range(22))
    weight_delta.patch(memoryview(full), memoryview(bytes(range(100, 116))), spans)
    assert full == bytes(range(108, 116)) + bytes(range(8, 14)) + bytes(range(100, 108))
    after = weight_delta.full_manifest(FULL, delta)
    assert (after.version, after.total_bytes, list(after.tensors)) == (2, 22, list(FULL.tensors))
    assert not weight_delta.is_delta(after) and weight_delta.is_delta(delta)


@pytest.mark.parametrize("tensors, words", [
    ([("d", F32, [2])], "delta tensor 'd' is not in version 1's weights"),
    ([("b", F32, [3])], "delta tensor 'b' is float32 [3], version 1 has it as bfloat16 [3]"),
    ([("c", F32, [2, 1])], "'c' is float32 [2, 1], version 1 has it as float32 [1, 2]"),
])
def test_a_delta_that_does_not_fit_its_base_names_the_tensor(tensors, words):
    with pytest.raises(WireError, match=words.replace("[", r"\[").replace("]", r"\]")) as error:
        weight_delta.spans(manifest(tensors, version=2, base=1), FULL)
    assert error.value.field == "manifest.tensors[0]"


def test_the_trainer_finds_exactly_the_tensors_whose_bytes_changed():
    weights = {"w": torch.tensor([1.0, float("nan")]), "z": torch.tensor([0.0]), "i": torch.tensor([3])}
    base = DeltaBase()
    assert base.changed(list(weights.items())) is None  # nothing kept: full
    base.record(list(weights.items()), None, 4)
    assert base.version == 4 and base.changed(list(weights.items())) == []  # the same NaN is the same bytes
    weights["z"] = torch.tensor([-0.0])  # equal as numbers, not as bytes
    changed = base.changed(list(weights.items()))
    assert [name for name, _ in changed] == ["z"]
    base.record(list(weights.items()), changed, 5)
    assert base.version == 5 and base.changed(list(weights.items())) == []
    weights["i"] = torch.tensor([3, 4])  # another shape: only a full push will do
    assert base.changed(list(weights.items())) is None
    assert base.changed([("w", weights["w"])]) is None  # tensors missing: full
    base.forget()
    assert base.version is None and base.changed([("w", weights["w"])]) is None


def test_the_kept_copy_does_not_follow_the_trainers_tensor_in_place():
    tensor = torch.zeros(3)
    base = DeltaBase()
    base.record([("t", tensor)], None, 1)
    tensor += 1  # an optimizer step writes in place
    assert [name for name, _ in base.changed([("t", tensor)])] == ["t"]


PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
NAMES = [f"model.layers.{i}.self_attn.{p}.{kind}" for i in (0, 1) for p in ("q_proj", "k_proj", "v_proj")
         for kind in ("weight", "bias")] + \
        [f"model.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")] + \
        ["model.norm.weight", "lm_head.weight"]


def test_a_changed_tensor_brings_its_whole_fused_layer_and_nothing_else():
    assert layer_of("model.layers.0.self_attn.k_proj.bias", PACKED) == "model.layers.0.self_attn.qkv_proj"
    assert layer_of("model.layers.0.mlp.down_proj.weight", PACKED) == "model.layers.0.mlp.down_proj"
    assert loaded_with(NAMES, ["model.layers.1.self_attn.v_proj.weight"], PACKED) == {
        f"model.layers.1.self_attn.{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj") for kind in ("weight", "bias")}
    assert loaded_with(NAMES, ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"], PACKED) == {
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"}
    assert loaded_with(NAMES, [], PACKED) == set()
    assert loaded_with(NAMES, ["model.layers.0.self_attn.q_proj.weight"], {}) == {
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias"}
