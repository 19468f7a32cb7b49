"""Weight fingerprints (``rlfleet.wire.fingerprint``): what a replica checks its staged bytes and its engine's
parameters against (``WeightPush.verify``, ``transfer.LoadCheck``)."""

import pytest
import torch

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.common.weight_stream import WeightPush
from rlfleet.services.generation.transfer import LoadCheck, engine_parameter
from rlfleet.v1 import weights_pb2
from rlfleet.wire import weight_delta
from rlfleet.wire.fingerprint import MASK, combine, fingerprint
from rlfleet.wire.push_messages import iter_push_messages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.int32, torch.uint8, torch.bool])
def test_a_fingerprint_adds_up_over_any_split_and_changes_with_any_changed_byte(dtype):
    torch.manual_seed(0)
    whole = (torch.randn(12, 6) * 50).to(dtype)
    parts = [whole[:5], whole[5:7], whole[7:]]  # q, k and v rows fused into one qkv parameter
    assert combine(fingerprint(part) for part in parts) == fingerprint(whole)
    assert fingerprint(torch.cat([whole, torch.zeros(3, 6, dtype=dtype)])) == fingerprint(whole)  # zero padding
    assert fingerprint(whole.t()) == fingerprint(whole.t().contiguous())  # a view reads as its values
    for byte in (0, whole.element_size() - 1, whole.numel() * whole.element_size() - 1):
        changed = whole.clone()
        changed.view(-1).view(torch.uint8)[byte] ^= 0x01 if dtype is not torch.bool else 0x01
        assert fingerprint(changed) != fingerprint(whole), byte
    assert 0 <= fingerprint(whole) <= MASK


def test_a_fingerprint_wraps_modulo_2_to_the_64():
    big = torch.full((4,), 2**62, dtype=torch.int64)
    assert fingerprint(big) == 0 and fingerprint(big[:1]) == 2**62
    assert fingerprint(torch.tensor([-1], dtype=torch.int64)) == MASK


def test_the_sdk_puts_each_tensors_fingerprint_in_the_manifest_unless_told_not_to():
    pairs = [("a", torch.randn(3, 4)), ("b", torch.arange(5)), ("c", torch.randn(2, 2).to(torch.bfloat16).t())]
    manifest = next(iter_push_messages(pairs, version=1))[1]
    assert [spec.fingerprint for spec in manifest.tensors] == [fingerprint(tensor) for _, tensor in pairs]
    bare = next(iter_push_messages(pairs, version=1, fingerprints=False))[1]
    assert not any(spec.HasField("fingerprint") for spec in bare.tensors)


def staged(pairs, **kwargs):
    messages = list(iter_push_messages(pairs, version=4, **kwargs))
    push = WeightPush.from_manifest(messages[0][1], 1 << 20)
    data = bytearray(push.total_bytes)
    push.attach_sink(memoryview(data))
    for _, chunk in messages[1:]:
        push.add_chunk(chunk)
    push.finish()
    return push, data, messages[0][1]


def test_staged_bytes_are_checked_against_the_manifest_and_a_changed_byte_names_its_tensor():
    pairs = [("a", torch.randn(3, 4)), ("b", torch.randn(6)), ("c", torch.arange(4))]
    push, data, manifest = staged(pairs)
    flat = torch.frombuffer(data, dtype=torch.uint8)
    assert push.verify(flat) == 3
    data[weight_delta.layout(manifest)["b"][0] + 5] ^= 0x10
    with pytest.raises(InvalidArgument, match=r"1 tensor\(s\) do not match their fingerprints: b \(0x") as err:
        push.verify(flat)
    assert "'a'" not in str(err.value) and "a (" not in str(err.value) and "nothing applied" in str(err.value)
    unchecked, data, _ = staged(pairs, fingerprints=False)  # a manifest without fingerprints: nothing to check
    data[0] ^= 0xFF
    assert unchecked.verify(torch.frombuffer(data, dtype=torch.uint8)) == 0


def test_a_delta_carries_its_tensors_fingerprints_into_the_full_manifest():
    full = next(iter_push_messages([("a", torch.ones(2)), ("b", torch.ones(3))], version=1))[1]
    delta = next(iter_push_messages([("b", torch.zeros(3))], version=2, base_version=1))[1]
    after = weight_delta.full_manifest(full, delta)
    assert [spec.fingerprint for spec in after.tensors] == [fingerprint(torch.ones(2)), fingerprint(torch.zeros(3))]
    bare = next(iter_push_messages([("a", torch.zeros(2))], version=2, base_version=1, fingerprints=False))[1]
    weight_delta.patch_fingerprints(after, bare)
    assert not after.tensors[0].HasField("fingerprint") and after.tensors[1].HasField("fingerprint")


class TinyBlock(torch.nn.Module):
    """A layer as vLLM lays one out: q, k and v fused into ``qkv_proj``, a norm as it is."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self):
        super().__init__()
        self.qkv_proj = torch.nn.Linear(4, 12, bias=False)
        self.norm = torch.nn.LayerNorm(4)
        self.packed = torch.nn.Linear(4, 4, bias=False)  # a weight its load transforms (as a packed GEMM's)

    def load(self, weights):
        """What a vLLM model's ``load_weights`` does with them: copy, fuse, transform."""
        rows = {"q_proj": slice(0, 4), "k_proj": slice(4, 8), "v_proj": slice(8, 12)}
        for name, tensor in weights:
            module = name.split(".")[0]
            with torch.no_grad():
                if module in rows:
                    self.qkv_proj.weight[rows[module]] = tensor
                elif module == "packed":
                    self.packed.weight.copy_(tensor * 0.5)  # a kernel's own layout or scale
                else:
                    getattr(self.norm, name.split(".")[-1]).copy_(tensor)


def checkpoint(seed):
    generator = torch.Generator().manual_seed(seed)
    return [(f"{module}.weight", torch.randn(4, 4, generator=generator)) for module in ("q_proj", "k_proj", "v_proj")] + \
        [("norm.weight", torch.randn(4, generator=generator)), ("norm.bias", torch.randn(4, generator=generator)),
         ("packed.weight", torch.randn(4, 4, generator=generator))]


def test_the_load_check_compares_each_parameter_with_the_tensors_loaded_into_it_and_names_what_differs():
    assert engine_parameter("model.layers.0.self_attn.k_proj.weight", TinyBlock.packed_modules_mapping) == \
        "model.layers.0.self_attn.qkv_proj.weight"
    model = TinyBlock()
    model.load(checkpoint(0))
    check = LoadCheck(model)
    assert check.calibrate(model, iter(checkpoint(0))) == {"packed.weight"}  # transformed: not compared
    assert check.checkable == {"qkv_proj.weight", "norm.weight", "norm.bias"}

    pushed = checkpoint(1)
    trainer = {name: fingerprint(tensor) for name, tensor in pushed}
    dtypes = {name: tensor.dtype for name, tensor in pushed}
    model.load(check.record(iter(pushed), trainer, dtypes))
    result = check.check(model)
    assert result["checked"] == 3 and result["wrong"] == "" and result["seconds"] > 0

    pushed = checkpoint(2)  # a load that left a tensor behind: k_proj's rows read, never written
    model.load(pair for pair in check.record(iter(pushed), {}, {}) if pair[0] != "k_proj.weight")
    result = check.check(model)
    assert result["checked"] == 3 and result["wrong"].startswith("qkv_proj.weight in the engine ("), result
    assert "norm" not in result["wrong"]
    model.load(check.record(iter(pushed), {}, {}))
    with torch.no_grad():
        model.norm.bias[1] += 1.0  # ... or a parameter changed after its load
    assert check.check(model)["wrong"].startswith("norm.bias in the engine (")

    pushed = checkpoint(3)  # bytes that changed since the trainer fingerprinted them: the parameter must hold
    trainer = {name: fingerprint(tensor) for name, tensor in pushed}  # the trainer's, not what was loaded
    pushed[3][1][0] += 1.0
    model.load(check.record(iter(pushed), trainer, dtypes))
    result = check.check(model)
    assert result["wrong"].startswith("norm.weight in the engine (") and "qkv" not in result["wrong"], result
    converted = [(name, tensor.double()) for name, tensor in checkpoint(4)]  # converted as they load: their own
    model.double()
    model.load(check.record(iter(converted), trainer, dtypes))
    assert check.check(model)["wrong"] == ""
    assert check.check(model)["checked"] == 0  # forgotten once checked: nothing recorded since
