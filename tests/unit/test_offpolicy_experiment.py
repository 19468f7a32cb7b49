"""The off-policy experiment's arithmetic (bench/offpolicy_experiment.py) on runs made up by hand, and the GRPO
demo's long-tailed response budgets."""

from __future__ import annotations

import importlib.util
import random
import statistics
from pathlib import Path

import pytest

from tests.example_modules import import_example

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def experiment():
    spec = importlib.util.spec_from_file_location("offpolicy_experiment", ROOT / "bench" / "offpolicy_experiment.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(arm: str, seed: int, rewards: list[float], step_seconds: float, regime: str = "realistic",
        lag1_k3: float | None = None) -> dict:
    elapsed, steps = 0.0, []
    for index, reward in enumerate(rewards):
        elapsed += step_seconds
        by_lag = {"0": {"tokens": 90, "kl_k3": 1e-9, "ess_token": 1.0, "fraction": 0.9}}
        if lag1_k3 is not None:
            by_lag["1"] = {"tokens": 10, "kl_k3": lag1_k3, "ess_token": 0.9, "fraction": 0.1}
        steps.append({"step": index, "reward_mean": reward, "elapsed_seconds": elapsed, "response_tokens": 100,
                      "offpolicy/tokens": 100, "staleness_mean": 0.1 if lag1_k3 else 0.0, "by_lag": by_lag})
    return {"regime": regime, "arm": arm, "seed": seed, "best": None, "steps": steps}


def test_time_to_target_and_the_result_keys_by_hand(experiment):
    ramp = [0.2, 0.2, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0, 1.0]  # sync and async learn alike per step
    runs = []
    for seed in (0, 1, 2):
        runs += [run("sync", seed, ramp, 2.0), run("async-2", seed, ramp, 1.0, lag1_k3=0.004),
                 run("async-kl", seed, ramp, 1.25, lag1_k3=0.002), run("async-4", seed, [0.2] * 10, 0.5, lag1_k3=0.01)]
    numbers = experiment.headline(runs)
    realistic = numbers["realistic"]

    # The target: 80% of the way from the first 3 steps' reward (0.2) to sync's final (the last 5 steps: 0.96):
    # 0.808. The 3-step mean reaches it at step 7 (0.8, 1.0, 1.0 -> 0.933; step 6's 0.6, 0.8, 1.0 is 0.8).
    assert realistic["target_reward"] == pytest.approx(0.808)
    assert realistic["arms"]["sync"]["step_to_target_per_seed"] == [7, 7, 7]
    assert realistic["arms"]["sync"]["time_to_target"] == pytest.approx(16.0)
    assert realistic["arms"]["async-2"]["time_to_target"] == pytest.approx(8.0)
    assert realistic["arms"]["async-4"]["time_to_target"] is None  # never learned
    assert experiment.best_async(realistic["arms"]) == "async-2"

    result = experiment.result_line(runs, numbers)
    assert result["time_to_target_best_async_over_sync"] == pytest.approx(0.5)
    assert result["final_reward_best_async_minus_sync"] == pytest.approx(0.0)
    assert result["divergence_bound_time_over_best_fixed"] == pytest.approx(10.0 / 8.0)
    assert result["realistic"]["best_fixed"] == "async-2"
    # lag-1 k3 token-weighted over every async run's steps: 10 tokens each at 0.004, 0.002 and 0.01
    assert result["per_version_k3_realistic"] == pytest.approx((0.004 + 0.002 + 0.01) / 3)
    assert result["per_version_k3_today"] is None


def test_arms_run_in_an_order_rotated_by_the_seed_the_best_variants_last(experiment):
    arms = ["sync", "async-1", "async-kl", "best+icepop", "best+resume"]
    assert experiment.run_order(arms, 0) == arms
    assert experiment.run_order(arms, 1) == ["async-1", "async-kl", "sync", "best+resume", "best+icepop"]


def test_response_budgets_have_the_documented_heavy_tail():
    train_grpo = import_example("train_grpo")
    rng = random.Random(0)
    budgets = [train_grpo.response_budget(rng, 192) for _ in range(4000)]

    assert min(budgets) == 16 and max(budgets) == 192
    assert 22 <= statistics.median(budgets) <= 29  # Pareto(1.5) from 16: median 16 * 2^(2/3) = 25.4
    assert 0.04 <= sum(b >= 101 for b in budgets) / len(budgets) <= 0.09  # P(X >= 4 medians) = 0.063
    prompts = train_grpo.task_prompts(8, random.Random(1), long_tail=48)
    assert all(16 <= p["sampling"]["max_tokens"] <= 48 for p in prompts)
    assert "sampling" not in train_grpo.task_prompts(1, random.Random(1))[0]

def test_a_seed_that_never_reaches_the_target_counts_as_slowest_not_as_absent(experiment):
    ramp, flat = [0.2, 0.2, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0, 1.0], [0.2] * 10
    runs = []
    for seed in (0, 1, 2):
        runs.append(run("sync", seed, ramp, 2.0))  # reaches it at 16 s
    # async-1 is fast when it learns (8 s) but never gets there at 2 of 3 seeds: its median is "never",
    # where leaving those seeds out would have made it the fastest arm.
    runs += [run("async-1", 0, ramp, 1.0, lag1_k3=0.002), run("async-1", 1, flat, 1.0, lag1_k3=0.002),
             run("async-1", 2, flat, 1.0, lag1_k3=0.002)]
    # async-2 never gets there at 1 seed of 3: its median is the slower of the two that did.
    runs += [run("async-2", 0, ramp, 1.5, lag1_k3=0.004), run("async-2", 1, ramp, 3.0, lag1_k3=0.004),
             run("async-2", 2, flat, 1.5, lag1_k3=0.004)]
    runs += [run("async-kl", seed, flat, 1.0, lag1_k3=0.003) for seed in (0, 1, 2)]
    arms = experiment.headline(runs)["realistic"]["arms"]
    assert arms["async-1"]["time_to_target_per_seed"] == [8.0, None, None]
    assert arms["async-1"]["time_to_target"] is None
    assert arms["async-2"]["time_to_target"] == pytest.approx(24.0)  # of 12, 24 and never
    assert experiment.best_async(arms) == "async-2"

    result = experiment.result_line(runs, experiment.headline(runs))["realistic"]
    assert result["time_to_target_ratio_per_seed"] == [pytest.approx(0.75), pytest.approx(1.5), "never"]
    assert result["time_to_target_best_async_over_sync"] == pytest.approx(1.5)
    assert result["divergence_bound_time_over_best_fixed"] == "never"  # async-kl never; async-2 did
    assert experiment.time_ratio(None, None) is None and experiment.time_ratio(4.0, None) == 0.0
    assert experiment.median_time([1.0, None]) is None and experiment.median_time([]) is None
