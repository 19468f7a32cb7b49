"""Two runs on one fleet, each playing the other: self-play of two LoRA policies on shared replicas.

    PYTHONPATH=examples rlfleet-suite --fresh --runs 2 --environment number_duel=number_duel:NumberDuel \\
        --run-collector-arg='r0:--players={"opponent": "r1"}' \\
        --run-collector-arg='r1:--players={"opponent": "r0"}' ... \\
        --then "python examples/train_two_players.py --collectors {collectors} --model-dir {model_dir}"

(``scripts/demo --two-players`` runs exactly that.) The game is ``examples/number_duel.py``: the
episode's own policy speaks, its opponent answers, the own policy speaks again; the more digits a turn
has, the bigger its number; the reward is the digit fraction of the own turns plus a bonus for beating
the opponent's number. Run r0's collector maps the environment's ``opponent`` to run r1 and r1's to r0
(their ``players`` setting): in r0's episodes r1's current adapter plays the opponent, and the other
way round. Each run's batches carry its own episodes, its own turns trainable and the opponent's turn
as context (``masks/all_assistant_mask`` false there), so each trainer is the GRPO demo's loop
(``train_grpo.train``) on LoRA, unchanged, in a thread of its own.

Both trainers push their starting adapter (version 1) before either submits a prompt, so each run's
policy is on the replicas before the other's episodes need it. Writes ``metrics.json`` (per run, the
GRPO demo's records) and ``metrics.png`` (both runs' mean reward per step) to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import threading
from pathlib import Path

import torch

from train_grpo import first_and_last, lora_policy, prepare_run, push_policy, train, training_parser  # examples/ is sys.path[0]

PROMPT = [{"role": "user", "content": "number duel: say a number, bigger than your opponent's"}]
ENVIRONMENT = "number_duel"


def duel_prompts(count: int) -> list[dict]:
    """``count`` episodes' prompts: rewarded by the game alone (``reward_fn`` none)."""
    return [{"prompt": PROMPT, "environment": ENVIRONMENT, "reward_fn": "none"} for _ in range(count)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = training_parser(__doc__.splitlines()[0], steps=30, groups_per_step=8, group_size=4, lr=5e-4,
                             kl_coef=0.0, out=Path("runs") / "two_players")
    parser.add_argument("--collectors", required=True,
                        help="the two runs' collectors, comma-separated (rlfleet-suite's {collectors})")
    parser.add_argument("--lora", type=int, default=8, metavar="RANK", help="each run's LoRA adapter rank")
    parser.set_defaults(collector="")
    ns = parser.parse_args(["--collector", "", *(argv if argv is not None else sys.argv[1:])])
    ns.collectors = ns.collectors.split(",")
    if len(ns.collectors) != 2:
        parser.error(f"--collectors: two runs' collectors, got {len(ns.collectors)}")
    ns.lora_alpha = 2.0 * ns.lora
    return ns


def play(index: int, ns: argparse.Namespace, pushed_first: threading.Barrier, results: dict) -> None:
    """Run ``index``'s trainer: its LoRA adapter pushed, then, once the other's is too, the GRPO loop."""
    from transformers import AutoModelForCausalLM  # imported by main first: imports in threads race

    from rlfleet.client import connect, credentials_from

    ns = copy.copy(ns)
    ns.out = ns.out / f"r{index}"
    ns.out.mkdir(parents=True, exist_ok=True)
    model = lora_policy(AutoModelForCausalLM.from_pretrained(ns.model_dir, torch_dtype=torch.float32),
                        ns.lora, ns.lora_alpha)
    model.train()
    secrets = {} if ns.credentials is None else credentials_from(ns.credentials, run=f"r{index}")
    try:
        with connect(ns.collectors[index], run="new", **secrets) as client:
            client.wait_ready(timeout=300)
            pushed = push_policy(client, model, ns)
            print(f"[two-players] run r{index}: {client.run.run_id}, its adapter at version {pushed.version}",
                  file=sys.stderr)
            pushed_first.wait(timeout=600)
            results[index] = train(client, model, ns, duel_prompts)
    except BaseException as exc:
        pushed_first.abort()
        results[index] = exc
        raise


def plot(runs: dict[int, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for index, metrics in sorted(runs.items()):
        ax.plot([m["step"] for m in metrics], [m["reward_mean"] for m in metrics], marker=".",
                label=f"run r{index} (opponent: r{1 - index})")
    ax.set_xlabel("step (= the run's policy version pushed)")
    ax.set_ylabel("mean episode reward")
    ax.set_title("number duel: two runs on one fleet, each the other's opponent")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ns = parse_args(argv)
    prepare_run(ns)
    import peft  # noqa: F401 - what the threads use, imported once here (lazy imports race in threads)
    import tqdm  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    import rlfleet.client  # noqa: F401
    pushed_first = threading.Barrier(2)
    results: dict[int, list[dict] | BaseException] = {}
    threads = [threading.Thread(target=play, args=(i, ns, pushed_first, results), name=f"r{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = {i: r for i, r in results.items() if isinstance(r, BaseException)}
    if failed or len(results) != 2:
        sys.exit(f"[two-players] a trainer failed: {failed or 'no result'}")
    (ns.out / "metrics.json").write_text(json.dumps({f"r{i}": m for i, m in sorted(results.items())}, indent=1))
    plot(results, ns.out / "metrics.png")
    for index, metrics in sorted(results.items()):
        first, last = first_and_last(metrics, "reward_mean")
        print(f"[two-players] run r{index}: reward {first:.3f} (first 5 steps) -> {last:.3f} (last 5)", file=sys.stderr)
    print(f"[two-players] metrics in {ns.out / 'metrics.json'}, plot in {ns.out / 'metrics.png'}", file=sys.stderr)
    return {f"r{i}": m for i, m in results.items()}


if __name__ == "__main__":
    main()
