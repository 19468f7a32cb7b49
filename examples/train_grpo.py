"""A GRPO training run against rlfleet, in plain PyTorch.

    python examples/train_grpo.py --collector 127.0.0.1:50050 --model-dir ~/.cache/rlfleet/tiny-model

The trainer owns only the optimisation: every step it submits prompts, pulls
one batch of scored GRPO groups from the collector, takes a clipped
policy-gradient step with the behaviour log-probs as the old policy (plus an
optional k3 KL term to the reference), and pushes its new weights back. The
task is verifiable and dense enough for a random tiny model to learn on CPU
in minutes: answer with digits only (reward = fraction of the response's
characters that are digits, the reward service's ``char_fraction``).

With ``--lora RANK`` the policy is wrapped in a peft LoRA adapter on every linear projection, only
the adapter is trained, and each step pushes only the adapter (``push_adapter``): the generation
replicas, started with the generation setting ``max_lora_rank`` >= RANK, serve their weights plus it.

Writes ``metrics.json`` and ``metrics.png`` (reward and KL per step) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Callable

import torch

TASK_WORDS = "seven three nine two one eight five four six zero".split()
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""``--lora``: every linear projection of a Qwen2/Llama decoder layer."""


def task_prompts(count: int, rng: random.Random, long_tail: int | None = None) -> list[dict]:
    """Prompts of the digits-only task (the reward function needs no ground truth). With ``long_tail`` each
    prompt's response budget is drawn from ``response_budget``: a long tail of response lengths."""
    prompts = []
    for _ in range(count):
        words = " ".join(rng.choice(TASK_WORDS) for _ in range(rng.randint(2, 4)))
        prompt = {"prompt": [{"role": "user", "content": f"answer in digits: {words}"}],
                  "reward_fn": "char_fraction", "reward_args": {"pattern": "[0-9]"}}
        if long_tail:
            prompt["sampling"] = {"max_tokens": response_budget(rng, long_tail)}
        prompts.append(prompt)
    return prompts


def response_budget(rng: random.Random, longest: int, shortest: int = 16) -> int:
    """A response budget with a heavy tail, as reasoning lengths have: Pareto with shape 1.5 from ``shortest``
    tokens, capped at ``longest`` (median ~25 tokens; about 1 prompt in 16 gets 4x that or more). The tiny
    model rarely samples EOS, so its responses run to their budget: a step's slowest group is its straggler."""
    return min(longest, int(shortest * rng.paretovariate(1.5)))


def response_log_probs(model, batch, temperature: torch.Tensor) -> torch.Tensor:
    """Current-policy log-probs of every response token, flat in the batch's ragged order."""
    full, attention = batch.padded("tokens/full")
    assistant, _ = batch.padded("masks/all_assistant_mask", pad_value=False)
    logits = model(input_ids=full, attention_mask=attention.long()).logits[:, :-1].float()
    logits = logits / temperature.view(-1, 1, 1)
    token_log_probs = torch.log_softmax(logits, -1).gather(-1, full[:, 1:, None])[..., 0]
    # Position t predicts token t+1: the response tokens are where the shifted assistant mask is set.
    return token_log_probs[assistant[:, 1:]]


def sampled_response_mask(batch) -> torch.Tensor:
    """Flat over the response tokens in the batch's ragged order: True where the model sampled the token
    (every token of a single turn; False over an episode's observation tokens, which are not trained on)."""
    assistant = batch.ragged("masks/all_assistant_mask").to_list()
    prompt_lengths = batch.ragged("tokens/prompt").lengths.tolist()
    return torch.cat([mask[length:] for mask, length in zip(assistant, prompt_lengths)])


def grpo_step(model, optimizer, batch, *, clip_eps: float, kl_coef: float, is_correction: str | None = None,
              trainer_version: int = 0, minibatches: int = 1) -> dict[str, float]:
    """Clipped policy-gradient steps on ``batch``: ``minibatches`` optimizer steps, each on its share of the
    batch's samples (PPO's minibatches: from the second on the weights have moved, so the clip acts). Without
    ``is_correction`` the behaviour log-probs are the old policy (PPO's ratio is trainer over behaviour,
    clipped: stale tokens mostly fall outside the clip). With a preset of ``rlfleet.client.offpolicy`` it is
    decoupled PPO: the ratio is taken to the trainer's own weights before the step (the proximal policy, 1
    at the first minibatch), and the mismatch between the proximal policy and the behaviour is corrected by
    the preset's importance weights instead. Metrics are the first minibatch's (the weights before the step)."""
    parts = []
    proximal = None
    for index in range(minibatches):
        part = _policy_step(model, optimizer, batch, clip_eps=clip_eps, kl_coef=kl_coef, is_correction=is_correction,
                            trainer_version=trainer_version, proximal=proximal, share=(index, minibatches))
        proximal = part.pop("proximal")
        parts.append(part)
    budgets = batch["sampling", "max_tokens"]
    return {**parts[0], "clip_fraction": sum(part["clip_fraction"] for part in parts) / len(parts),
            "minibatches": minibatches, "response_budget_min": int(budgets.min()),
            "response_budget_max": int(budgets.max())}


def _policy_step(model, optimizer, batch, *, clip_eps, kl_coef, is_correction, trainer_version, proximal,
                 share: tuple[int, int]) -> dict:
    """One optimizer step on the samples ``share`` = (k, K) selects (sample i when i % K == k); its
    ``clip_fraction`` is of its own tokens."""
    sampled = sampled_response_mask(batch)
    behavior = batch.ragged("log_probs/response").values[sampled]
    reference = batch.ragged("ref_log_probs/response").values[sampled]
    lengths = batch.ragged("tokens/response").lengths
    sample_of_token = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[sampled]
    advantages = batch["advantage"].float()[sample_of_token]
    temperature = batch["sampling", "temperature"].float()

    new = response_log_probs(model, batch, temperature)
    proximal = new.detach() if proximal is None else proximal  # the trainer's weights before the step
    mismatch = (proximal - behavior).abs()
    weights, offpolicy, by_lag = torch.ones_like(new), {}, None
    if is_correction is None:
        ratio = torch.exp(new - behavior)
    else:
        ratio = torch.exp(new - proximal)
        weights, offpolicy, by_lag = correction_weights(proximal, behavior, sample_of_token, len(lengths),
                                                        is_correction, token_versions(batch)[sampled], trainer_version)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages) * weights
    log_ratio_ref = reference - new
    kl = torch.expm1(log_ratio_ref) - log_ratio_ref  # k3 estimator of KL(policy || reference)
    index, count = share
    mine = (sample_of_token % count == index).float()  # this minibatch's tokens; 1 everywhere when count is 1
    tokens = mine.sum().clamp(min=1)
    loss = -(surrogate * mine).sum() / tokens + kl_coef * (kl * mine).sum() / tokens
    clipped = ((ratio - 1).abs() > clip_eps).float()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {"loss": loss.item(), "kl": kl.mean().item(), "logprob_mismatch_max": mismatch.max().item(),
            "logprob_mismatch_mean": mismatch.mean().item(), "response_tokens": int(sampled.sum()),
            "clip_fraction": ((clipped * mine).sum() / tokens).item(), "proximal": proximal,
            "by_lag": by_lag, **offpolicy}


def token_versions(batch) -> torch.Tensor:
    """The policy version that sampled each response token, flat in the batch's ragged order: the batch's
    ``versions/response``; from a collector older than that key, each sample's start version (exact unless
    a keep-mode push landed mid-sample)."""
    if ("versions", "response") in batch.td.keys(include_nested=True):
        return batch.ragged("versions/response").values
    lengths = batch.ragged("tokens/response").lengths
    return torch.repeat_interleave(batch["policy_version_start"].long(), lengths)


def correction_weights(new, behavior, sample_of_token, samples: int, preset: str, versions, trainer_version: int):
    """``rlfleet.client.offpolicy``'s weights for flat tokens (padded per sample for it, flattened back),
    its metrics, flat (``offpolicy/kl_k3``, ``offpolicy/lag1/ess_token``, ...), and per lag (what the
    collector is told: ``report_mismatch``)."""
    from rlfleet.client.offpolicy import importance_weights

    counts = torch.bincount(sample_of_token, minlength=samples).tolist()

    def padded(values):
        return torch.nn.utils.rnn.pad_sequence(list(values.split(counts)), batch_first=True)

    mask = padded(torch.ones_like(behavior, dtype=torch.bool))
    corrected = importance_weights(padded(new.detach()), padded(behavior), mask, preset,
                                   versions=padded(versions), trainer_version=trainer_version)
    return corrected.weights[mask], corrected.flat_metrics(), corrected.by_lag


def plot(metrics: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, (ax_reward, ax_kl) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_reward.plot(steps, [m["reward_mean"] for m in metrics], marker=".", label="mean reward")
    ax_reward.set_ylabel("reward (digit fraction)")
    ax_reward.grid(alpha=0.3)
    ax_reward.set_title("rlfleet GRPO demo")
    ax_kl.plot(steps, [m["kl"] for m in metrics], color="tab:red", marker=".", label="KL to reference (k3)")
    ax_kl.set_ylabel("KL")
    ax_kl.set_xlabel("step (= policy version pushed)")
    ax_kl.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def training_parser(description: str, *, steps: int, groups_per_step: int, group_size: int, lr: float,
                    kl_coef: float, out: Path) -> argparse.ArgumentParser:
    """The flags every GRPO demo takes (the defaults are the demo's own)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--collector", required=True, help="collector address host:port")
    parser.add_argument("--model-dir", required=True, help="the same weights the generation replicas serve")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--groups-per-step", type=int, default=groups_per_step,
                        help="must match the collector's groups_per_step")
    parser.add_argument("--group-size", type=int, default=group_size, help="must match the collector's group_size")
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--clip-eps", type=float, default=0.2)
    parser.add_argument("--kl-coef", type=float, default=kl_coef)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="the trainer's torch threads (default: torch's)")
    parser.add_argument("--auth-token", default=None, help="bearer token (prefer --credentials: a command line shows in ps)")
    parser.add_argument("--credentials", type=Path, default=None,
                        help="a deployment's credentials directory (rlfleet.services.credentials; compose's `credentials` "
                             "volume copied out): TLS with ca.pem, the client certificate trainer.pem/trainer.key, "
                             "the token in token-trainer")
    parser.add_argument("--credentials-run", default=None, metavar="RUN",
                        help="with --credentials, the credentials of this run of a shared fleet: trainer-RUN.pem/.key "
                             "and token-trainer-RUN (docs/concepts/many-runs.md)")
    parser.add_argument("--transport", default="auto", choices=["auto", "shm", "grpc"],
                        help="weight push transport; auto = shm when the collector shares this host, else grpc")
    parser.add_argument("--is-correction", default=None, metavar="PRESET",
                        help="decoupled PPO with this importance-sampling correction of the train/inference "
                             "mismatch (rlfleet.client.offpolicy: none, token_tis, seq_tis, seq_mis, geo_mis, "
                             "icepop); its metrics go into metrics.json per step and to the collector "
                             "(report_mismatch). Default: the behaviour "
                             "log-probs as PPO's old policy, no correction")
    parser.add_argument("--prompts-ahead", type=int, default=1, metavar="STEPS",
                        help="steps of prompts kept queued at the collector beyond the step being read; async mode "
                             "can only run as many versions ahead as there are prompts (max_staleness of them reaches it)")
    parser.add_argument("--resume", default=None, metavar="RUN_ID@VERSION",
                        help="resume this run, --model-dir holding the weights of that version (the run printed at "
                             "each step); default: start a new run, refused by a collector that holds one already")
    parser.add_argument("--out", type=Path, default=out)
    return parser


def connection(ns: argparse.Namespace) -> dict:
    """``connect`` keywords from ``--auth-token`` / ``--credentials`` (TLS, client certificate, trainer token)
    and ``--resume`` (the run: a new one by default)."""
    from rlfleet.client import credentials_from

    secrets = ({"auth_token": ns.auth_token} if ns.credentials is None
               else credentials_from(ns.credentials, run=ns.credentials_run))
    return {**secrets, "run": ns.resume or "new"}


def join_run(client) -> None:
    """Join the run now: a collector holding another run refuses here, naming both, before any work."""
    from rlfleet.client import FailedPreconditionError

    try:
        run = client.join()
    except FailedPreconditionError as refused:
        sys.exit(f"[demo] {refused}")
    print(f"[demo] run {run.run_id} at version {run.version} ({'resumed' if run.version else 'new'}); "
          f"resume it with --resume RUN_ID@VERSION, the version being the last step's", file=sys.stderr)


def prepare_run(ns) -> random.Random:
    """Seed torch, set its threads, make the output directory; the run's prompt RNG."""
    torch.manual_seed(ns.seed)
    if ns.torch_threads:
        torch.set_num_threads(ns.torch_threads)
    ns.out.mkdir(parents=True, exist_ok=True)
    return random.Random(ns.seed)


def train(client, model, ns, next_prompts: Callable[[int], list[dict]],
          describe: Callable[[object], dict] = lambda batch: {}) -> list[dict]:
    """The GRPO loop: keep the prompt queue a step ahead, read one step's batch of whole groups, take a
    policy-gradient step, push the weights. One metrics record per step; ``describe(batch)`` adds the
    task's own metrics to it."""
    from tqdm import tqdm

    # Only what trains: all of a plain model, the adapter of a LoRA one (its base weights are frozen).
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=ns.lr, weight_decay=0.0)
    batch_size = ns.groups_per_step * ns.group_size
    metrics: list[dict] = []
    if getattr(ns, "push_first", False):  # replicas that served another run's weights start on the trainer's
        first = push_policy(client, model, ns)
        print(f"[demo] pushed the starting weights first: version {first.version}", file=sys.stderr)
    client.submit_prompts(next_prompts((1 + ns.prompts_ahead) * ns.groups_per_step))
    with client.batches(batch_size=batch_size, whole_groups=True) as batches:
        progress = tqdm(range(ns.steps), desc="GRPO", unit="step", file=sys.stderr)
        iterator = iter(batches)
        for step in progress:
            started = time.monotonic()
            client.submit_prompts(next_prompts(ns.groups_per_step))  # keep the queue a step ahead
            batch = next(iterator)
            version_before = client.policy_version
            stats = grpo_step(model, optimizer, batch, clip_eps=ns.clip_eps, kl_coef=ns.kl_coef,
                              is_correction=ns.is_correction, trainer_version=version_before,
                              minibatches=getattr(ns, "minibatches", 1))
            by_lag = stats.pop("by_lag")
            if by_lag:  # the collector shows it, and its mismatch breaker acts on it
                client.report_mismatch(by_lag, version_before)
            pushed = push_policy(client, model, ns)
            elapsed = time.monotonic() - started
            starts = batch["policy_version_start"]
            task = describe(batch)
            record = {
                "step": step, "policy_version": pushed.version, "version_before": version_before,
                "reward_mean": batch["score"].float().mean().item(),
                "batch_policy_version_min": int(starts.min()), "batch_policy_version_max": int(starts.max()),
                "staleness_mean": float((version_before - starts).float().mean()),
                "tokens_per_second": stats["response_tokens"] / elapsed, "step_seconds": elapsed,
                "push_mb_per_s": pushed.megabytes_per_second, "push_seconds": pushed.seconds,
                "push_transport": pushed.transport, "run": str(client.run), **stats, **task,
            }
            if pushed.adapter_rank:
                record["push_kind"] = "adapter"
            metrics.append(record)
            progress.set_postfix(reward=f"{record['reward_mean']:.3f}", kl=f"{record['kl']:.3f}", v=pushed.version)
            progress.write(
                f"step {step:3d}  v{pushed.version:<4d} reward {record['reward_mean']:.3f}  kl {record['kl']:.3f}  "
                f"tok/s {record['tokens_per_second']:6.0f}  staleness {record['staleness_mean']:.1f}  "
                f"logprob mismatch {record['logprob_mismatch_max']:.1e}  "
                f"push {pushed.seconds * 1e3:.0f} ms over {pushed.transport}"
                + (f" (LoRA adapter, rank {pushed.adapter_rank})" if pushed.adapter_rank else "")
                + "".join(f"  {key} {value:.2f}" for key, value in task.items() if isinstance(value, float)))
    return metrics


def push_policy(client, model, ns):
    """Push the step's policy: with ``--lora`` only the adapter (``model`` is its PeftModel), else every weight."""
    if getattr(ns, "lora", None):  # examples sharing this loop have no --lora
        return client.push_adapter(model, progress=False, transport=ns.transport)
    return client.push_weights(model, progress=False, transport=ns.transport)


def lora_policy(model, rank: int, alpha: float):
    """``model`` wrapped in a fresh peft LoRA adapter on ``LORA_TARGETS``: only the adapter trains.

    No LoRA dropout: the trainer's log-probs must be the served model's (behaviour log-probs)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def demo_parser() -> argparse.ArgumentParser:
    """This demo's flags: ``training_parser``'s plus ``--lora``."""
    parser = training_parser(__doc__.splitlines()[0], steps=30, groups_per_step=8, group_size=4, lr=3e-4,
                             kl_coef=0.05, out=Path("runs") / "demo")
    parser.add_argument("--lora", type=int, default=None, metavar="RANK",
                        help="train a LoRA adapter of this rank on every linear projection (peft) and push only "
                             "the adapter each step; the generation replicas need max_lora_rank >= RANK")
    parser.add_argument("--lora-alpha", type=float, default=None, metavar="ALPHA",
                        help="the adapter's lora_alpha (its update is scaled by alpha / rank); default 2 x RANK")
    parser.add_argument("--minibatches", type=int, default=1, metavar="K",
                        help="optimizer steps per batch, each on 1/K of its samples (PPO minibatches: the clip acts "
                             "from the second on)")
    parser.add_argument("--push-first", action="store_true",
                        help="push the starting weights before the first step (replicas that served another run "
                             "then sample from this trainer's policy from the first batch on)")
    parser.add_argument("--long-tail", type=int, default=None, metavar="TOKENS",
                        help="draw each prompt's response budget from a heavy-tailed distribution capped at TOKENS "
                             "(a long tail of response lengths, as reasoning has); default: the collector's")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's flags, checked (``--lora-alpha`` defaults to twice ``--lora``)."""
    parser = demo_parser()
    ns = parser.parse_args(argv)
    if ns.lora is not None and ns.lora < 1:
        parser.error(f"--lora: the rank must be >= 1, got {ns.lora}")
    if ns.lora is None and ns.lora_alpha is not None:
        parser.error("--lora-alpha needs --lora RANK")
    if ns.lora_alpha is not None and not ns.lora_alpha > 0:
        parser.error(f"--lora-alpha must be > 0, got {ns.lora_alpha}")
    if ns.lora is not None and ns.lora_alpha is None:
        ns.lora_alpha = 2.0 * ns.lora
    if ns.minibatches < 1:
        parser.error(f"--minibatches must be >= 1, got {ns.minibatches}")
    if ns.long_tail is not None and ns.long_tail < 16:
        parser.error(f"--long-tail must be at least 16 tokens, got {ns.long_tail}")
    return ns


def first_and_last(metrics: list[dict], key: str, count: int = 5) -> tuple[float, float]:
    """Mean of ``key`` over the first and over the last ``count`` steps (steps where it is None skipped)."""
    def mean(records):
        values = [m[key] for m in records if m[key] is not None]
        return sum(values) / len(values) if values else float("nan")
    return mean(metrics[:count]), mean(metrics[-count:])


def main(argv: list[str] | None = None) -> dict:
    ns = parse_args(argv)

    from transformers import AutoModelForCausalLM

    from rlfleet.client import connect

    rng = prepare_run(ns)
    model = AutoModelForCausalLM.from_pretrained(ns.model_dir, torch_dtype=torch.float32)
    if ns.lora:
        model = lora_policy(model, ns.lora, ns.lora_alpha)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"[demo] LoRA rank {ns.lora}, alpha {ns.lora_alpha:g} on {', '.join(LORA_TARGETS)}: {trainable} of "
              f"{sum(p.numel() for p in model.parameters())} parameters train; each step pushes the adapter",
              file=sys.stderr)
    model.train()

    with connect(ns.collector, **connection(ns)) as client:
        client.wait_ready(timeout=300)
        join_run(client)
        metrics = train(client, model, ns, lambda count: task_prompts(count, rng, ns.long_tail))
    (ns.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    plot(metrics, ns.out / "metrics.png")
    first, last = first_and_last(metrics, "reward_mean")
    print(f"[demo] reward {first:.3f} (first 5 steps) -> {last:.3f} (last 5); "
          f"metrics in {ns.out / 'metrics.json'}, plot in {ns.out / 'metrics.png'}", file=sys.stderr)
    return {"metrics": metrics}


if __name__ == "__main__":
    main()
