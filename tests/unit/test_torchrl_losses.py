"""TorchRL 0.14's own GRPOLoss, MCAdvantage and TransformersWrapper on rlfleet batches, unchanged.

The batches are built by the collector's own code and pass through the wire codec; the model is
the tiny HF model the suite serves. The end-to-end run against the real services is
tests/integration/test_torchrl.py."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlfleet.client.torchrl import policy_state_dict, temperature_scaled, to_torchrl
from tests.torchrl_batches import ragged_batch

import torchrl.modules.llm as torchrl_llm  # the test environment has rlfleet[torchrl]
from torchrl.objectives.llm import GRPOLoss, MCAdvantage


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def wrapper(model, tiny_model_dir):
    from transformers import AutoTokenizer

    return torchrl_llm.TransformersWrapper(model, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
                                           input_mode="tokens", generate=False, return_log_probs=True,
                                           pad_output=False)


def model_log_probs(model, temperature: float = 1.0):
    """Behaviour log-probs as the engine computes them: the model's own, of logits / temperature."""
    def behaviour(prompt, response):
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float() / temperature
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][len(prompt) - 1:]
    return behaviour


def test_grpo_loss_reads_rlfleet_batches_with_tokens_log_probs_and_advantages_aligned(model, wrapper):
    ragged = ragged_batch(groups=2, group_size=3, vocab=500, behaviour=model_log_probs(model))
    loss_fn = GRPOLoss(wrapper, masking_strategy="sft", kl_to_ref_coeff=0.1)
    out = loss_fn(to_torchrl(ragged))
    # The trainer's log-probs equal the behaviour ones only if GRPOLoss read every response token
    # at its own position: then the ratio is 1 and the clipped objective is -(token mean of A).
    assert abs(float(out.kl_approx)) < 1e-5 and abs(float(out.ESS) - 1) < 1e-5
    lengths = torch.tensor([len(t) for t in ragged["tokens", "response"].unbind(0)])
    expected = -(ragged["advantage"] * lengths).sum() / lengths.sum()
    assert torch.allclose(out.loss_objective, expected, atol=1e-5)
    # The reference is 0.05 below the behaviour on every response token (the batch helper).
    assert float(out.kl_to_ref) > 0
    total = sum(value for key, value in out.items() if key.startswith("loss_"))
    assert torch.isfinite(total)
    total.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.zero_grad()


def test_mc_advantage_recomputes_rlfleets_group_advantage(model):
    ragged = ragged_batch(groups=3, group_size=4, vocab=500)
    data = to_torchrl(ragged)
    recomputed = MCAdvantage(grpo_size=4).inv(data)
    # TorchRL divides by std.clamp_min(1e-6), rlfleet by (std + 1e-6).
    assert torch.allclose(recomputed.get("advantage", as_padded_tensor=True).view(-1), ragged["advantage"],
                          rtol=1e-3, atol=1e-4)


def test_the_wrappers_weights_carry_the_served_models_names(model, wrapper):
    names = set(model.state_dict())
    assert all(name.startswith("model.") for name in wrapper.state_dict())
    for weights in (wrapper, wrapper.state_dict(), TensorDict.from_module(wrapper), TensorDict.from_module(model)):
        assert set(policy_state_dict(weights)) == names


@pytest.mark.parametrize("temperature", [0.7])
def test_at_temperature_t_the_wrapper_must_score_logits_over_t(model, wrapper, temperature):
    """rlfleet's behaviour log-probs are of logits / T; TorchRL's wrapper has no temperature.
    Scaled with temperature_scaled the loss sees the sampled distribution (ratio 1 before any update);
    unscaled, GRPOLoss would see an off-policy gap that is the temperature's alone."""
    ragged = ragged_batch(groups=2, group_size=3, vocab=500, behaviour=model_log_probs(model, temperature),
                          temperature=temperature)
    loss_fn = GRPOLoss(wrapper, masking_strategy="sft")
    unscaled = loss_fn(to_torchrl(ragged))
    handle = temperature_scaled(model, temperature)
    try:
        scaled = loss_fn(to_torchrl(ragged))
    finally:
        handle.remove()
    assert abs(float(scaled.kl_approx)) < 1e-5 and abs(float(scaled.ESS) - 1) < 1e-5
    assert abs(float(unscaled.kl_approx)) > 1e-3


def test_grpo_loss_trains_on_multi_turn_episodes_over_the_assistant_tokens_only(model, wrapper):
    from tests.torchrl_batches import episode_batch

    def behaviour(history, sampled):
        return model_log_probs(model)(history, sampled)

    ragged = episode_batch(group_size=3, turns=3, vocab=500, behaviour=behaviour)
    data = to_torchrl(ragged)
    # The masking ChatEnv's history mode gives: assistant tokens only (rlhf), over the full sequence.
    loss_fn = GRPOLoss(wrapper, masking_strategy="rlhf", kl_to_ref_coeff=0.1)
    out = loss_fn(data)
    # Behaviour = the model's own log-probs at every sampled token: ratio 1 only if GRPOLoss read each
    # assistant token at its position and skipped the observation tokens.
    assert abs(float(out.kl_approx)) < 1e-5 and abs(float(out.ESS) - 1) < 1e-5
    sampled = torch.tensor([int(m.sum()) for m in ragged["masks", "all_assistant_mask"].unbind(0)])
    expected = -(ragged["advantage"] * sampled).sum() / sampled.sum()
    assert torch.allclose(out.loss_objective, expected, atol=1e-5)
    total = sum(value for key, value in out.items() if key.startswith("loss_"))
    assert torch.isfinite(total)
