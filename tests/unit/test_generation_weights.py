"""Weight-push validation against the checkpoint, and the worker's load from a segment, without vLLM."""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet.services.common.errors import InvalidArgument, ResourceExhausted
from rlfleet.services.generation.staging import StagedPush
from rlfleet.services.generation.transfer import RlfleetUpdateInfo, shm_weights
from rlfleet.services.generation.push_validation import TensorSpec, checkpoint_bytes, read_checkpoint_specs, validate_push
from rlfleet.v1 import weights_pb2
from rlfleet.wire import shm

CHECKPOINT = {
    "embed.weight": TensorSpec("float32", (4, 3)),
    "norm.weight": TensorSpec("bfloat16", (3,)),
}
GOOD = [("embed.weight", torch.float32, (4, 3)), ("norm.weight", torch.bfloat16, (3,))]


def validate(entries):
    names, dtypes, shapes = zip(*entries) if entries else ((), (), ())
    validate_push(names, dtypes, shapes, CHECKPOINT)


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
    validate(GOOD)
    validate([("embed.weight", torch.bfloat16, (4, 3)), GOOD[1]])


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (GOOD + [("extra.weight", torch.float32, (1,))], "unknown tensor 'extra.weight'"),
        (GOOD[:1], "missing tensors 'norm.weight'"),
        (GOOD + GOOD[:1], "'embed.weight' sent twice"),
        ([("embed.weight", torch.float32, (3, 4)), GOOD[1]], "'embed.weight' has shape"),
        ([("embed.weight", torch.int32, (4, 3)), GOOD[1]], "'embed.weight' has dtype int32"),
    ],
)
def test_bad_push_names_the_tensor(entries, message):
    with pytest.raises(InvalidArgument, match=message):
        validate(entries)


@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16, None])
def test_worker_loads_views_of_the_segment_converting_floats(tmp_path, target):
    """bf16/fp16 pushes into a float32 or bf16 engine: floats are converted, ints never."""
    tensors = {"a": torch.randn(3, 5, dtype=torch.bfloat16), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(2, 2, dtype=torch.float16), "d": torch.randn(4)}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    with shm.create_segment(size, directory=str(tmp_path)) as segment:
        shm.write_tensors(segment, list(tensors.values()))
        info = RlfleetUpdateInfo(names=list(tensors),
                                 dtype_names=[str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                                 shapes=[list(t.shape) for t in tensors.values()], shm_path=segment.path,
                                 total_bytes=size)
        loaded = dict(shm_weights(segment.as_uint8(), info, target))
    for name, tensor in tensors.items():
        got = loaded[name]
        if tensor.is_floating_point() and target is not None:
            assert got.dtype == target
            assert torch.equal(got, tensor.to(target))
        else:
            assert got.dtype == tensor.dtype and torch.equal(got, tensor)


def test_update_info_rejects_mismatched_lists():
    with pytest.raises(ValueError, match="differ in length"):
        RlfleetUpdateInfo(names=["a"], dtype_names=[], shapes=[[1]])


# --- a manifest is checked against the served model before any memory is given to it ------------

def manifest_of(entries, version=1):
    """A manifest declaring ``(name, dtype, shape)`` tensors (no bytes needed)."""
    from rlfleet.wire.tensor import dtype_to_wire

    specs = [weights_pb2.WeightSpec(name=name, dtype=dtype_to_wire(dtype), shape=list(shape))
             for name, dtype, shape in entries]
    total = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in entries)
    return weights_pb2.WeightManifest(version=version, tensors=specs, total_bytes=min(total, 2**64 - 1))


@pytest.fixture
def no_segments(monkeypatch):
    """Fail the test if a staging segment is ever created."""
    def refuse(*args, **kwargs):
        raise AssertionError("a segment was allocated for a manifest that should have been refused")
    monkeypatch.setattr("rlfleet.services.generation.staging.shm.create_segment", refuse)


def test_checkpoint_bytes_counts_each_tensor_in_its_own_dtype():
    assert checkpoint_bytes(CHECKPOINT) == 4 * 3 * 4 + 3 * 2


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        # Declares ~2**62 bytes: an unknown name is refused before the size is even computed.
        (GOOD + [("huge.weight", torch.float32, (2**30, 2**30))], "unknown tensor 'huge.weight'"),
        ([("embed.weight", torch.float32, (2**31, 2**31)), GOOD[1]], "'embed.weight' has shape"),
        ([("embed.weight", torch.float32, [1] * 1000), GOOD[1]], "'embed.weight' has 1000 dimensions"),
        (GOOD[:1], "missing tensors 'norm.weight'"),
    ],
)
def test_manifest_not_matching_the_model_is_refused_before_allocating(no_segments, entries, message):
    with pytest.raises(InvalidArgument, match=message):
        StagedPush.begin(manifest_of(entries), CHECKPOINT, max_bytes=1 << 62)


def test_push_over_the_size_limit_is_refused_before_allocating(no_segments):
    wide = [("embed.weight", torch.float64, (4, 3)), ("norm.weight", torch.float64, (3,))]  # 120 bytes
    with pytest.raises(ResourceExhausted, match="exceeds the limit of 119"):
        StagedPush.begin(manifest_of(wide), CHECKPOINT, max_bytes=119)


def test_a_valid_manifest_gets_a_segment_of_its_size(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    staged = StagedPush.begin(manifest_of(GOOD), CHECKPOINT, max_bytes=54)
    try:
        assert staged.segment.size == staged.push.total_bytes == 54
    finally:
        staged.close()


def test_engine_push_limit_is_a_multiple_of_the_served_checkpoint():
    from rlfleet.services.generation.config import GenerationEngineConfig
    from rlfleet.services.generation.vllm_engine import GenerationEngine

    for settings, limit in ((dict(), 4 * checkpoint_bytes(CHECKPOINT)),  # max_push_factor's default
                            (dict(max_push_factor=2.0), 2 * checkpoint_bytes(CHECKPOINT)),
                            (dict(max_push_bytes=1000), 1000)):
        engine = GenerationEngine(GenerationEngineConfig(model="/m", **settings))
        engine.weights.checkpoint_specs = CHECKPOINT
        assert engine.weights.max_push_bytes == limit
