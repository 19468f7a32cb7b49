"""TorchRL's GRPO recipe (sota-implementations/grpo/grpo-sync.py, torchrl 0.14) with rlfleet as the collector.

    python examples/train_torchrl.py --collector 127.0.0.1:50050 --model-dir ~/.cache/rlfleet/tiny-model

Everything TorchRL's recipe builds is built here the same way — a ``TransformersWrapper``
training policy, ``GRPOLoss``, a ``LazyStackStorage`` replay buffer with ``MCAdvantage`` on
write, a ``DataLoadingPrimer`` over the prompts, a weight-sync sender registered with the HF
model and the collector, ``GRPOTrainer`` — except two lines: the collector is
``RlfleetLLMCollector`` (generation, reference, rewards run as rlfleet services) instead of
``RayLLMCollector`` over a vLLM engine, and the scheme is ``RlfleetWeightSyncScheme`` instead of
``VLLMWeightSyncScheme``. No batch is converted: the loss and MCAdvantage read rlfleet's batches
as they come. The task is the plain demo's (answer in digits; reward = digit fraction).

Writes ``metrics.json`` and ``metrics.png`` (reward per step, step time) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

TASK_WORDS = "seven three nine two one eight five four six zero".split()


def task_dataset(count: int, seed: int) -> list[dict]:
    """Rows as a HF dataset's would be after TorchRL's collate: a ``query`` per row."""
    rng = random.Random(seed)
    return [{"query": "answer in digits: " + " ".join(rng.choice(TASK_WORDS) for _ in range(rng.randint(2, 4)))}
            for _ in range(count)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collector", required=True, help="collector address host:port")
    parser.add_argument("--model-dir", required=True, help="the same weights the generation replicas serve")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--groups-per-step", type=int, default=8, help="must match the collector's groups_per_step")
    parser.add_argument("--group-size", type=int, default=4, help="must match the collector's group_size")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--kl-to-ref-coeff", type=float, default=0.05)
    parser.add_argument("--entropy-coeff", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--is-correction", default=None, metavar="PRESET",
                        help="decoupled PPO with this importance-sampling correction (rlfleet.client.offpolicy: none, "
                             "token_tis, seq_tis, seq_mis, geo_mis, icepop) through rlfleet's CorrectedGRPOLoss; its "
                             "offpolicy/* metrics join the loss output. Default: TorchRL's GRPOLoss as it is")
    parser.add_argument("--out", type=Path, default=Path("runs") / "torchrl")
    ns = parser.parse_args(argv)

    from tensordict import set_list_to_stack
    from torch.utils.data import DataLoader
    from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement
    from torchrl.envs.llm.transforms import DataLoadingPrimer
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss, MCAdvantage
    from torchrl.trainers.algorithms.grpo import GRPOTrainer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfleet.client.torchrl import RlfleetLLMCollector, RlfleetWeightSyncScheme

    set_list_to_stack(True).set()
    torch.manual_seed(ns.seed)
    ns.out.mkdir(parents=True, exist_ok=True)
    turns_per_batch = ns.groups_per_step * ns.group_size

    # Training policy (grpo_utils.get_train_model): the HF model in a tokens-mode wrapper, eval().
    tokenizer = AutoTokenizer.from_pretrained(ns.model_dir)
    train_model = AutoModelForCausalLM.from_pretrained(ns.model_dir, dtype=torch.float32).eval()
    policy_training = TransformersWrapper(train_model, tokenizer=tokenizer, input_mode="tokens", generate=False,
                                          return_log_probs=True, pad_output=False)

    # Prompts and replay buffer (grpo-sync.py: DataLoadingPrimer inside the env; LazyStackStorage + MCAdvantage).
    dataloader = DataLoader(task_dataset(512, ns.seed), batch_size=ns.groups_per_step, shuffle=True)
    primer = DataLoadingPrimer(dataloader=dataloader, repeats=ns.group_size)
    replay_buffer = ReplayBuffer(storage=LazyStackStorage(turns_per_batch), sampler=SamplerWithoutReplacement(),
                                 transform=MCAdvantage(grpo_size=ns.group_size), batch_size=turns_per_batch)

    # The one swap: rlfleet's collector instead of RayLLMCollector(env=..., policy=vLLMWrapper(engine)).
    collector = RlfleetLLMCollector(ns.collector, dialog_turns_per_batch=turns_per_batch,
                                    total_dialog_turns=ns.steps * turns_per_batch, replay_buffer=replay_buffer,
                                    prompts=primer, reward_fn="char_fraction", reward_args={"pattern": "[0-9]"})
    collector.client.wait_ready(timeout=300)

    loss_options = dict(actor_network=policy_training, kl_to_ref_coeff=ns.kl_to_ref_coeff,
                        entropy_coeff=ns.entropy_coeff, masking_strategy="sft")
    if ns.is_correction is None:
        loss_fn = GRPOLoss(**loss_options)
    else:  # the trainer holds the weights it pushed last (the first push is below)
        from rlfleet.client.torchrl import CorrectedGRPOLoss

        loss_fn = CorrectedGRPOLoss(correction=ns.is_correction, trainer_version=lambda: collector.last_push.version,
                                    **loss_options)

    # ... and rlfleet's scheme instead of VLLMWeightSyncScheme; wired exactly as the recipe wires it.
    sender = RlfleetWeightSyncScheme(collector).create_sender()
    sender.register_model(policy_training.model)
    sender.init_all_workers_group(None)
    sender.register_collector(collector)
    sender.update_weights()

    optimizer = torch.optim.Adam(policy_training.parameters(), lr=ns.lr, fused=False)
    trainer = GRPOTrainer(
        collector=collector, total_frames=ns.steps * turns_per_batch, frame_skip=1, optim_steps_per_batch=None,
        loss_module=loss_fn, optimizer=optimizer, weight_sync_sender=sender, weight_update_frequency=1,
        empty_replay_buffer_on_weight_update=True, replay_buffer=replay_buffer, num_epochs=1,
        async_collection=False, progress_bar=False, log_rewards=False, log_kl=False, clip_norm=1.0)

    metrics: list[dict] = []
    step = {"started": time.monotonic(), "loss": [], "reward": []}

    def record_batch(batch):  # process_optim_batch: the sampled replay-buffer batch, as the loss sees it
        step["reward"].append(batch.get(("next", "reward"), as_padded_tensor=True).float().mean().item())
        step["versions"] = sorted({int(v) for v in batch.get("policy_version").tolist()})
        return batch

    def record_loss(optim_steps, average_losses):  # post_optim_complete_log: the epoch's mean losses
        step["loss"].append(float(sum(v for k, v in average_losses.items() if k.startswith("loss_"))))
        step["kl_to_ref"] = float(average_losses.get("kl_to_ref", torch.tensor(float("nan"))))

    def end_step():  # post_steps, after the weight push (UpdateWeights registered first)
        now = time.monotonic()
        record = {"step": len(metrics), "reward_mean": sum(step["reward"]) / len(step["reward"]),
                  "loss": sum(step["loss"]) / len(step["loss"]), "kl_to_ref": step["kl_to_ref"],
                  "batch_policy_versions": step["versions"], "policy_version": collector.last_push.version,
                  "push_seconds": collector.last_push.seconds, "push_transport": collector.last_push.transport,
                  "step_seconds": now - step["started"]}
        metrics.append(record)
        print(f"step {record['step']:3d}  v{record['policy_version']:<4d} reward {record['reward_mean']:.3f}  "
              f"loss {record['loss']:+.4f}  kl {record['kl_to_ref']:.4f}  step {record['step_seconds']:.2f} s  "
              f"push {record['push_seconds'] * 1e3:.0f} ms over {record['push_transport']}", file=sys.stderr)
        step.update(started=now, loss=[], reward=[])

    trainer.register_op("process_optim_batch", record_batch)
    trainer.register_op("post_optim_complete_log", record_loss)
    trainer.register_op("post_steps", end_step)
    trainer.train()

    (ns.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    plot(metrics, ns.out / "metrics.png")
    first = sum(m["reward_mean"] for m in metrics[:5]) / max(1, len(metrics[:5]))
    last = sum(m["reward_mean"] for m in metrics[-5:]) / max(1, len(metrics[-5:]))
    seconds = sorted(m["step_seconds"] for m in metrics[1:]) or [float("nan")]
    print(f"[torchrl] reward {first:.3f} (first 5 steps) -> {last:.3f} (last 5); median step "
          f"{seconds[len(seconds) // 2]:.2f} s; metrics in {ns.out / 'metrics.json'}", file=sys.stderr)
    return {"metrics": metrics}


def plot(metrics: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, (ax_reward, ax_time) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_reward.plot(steps, [m["reward_mean"] for m in metrics], marker=".")
    ax_reward.set_ylabel("reward (digit fraction)")
    ax_reward.set_title("TorchRL GRPOTrainer + GRPOLoss on rlfleet")
    ax_reward.grid(alpha=0.3)
    ax_time.plot(steps, [m["step_seconds"] for m in metrics], color="tab:green", marker=".")
    ax_time.set_ylabel("step time (s)")
    ax_time.set_xlabel("step (= policy version pushed)")
    ax_time.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
