"""When should I run async? The GRPO demo on- and off-policy, against wall-clock time and steps.

    .venv/bin/python bench/offpolicy_experiment.py [--steps 30] [--seeds 0,1,2] [--regimes today,realistic]
        [--arms sync,async-1,async-2,async-4,async-kl,best+token_tis,best+icepop,best+resume]

Runs the digits-only task of ``examples/train_grpo.py`` on the tiny local model against the whole suite
(the processes ``scripts/demo`` starts, through ``rlfleet.services.suite.start_suite``). Each run has its
own trajectory service and collector, started fresh (a new buffer and collector state: no two runs share
either); the generation engine, the reference and the reward service (stateless with the constant KL
controller) are started once per seed and shared by its runs, and each trainer pushes its starting weights
before its first step (``train_grpo.py --push-first``), so the engine samples from that run's policy from
its first batch on (a swap clears vLLM's prefix cache).
The collector keeps scripts/demo's settings (groups of 4, 8 groups per step, temperature 1, reward
``char_fraction``) except the mode; the trainer gives each prompt a response budget from a heavy tail
(``train_grpo.py --long-tail``: median ~25 tokens, one prompt in 16 four times that or more), so a step's slowest
group stalls a synchronous trainer and asynchronous generation has something to overlap.

Arms (each with every regime and seed):

- ``sync``: ``--mode sync``;
- ``async-K``: ``--mode async --max-staleness K``, K = 1, 2, 4;
- ``async-kl``: admission by measured divergence: ``--mismatch-kl-target`` (``--kl-target``) under the
  ceiling ``--max-staleness 4``; the trainer's reports set the bound;
- ``best+token_tis``, ``best+icepop``: the best plain async arm so far (shortest median time to the target
  reward; the choice is recorded per run) with that correction;
- ``best+resume``: the best arm with ``--swap-mode resume`` (the others swap with ``keep``, the default).

Every arm but the corrections runs the trainer with ``--is-correction none`` (decoupled PPO with unit
weights), so every step records the mismatch per version lag and the trainer reports it (what ``async-kl``
admits by). Regimes (``REGIMES``): ``today`` is the demo's learning rate, one optimizer step per batch
(consecutive versions about 1 nat of k3 KL per token apart); ``realistic`` a lower one with PPO minibatches
(the clip acts), consecutive versions 1e-3 to 1e-2 apart as in a real GRPO run. Runs are interleaved: for
each seed, every regime's arms in an order rotated by the seed, so the machine's drift hits every arm alike.

``--split-cpus`` gives the trainer CPU 0 and every service the others (the driver sets its own affinity before it
starts anything, and the trainer's at its start): generation then has hardware of its own, as a GPU trainer and
generation replicas on other GPUs have, so what async overlaps is no longer taken from the trainer. Without it
the trainer and the services share every core, as the test machine's jobs do.

Wall-clock is the trainer's: the sum of its step times from its first step (the suite's start and the
trainer's own imports are not the run). The target reward of a regime is ``TARGET_FRACTION`` of the way from
the first steps' reward to the sync arm's final reward (medians over seeds); time to target is the first
time a run's reward (mean of ``SMOOTH`` steps) reaches it.

Writes one JSON file (machine, commit, settings, every per-step metric of every run, the headline numbers),
one PNG per regime, and prints ``RESULT {json}`` last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_COLLECTOR_ARGS = ["--group-size=4", "--groups-per-step=8", '--sampling={"temperature": 1.0, "max_tokens": 24}',
                       "--reward-fn=char_fraction"]
"""scripts/demo's collector settings, less the mode (each prompt's budget overrides ``max_tokens``)."""
PLAIN_ARMS: dict[str, list[str]] = {
    "sync": ["--mode=sync"],
    "async-1": ["--mode=async", "--max-staleness=1"],
    "async-2": ["--mode=async", "--max-staleness=2"],
    "async-4": ["--mode=async", "--max-staleness=4"],
    "async-kl": ["--mode=async", "--max-staleness=4"],  # + --mismatch-kl-target
}
"""Arm name -> collector mode flags; the trainer's preset is ``none``."""
BEST_ARMS: dict[str, tuple[list[str], str]] = {
    "best+token_tis": ([], "token_tis"),
    "best+icepop": ([], "icepop"),
    "best+resume": (["--swap-mode=resume"], "none"),
}
"""Arm name -> (flags added to the best plain async arm's, the trainer's preset)."""
ARMS = [*PLAIN_ARMS, *BEST_ARMS]
REGIMES: dict[str, list[str]] = {
    "today": ["--lr=3e-4"],
    "realistic": ["--lr=1.5e-5", "--minibatches=2"],
}
"""Regime -> the trainer's flags."""
LONG_TAIL = 192
"""The longest response budget (``train_grpo.py --long-tail``)."""
FINAL_STEPS = 5
SMOOTH = 3
TARGET_FRACTION = 0.8


def start_backends(seed: int, ns: argparse.Namespace) -> dict:
    """The seed's generation engine (its sampling seed), reference and reward services."""
    from rlfleet.services.suite import SuiteOptions, start_suite

    workdir = ns.workdir / f"backends-seed{seed}"
    subprocess.run(["rm", "-rf", str(workdir)], check=True)
    procs = start_suite(SuiteOptions(model_dir=ns.model_dir, generation_args=["--seed", str(seed)]), workdir,
                        without_collector=True)
    procs.pop("trajectory").stop()  # each run gets a fresh one
    return procs


def run_arm_seed(regime: str, arm: str, seed: int, ns: argparse.Namespace, best: str | None,
                 backends: dict) -> dict:
    """A fresh trajectory service and collector on the seed's backends, one training run of ``ns.steps``
    steps; its per-step metrics."""
    from rlfleet.services.launch import ServiceProcess

    if arm in BEST_ARMS:
        extra, preset = BEST_ARMS[arm]
        mode_args = [*arm_collector_args(best, ns), *extra]
    else:
        mode_args, preset = arm_collector_args(arm, ns), "none"
    workdir = ns.workdir / f"{regime}-{arm}-seed{seed}"
    subprocess.run(["rm", "-rf", str(workdir)], check=True)  # a fresh collector state, buffer and log
    collector_args = [*DEMO_COLLECTOR_ARGS, *mode_args, f"--seed={seed}"]
    started = time.monotonic()
    trajectory = ServiceProcess("trajectory", ["--db-path", str(workdir / "trajectories.db"), "--log-format", "text"])
    trajectory.start(workdir / "trajectory").wait_ready(300)
    collector = ServiceProcess("collector", [
        "--generation-addresses", json.dumps([p.address for k, p in backends.items() if k.startswith("generation")]),
        "--reference-address", backends["reference"].address, "--reward-address", backends["reward"].address,
        "--trajectory-address", trajectory.address, "--state-dir", str(workdir / "collector"), "--log-format", "text",
        *collector_args])
    try:
        collector.start(workdir / "collector-proc").wait_ready(300)
        suite_seconds = time.monotonic() - started
        subprocess.run([sys.executable, str(ROOT / "examples" / "train_grpo.py"),
                        "--collector", collector.address, "--model-dir", str(ns.model_dir),
                        "--steps", str(ns.steps), "--seed", str(seed), "--is-correction", preset,
                        "--prompts-ahead", str(ns.prompts_ahead), "--long-tail", str(LONG_TAIL), "--push-first",
                        *joined_run(collector.address), *REGIMES[regime], "--out", str(workdir / "train")],
                       check=True, timeout=3600, preexec_fn=trainer_affinity(ns))
    finally:
        collector.stop()
        trajectory.stop()
    records = json.loads((workdir / "train" / "metrics.json").read_text())
    elapsed = 0.0
    steps = []
    for record in records:
        elapsed += record["step_seconds"]
        steps.append({**step_record(record), "elapsed_seconds": elapsed})
    return {"regime": regime, "arm": arm, "seed": seed, "preset": preset, "best": best if arm in BEST_ARMS else None,
            "collector_args": collector_args, "suite_start_seconds": suite_seconds,
            "run_seconds": time.monotonic() - started, "steps": steps}


TRAINER_CPUS = {0}
"""``--split-cpus``: the trainer's CPUs; every other CPU is the services'."""


def service_cpus() -> set[int]:
    return set(os.sched_getaffinity(0)) - TRAINER_CPUS


def trainer_affinity(ns: argparse.Namespace):
    """``preexec_fn`` of the trainer's process: on ``TRAINER_CPUS`` alone with ``--split-cpus``."""
    if not ns.split_cpus:
        return None
    return lambda: os.sched_setaffinity(0, TRAINER_CPUS)


def joined_run(collector: str) -> list[str]:
    """The trainer's ``--resume`` for a fresh collector over the seed's shared engine: the collector adopts the
    version the engine serves from the previous run (``docs/limits.md``) and would refuse a new run, so the
    trainer joins the collector's run at that version, then replaces the weights at once (``--push-first``,
    before any prompt is submitted: no batch comes from the previous run's weights)."""
    from rlfleet.client import connect

    with connect(collector) as client:
        run = client.status().run
    return ["--resume", str(run)] if run is not None and run.version > 0 else []


def arm_collector_args(arm: str, ns: argparse.Namespace) -> list[str]:
    args = list(PLAIN_ARMS[arm])
    if arm == "async-kl":
        args.append(f"--mismatch-kl-target={ns.kl_target}")
    return args


def step_record(record: dict) -> dict:
    """The trainer's metrics record, plus ``by_lag``: per version lag the tokens, their fraction of the
    step's tokens, k1 and k3 KL(behaviour || trainer), token ESS and masked fraction."""
    lags: dict[int, dict] = {}
    for key, value in record.items():
        if key.startswith("offpolicy/lag"):
            lag, name = key[len("offpolicy/lag"):].split("/", 1)
            lags.setdefault(int(lag), {})[name] = value
    total = sum(values["tokens"] for values in lags.values())
    for values in lags.values():
        values["fraction"] = values["tokens"] / total
    return {**record, "by_lag": {str(lag): lags[lag] for lag in sorted(lags)}}


def pooled(steps: list[dict], lags: str, name: str) -> float | None:
    """Token-weighted mean of ``name`` over ``steps``' lag 0 (``lags="0"``) or every lag >= 1 (``"1+"``)."""
    weighted = tokens = 0.0
    for step in steps:
        for lag, values in step["by_lag"].items():
            if (lag == "0") == (lags == "0"):
                weighted += values[name] * values["tokens"]
                tokens += values["tokens"]
    return weighted / tokens if tokens else None


def mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def median_time(values: list) -> float | None:
    """The median of times to the target (or of their ratios), a seed that never reached it (None, or an
    ``inf`` ratio) counting as slower than every one that did: left out, it would make an arm that sometimes
    never gets there look fast. None (never) when the median falls on such a seed."""
    if not values:
        return None
    middle = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(middle) else middle


def smoothed(steps: list[dict]) -> list[float]:
    """Each step's reward as the mean of it and the ``SMOOTH - 1`` before it."""
    rewards = [s["reward_mean"] for s in steps]
    return [sum(rewards[max(0, i - SMOOTH + 1):i + 1]) / len(rewards[max(0, i - SMOOTH + 1):i + 1])
            for i in range(len(rewards))]


def final_reward(run: dict) -> float:
    return mean([s["reward_mean"] for s in run["steps"][-FINAL_STEPS:]])


def target_reward(runs: list[dict]) -> float | None:
    """``TARGET_FRACTION`` of the way from the first steps' reward (every run's first ``SMOOTH`` steps, median)
    to the sync arm's final reward (median over seeds); None without a sync run."""
    sync = [final_reward(run) for run in runs if run["arm"] == "sync"]
    if not sync:
        return None
    start = median([mean([s["reward_mean"] for s in run["steps"][:SMOOTH]]) for run in runs])
    return start + TARGET_FRACTION * (median(sync) - start)


def time_to(run: dict, target: float | None) -> tuple[float | None, int | None]:
    """(seconds, step) at which the run's smoothed reward first reached ``target``; (None, None) if never."""
    if target is None:
        return None, None
    for step, reward in zip(run["steps"], smoothed(run["steps"])):
        if reward >= target:
            return step["elapsed_seconds"], step["step"]
    return None, None


def headline(runs: list[dict]) -> dict[str, dict]:
    """Per regime: the target reward and, per arm, the time and the step to it (median over seeds, and each
    seed's), the final-5-step reward (median, and each seed's), the trainer's wall time and throughput,
    k3 KL and token ESS at lag 0 and at lags >= 1 (token-weighted over every step of every seed), the lag-1
    k3 KL (one version apart: how far consecutive versions are), the fraction of tokens at lags >= 1, the mean
    staleness and the admission bound's range (``async-kl``)."""
    out = {}
    for regime in dict.fromkeys(run["regime"] for run in runs):
        regime_runs = [run for run in runs if run["regime"] == regime]
        target = target_reward(regime_runs)
        arms = {}
        for arm in dict.fromkeys(run["arm"] for run in regime_runs):
            arm_runs = sorted((run for run in regime_runs if run["arm"] == arm), key=lambda run: run["seed"])
            steps = [step for run in arm_runs for step in run["steps"]]
            reached = [time_to(run, target) for run in arm_runs]
            stale = sum(v["tokens"] for s in steps for lag, v in s["by_lag"].items() if lag != "0")
            wall = [run["steps"][-1]["elapsed_seconds"] for run in arm_runs]
            arms[arm] = {
                "seeds": [run["seed"] for run in arm_runs],
                "time_to_target": median_time([seconds for seconds, _ in reached]),
                "time_to_target_per_seed": [seconds for seconds, _ in reached],
                "step_to_target_per_seed": [step for _, step in reached],
                "final_reward": median([final_reward(run) for run in arm_runs]),
                "final_reward_per_seed": [final_reward(run) for run in arm_runs],
                "wall_seconds": median(wall),
                "tokens_per_second": median([sum(s["response_tokens"] for s in run["steps"])
                                             / run["steps"][-1]["elapsed_seconds"] for run in arm_runs]),
                "kl_k3_lag0": pooled(steps, "0", "kl_k3"), "kl_k3_lag1plus": pooled(steps, "1+", "kl_k3"),
                "kl_k3_lag1": pooled_at(steps, 1, "kl_k3"),
                "ess_token_lag1plus": pooled(steps, "1+", "ess_token"),
                "stale_token_fraction": stale / max(1, sum(s["offpolicy/tokens"] for s in steps)),
                "staleness_mean": mean([s["staleness_mean"] for s in steps]),
                "best": arm_runs[0].get("best"),
            }
        out[regime] = {"target_reward": target, "arms": arms}
    return out


def best_async(arms: dict[str, dict], among=None) -> str | None:
    """The async arm with the shortest median time to the target (ties and never-reached: final reward)."""
    candidates = [arm for arm in arms if arm != "sync" and (among is None or arm in among)]
    if not candidates:
        return None
    return min(candidates, key=lambda arm: (arms[arm]["time_to_target"] is None,
                                            arms[arm]["time_to_target"] or 0.0, -(arms[arm]["final_reward"] or 0.0)))


def time_ratio(time: float | None, base: float | None) -> float | None:
    """``time / base`` of two times to the target (None: never reached): ``inf`` when only ``base`` got there,
    0 when only ``time`` did, None when neither did (the seed tells nothing)."""
    if base is None:
        return None if time is None else 0.0
    return math.inf if time is None else time / base


def shown(ratio: float | None) -> float | str | None:
    """A ratio as the JSON keeps it: "never" for ``inf`` (JSON has no infinity)."""
    return "never" if ratio is not None and math.isinf(ratio) else ratio


def result_line(runs: list[dict], numbers: dict[str, dict]) -> dict:
    """The issue's RESULT keys (module docstring), per regime and, unprefixed, for the realistic one."""
    out = {}
    for regime, summary in numbers.items():
        arms = summary["arms"]
        best = best_async(arms)
        ratios = []
        if best and "sync" in arms:
            for seed, sync_time in zip(arms["sync"]["seeds"], arms["sync"]["time_to_target_per_seed"]):
                if seed in arms[best]["seeds"]:
                    best_time = arms[best]["time_to_target_per_seed"][arms[best]["seeds"].index(seed)]
                    ratios.append(time_ratio(best_time, sync_time))
        fixed = best_async(arms, among=[arm for arm in PLAIN_ARMS if arm.startswith("async-") and arm != "async-kl"])
        kl_time = arms.get("async-kl", {}).get("time_to_target")
        fixed_time = arms[fixed]["time_to_target"] if fixed else None
        sync_finals = arms.get("sync", {}).get("final_reward_per_seed", [])
        per_version = pooled_at([s for run in runs if run["regime"] == regime and run["arm"] != "sync"
                                 for s in run["steps"]], 1, "kl_k3")
        keys = {
            "best_async": best,
            "time_to_target_best_async_over_sync": median_time([r for r in ratios if r is not None]),
            "time_to_target_ratio_per_seed": [shown(r) for r in ratios],
            "final_reward_best_async_minus_sync": (arms[best]["final_reward"] - arms["sync"]["final_reward"]
                                                   if best and "sync" in arms else None),
            "sync_final_reward_spread": (max(sync_finals) - min(sync_finals)) if sync_finals else None,
            "divergence_bound_time_over_best_fixed": shown(time_ratio(kl_time, fixed_time) if "async-kl" in arms and fixed
                                                           else None),
            "best_fixed": fixed,
            "per_version_k3": per_version,
            "target_reward": summary["target_reward"],
        }
        out[regime] = keys
    realistic = out.get("realistic", {})
    out.update({key: realistic.get(key) for key in ("time_to_target_best_async_over_sync",
                                                    "final_reward_best_async_minus_sync",
                                                    "divergence_bound_time_over_best_fixed")})
    out["per_version_k3_realistic"] = realistic.get("per_version_k3")
    out["per_version_k3_today"] = out.get("today", {}).get("per_version_k3")
    return out


def machine() -> dict:
    """Where and at what code the experiment ran."""
    import torch
    import vllm

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git("rev-parse", "--short", "HEAD"), "git_dirty": bool(git("status", "--porcelain")),
            "nproc": os.cpu_count(), "cpu_model": cpu, "load_average_at_start": os.getloadavg(),
            "python": platform.python_version(), "torch": torch.__version__, "vllm": vllm.__version__}


def per_step_across_seeds(arm_runs: list[dict], value) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, and the mean, min and max over seeds of ``value(step)`` (None skipped) at each step."""
    steps = sorted({s["step"] for run in arm_runs for s in run["steps"]})
    means, lows, highs = [], [], []
    for index in steps:
        values = [v for run in arm_runs for s in run["steps"] if s["step"] == index
                  for v in [value(s)] if v is not None]
        means.append(sum(values) / len(values) if values else float("nan"))
        lows.append(min(values, default=float("nan")))
        highs.append(max(values, default=float("nan")))
    return steps, means, lows, highs


def lag_value(step: dict, lags: str, name: str) -> float | None:
    return pooled([step], lags, name)


def plot(runs: list[dict], numbers: dict, path: Path, title: str) -> None:
    """One regime: reward against steps and against the trainer's wall-clock seconds (mean over seeds, band
    min-max, the target dashed); the trained tokens' mean lag; k3 KL and token ESS by version lag
    (token-weighted over all steps); trained tokens per second and time to the target per arm (bars: median,
    dots: seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(dict.fromkeys(run["arm"] for run in runs))
    palette = plt.get_cmap("tab10")
    colors = {arm: palette(index) for index, arm in enumerate(ARMS)}
    fig, axes = plt.subplots(2, 4, figsize=(21, 9))
    (ax_step, ax_time, ax_lag, ax_k3), (ax_ess, ax_throughput, ax_target, ax_final) = axes
    for arm in arms:
        arm_runs = [run for run in runs if run["arm"] == arm]
        color = colors.get(arm)
        steps, means, lows, highs = per_step_across_seeds(arm_runs, lambda s: s["reward_mean"])
        ax_step.plot(steps, means, color=color, marker=".", label=arm)
        ax_step.fill_between(steps, lows, highs, color=color, alpha=0.12)
        for run in arm_runs:  # each seed against its own clock
            ax_time.plot([s["elapsed_seconds"] for s in run["steps"]], smoothed(run["steps"]), color=color,
                         alpha=0.8, label=arm if run is arm_runs[0] else None)
        steps, means, lows, highs = per_step_across_seeds(
            arm_runs, lambda s: sum(int(lag) * v["fraction"] for lag, v in s["by_lag"].items()))
        ax_lag.plot(steps, means, color=color, marker=".", label=arm)
        all_steps = [s for run in arm_runs for s in run["steps"]]
        lags = sorted({int(lag) for s in all_steps for lag in s["by_lag"]})
        for ax, name in ((ax_k3, "kl_k3"), (ax_ess, "ess_token")):
            ax.plot(lags, [pooled_at(all_steps, lag, name) for lag in lags], color=color, marker="o", label=arm)
    summary = numbers["arms"]
    for ax, key, per_seed in ((ax_throughput, "tokens_per_second", None),
                              (ax_target, "time_to_target", "time_to_target_per_seed"),
                              (ax_final, "final_reward", "final_reward_per_seed")):
        for index, arm in enumerate(arms):
            value = summary[arm][key]
            ax.bar(index, value if value is not None else 0.0, color=colors.get(arm), alpha=0.7)
            if value is None:
                ax.text(index, 0, "never", ha="center", va="bottom", fontsize=8)
            if per_seed:
                ax.plot([index] * len(summary[arm][per_seed]), [v for v in summary[arm][per_seed]],
                        "k.", markersize=6)
        ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right", fontsize=8)
    target = numbers["target_reward"]
    if target is not None:
        for ax in (ax_step, ax_time):
            ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:.2f}")
    ax_step.set(title="reward by step (mean over seeds, band: min-max)", xlabel="step", ylabel="reward")
    ax_time.set(title=f"reward ({SMOOTH}-step mean) by the trainer's wall-clock, each seed", xlabel="seconds",
                ylabel="reward")
    ax_lag.set(title="mean version lag of the trained tokens", xlabel="step", ylabel="lag (versions)")
    ax_k3.set(title="k3 KL(behaviour || trainer) by lag", xlabel="lag (versions)", ylabel="k3 KL", yscale="log")
    ax_ess.set(title="token ESS by lag", xlabel="lag (versions)", ylabel="ESS (normalised)")
    ax_throughput.set(title="trained tokens per second of the trainer's clock (median)", ylabel="tokens/s")
    ax_target.set(title="seconds to the target reward (median; dots: seeds)", ylabel="seconds")
    ax_final.set(title=f"final reward (last {FINAL_STEPS} steps; dots: seeds)", ylabel="reward")
    for ax in (ax_k3, ax_ess):
        ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in (ax_step, ax_time, ax_lag, ax_k3, ax_ess):
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def pooled_at(steps: list[dict], lag: int, name: str) -> float | None:
    """Token-weighted mean of ``name`` at exactly ``lag`` over ``steps``."""
    pairs = [(s["by_lag"][str(lag)][name], s["by_lag"][str(lag)]["tokens"]) for s in steps if str(lag) in s["by_lag"]]
    tokens = sum(t for _, t in pairs)
    return sum(v * t for v, t in pairs) / tokens if tokens else None


def run_order(arms: list[str], seed: int) -> list[str]:
    """The plain arms, then the best-arm variants (they need a best), each rotated by the seed."""
    plain = [arm for arm in arms if arm in PLAIN_ARMS]
    best = [arm for arm in arms if arm in BEST_ARMS]

    def rotated(items):
        return items[seed % len(items):] + items[:seed % len(items)] if items else items
    return rotated(plain) + rotated(best)


def main(argv: list[str] | None = None) -> None:
    today = datetime.date.today().isoformat()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="trainer steps per run (the same for every arm)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--regimes", default=",".join(REGIMES), help=f"comma-separated, of {', '.join(REGIMES)}")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--kl-target", type=float, default=0.05,
                        help="async-kl's mismatch_kl_target: the k3 KL admission keeps every lag >= 1 under")
    parser.add_argument("--prompts-ahead", type=int, default=5,
                        help="steps of prompts the trainer keeps queued (>= max_staleness lets async reach it)")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the suite's tiny model")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "offpolicy-experiment")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / f"offpolicy-experiment-{today}.json",
                        help="the result file; the plots go next to it (-REGIME.png)")
    parser.add_argument("--split-cpus", action="store_true",
                        help="the trainer on CPU 0, every service on the others (generation with hardware of its own)")
    parser.add_argument("--continue", dest="resume", action="store_true",
                        help="keep the runs --out holds (a cut-short experiment, the same settings) and run the rest")
    ns = parser.parse_args(argv)
    arms, regimes = ns.arms.split(","), ns.regimes.split(",")
    for name, chosen, known in (("arms", arms, ARMS), ("regimes", regimes, REGIMES)):
        if set(chosen) - set(known):
            parser.error(f"unknown {name} {sorted(set(chosen) - set(known))}; known: {', '.join(known)}")
    if any(arm in BEST_ARMS for arm in arms) and not any(arm.startswith("async-") for arm in arms):
        parser.error("the best+ arms need at least one async-K or async-kl arm to choose the best of")
    seeds = [int(seed) for seed in ns.seeds.split(",")]
    if ns.split_cpus:
        if not service_cpus() or not TRAINER_CPUS <= set(os.sched_getaffinity(0)):
            parser.error(f"--split-cpus needs CPU 0 and another one; this process may use {sorted(os.sched_getaffinity(0))}")
        os.sched_setaffinity(0, service_cpus())  # before any service (or thread) starts: they inherit it

    from rlfleet.services.models.tiny import build_tiny_model
    from rlfleet.services.suite import DEFAULT_MODEL_DIR, stop_suite

    ns.model_dir = build_tiny_model(ns.model_dir or DEFAULT_MODEL_DIR)
    started = time.monotonic()
    result = {"machine": machine(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "settings": {"steps": ns.steps, "seeds": seeds, "regimes": {r: REGIMES[r] for r in regimes},
                           "arms": arms, "kl_target": ns.kl_target, "collector": DEMO_COLLECTOR_ARGS,
                           "long_tail": LONG_TAIL, "prompts_ahead": ns.prompts_ahead, "final_steps": FINAL_STEPS,
                           "smooth": SMOOTH, "target_fraction": TARGET_FRACTION,
                           "cpus": ({"trainer": sorted(TRAINER_CPUS), "services": sorted(service_cpus())}
                                    if ns.split_cpus else "shared")},
              "runs": []}
    if ns.resume and ns.out.exists():
        kept = json.loads(ns.out.read_text())
        if kept["settings"] != result["settings"]:
            parser.error(f"--continue: {ns.out} was run with other settings: {kept['settings']}")
        result["runs"], result["machines"] = kept["runs"], [*kept.get("machines", [kept["machine"]])]
        result["machines"].append(result["machine"])
        started -= kept.get("wall_seconds", 0.0)
        print(f"[offpolicy] continuing {ns.out}: {len(result['runs'])} runs kept", file=sys.stderr, flush=True)
    total = len(seeds) * len(regimes) * len(arms)
    for seed in seeds:  # seed-major: a cut-short experiment still has every arm at the first seeds
        todo = [(regime, arm) for regime in regimes for arm in run_order(arms, seed)
                if not any(run["regime"] == regime and run["arm"] == arm and run["seed"] == seed
                           for run in result["runs"])]  # --continue keeps the runs done
        if not todo:
            continue
        backends = start_backends(seed, ns)
        try:
            for regime, arm in todo:
                regime_runs = [run for run in result["runs"] if run["regime"] == regime]
                best = best_async(headline(regime_runs)[regime]["arms"], among=PLAIN_ARMS) if regime_runs else None
                if arm in BEST_ARMS and best is None:
                    best = next(a for a in arms if a in PLAIN_ARMS and a != "sync")
                print(f"[offpolicy] {len(result['runs']) + 1}/{total} {regime} {arm} seed {seed}"
                      + (f" (best: {best})" if arm in BEST_ARMS else ""), file=sys.stderr, flush=True)
                run = run_arm_seed(regime, arm, seed, ns, best, backends)
                print(f"[offpolicy] {regime} {arm} seed {seed}: reward {final_reward(run):.3f} after "
                      f"{run['steps'][-1]['elapsed_seconds']:.0f} s of training ({run['run_seconds']:.0f} s with "
                      f"its collector's start)", file=sys.stderr, flush=True)
                result["runs"].append(run)
                result["headline"] = headline(result["runs"])
                result["result"] = result_line(result["runs"], result["headline"])
                result["wall_seconds"] = time.monotonic() - started
                ns.out.parent.mkdir(parents=True, exist_ok=True)
                ns.out.write_text(json.dumps(result, indent=1))  # after every run: a cut-short one keeps its results
        finally:
            stop_suite(backends)
    for regime in regimes:
        plot([run for run in result["runs"] if run["regime"] == regime], result["headline"][regime],
             ns.out.with_name(f"{ns.out.stem}-{regime}.png"),
             f"GRPO digits task, long-tailed responses, tiny model: {regime} regime ({' '.join(REGIMES[regime])}"
             + (", trainer on CPU 0, services on the others" if ns.split_cpus else "") + "), "
             f"{ns.steps} steps x seeds {ns.seeds} ({result['machine']['date'][:10]}, "
             f"{result['machine']['git_commit']})")
    print("RESULT " + json.dumps(rounded(result["result"])), flush=True)


def rounded(value):
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item) for item in value]
    return value


if __name__ == "__main__":
    main()
