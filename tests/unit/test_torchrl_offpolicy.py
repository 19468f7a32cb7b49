"""``CorrectedGRPOLoss``: TorchRL 0.14's GRPOLoss applying rlfleet's IS corrections, on rlfleet batches.

The batches are the collector's own (tests/torchrl_batches.py) in TorchRL's layout. The equivalence
with plain GRPOLoss runs the tiny HF model; the per-token checks use a stand-in policy whose current
log-probs are a parameter laid out as GRPOLoss reads them, so a gradient lands on one token."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from rlfleet.client.offpolicy import importance_weights
from rlfleet.client.torchrl import CorrectedGRPOLoss, to_torchrl
from tests.torchrl_batches import episode_batch, ragged_batch

from torchrl.objectives.llm import GRPOLoss  # the test environment has rlfleet[torchrl]


class TokenLogProbs(torch.nn.Module):
    """A policy whose current log-probs are the behaviour's plus ``log_ratio``, as a [B, T] parameter
    left-padded over ``tokens/full`` (GRPOLoss's layout); its mask is the assistant tokens."""

    def __init__(self, data, log_ratio: torch.Tensor):
        super().__init__()
        self.mask = padded(data, ("masks", "all_assistant_mask"), False)
        self.behaviour = padded(data, ("log_probs", "full"), 0.0).nan_to_num(0.0)
        self.log_probs = torch.nn.Parameter(torch.where(self.mask, self.behaviour + log_ratio, 0.0))

    def get_dist(self, tensordict, **kwargs):
        return SimpleNamespace(mask=self.mask, log_prob=lambda action: self.log_probs)

    _get_sft_dist = _get_rlhf_dist = get_dist


def padded(data, key, value):
    return data.get(key, as_padded_tensor=True, padding_side="left", padding_value=value)


def stand_in(log_ratio_range=(-1.2, 1.8), seed=0, groups=3):
    """A batch and a stand-in policy whose per-token log-ratios to the behaviour are drawn in the range:
    ratios from 0.3 to 6, so truncation and both sides of icepop's band all occur."""
    data = to_torchrl(ragged_batch(groups=groups, group_size=4, vocab=500))
    tokens = padded(data, ("tokens", "full"), 0).shape
    low, high = log_ratio_range
    log_ratio = torch.rand(tokens, generator=torch.Generator().manual_seed(seed)) * (high - low) + low
    return data, TokenLogProbs(data, log_ratio)


def advantages(data) -> torch.Tensor:
    return data.get("advantage", as_padded_tensor=True).view(-1)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def wrapper(model, tiny_model_dir):
    import torchrl.modules.llm as torchrl_llm
    from transformers import AutoTokenizer

    return torchrl_llm.TransformersWrapper(model, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
                                           input_mode="tokens", generate=False, return_log_probs=True,
                                           pad_output=False)


def test_preset_none_on_on_policy_tokens_is_grpo_loss_and_reports_the_metrics(model, wrapper):
    def behaviour(prompt, response):  # the model's own log-probs: trainer == behaviour
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][len(prompt) - 1:]

    data = to_torchrl(ragged_batch(groups=2, group_size=3, vocab=500, behaviour=behaviour))
    options = dict(masking_strategy="sft", kl_to_ref_coeff=0.1)
    outputs, gradients = [], []
    for loss_fn in (GRPOLoss(wrapper, **options), CorrectedGRPOLoss(wrapper, correction="none", trainer_version=4,
                                                                    **options)):
        out = loss_fn(data)
        sum(value for key, value in out.items() if key.startswith("loss_")).backward()
        gradients.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
        outputs.append(out)
    plain, corrected = outputs
    for key in ("loss_objective", "loss_entropy", "loss_kl_to_ref", "kl_to_ref", "kl_approx", "ESS"):
        assert torch.allclose(corrected[key], plain.get(key), atol=1e-6), key
    assert all(torch.allclose(c, p, atol=1e-6) for c, p in zip(*gradients))
    # (d) the correction's metrics, and per lag: every response token was sampled by version 3.
    response_tokens = sum(len(t) for t in data.get(("tokens", "response"), as_list=True))
    assert float(corrected["offpolicy/tokens"]) == response_tokens
    assert abs(float(corrected["offpolicy/kl_k3"])) < 1e-5
    assert float(corrected["offpolicy/ess_token"]) == pytest.approx(1)
    assert float(corrected["offpolicy/lag1/tokens"]) == response_tokens
    assert not any("lag0" in key for key in corrected.keys())


@pytest.mark.parametrize("preset", ["token_tis", "seq_tis"])
def test_the_loss_applies_importance_weights_weights_per_token(preset):
    data, policy = stand_in()
    mask, advantage = policy.mask, advantages(data)
    per_token = CorrectedGRPOLoss(policy, correction=preset, entropy_bonus=False, aggregation="none")(data)
    expected = importance_weights(policy.log_probs.detach(), policy.behaviour, mask, preset).weights
    # The proximal ratio is 1 at the forward, so each token's loss is -weight * advantage.
    assert torch.allclose(per_token["loss_objective"].squeeze(-1), -expected * advantage[:, None], atol=1e-6)
    assert 0 < float(per_token["offpolicy/truncated_fraction"]) < 1

    # By hand, one token of the token mean: d loss / d log π(token) = -weight * A / tokens.
    loss = CorrectedGRPOLoss(policy, correction=preset, entropy_bonus=False)(data)["loss_objective"]
    loss.backward()
    row, column = 2, mask.shape[1] - 1
    log_ratio = (policy.log_probs - policy.behaviour).detach()
    level_log_ratio = log_ratio[row, column] if preset == "token_tis" else log_ratio[row][mask[row]].sum()
    weight = min(math.exp(level_log_ratio), 2.0)
    assert float(policy.log_probs.grad[row, column]) == pytest.approx(-weight * float(advantage[row]) / int(mask.sum()),
                                                                       rel=1e-5)
    assert float(loss) == pytest.approx(float((-expected * advantage[:, None]).sum() / mask.sum()), rel=1e-5)


@pytest.mark.parametrize("preset", ["seq_mis", "icepop"])
def test_no_gradient_flows_through_the_tokens_a_correction_masks(preset):
    data, policy = stand_in()
    loss_fn = CorrectedGRPOLoss(policy, correction=preset, entropy_bonus=False, kl_to_ref_coeff=0.1)
    out = loss_fn(data)
    sum(value for key, value in out.items() if key.startswith("loss_")).backward()
    masked, kept = policy.mask & ~loss_fn.last.mask, loss_fn.last.mask
    assert masked.any() and kept.any()
    assert (policy.log_probs.grad[masked] == 0).all()  # objective and KL to the reference alike
    assert (policy.log_probs.grad[kept] != 0).all()
    assert float(out["offpolicy/masked_fraction"]) == pytest.approx(int(masked.sum()) / int(policy.mask.sum()))


def test_a_batch_masked_whole_gives_a_zero_loss_not_nan():
    data, policy = stand_in(log_ratio_range=(0.5, 1.0))  # every geometric mean far above 1.001
    loss_fn = CorrectedGRPOLoss(policy, correction="geo_mis", entropy_bonus=False, kl_to_ref_coeff=0.1)
    out = loss_fn(data)
    total = sum(value for key, value in out.items() if key.startswith("loss_"))
    total.backward()
    assert float(total) == 0 and (policy.log_probs.grad == 0).all()
    assert float(out["offpolicy/masked_sequence_fraction"]) == 1


def test_lags_are_counted_at_the_tokens_each_version_sampled_in_multi_turn_episodes():
    ragged = episode_batch(group_size=3, turns=3, vocab=500)  # turn k sampled by version k; observations -1
    data = to_torchrl(ragged)
    policy = TokenLogProbs(data, torch.zeros(padded(data, ("tokens", "full"), 0).shape))
    loss_fn = CorrectedGRPOLoss(policy, correction="icepop", masking_strategy="rlhf", entropy_bonus=False,
                                trainer_version=lambda: 5)
    out = loss_fn(data)
    sampled_by = Counter(v for v in ragged.get(("versions", "response")).values().tolist() if v >= 0)
    assert {lag: values["tokens"] for lag, values in loss_fn.last.by_lag.items()} == {
        5 - version: count for version, count in sampled_by.items()}
    assert {f"offpolicy/lag{5 - v}/kl_k3" for v in sampled_by} <= set(out.keys())


def test_an_unknown_preset_is_refused_at_construction():
    with pytest.raises(ValueError, match="presets are none, token_tis"):
        CorrectedGRPOLoss(None, correction="tis")
