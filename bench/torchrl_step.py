"""Step time of TorchRL's GRPO recipe on rlfleet against the plain SDK demo.

TorchRL's recipe is ``examples/train_torchrl.py``, the plain SDK demo ``examples/train_grpo.py``.

    .venv/bin/python bench/torchrl_step.py [--rounds 2] [--steps 10]

Both trainers run the demo's task and collector settings (sync, 8 groups of 4 per step, 24 tokens,
``char_fraction``) against a fresh suite each (so each starts from the tiny model's own weights),
alternating ``--rounds`` times. A step is one batch collected, one optimizer step, one weight push:
the plain demo times it from its prompt submit to its push's reply; the recipe between
GRPOTrainer's ``post_steps`` hooks. Step 0 (the engine's first batch) is left out; each run's median
step time counts, and ratio = recipe / plain per round, median over rounds (1.0 = the TorchRL stack
costs nothing over hand-written code). The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlfleet.services.models.tiny import build_tiny_model  # noqa: E402
from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite  # noqa: E402

COLLECTOR_ARGS = ["--mode=sync", "--group-size=4", "--groups-per-step=8",
                  '--sampling={"temperature": 1.0, "max_tokens": 24}', "--reward-fn=char_fraction"]
TRAINERS = {"plain SDK (train_grpo.py)": "train_grpo.py", "TorchRL recipe (train_torchrl.py)": "train_torchrl.py"}


def run_trainer(script: str, steps: int, model_dir: Path, work: Path) -> list[dict]:
    procs = start_suite(SuiteOptions(model_dir=model_dir, collector_args=COLLECTOR_ARGS), work / "suite")
    try:
        out = work / "out"
        subprocess.run([sys.executable, str(ROOT / "examples" / script), "--collector", procs["collector"].address,
                        "--model-dir", str(model_dir), "--steps", str(steps), "--out", str(out)],
                       check=True, timeout=1800, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads((out / "metrics.json").read_text())
    finally:
        stop_suite(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-torchrl-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model")
        medians: dict[str, list[float]] = {name: [] for name in TRAINERS}
        rewards: dict[str, list[float]] = {name: [] for name in TRAINERS}
        for round_index in range(ns.rounds):
            for name, script in TRAINERS.items():
                metrics = run_trainer(script, ns.steps, model_dir, Path(tmp) / f"{round_index}-{script}")
                medians[name].append(statistics.median(m["step_seconds"] for m in metrics[1:]))
                rewards[name].append(statistics.mean(m["reward_mean"] for m in metrics[-3:]))
                print(f"round {round_index}: {name:34s} median step {medians[name][-1]:.2f} s, "
                      f"reward (last 3) {rewards[name][-1]:.2f}", file=sys.stderr)
    plain, recipe = TRAINERS
    ratios = [r / p for r, p in zip(medians[recipe], medians[plain])]
    print("\n| trainer | median step (s), per round | reward, last 3 steps |\n|---|---|---|")
    for name in TRAINERS:
        print(f"| {name} | {', '.join(f'{s:.2f}' for s in medians[name])} | "
              f"{', '.join(f'{r:.2f}' for r in rewards[name])} |")
    print(f"\nrecipe / plain step time: {', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})")
    print("RESULT " + json.dumps({"torchrl_vs_plain_step_time": round(statistics.median(ratios), 4),
                                  "plain_step_seconds": round(statistics.median(medians[plain]), 4),
                                  "torchrl_step_seconds": round(statistics.median(medians[recipe]), 4)}))


if __name__ == "__main__":
    main()
