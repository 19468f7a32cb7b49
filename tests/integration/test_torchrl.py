"""TorchRL 0.14 on rlfleet, end to end through the real suite, with no conversion code.

TorchRL's own ``GRPOLoss``, ``MCAdvantage``, ``TransformersWrapper`` and ``GRPOTrainer`` read
``RlfleetLLMCollector``'s batches and push through the adapter: in-process for the contract
(log-probs aligned, versions, temperature), as ``examples/train_torchrl.py`` (TorchRL's GRPO
recipe with the collector swapped) for learning, and as TorchRL's Ray recipe (``grpo-async.py``'s
pattern) with ``RlfleetRayLLMCollector`` in a real Ray actor filling a ``RayReplayBuffer``."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from rlfleet.client import connect
from rlfleet.client.torchrl import (RlfleetLLMCollector, RlfleetRayLLMCollector, RlfleetWeightSyncScheme,
                                    temperature_scaled)
from tests.integration.suites import DEMO_COLLECTOR_ARGS, run_example, suite_fixture
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
GROUP, GROUPS = 4, 8
BATCH = GROUP * GROUPS
EXAMPLE_STEPS = 14
TASK = dict(reward_fn="char_fraction", reward_args={"pattern": "[0-9]"})


suite = suite_fixture(DEMO_COLLECTOR_ARGS, "torchrl-suite")  # 8 groups of 4 per step (GROUPS, GROUP)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from torchrl.modules.llm import TransformersWrapper
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return TransformersWrapper(model, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir), input_mode="tokens",
                               generate=False, return_log_probs=True, pad_output=False)


def queries(count: int, tag: str) -> DataLoader:
    """A finite prompt source in a HF dataset's collated form ({"query": [...]} per batch)."""
    rows = [{"query": f"answer in digits: {tag} {i}"} for i in range(count)]
    return DataLoader(rows, batch_size=GROUPS)


def advantages(data) -> dict[str, float]:
    return dict(zip(data.get("trajectory_id").tolist(), data.get("advantage", as_padded_tensor=True).view(-1).tolist()))


def as_rlfleet_scales(recomputed) -> dict[str, float]:
    """MCAdvantage's (r - mean) / std.clamp_min(1e-6) rescaled to rlfleet's (r - mean) / (std + 1e-6):
    the two differ by std / (std + eps), which matters for groups whose scores barely differ."""
    rewards = recomputed.get(("next", "reward"), as_padded_tensor=True).view(-1)
    queries = recomputed.get("query").tolist()
    std = {q: rewards[[i for i, other in enumerate(queries) if other == q]].std().item() for q in set(queries)}
    return {tid: adv * std[q] / (std[q] + 1e-6) if std[q] > 0 else adv
            for (tid, adv), q in zip(advantages(recomputed).items(), queries)}


def test_grpo_loss_and_mc_advantage_run_on_rlfleet_batches_and_pushes_advance_one_version(suite, policy):
    from torchrl.objectives.llm import GRPOLoss, MCAdvantage

    steps = 4
    loss_fn = GRPOLoss(policy, masking_strategy="sft", kl_to_ref_coeff=0.05, entropy_coeff=0.0)
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-4)
    collector = RlfleetLLMCollector(suite["collector"].address, dialog_turns_per_batch=BATCH, policy=policy,
                                    total_dialog_turns=steps * BATCH, prompts=queries(steps * GROUPS, "a"), **TASK)
    with collector:
        collector.client.wait_ready(timeout=300)
        version = collector.update_policy_weights_()  # the engines now serve exactly these weights
        for data in collector:
            assert data.get("policy_version").unique().tolist() == [version]  # sync: on-policy
            out = loss_fn(data)
            # The trainer's log-probs over the engine's tokens equal the engine's behaviour log-probs:
            # GRPOLoss found every response token where rlfleet put it (ratio 1 before the update).
            assert abs(float(out.kl_approx)) < 1e-4 and abs(float(out.ESS) - 1) < 1e-3, out
            recomputed = MCAdvantage(grpo_size=GROUP).inv(data.clone())  # groups by "query"; may reorder
            assert as_rlfleet_scales(recomputed) == pytest.approx(advantages(data), rel=1e-3, abs=1e-4)
            loss = out.loss_objective + out.loss_kl_to_ref
            assert torch.isfinite(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            pushed = collector.update_policy_weights_()
            assert pushed == version + 1 == collector.policy_version
            version = pushed


def test_grpo_async_recipe_pattern_with_the_ray_collector_in_a_ray_actor(suite, policy):
    """grpo-async.py's calls, in its order, with RayLLMCollector swapped for RlfleetRayLLMCollector: a
    RayReplayBuffer with MCAdvantage, the sender's first push, ``start()`` filling the buffer from a Ray
    actor, a loss step on a sample, one push through ``update_policy_weights_``, the next batch."""
    ray = pytest.importorskip("ray")
    from functools import partial

    from torchrl.data import LazyStackStorage
    from torchrl.data.replay_buffers.ray_buffer import RayReplayBuffer
    from torchrl.objectives.llm import GRPOLoss, MCAdvantage

    # A cluster of its own ("local"): never join another one running on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rb = collector = None
    try:
        # Capacity one batch: the second batch replaces the first, so a sample after it is all of it.
        rb = RayReplayBuffer(storage=partial(LazyStackStorage, BATCH), transform_factory=partial(MCAdvantage,
                             grpo_size=GROUP), batch_size=BATCH, remote_config={"num_cpus": 1, "num_gpus": 0})
        collector = RlfleetRayLLMCollector(suite["collector"].address, dialog_turns_per_batch=BATCH,
                                           total_dialog_turns=2 * BATCH, replay_buffer=rb, track_policy_version=True,
                                           weight_updater=None, prompts=queries(2 * GROUPS, "ray"), **TASK)
        assert isinstance(collector._collector, ray.actor.ActorHandle)
        sender = RlfleetWeightSyncScheme(collector).create_sender()
        sender.register_model(policy.model)
        version = sender.update_weights()  # the recipe's first update, before the collectors start
        collector.start()
        sender.register_collector(collector)
        wait_for(lambda: collector.getattr_rb("write_count") >= BATCH, 180, "the actor's first batch in the buffer")
        data = rb.sample()
        assert data.get("policy_version").unique().tolist() == [version]
        assert data.get(("tokens", "response"), as_padded_tensor=True, padding_side="left").shape[0] == BATCH
        assert data.get("advantage", as_padded_tensor=True).shape == (BATCH, 1, 1)  # MCAdvantage on write
        out = GRPOLoss(policy, masking_strategy="sft")(data)  # TorchRL's loss reads the sample as it is
        assert torch.isfinite(out.loss_objective), out
        out.loss_objective.backward()
        torch.optim.SGD(policy.parameters(), lr=1e-3).step()
        policy.zero_grad()
        pushed = collector.update_policy_weights_(policy)
        assert pushed == version + 1 == collector.policy_version
        wait_for(lambda: not collector.is_running(), 180, "the actor to stop at total_dialog_turns")
        assert collector.getattr_rb("write_count") == 2 * BATCH
        assert rb.sample().get("policy_version").unique().tolist() == [version + 1]  # sync: on the pushed weights
        # A push after the last batch, as a training step ends: the sync collector's next step is allowed again
        # (the tests after this one take it without pushing first).
        assert collector.update_policy_weights_(policy) == version + 2
    finally:
        if collector is not None:
            collector.shutdown()
        if rb is not None:
            rb.close()
        ray.shutdown()


def test_at_temperature_t_a_scaled_wrapper_scores_what_the_engine_sampled(suite, policy):
    from torchrl.objectives.llm import GRPOLoss

    temperature = 0.7
    loss_fn = GRPOLoss(policy, masking_strategy="sft")
    with connect(suite["collector"].address) as client:
        client.submit_prompts([{"prompt": [{"role": "user", "content": f"answer in digits: t {i}"}],
                                "sampling": {"temperature": temperature}, **TASK} for i in range(GROUPS)])
        collector = RlfleetLLMCollector(client, dialog_turns_per_batch=BATCH, total_dialog_turns=BATCH)
        data = next(iter(collector))
        collector.shutdown()
    assert torch.allclose(data.get(("sampling", "temperature")), torch.tensor(temperature))
    unscaled = loss_fn(data)
    handle = temperature_scaled(policy.model, temperature)
    try:
        scaled = loss_fn(data)
    finally:
        handle.remove()
    assert abs(float(scaled.kl_approx)) < 1e-4 and abs(float(scaled.ESS) - 1) < 1e-3, scaled
    assert abs(float(unscaled.kl_approx)) > 10 * abs(float(scaled.kl_approx)), (unscaled, scaled)


@pytest.fixture(scope="module")
def recipe_metrics(suite, tiny_model_dir, tmp_path_factory):
    return run_example("train_torchrl.py", suite, tiny_model_dir, EXAMPLE_STEPS, tmp_path_factory.mktemp("torchrl-out"))


def test_torchrl_recipe_with_rlfleet_collector_learns(recipe_metrics):
    """GRPOTrainer + GRPOLoss + MCAdvantage replay buffer, untouched; the bound is test_demo's."""
    assert len(recipe_metrics) == EXAMPLE_STEPS
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in recipe_metrics)
    rewards = [m["reward_mean"] for m in recipe_metrics]
    assert sum(rewards[-4:]) / 4 - rewards[0] >= 0.4, rewards


def test_torchrl_recipe_versions_advance_one_per_step_on_policy(recipe_metrics):
    versions = [m["policy_version"] for m in recipe_metrics]
    assert versions == list(range(versions[0], versions[0] + EXAMPLE_STEPS))
    for m in recipe_metrics:
        # Sync: the step's batch was generated by the weights pushed just before it.
        assert m["batch_policy_versions"] == [m["policy_version"] - 1], m
