"""LoRA adapter pushes on the replica side: validation, the config check, the directory vLLM loads."""

from __future__ import annotations

import json

import pytest
import torch

from rlfleet.client.lora import adapter_tensors
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.wire import WireError
from rlfleet.services.generation.lora_adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoraAdapterConfig,
    lora_request,
    remove_adapter_dir,
    supported_max_lora_ranks,
    validate_adapter,
    write_adapter_dir,
)
from rlfleet.services.generation.push_validation import TensorSpec, read_checkpoint_specs

REFUSED = (InvalidArgument, WireError)
"""What a replica refuses bad input with: both answer INVALID_ARGUMENT (the one interceptor maps them)."""

RANK = 4
LAYER = "model.layers.0"
CHECKPOINT = {
    "model.embed_tokens.weight": TensorSpec("float32", (512, 128)),
    f"{LAYER}.self_attn.q_proj.weight": TensorSpec("float32", (128, 128)),
    f"{LAYER}.self_attn.k_proj.weight": TensorSpec("float32", (64, 128)),
    f"{LAYER}.self_attn.k_proj.bias": TensorSpec("float32", (64,)),
    f"{LAYER}.mlp.down_proj.weight": TensorSpec("float32", (128, 256)),
    "model.norm.weight": TensorSpec("float32", (128,)),
    "lm_head.weight": TensorSpec("float32", (512, 128)),
}
CONFIG = LoraAdapterConfig(rank=RANK, alpha=8, target_modules=("q_proj", "k_proj", "down_proj"))
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def factor(module: str, which: str) -> str:
    return f"base_model.model.{LAYER}.{module}.{which}.weight"


def good_adapter() -> tuple[list[str], list[torch.dtype], list[tuple[int, ...]]]:
    """k_proj (out 64 != in 128, so a transposed factor shows) and down_proj (in 256)."""
    names = [factor("self_attn.k_proj", "lora_A"), factor("self_attn.k_proj", "lora_B"),
             factor("mlp.down_proj", "lora_A"), factor("mlp.down_proj", "lora_B")]
    shapes = [(RANK, 128), (64, RANK), (RANK, 256), (128, RANK)]
    return names, [torch.float32] * 4, shapes


def as_buffer(tensors: list[torch.Tensor]) -> memoryview:
    """The push's layout: every tensor's raw C-contiguous bytes back to back."""
    return memoryview(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors))


# ---------------------------------------------------------------- validation


def test_a_well_formed_adapter_passes_with_names_in_peft_form():
    names, dtypes, shapes = good_adapter()
    assert validate_adapter(names, dtypes, shapes, CHECKPOINT, CONFIG) == names
    bare = [name.removeprefix("base_model.model.") for name in names]
    assert validate_adapter(bare, [torch.bfloat16] * 4, shapes, CHECKPOINT, CONFIG) == names


def _replace(index: int, *, name=None, dtype=None, shape=None):
    names, dtypes, shapes = good_adapter()
    names[index] = name or names[index]
    dtypes[index] = dtype or dtypes[index]
    shapes[index] = shape or shapes[index]
    return names, dtypes, shapes


BAD_ADAPTERS = {
    "unknown layer": (_replace(0, name="base_model.model.model.layers.9.self_attn.k_proj.lora_A.weight"),
                      "model.layers.9.self_attn.k_proj.lora_A.weight", "unknown module"),
    "module not targeted": (
        _replace(0, name=factor("self_attn.v_proj", "lora_A")), "v_proj.lora_A", "not in target_modules"),
    "not a factor": (_replace(0, name=f"{LAYER}.self_attn.k_proj.weight"), "k_proj.weight]", "not a LoRA factor"),
    "peft adapter suffix": (_replace(0, name=f"{LAYER}.self_attn.k_proj.lora_A.default.weight"),
                            "lora_A.default.weight", "not a LoRA factor"),
    "lora_A transposed": (_replace(0, shape=(128, RANK)), "k_proj.lora_A", "lora_A's [rank, in_features] with rank 4"),
    "lora_B transposed": (_replace(1, shape=(RANK, 64)), "k_proj.lora_B", "lora_B's [out_features, rank] with rank 4"),
    "lora_A of another rank": (_replace(2, shape=(8, 256)), "down_proj.lora_A", "shape [8, 256]"),
    "lora_A of another layer's width": (_replace(0, shape=(RANK, 100)), "k_proj.lora_A",
                                        "[rank, in_features] = [4, 128]"),
    "three dimensions": (_replace(3, shape=(128, RANK, 1)), "down_proj.lora_B", "shape [128, 4, 1]"),
    "integer dtype": (_replace(1, dtype=torch.int32), "k_proj.lora_B", "dtype int32 is not floating point"),
    "bool dtype": (_replace(1, dtype=torch.bool), "k_proj.lora_B", "dtype bool is not floating point"),
}


@pytest.mark.parametrize("case", BAD_ADAPTERS, ids=list(BAD_ADAPTERS))
def test_a_bad_tensor_is_invalid_argument_naming_it(case):
    (names, dtypes, shapes), named, reason = BAD_ADAPTERS[case]
    with pytest.raises(REFUSED) as err:
        validate_adapter(names, dtypes, shapes, CHECKPOINT, CONFIG)
    assert named in str(err.value) and reason in str(err.value)


SHARED_RULES = ["module not targeted", "not a factor", "lora_A transposed", "lora_B transposed", "lora_A of another rank",
                "three dimensions", "integer dtype"]


@pytest.mark.parametrize("case", SHARED_RULES)
def test_the_sdk_refuses_what_the_replica_refuses_in_the_same_words(case):
    """One set of rules (rlfleet.wire.lora_factors): what the SDK refuses before sending, a replica
    refuses on arrival, with the same message."""
    (names, dtypes, shapes), _, _ = BAD_ADAPTERS[case]
    with pytest.raises(REFUSED) as replica:
        validate_adapter(names, dtypes, shapes, CHECKPOINT, CONFIG)
    tensors = {name: torch.zeros(shape, dtype=dtype) for name, dtype, shape in zip(names, dtypes, shapes)}
    with pytest.raises(ValueError) as sdk:
        adapter_tensors(tensors, rank=RANK, alpha=8, target_modules=list(CONFIG.target_modules))
    assert str(replica.value) == str(sdk.value)


def test_a_factor_sent_twice_is_refused_with_or_without_the_prefix():
    names, dtypes, shapes = good_adapter()
    for again in (names[2], names[2].removeprefix("base_model.model.")):
        with pytest.raises(REFUSED, match=r"down_proj.lora_A.weight\]: given twice"):
            validate_adapter(names + [again], dtypes + [torch.float32], shapes + [(RANK, 256)], CHECKPOINT, CONFIG)


def test_a_factor_without_its_partner_is_refused():
    names, dtypes, shapes = good_adapter()
    with pytest.raises(REFUSED, match=r"k_proj.lora_A.weight\]: has no lora_B partner"):
        validate_adapter(names[:1] + names[2:], dtypes[1:], shapes[:1] + shapes[2:], CHECKPOINT, CONFIG)
    with pytest.raises(REFUSED, match=r"down_proj.lora_B.weight\]: has no lora_A partner"):
        validate_adapter(names[:2] + names[3:], dtypes[1:], shapes[:2] + shapes[3:], CHECKPOINT, CONFIG)


def test_embeddings_are_not_lora_linear_modules():
    config = LoraAdapterConfig(rank=RANK, alpha=8, target_modules=("embed_tokens",))
    names = ["model.embed_tokens.lora_A.weight", "model.embed_tokens.lora_B.weight"]
    with pytest.raises(REFUSED, match=r"embed_tokens.lora_A.weight\]: names unknown module"):
        validate_adapter(names, [torch.float32] * 2, [(RANK, 128), (512, RANK)], CHECKPOINT, config)


def test_counts_must_agree_and_an_adapter_has_tensors():
    names, dtypes, shapes = good_adapter()
    with pytest.raises(REFUSED, match="4 names, 3 dtypes and 4 shapes"):
        validate_adapter(names, dtypes[:3], shapes, CHECKPOINT, CONFIG)
    with pytest.raises(REFUSED, match="no tensors"):
        validate_adapter([], [], [], CHECKPOINT, CONFIG)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("fields, reason", [
    (dict(rank=0), "lora.rank: must be a positive integer"),
    (dict(rank=8.0), "lora.rank: must be a positive integer"),
    (dict(alpha=0), "lora.alpha: must be a positive number"),
    (dict(alpha=float("nan")), "lora.alpha: must be a positive number"),
    (dict(target_modules=()), "non-empty list"),
    (dict(target_modules="q_proj"), "non-empty list"),
    (dict(target_modules=("self_attn.q_proj",)), "'self_attn.q_proj' is not a module name"),
    (dict(target_modules=("q_proj", "q_proj")), "repeat a name"),
])
def test_a_malformed_config_is_invalid_argument(fields, reason):
    with pytest.raises(REFUSED, match=reason):
        LoraAdapterConfig(**{**dict(rank=8, alpha=16, target_modules=("q_proj",)), **fields})


def test_the_config_is_checked_against_the_engine_and_the_model():
    assert {1, 8, 16, 32, 64} <= set(supported_max_lora_ranks())
    CONFIG.check_served(CHECKPOINT, max_lora_rank=8)
    LoraAdapterConfig(rank=8, alpha=16, target_modules=("q_proj",)).check_served(CHECKPOINT, max_lora_rank=8)
    with pytest.raises(REFUSED, match="rank 16 is above the engine's max_lora_rank 8"):
        LoraAdapterConfig(rank=16, alpha=16, target_modules=("q_proj",)).check_served(CHECKPOINT, max_lora_rank=8)
    with pytest.raises(ValueError, match="max_lora_rank 12 is not one vLLM allows"):
        CONFIG.check_served(CHECKPOINT, max_lora_rank=12)
    for module in ("c_attn", "lm_head", "norm"):
        config = LoraAdapterConfig(rank=4, alpha=8, target_modules=("q_proj", module))
        with pytest.raises(REFUSED, match=f"target module '{module}' is not a linear layer"):
            config.check_served(CHECKPOINT, max_lora_rank=8)


def test_the_tiny_models_projections_are_all_targets(tiny_model_dir):
    config = LoraAdapterConfig(rank=8, alpha=16, target_modules=ALL_TARGETS)
    config.check_served(read_checkpoint_specs(tiny_model_dir), max_lora_rank=8)


# ---------------------------------------------------------------- the directory


@pytest.fixture(scope="module")
def peft_adapter(tiny_model_dir):
    """A peft LoRA on the tiny model with non-zero lora_B: (peft model, its adapter state dict, config)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=list(ALL_TARGETS)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return model.eval(), get_peft_model_state_dict(model), LoraAdapterConfig(8, 16, ALL_TARGETS)


def test_the_directory_round_trips_through_safetensors_and_peft(peft_adapter, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, state, config = peft_adapter
    names = validate_adapter(list(state), [t.dtype for t in state.values()], [t.shape for t in state.values()],
                             read_checkpoint_specs(tiny_model_dir), config)
    assert names == list(state)  # peft's names are already in the form vLLM expects
    directory = write_adapter_dir(tmp_path / "rlfleet-lora-v1", names, [t.dtype for t in state.values()],
                                  [t.shape for t in state.values()], as_buffer(list(state.values())), config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rlfleet-lora-v1"]  # no temp dir left
    written = load_file(str(directory / WEIGHTS_FILE))
    assert written.keys() == state.keys() and all(torch.equal(written[k], state[k]) for k in state)
    adapter_config = json.loads((directory / CONFIG_FILE).read_text())
    assert (adapter_config["peft_type"], adapter_config["r"], adapter_config["lora_alpha"]) == ("LORA", 8, 16)

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    loaded = PeftModel.from_pretrained(base, str(directory)).eval()
    ids = torch.tensor([[1, 348, 201, 330, 400, 223, 20, 267]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_bare_names_and_bf16_are_written_in_peft_form(tmp_path):
    names, _, shapes = good_adapter()
    bare = [name.removeprefix("base_model.model.") for name in names]
    tensors = [torch.randn(shape, dtype=torch.bfloat16) for shape in shapes]
    directory = write_adapter_dir(tmp_path / "v2", bare, [torch.bfloat16] * 4, shapes, as_buffer(tensors), CONFIG)
    from safetensors.torch import load_file

    written = load_file(str(directory / WEIGHTS_FILE))
    assert all(written[name].dtype == torch.bfloat16 and torch.equal(written[name], t)
               for name, t in zip(names, tensors))


def test_a_short_buffer_or_an_existing_directory_writes_nothing(tmp_path):
    names, dtypes, shapes = good_adapter()
    buffer = as_buffer([torch.zeros(shape) for shape in shapes])
    with pytest.raises(REFUSED, match=f"buffer holds {buffer.nbytes - 4} bytes, the tensors need"):
        write_adapter_dir(tmp_path / "v3", names, dtypes, shapes, buffer[:-4], CONFIG)
    assert list(tmp_path.iterdir()) == []
    twice = [names[0], names[0].removeprefix("base_model.model."), *names[2:]]
    with pytest.raises(REFUSED, match="k_proj.lora_A.weight' sent twice"):
        write_adapter_dir(tmp_path / "v3", twice, dtypes, [shapes[0], shapes[0], *shapes[2:]], buffer, CONFIG)
    write_adapter_dir(tmp_path / "v3", names, dtypes, shapes, buffer, CONFIG)
    with pytest.raises(FileExistsError):
        write_adapter_dir(tmp_path / "v3", names, dtypes, shapes, buffer, CONFIG)
    remove_adapter_dir(tmp_path / "v3")
    remove_adapter_dir(tmp_path / "v3")  # gone already: nothing to do
    remove_adapter_dir(tmp_path / "no-such-parent" / "v3")
    assert list(tmp_path.iterdir()) == []


def test_each_version_is_its_own_adapter(tmp_path):
    first, second = lora_request(0, tmp_path / "v0"), lora_request(7, tmp_path / "v7")
    assert (first.lora_name, first.lora_int_id, first.lora_path) == ("rlfleet-v0", 1, str(tmp_path / "v0"))
    assert (second.lora_name, second.lora_int_id) == ("rlfleet-v7", 8)
    with pytest.raises(ValueError, match="non-negative"):
        lora_request(-1, tmp_path)
