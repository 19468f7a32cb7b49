"""LoRA adapter pushes, trainer side: the adapter's tensors and hyper-parameters, the manifest that
carries them, ``push_adapter`` against an in-process fake collector, the TorchRL adapter and the demo's
``--lora``. The replica side is in test_lora_adapter.py."""

from __future__ import annotations

import asyncio
import copy
import zlib
from pathlib import Path

import grpc
import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from tensordict.nn import TensorDictModuleBase

from rlfleet.client import connect, connect_async
from rlfleet.client.batches import Batch
from rlfleet.client.channel import ChannelSettings
from rlfleet.client.lora import adapter_tensors
from rlfleet.client.push import push_weights
from rlfleet.client.torchrl import RlfleetLLMCollector, RlfleetWeightSyncScheme
from rlfleet.v1 import collector_pb2, collector_pb2_grpc, weights_pb2
from rlfleet.wire import shm
from rlfleet.wire.push_messages import iter_push_messages
from rlfleet.wire.tensor import dtype_from_wire
from tests.example_modules import import_example
from tests.torchrl_batches import Pushed, ragged_batch

PREFIX = "base_model.model."
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def base_model(request):
    """The tiny Qwen2 model (2 layers), loaded once: each test wraps a deep copy (peft injects in place)."""
    from transformers import AutoModelForCausalLM

    from rlfleet.services.models.tiny import build_tiny_model

    path: Path = build_tiny_model(request.config.cache.mkdir("rlfleet-tiny-model"))
    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)


def peft_model(base_model, **options):
    config = dict(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                  task_type="CAUSAL_LM")
    return get_peft_model(copy.deepcopy(base_model), LoraConfig(**{**config, **options}))


def factors(module: str = "q_proj", rank: int = 2, *, layer: int = 0, out_features: int = 6, in_features: int = 5):
    path = f"model.layers.{layer}.self_attn.{module}"
    return {f"{path}.lora_A.weight": torch.randn(rank, in_features),
            f"{path}.lora_B.weight": torch.zeros(out_features, rank)}


# --- adapter_tensors ------------------------------------------------------------------------------------
def test_a_peft_models_adapter_is_its_factors_under_peft_names_with_its_configs_hyper_parameters(base_model):
    model = peft_model(base_model)
    pairs, lora = adapter_tensors(model)
    names = [name for name, _ in pairs]
    assert names == list(get_peft_model_state_dict(model))
    assert len(names) == 2 * 3 * 2 and all(name.startswith(PREFIX) for name in names)
    assert f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert (lora.rank, lora.alpha) == (4, 12.0) and set(lora.target_modules) == {"q_proj", "v_proj", "down_proj"}
    # References, not copies: each tensor is its parameter's own storage.
    parameters = dict(model.named_parameters())
    for name, tensor in pairs:
        assert tensor.data_ptr() == parameters[name.replace(".weight", ".default.weight")].data_ptr(), name
    # peft's "all-linear" is not a module list: the modules that hold factors are named (never lm_head).
    _, lora = adapter_tensors(peft_model(base_model, target_modules="all-linear"))
    assert sorted(lora.target_modules) == sorted(LINEAR)


@pytest.mark.parametrize("option, value", [
    ("use_dora", True), ("bias", "lora_only"), ("modules_to_save", ["lm_head"]), ("rank_pattern", {"q_proj": 8}),
    ("alpha_pattern", {"q_proj": 3}), ("use_rslora", True),
])
def test_what_vllm_cannot_serve_is_refused_naming_the_option(base_model, option, value):
    with pytest.raises(ValueError, match=f"LoraConfig {option}="):
        adapter_tensors(peft_model(base_model, **{option: value}))


def test_a_peft_model_brings_its_own_hyper_parameters_and_a_plain_model_is_no_adapter(base_model):
    with pytest.raises(ValueError, match="come from the PeftModel's LoraConfig"):
        adapter_tensors(peft_model(base_model), rank=4)
    with pytest.raises(TypeError, match="push_weights"):
        adapter_tensors(base_model)


def test_adapter_tensors_given_as_a_mapping_get_the_prefix_and_stay_the_callers_tensors():
    tensors = {**factors("q_proj"), **factors("down_proj", layer=1)}
    pairs, lora = adapter_tensors(tensors, rank=2, alpha=4, target_modules=["q_proj", "down_proj"])
    assert [name for name, _ in pairs] == [PREFIX + name for name in tensors]
    assert all(tensor is tensors[name.removeprefix(PREFIX)] for name, tensor in pairs)
    assert (lora.rank, lora.alpha, list(lora.target_modules)) == (2, 4.0, ["q_proj", "down_proj"])
    prefixed = [(PREFIX + name, tensor) for name, tensor in factors().items()]
    assert [name for name, _ in adapter_tensors(prefixed, rank=2, alpha=4, target_modules="q_proj")[0]] == \
        [name for name, _ in prefixed]


@pytest.mark.parametrize("tensors, options, match", [
    (factors(), dict(alpha=4, target_modules=["q_proj"]), "need rank"),
    (factors(), dict(rank=2), "need alpha, target_modules"),
    (factors(), dict(rank=0, alpha=4, target_modules=["q_proj"]), "lora.rank: must be a positive integer"),
    (factors(), dict(rank=2, alpha=float("nan"), target_modules=["q_proj"]), "lora.alpha: must be a positive number"),
    (factors(), dict(rank=2, alpha=4, target_modules=["self_attn.q_proj"]), "not a module name"),
    (factors(), dict(rank=3, alpha=4, target_modules=["q_proj"]), r"lora_A.weight\]: shape \[2, 5\]"),
    (factors(), dict(rank=2, alpha=4, target_modules=["v_proj"]), "'q_proj' is not in target_modules"),
    ({"model.embed_tokens.lora_embedding_A": torch.ones(2, 8)}, dict(rank=2, alpha=4, target_modules=["q_proj"]),
     "not a LoRA factor"),
    ({"model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 5)},
     dict(rank=2, alpha=4, target_modules=["q_proj"]), r"lora_A.weight\]: has no lora_B partner"),
    ({**factors(), PREFIX + "model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 5)},
     dict(rank=2, alpha=4, target_modules=["q_proj"]), "given twice"),
    ({"model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 5, dtype=torch.int32),
      "model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(6, 2)},
     dict(rank=2, alpha=4, target_modules=["q_proj"]), "not floating point"),
])
def test_adapter_tensors_that_are_no_servable_adapter_are_refused_naming_why(tensors, options, match):
    with pytest.raises(ValueError, match=match):
        adapter_tensors(tensors, **options)


# --- the manifest -----------------------------------------------------------------------------------------
def test_an_adapter_push_manifest_carries_the_lora_hyper_parameters_and_only_the_factors():
    pairs, lora = adapter_tensors(factors(), rank=2, alpha=4, target_modules=["q_proj"])
    messages = list(iter_push_messages(pairs, version=3, chunk_bytes=16, lora=lora))
    manifest = messages[0][1]
    assert manifest.lora == lora and not manifest.HasField("delta")
    assert [spec.name for spec in manifest.tensors] == [name for name, _ in pairs]
    data = b"".join(chunk.data for _, chunk in messages[1:])
    assert data == b"".join(tensor.numpy().tobytes() for _, tensor in pairs)
    assert manifest.checksum == f"crc32:{zlib.crc32(data):08x}"
    assert not next(iter_push_messages(pairs, version=3))[1].HasField("lora")  # a weight push has none
    with pytest.raises(ValueError, match="not both"):
        next(iter_push_messages(pairs, version=3, lora=lora, base_version=2))


# --- push_adapter -----------------------------------------------------------------------------------------
def test_push_adapter_refuses_nccl_and_a_delta_before_sending_anything():
    pairs, lora = adapter_tensors(factors(), rank=2, alpha=4, target_modules=["q_proj"])

    def never_called(**_):
        raise AssertionError("no call may start")

    for options, match in ((dict(transport="nccl"), "an adapter push travels by shm or grpc"),
                           (dict(delta=True), "an adapter push is whole, never a delta")):
        with pytest.raises(ValueError, match=match):
            asyncio.run(push_weights(never_called, pairs, version=None, mode="keep", chunk_bytes=1 << 20,
                                     progress=False, timeout=1.0, settings=ChannelSettings(), lora=lora, **options))
    with connect("127.0.0.1:1", timeout=1, retries=0) as client:  # never dialled: refused locally
        with pytest.raises(ValueError, match="shm or grpc"):
            client.push_adapter(factors(), rank=2, alpha=4, target_modules=["q_proj"], transport="nccl")
        with pytest.raises(ValueError, match="need rank"):
            client.push_adapter(factors())


class PushRecorder(collector_pb2_grpc.CollectorServiceServicer):
    """A collector that commits every push and keeps its manifest and tensors (shm or chunks)."""

    def __init__(self):
        self.pushes: list[tuple[weights_pb2.WeightManifest, dict[str, torch.Tensor]]] = []

    async def PushWeights(self, request_iterator, context):
        requests = aiter(request_iterator)
        manifest = (await anext(requests)).manifest
        if manifest.HasField("shm"):
            with shm.open_segment(manifest.shm.path, manifest.total_bytes) as segment:
                data = bytes(segment.buffer)
        else:
            data = b"".join([request.chunk.data async for request in requests])
        tensors, offset = {}, 0
        for spec in manifest.tensors:
            dtype = dtype_from_wire(spec.dtype)
            size = torch.Size(spec.shape).numel() * dtype.itemsize
            tensors[spec.name] = torch.frombuffer(bytearray(data[offset:offset + size]), dtype=dtype).reshape(
                list(spec.shape))
            offset += size
        self.pushes.append((manifest, tensors))
        return collector_pb2.PushWeightsResponse(version=len(self.pushes), received_bytes=len(data), replicas=[
            collector_pb2.ReplicaPushResult(address="gen-0:1", applied=True)])


async def test_an_adapter_push_reaches_the_collector_as_the_adapters_factors_only(base_model):
    recorder = PushRecorder()
    server = grpc.aio.server()
    collector_pb2_grpc.add_CollectorServiceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    model = peft_model(base_model)
    adapter = get_peft_model_state_dict(model)
    try:
        async with connect_async(f"127.0.0.1:{port}", timeout=10, retries=0) as client:
            assert (await client.push_weights({"w": torch.ones(3)}, progress=False, delta=True)).adapter_rank == 0
            for transport in ("grpc", "shm"):
                result = await client.push_adapter(model, mode="wait", progress=False, transport=transport)
                manifest, tensors = recorder.pushes[-1]
                assert (result.adapter_rank, result.tensors, result.transport) == (4, len(adapter), transport)
                assert (manifest.lora.rank, manifest.lora.alpha) == (4, 12.0)
                assert set(manifest.lora.target_modules) == {"q_proj", "v_proj", "down_proj"}
                assert manifest.mode == weights_pb2.UPDATE_MODE_WAIT and not manifest.HasField("delta")
                assert list(tensors) == list(adapter)  # the factors, no base weight
                assert all(torch.equal(tensors[name], tensor) for name, tensor in adapter.items())
            # The adapter push forgot what the first push kept: the next delta=True push goes full.
            await client.push_weights({"w": torch.ones(3)}, progress=False, delta=True)
            assert not recorder.pushes[-1][0].HasField("delta") and not recorder.pushes[-1][0].HasField("lora")
    finally:
        await server.stop(0)


# --- TorchRL --------------------------------------------------------------------------------------------
class Wrapper(TensorDictModuleBase):
    """As TorchRL's TransformersWrapper: the trained model is ``.model``."""

    in_keys, out_keys = ["x"], ["y"]

    def __init__(self, model):
        super().__init__()
        self.model = model


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(4, 4, bias=False)


class FakeClient:
    """Records which push the adapter chose (unit test of the logic above rlfleet's client)."""

    def __init__(self):
        self.pushes: list[tuple[str, object]] = []
        self.strategies: list[str] = []

    def push_weights(self, weights, *, mode, transport, strategy, progress):
        self.pushes.append(("weights", set(weights)))
        self.strategies.append(strategy)
        return Pushed(len(self.pushes))

    def push_adapter(self, adapter, *, mode, transport, strategy, progress):
        self.pushes.append(("adapter", adapter))
        self.strategies.append(strategy)
        return Pushed(len(self.pushes))

    @property
    def policy_version(self):
        return len(self.pushes)


def test_a_peft_policy_pushes_its_adapter_and_a_plain_one_its_weights():
    lora = get_peft_model(TinyLM(), LoraConfig(r=2, target_modules=["q_proj"]))
    client = FakeClient()
    collector = RlfleetLLMCollector(client, dialog_turns_per_batch=6, policy=Wrapper(lora), push_mode="abort",
                                    push_strategy="rolling")
    assert collector.update_policy_weights_() == 1
    assert collector.update_policy_weights_(lora) == 2
    assert collector.update_policy_weights_(TinyLM()) == 3
    assert client.pushes == [("adapter", lora), ("adapter", lora), ("weights", {"q_proj.weight"})]
    sender = RlfleetWeightSyncScheme(collector).create_sender()
    sender.register_model(lora)
    sender.register_collector(collector)
    assert sender.update_weights() == 4 and client.pushes[-1] == ("adapter", lora)
    assert client.strategies == ["rolling"] * 4
    assert collector.unacknowledged_pushes == 0


# --- the demo's --lora ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def train_grpo():
    return import_example("train_grpo")


ARGS = ["--collector", "127.0.0.1:1", "--model-dir", "unused"]


def test_the_demos_lora_flags(train_grpo):
    ns = train_grpo.parse_args(ARGS + ["--lora", "8"])
    assert (ns.lora, ns.lora_alpha) == (8, 16.0)
    assert train_grpo.parse_args(ARGS + ["--lora", "8", "--lora-alpha", "4"]).lora_alpha == 4.0
    plain = train_grpo.parse_args(ARGS)
    assert (plain.lora, plain.lora_alpha) == (None, None)
    for bad in (["--lora", "0"], ["--lora-alpha", "4"], ["--lora", "2", "--lora-alpha", "0"]):
        with pytest.raises(SystemExit):
            train_grpo.parse_args(ARGS + bad)


class DemoClient:
    """What ``train`` asks of a client, over one fixed batch; records the pushes."""

    run = "run-20261128-000000-000000@0"

    def __init__(self, batch):
        self.batch = batch
        self.pushes: list[str] = []

    def submit_prompts(self, prompts):
        return [str(i) for i in range(len(prompts))]

    @property
    def policy_version(self):
        return len(self.pushes)

    def batches(self, batch_size, whole_groups):
        assert batch_size == len(self.batch)
        client = self

        class Stream:
            def __enter__(self):
                return iter(lambda: client.batch, None)

            def __exit__(self, *exc):
                return None

        return Stream()

    def _pushed(self, kind, rank):
        self.pushes.append(kind)
        return type("Pushed", (), dict(version=len(self.pushes), megabytes_per_second=1.0, seconds=0.01,
                                       transport="shm", adapter_rank=rank))()

    def push_adapter(self, model, *, progress, transport):
        adapter_tensors(model)  # what the real client sends: must be a servable adapter
        return self._pushed("adapter", 4)

    def push_weights(self, model, *, progress, transport):
        return self._pushed("weights", 0)


def test_the_demo_with_lora_trains_only_the_adapter_and_pushes_it_each_step(train_grpo, base_model):
    ns = train_grpo.parse_args(ARGS + ["--lora", "4", "--steps", "2", "--groups-per-step", "2", "--group-size", "3",
                                       "--lr", "1e-2"])
    model = train_grpo.lora_policy(copy.deepcopy(base_model), ns.lora, ns.lora_alpha)
    _, lora = adapter_tensors(model)
    assert (lora.rank, lora.alpha, sorted(lora.target_modules)) == (4, 8.0, sorted(LINEAR))
    base = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    adapter = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_" in name for name in adapter)
    batch = Batch(ragged_batch(groups=2, group_size=3), "lease", False, 0.0, stream=None)
    client = DemoClient(batch)
    metrics = train_grpo.train(client, model, ns, lambda count: [{"prompt": "p"}] * count)
    assert client.pushes == ["adapter", "adapter"] and [m["push_kind"] for m in metrics] == ["adapter"] * 2
    assert all(torch.equal(p, base[name]) for name, p in model.named_parameters() if name in base)
    assert any(not torch.equal(p, adapter[name]) for name, p in model.named_parameters() if name in adapter)
    # Without --lora the same loop pushes every weight.
    plain = train_grpo.parse_args(ARGS)
    assert train_grpo.push_policy(client, base_model, plain).adapter_rank == 0 and client.pushes[-1] == "weights"
