"""The GRPO demo on- and off-policy, with and without importance-sampling correction.

    .venv/bin/python bench/offpolicy_experiment.py [--steps 30] [--seeds 0,1,2]
        [--arms sync,async,async+tis,async+mis] [--prompts-ahead 5]

Runs the digits-only task of ``examples/train_grpo.py`` on the tiny local model against the whole suite
(the processes ``scripts/demo`` starts, through ``rlfleet.services.suite.start_suite``), one fresh suite
per arm and seed (its own work directory: trajectory buffer, collector state, engine), so no two runs
share state. The collector keeps scripts/demo's settings (groups of 4, 8 groups per step, 24 tokens at
temperature 1, reward ``char_fraction``) except the mode:

- ``sync``: ``--mode sync`` (on-policy);
- ``async``: ``--mode async --max-staleness 4``, preset ``none`` (no correction; the mismatch is measured);
- ``async+tis``: the same, preset ``token_tis`` (token ratio truncated at 2);
- ``async+mis``: the same, preset ``seq_mis`` (a sequence whose ratio exceeds 2 is dropped).

Every arm runs the trainer with ``--is-correction PRESET`` (``none`` for sync and async), so every step
records the mismatch per version lag (``offpolicy/lagN/...``); the trainer pushes its weights every step.
``--prompts-ahead`` keeps that many steps of prompts queued at the collector (the trainer's
``--prompts-ahead``): with the demo's one step ahead, generation could not run as far ahead as
``max_staleness`` allows. The seed varies the trainer (``--seed``: its torch seed and its
prompts), the generation engine's sampling seed and the collector's.

Writes one JSON file (machine, commit, settings, every per-step metric of every run, the headline numbers)
and one PNG, and prints ``RESULT {json}`` with the headline numbers per arm last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_COLLECTOR_ARGS = ["--group-size=4", "--groups-per-step=8", '--sampling={"temperature": 1.0, "max_tokens": 24}',
                       "--reward-fn=char_fraction"]
"""scripts/demo's collector settings, less the mode."""
ASYNC = ["--mode=async", "--max-staleness=4"]
ARMS: dict[str, tuple[list[str], str]] = {
    "sync": (["--mode=sync"], "none"),
    "async": (ASYNC, "none"),
    "async+tis": (ASYNC, "token_tis"),
    "async+mis": (ASYNC, "seq_mis"),
}
"""Arm name -> (collector mode flags, the trainer's ``--is-correction`` preset)."""
FINAL_STEPS = 5
REWARD_REACHED = 0.9
"""The reward level whose first step is reported (the task saturates near 1)."""


def run_arm_seed(arm: str, seed: int, ns: argparse.Namespace) -> dict:
    """One fresh suite, one training run of ``ns.steps`` steps; its per-step metrics."""
    from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite

    mode_args, preset = ARMS[arm]
    workdir = ns.workdir / f"{arm}-seed{seed}"
    subprocess.run(["rm", "-rf", str(workdir)], check=True)  # a fresh collector state, buffer and log
    options = SuiteOptions(model_dir=ns.model_dir, collector_args=[*DEMO_COLLECTOR_ARGS, *mode_args, f"--seed={seed}"],
                           generation_args=["--seed", str(seed)])
    started = time.monotonic()
    procs = start_suite(options, workdir / "suite")
    suite_seconds = time.monotonic() - started
    try:
        subprocess.run([sys.executable, str(ROOT / "examples" / "train_grpo.py"),
                        "--collector", procs["collector"].address, "--model-dir", str(ns.model_dir),
                        "--steps", str(ns.steps), "--seed", str(seed), "--is-correction", preset,
                        "--prompts-ahead", str(ns.prompts_ahead), "--out", str(workdir / "train")],
                       check=True, timeout=3600)
    finally:
        stop_suite(procs)
    records = json.loads((workdir / "train" / "metrics.json").read_text())
    return {"arm": arm, "seed": seed, "preset": preset, "collector_args": options.collector_args,
            "suite_start_seconds": suite_seconds, "run_seconds": time.monotonic() - started,
            "steps": [step_record(record) for record in records]}


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


def headline(runs: list[dict]) -> dict[str, dict]:
    """Per arm: the final-5-step mean reward (mean over seeds, with each seed's), the mean reward over all
    steps, the first step whose reward reached 0.9 (mean over the seeds that reached it), k3 KL and token ESS at lag 0
    and at lags >= 1 (token-weighted over every step of every seed), the batch's token ESS (mean over steps),
    the fraction of tokens at lags >= 1 and the mean staleness."""
    out = {}
    for arm in dict.fromkeys(run["arm"] for run in runs):
        arm_runs = [run for run in runs if run["arm"] == arm]
        steps = [step for run in arm_runs for step in run["steps"]]
        finals = [mean([s["reward_mean"] for s in run["steps"][-FINAL_STEPS:]]) for run in arm_runs]
        reached = [next((s["step"] for s in run["steps"] if s["reward_mean"] >= REWARD_REACHED), None)
                   for run in arm_runs]
        stale = sum(v["tokens"] for s in steps for lag, v in s["by_lag"].items() if lag != "0")
        out[arm] = {
            "final_reward": mean(finals), "final_reward_per_seed": finals,
            "mean_reward_all_steps": mean([s["reward_mean"] for s in steps]),
            "first_step_reward_ge_0.9": mean(reached), "first_step_reward_ge_0.9_per_seed": reached,
            "kl_k3_lag0": pooled(steps, "0", "kl_k3"), "kl_k3_lag1plus": pooled(steps, "1+", "kl_k3"),
            "ess_token": mean([s.get("offpolicy/ess_token") for s in steps]),
            "ess_token_lag0": pooled(steps, "0", "ess_token"), "ess_token_lag1plus": pooled(steps, "1+", "ess_token"),
            "stale_token_fraction": stale / sum(s["offpolicy/tokens"] for s in steps),
            "staleness_mean": mean([s["staleness_mean"] for s in steps]),
            "kl_to_reference_final": mean([mean([s["kl"] for s in run["steps"][-FINAL_STEPS:]]) for run in arm_runs]),
            "step_seconds": mean([s["step_seconds"] for s in steps]),
            "seeds": len(arm_runs),
        }
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


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Reward and KL to the reference per step (mean over seeds, min-max band); the trained tokens' mean lag;
    k3 KL and token ESS at lag 0 and at lags >= 1 per step; k3 KL against the lag."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(dict.fromkeys(run["arm"] for run in runs))
    colors = dict(zip(ARMS, ["tab:blue", "tab:orange", "tab:green", "tab:red"]))
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    (ax_reward, ax_ref, ax_share), (ax_k3, ax_ess, ax_lag) = axes
    for arm in arms:
        arm_runs = [run for run in runs if run["arm"] == arm]
        color = colors.get(arm)
        for ax, key in ((ax_reward, "reward_mean"), (ax_ref, "kl")):
            steps, means, lows, highs = per_step_across_seeds(arm_runs, lambda s, key=key: s[key])
            ax.plot(steps, means, color=color, marker=".", label=arm)
            ax.fill_between(steps, lows, highs, color=color, alpha=0.15)
        for ax, name in ((ax_k3, "kl_k3"), (ax_ess, "ess_token")):
            for lags, style in (("0", ":"), ("1+", "-")):
                steps, means, _, _ = per_step_across_seeds(arm_runs, lambda s, n=name, l=lags: lag_value(s, l, n))
                if all(value != value for value in means):  # no token at these lags (sync: none stale)
                    continue
                ax.plot(steps, means, color=color, linestyle=style, marker=".", label=f"{arm}, lag {lags}")
        steps, means, lows, highs = per_step_across_seeds(
            arm_runs, lambda s: sum(int(lag) * v["fraction"] for lag, v in s["by_lag"].items()))
        ax_share.plot(steps, means, color=color, marker=".", label=arm)
        ax_share.fill_between(steps, lows, highs, color=color, alpha=0.15)
        all_steps = [s for run in arm_runs for s in run["steps"]]
        lags = sorted({int(lag) for s in all_steps for lag in s["by_lag"]})
        k3 = [pooled_at(all_steps, lag, "kl_k3") for lag in lags]
        ax_lag.plot(lags, k3, color=color, marker="o", label=arm)
    ax_reward.set(title="mean reward (mean over seeds, band: min-max)", ylabel="reward (digit fraction)")
    ax_ref.set(title="KL(trainer || reference), k3 (mean, min-max)", ylabel="KL")
    ax_share.set(title="mean version lag of trained tokens (min-max)", ylabel="lag (versions)")
    ax_k3.set(title="k3 KL(behaviour || trainer): lag 0 dotted, lag >= 1 solid", ylabel="k3 KL", yscale="log")
    ax_ess.set(title="token ESS: lag 0 dotted, lag >= 1 solid", ylabel="ESS (normalised)")
    ax_lag.set(title="k3 KL by version lag (token-weighted over all steps)", xlabel="lag (versions)",
               ylabel="k3 KL", yscale="log")
    ax_lag.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        if ax is not ax_lag:
            ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def pooled_at(steps: list[dict], lag: int, name: str) -> float | None:
    """Token-weighted mean of ``name`` at exactly ``lag`` over ``steps``."""
    pairs = [(s["by_lag"][str(lag)][name], s["by_lag"][str(lag)]["tokens"]) for s in steps if str(lag) in s["by_lag"]]
    tokens = sum(t for _, t in pairs)
    return sum(v * t for v, t in pairs) / tokens if tokens else None


def main(argv: list[str] | None = None) -> None:
    today = datetime.date.today().isoformat()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="trainer steps per run (the same for every arm)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--prompts-ahead", type=int, default=5,
                        help="steps of prompts the trainer keeps queued (>= max_staleness lets async reach it)")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the suite's tiny model")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "offpolicy-experiment")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / f"offpolicy-experiment-{today}.json",
                        help="the result file; the plot goes next to it (.png)")
    ns = parser.parse_args(argv)
    arms = ns.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
    seeds = [int(seed) for seed in ns.seeds.split(",")]

    from rlfleet.services.suite import DEFAULT_MODEL_DIR
    from rlfleet.services.models.tiny import build_tiny_model

    ns.model_dir = build_tiny_model(ns.model_dir or DEFAULT_MODEL_DIR)
    started = time.monotonic()
    result = {"machine": machine(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "settings": {"steps": ns.steps, "seeds": seeds, "arms": {arm: {"collector": [*DEMO_COLLECTOR_ARGS,
                           *ARMS[arm][0]], "is_correction": ARMS[arm][1]} for arm in arms},
                           "prompts_ahead": ns.prompts_ahead, "final_steps": FINAL_STEPS},
              "runs": []}
    for seed in seeds:  # seed-major: a cut-short experiment still has every arm at the first seeds
        for arm in arms:
            print(f"[offpolicy] {arm} seed {seed}: {ns.steps} steps", file=sys.stderr, flush=True)
            run = run_arm_seed(arm, seed, ns)
            print(f"[offpolicy] {arm} seed {seed}: {run['run_seconds']:.0f} s (suite start "
                  f"{run['suite_start_seconds']:.0f} s)", file=sys.stderr, flush=True)
            result["runs"].append(run)
            result["headline"] = headline(result["runs"])
            result["wall_seconds"] = time.monotonic() - started
            ns.out.parent.mkdir(parents=True, exist_ok=True)
            ns.out.write_text(json.dumps(result, indent=1))  # after every run: a cut-short one keeps its results
    plot(result["runs"], ns.out.with_suffix(".png"),
         f"GRPO digits task, tiny model, {ns.steps} steps x seeds {ns.seeds} ({result['machine']['date'][:10]}, "
         f"{result['machine']['git_commit']})")
    print("RESULT " + json.dumps({arm: {key: (float(f"{value:.4g}") if isinstance(value, float) else value)
                                        for key, value in numbers.items() if key != "final_reward_per_seed"}
                                  for arm, numbers in result["headline"].items()}), flush=True)


if __name__ == "__main__":
    main()
