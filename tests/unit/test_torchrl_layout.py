"""The TorchRL adapter's logic without TorchRL: layout, weight naming, versions, prompt feeding.

Runs on both tensordict minors (tests/unit/test_tensordict_minors.py); the same batches through
TorchRL's own GRPOLoss / MCAdvantage are in test_torchrl_losses.py."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict
from tensordict.nn import TensorDictModuleBase

from rlfleet.client.torchrl import (RlfleetLLMCollector, RlfleetWeightSyncScheme, policy_state_dict,
                                    temperature_scaled, to_torchrl)
from rlfleet.client.torchrl.prompts import prompt_items, to_spec
from rlfleet.wire import get_ragged
from tests.torchrl_batches import FakeBatch, Pushed, ragged_batch

PAD = dict(as_padded_tensor=True, padding_side="left")


@pytest.fixture(scope="module")
def ragged():
    return ragged_batch(groups=2, group_size=3)


def test_layout_is_a_lazy_stack_of_unpadded_samples(ragged):
    data = to_torchrl(ragged)
    assert isinstance(data, LazyStackedTensorDict) and data.batch_size == (6,) and data.stack_dim == 0
    prompts = get_ragged(ragged, ("tokens", "prompt")).to_list()
    responses = get_ragged(ragged, ("tokens", "response")).to_list()
    for i, sample in enumerate(data.tensordicts):
        p, r = len(prompts[i]), len(responses[i])
        assert sample.batch_size == ()
        assert torch.equal(sample["tokens", "prompt"], prompts[i])
        assert torch.equal(sample["tokens", "full"], torch.cat([prompts[i], responses[i]]))
        assert sample["masks", "all_assistant_mask"].tolist() == [False] * p + [True] * r
        assert sample["masks", "all_attention_mask"].all() and sample["masks", "all_attention_mask"].shape == (p + r,)
        full = sample["log_probs", "full"]
        assert full.shape == (p + r,) and full[:p].isnan().all()
        assert torch.equal(full[p:], sample["log_probs", "response"])
        ref = sample["next", "ref_log_probs", "full"]
        assert ref.shape == (p + r,) and not ref[:p].any()
        assert torch.equal(ref[p:], sample["next", "ref_log_probs", "response"])
        assert sample["advantage"].shape == (1, 1) and sample["next", "reward"].shape == (1, 1)
        assert sample["next", "token_reward"].shape == (r, 1)
        assert sample["next", "done"].tolist() == [True] and sample["done"].tolist() == [False]
        assert sample["policy_version"] == 3 and sample["next", "policy_version"] == 4
    assert data.get("query").tolist() == ["question 0"] * 3 + ["question 1"] * 3
    assert torch.equal(data.get("advantage", **PAD).view(-1), ragged["advantage"])
    assert torch.equal(data.get(("next", "reward"), **PAD).view(-1), ragged["clipped_score"])
    # Every other entry is carried, per sample.
    assert torch.equal(torch.stack([s["group_id"] for s in data.tensordicts]), ragged["group_id"])
    assert data.get("trajectory_id").tolist() == list(ragged["trajectory_id"])


def test_padded_and_list_reads_behave_as_torchrl_expects(ragged):
    data = to_torchrl(ragged)
    lengths = get_ragged(ragged, ("tokens", "full")).lengths
    tokens = data.get(("tokens", "full"), as_padded_tensor=True, padding_side="left", padding_value=-100)
    assert tokens.shape == (6, int(lengths.max()))
    for row, length in zip(tokens, lengths.tolist()):  # left-padded: the tokens end every row
        assert (row[: len(row) - length] == -100).all() and (row[len(row) - length:] != -100).all()
    assert data.get(("log_probs", "full"), **PAD).shape == tokens.shape
    assert data.get(("next", "ref_log_probs", "full"), **PAD).shape == tokens.shape
    assert [len(p) for p in data.get(("tokens", "prompt"), as_list=True)] == \
        get_ragged(ragged, ("tokens", "prompt")).lengths.tolist()


def test_ragged_form_is_left_untouched_and_an_empty_batch_is_refused(ragged):
    keys = set(ragged.keys(True, True))
    tokens = get_ragged(ragged, ("tokens", "full")).values.clone()
    to_torchrl(ragged)
    assert set(ragged.keys(True, True)) == keys
    assert torch.equal(get_ragged(ragged, ("tokens", "full")).values, tokens)
    assert to_torchrl(to_torchrl(ragged)).batch_size == (6,)
    with pytest.raises(ValueError, match="empty batch"):
        to_torchrl(TensorDict({}, batch_size=[0]))


class Wrapper(TensorDictModuleBase):
    """The shape of TorchRL's LLM wrappers for naming: a TensorDictModuleBase holding ``.model``."""

    in_keys, out_keys = ["x"], ["y"]

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, td):
        return td


class CausalLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(4, 2)
        self.model.rotary_emb = torch.nn.Module()  # a non-persistent buffer, as HF's rotary embeddings hold
        self.model.rotary_emb.register_buffer("inv_freq", torch.ones(1), persistent=False)
        self.lm_head = torch.nn.Linear(2, 4, bias=False)


def test_weights_in_every_form_map_to_the_models_own_names():
    model = CausalLM()
    want = set(model.state_dict())
    assert want == {"model.embed_tokens.weight", "lm_head.weight"}
    wrapper = Wrapper(model)
    assert set(wrapper.state_dict()) == {"model." + name for name in want}
    forms = {"module": model, "wrapper": wrapper, "wrapper state dict": wrapper.state_dict(),
             "state dict": model.state_dict(), "from_module(model)": TensorDict.from_module(model),
             "from_module(wrapper)": TensorDict.from_module(wrapper)}
    for form, weights in forms.items():
        state = policy_state_dict(weights)
        assert set(state) == want, form
        assert torch.equal(state["lm_head.weight"], model.lm_head.weight), form
    # A bare model whose names all start with "model." (no lm_head) keeps them.
    assert set(policy_state_dict({"model.embed_tokens.weight": torch.ones(1)})) == {"model.embed_tokens.weight"}
    with pytest.raises(TypeError, match="holds no trainable weights"):
        policy_state_dict(EngineWrapper())
    with pytest.raises(TypeError, match="expected a TorchRL LLM wrapper"):
        policy_state_dict(42)


class EngineWrapper(Wrapper):
    """As vLLMWrapper: ``.model`` is the inference engine, not a module."""

    def __init__(self):
        TensorDictModuleBase.__init__(self)
        self.model = "an AsyncVLLM engine"


def test_temperature_scaled_divides_the_logits_and_is_removable():
    class LM(torch.nn.Module):
        def forward(self, x):
            return {"logits": x * 2}

    model = LM()
    handle = temperature_scaled(model, 0.5)
    assert torch.equal(model(torch.ones(2))["logits"], torch.full((2,), 4.0))
    handle.remove()
    assert torch.equal(model(torch.ones(2))["logits"], torch.full((2,), 2.0))
    with pytest.raises(ValueError, match="temperature"):
        temperature_scaled(model, 0.0)


# --- the collector's logic over a stand-in client ---------------------------------------------
class FakeClient:
    """Records what the adapter asks of rlfleet's client (unit test of the logic above it)."""

    def __init__(self, batches=(), group_size=3):
        self.version = 0
        self.pushes: list[set[str]] = []
        self.submitted: list[dict] = []
        self._batches = list(batches)
        self.group_size = group_size
        self.stream_options = None

    def push_weights(self, weights, *, mode, transport, strategy, progress):
        self.pushes.append(set(weights))
        self.version += 1
        return Pushed(self.version)

    @property
    def policy_version(self):
        return self.version

    def submit_prompts(self, specs):
        self.submitted.extend(specs)
        return [str(i) for i in range(len(specs))]

    def status(self):
        return type("Status", (), {"group_size": self.group_size})()

    def batches(self, batch_size, **options):
        self.stream_options = dict(options, batch_size=batch_size)
        client = self

        class Stream:
            def __enter__(self):
                return iter(client._batches)

            def __exit__(self, *exc):
                return None

            def close(self):
                return None

        return Stream()


def test_update_policy_weights_takes_torchrl_forms_and_counts_one_version_per_push(caplog):
    model = CausalLM()
    client = FakeClient()
    collector = RlfleetLLMCollector(client, dialog_turns_per_batch=6, policy=Wrapper(model))
    names = set(model.state_dict())
    assert collector.update_policy_weights_() == 1
    assert collector.update_policy_weights_(model) == 2
    assert collector.update_policy_weights_(weights=TensorDict.from_module(model)) == 3
    assert collector.update_policy_weights_(policy=Wrapper(model)) == 4
    assert collector.update_policy_weights_(weights_dict={"policy": model.state_dict()}) == 5
    assert collector.update_policy_weights_(weights_dict={"a": model, "b": None}, model_id="a") == 6
    assert collector.update_policy_weights_(policy_weights=model) == 7
    assert client.pushes == [names] * 7 and collector.policy_version == 7
    with pytest.raises(ValueError, match="worker_ids"):
        collector.update_policy_weights_(worker_ids=[0])
    with pytest.raises(ValueError, match="model_id"):
        collector.update_policy_weights_(weights_dict={"a": model, "b": model})
    with pytest.raises(TypeError):
        collector.update_policy_weights_(unknown=model)
    # increment_version() after a push (TorchRL's order) counts; without one it moves nothing.
    assert len(client.pushes) == 7
    with caplog.at_level(logging.WARNING, logger="rlfleet.client.torchrl"):
        assert collector.increment_version() == 7
        assert collector.increment_version() == 7
    assert len(client.pushes) == 7 and collector.policy_version == 7
    assert sum("without a weight push" in r.message for r in caplog.records) == 1


def test_sender_pushes_once_then_runs_the_collectors_increment():
    model = CausalLM()
    client = FakeClient()
    collector = RlfleetLLMCollector(client, dialog_turns_per_batch=6)
    sender = RlfleetWeightSyncScheme(collector).create_sender()
    sender.register_model(Wrapper(model))
    sender.init_all_workers_group({"unused": None}, vllm_engine=None)
    sender.register_collector(collector)
    calls = []
    sender.register_post_hook(lambda: calls.append(collector.policy_version))
    for step in range(1, 4):
        assert sender.update_weights() == step
    assert len(client.pushes) == 3 and calls == [1, 2, 3]
    assert collector.unacknowledged_pushes == 0  # every push was matched by its increment
    with pytest.raises(ValueError, match="register_model"):
        RlfleetWeightSyncScheme(collector).create_sender().update_weights()


def test_iteration_layouts_replay_buffer_and_stream_options(ragged):
    class Buffer:
        def __init__(self):
            self.extended = []

        def extend(self, data):
            self.extended.append(data)

    client = FakeClient([FakeBatch(ragged), FakeBatch(ragged)])
    collector = RlfleetLLMCollector(client, dialog_turns_per_batch=6, min_policy_version=2, lease_seconds=30.0)
    got = list(collector)
    assert [type(d) for d in got] == [LazyStackedTensorDict] * 2
    assert client.stream_options == dict(batch_size=6, whole_groups=True, min_policy_version=2,
                                         lease_seconds=30.0, prefetch=1)
    buffer = Buffer()
    collector = RlfleetLLMCollector(FakeClient([FakeBatch(ragged)] * 3), dialog_turns_per_batch=6,
                                    replay_buffer=buffer, total_dialog_turns=12)
    assert list(collector) == [None, None] and len(buffer.extended) == 2  # stops at total_dialog_turns
    raw = next(iter(RlfleetLLMCollector(FakeClient([FakeBatch(ragged)]), dialog_turns_per_batch=6,
                                        layout="ragged")))
    assert raw is ragged and torch.equal(raw["policy_version"], ragged["policy_version_start"])


def test_prompt_sources_in_torchrl_forms_become_specs():
    defaults = dict(reward_fn="numeric_match", reward_args={"tolerance": "0"}, system_prompt="be brief")
    collated = {"query": ["1+1", "2+2"], "answer": ["2", "4"]}  # a DataLoader batch of a HF dataset
    specs = [to_spec(item, **defaults) for item in prompt_items([collated])]
    assert specs == [
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": q}],
         "ground_truth": a, "reward_fn": "numeric_match", "reward_args": {"tolerance": "0"}}
        for q, a in [("1+1", "2"), ("2+2", "4")]]
    rows = [{"question": "3+3", "answer": "6"}, "plain text", [{"role": "user", "content": "hi"}],
            {"prompt": "raw", "reward_fn": "exact_match"}]
    specs = [to_spec(item, reward_fn="char_fraction", reward_args=None, system_prompt=None)
             for item in prompt_items([rows])]
    assert [s["prompt"] for s in specs] == [[{"role": "user", "content": "3+3"}],
                                            [{"role": "user", "content": "plain text"}],
                                            [{"role": "user", "content": "hi"}], "raw"]
    assert [s["reward_fn"] for s in specs] == ["char_fraction"] * 3 + ["exact_match"]
    td = TensorDict({"query": ["a", "b"], "answer": ["1", "2"]}, batch_size=[2])
    assert [to_spec(i, reward_fn=None, reward_args=None, system_prompt=None)["ground_truth"]
            for i in prompt_items([td])] == ["1", "2"]
    with pytest.raises(ValueError, match="query"):
        to_spec({"content": "x"}, reward_fn=None, reward_args=None, system_prompt=None)


def test_a_primer_is_cycled_and_prompts_stay_a_few_batches_ahead(ragged):
    class Primer:  # TorchRL's DataLoadingPrimer keeps its loader as .dataloader and cycles it
        dataloader = [{"query": [f"q{i}" for i in range(4)]}]
        repeats = 3

    batches = [FakeBatch(ragged)] * 3
    client = FakeClient(batches, group_size=3)
    collector = RlfleetLLMCollector(client, dialog_turns_per_batch=6, prompts=Primer(), prompts_ahead=2)
    iterator = iter(collector)
    next(iterator)
    per_batch = math.ceil(6 / 3)
    # Before the stream: 2 batches' worth; after each delivered batch: its groups again.
    assert len(client.submitted) == 2 * per_batch + per_batch
    next(iterator)
    assert len(client.submitted) == 2 * per_batch + 2 * per_batch
    assert [s["prompt"][0]["content"] for s in client.submitted] == [f"q{i % 4}" for i in range(8)]


def test_a_primer_repeating_prompts_other_than_the_group_size_is_refused(ragged):
    class Primer:
        dataloader = [{"query": ["q"]}]
        repeats = 4

    collector = RlfleetLLMCollector(FakeClient([FakeBatch(ragged)], group_size=3), dialog_turns_per_batch=6,
                                    prompts=Primer())
    with pytest.raises(ValueError, match="repeats each prompt 4 times.*group_size"):
        next(iter(collector))


def test_submit_prompts_takes_one_pass_even_over_a_primer():
    class Primer:  # cycled when it feeds the collector, but an explicit submit is one pass
        dataloader = [{"query": ["a", "b"]}, {"query": ["c"]}]

    client = FakeClient()
    collector = RlfleetLLMCollector(client, dialog_turns_per_batch=6, reward_fn="char_fraction")
    assert len(collector.submit_prompts(Primer())) == 3
    assert [s["prompt"][0]["content"] for s in client.submitted] == ["a", "b", "c"]
    assert {s["reward_fn"] for s in client.submitted} == {"char_fraction"}
