"""An agentic GRPO run against rlfleet: the tiny model learns to call the Python tool.

    python -m rlfleet.services.suite --with-environment ... \\
        --then "python examples/train_agentic.py --collector {collector} --model-dir {model_dir} --out runs/agentic"

(``scripts/demo --agentic`` runs exactly that.) The task: "what is 37 times 48". A product of two
numbers in [32, 99] is four digits the tiny model cannot work out, but ``x = 37 * 48; print(x)`` in the
``python`` tool can. Every prompt runs as episodes of the environment service's built-in
``tool_calling`` environment: the model's turn either answers (the episode ends) or calls the tool in
a ``<tool_call>`` block, reads the output as a ``tool`` message, and goes on. Reward: ``numeric_match``
against the product (the last number of the transcript after the prompt).

The tiny model is randomly initialised: it would never write a well-formed tool call on its own. So
the script first warm-starts it with a short supervised phase on synthetic transcripts, rendered
token-exactly as the environment service renders episodes (its own ``ChatRenderer``, with the same
tools). A transcript either calls the tool with the right code and then answers with the tool's
number, or answers at once with a guess (another product: practically always wrong). The phases:

1. how to call: 90% tool transcripts, rendered *without* the tools block. The block is 600 of the
   prompt's 620 tokens; in short sequences the model finds, in about 150 steps, the attention that
   copies the operands into the code and the tool's number into the answer, which it does not find
   in hundreds of steps behind the block.
2. the same with the real prompt (tools block included), until the copying works behind it too.
3. how often: 30% tool transcripts, so the warm-started model calls the tool in a minority of
   episodes (the rest answer with a wrong guess).

Then GRPO, exactly the GRPO demo's loop (``train_grpo.train``): the episodes that call the tool score,
the ones that guess do not, and the group advantages raise the tool-call rate and the reward. The
warm-started weights are pushed (version 1) before the first prompt is submitted. The reference
service keeps the random initial weights, so the KL to it says nothing here: ``--kl-coef`` is 0.

Writes ``metrics.json`` (one object per step: the GRPO demo's keys plus ``turns_per_episode``,
``tool_calls_per_episode``, ``tool_call_rate``, ``reward_with_tool``, ``reward_without_tool``) and
``metrics.png`` (reward and tool-call rate per step) to ``--out``.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

from train_grpo import connection, first_and_last, join_run, prepare_run, train, training_parser  # examples/ is sys.path[0] when run as a script

OPERANDS = (32, 99)
"""Both factors in this range: every product has four digits."""
WARM_START_PHASES = ((0.35, 0.9, False), (0.5, 0.9, True), (0.15, 0.3, True))
"""(share of the warm-start steps, fraction of transcripts that call the tool, tools block in the prompt)."""
ENVIRONMENT = "tool_calling"
TURN_SAMPLING = {"max_tokens": 96}
"""Each prompt's own sampling: a turn that calls the tool is ~86 tokens, more than a collector's default
(64) leaves, so the run works against any collector (compose's too); the collector's other fields stay."""


def question(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"what is {a} times {b}"}]


def task_prompts(count: int, rng: random.Random) -> list[dict]:
    """Episodes of the tool-calling environment, scored by the product."""
    prompts = []
    for _ in range(count):
        a, b = rng.randint(*OPERANDS), rng.randint(*OPERANDS)
        prompts.append({"prompt": question(a, b), "environment": ENVIRONMENT, "sampling": TURN_SAMPLING,
                        "reward_fn": "numeric_match", "ground_truth": str(a * b)})
    return prompts


def tool_call(a: int, b: int) -> str:
    """The turn that computes ``a * b`` with the python tool."""
    call = {"name": "python", "arguments": {"code": f"x = {a} * {b}\nprint(x)"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


class Transcripts:
    """Warm-start transcripts as token ids, exactly as the environment service renders an episode:
    prompt tokens, the sampled tokens of each turn (the ones trained on), observation tokens."""

    def __init__(self, tokenizer):
        from rlfleet.services.environment.rendering import ChatRenderer
        from rlfleet.services.environment.tool_env import PYTHON_TOOL

        self.renderer = ChatRenderer(tokenizer)
        self.tools = [PYTHON_TOOL]  # what the environment offers (it runs no MCP server here)
        self.end_of_turn = tokenizer.eos_token

    def sample(self, rng: random.Random, call_tool: bool, with_tools: bool) -> tuple[list[int], list[bool]]:
        """A transcript's token ids and, per token, whether the model samples it."""
        a, b = rng.randint(*OPERANDS), rng.randint(*OPERANDS)
        messages, tools = question(a, b), self.tools if with_tools else []
        _, ids = self.renderer.prompt(messages, tools)
        sampled = [False] * len(ids)

        def turn(text: str) -> list[int]:
            turn_ids = self.renderer.encode(text + self.end_of_turn)
            ids.extend(turn_ids)
            sampled.extend([True] * len(turn_ids))
            return turn_ids

        if call_tool:
            call_ids = turn(tool_call(a, b))
            output = {"role": "tool", "name": "python", "content": str(a * b)}
            observation = self.renderer.observation(messages, call_ids, [output], tools).token_ids
            ids.extend(observation)
            sampled.extend([False] * len(observation))
            turn(str(a * b))
        else:
            turn(str(rng.randint(*OPERANDS) * rng.randint(*OPERANDS)))
        return ids, sampled


def sft_loss(model, transcripts: list[tuple[list[int], list[bool]]], pad_id: int) -> torch.Tensor:
    """Mean negative log-likelihood of the sampled tokens. The prefix every transcript shares (the
    prompt's tools block: most of each sequence) is run once and its keys and values reused."""
    first = transcripts[0][0]
    shared = 0
    while all(len(ids) > shared + 1 and ids[shared] == first[shared] for ids, _ in transcripts):
        shared += 1
    rest = max(len(ids) for ids, _ in transcripts) - shared
    input_ids = torch.full((len(transcripts), rest), pad_id)
    attention = torch.zeros(len(transcripts), shared + rest, dtype=torch.long)
    trained = torch.zeros(len(transcripts), rest, dtype=torch.bool)
    for row, (ids, sampled) in enumerate(transcripts):
        input_ids[row, :len(ids) - shared] = torch.tensor(ids[shared:])
        attention[row, :len(ids)] = 1
        trained[row, :len(ids) - shared] = torch.tensor(sampled[shared:])
    cache = model(input_ids=torch.tensor([first[:shared]]), use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(transcripts))
    logits = model(input_ids=input_ids, attention_mask=attention, past_key_values=cache).logits[:, :-1].float()
    log_probs = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    # The first token after the shared prefix is the prompt's (the question), never sampled.
    return -log_probs[trained[:, 1:]].mean()


def warm_start(model, tokenizer, rng: random.Random, *, steps: int, lr: float, batch_size: int) -> None:
    """The supervised phases of the module docstring, ``steps`` in all."""
    from tqdm import tqdm

    transcripts = Transcripts(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for phase, (share, tool_fraction, with_tools) in enumerate(WARM_START_PHASES):
        phase_steps = round(share * steps)
        last = phase == len(WARM_START_PHASES) - 1
        progress = tqdm(range(phase_steps), unit="step", file=sys.stderr,
                        desc=f"warm start ({tool_fraction:.0%} tool calls{', tools block' if with_tools else ''})")
        for step in progress:
            if last:  # Adam at a constant rate overshoots the new mix (0.9 -> 0.02 seen): settle on it
                for group in optimizer.param_groups:
                    group["lr"] = lr * (1 - step / phase_steps)
            batch = [transcripts.sample(rng, rng.random() < tool_fraction, with_tools) for _ in range(batch_size)]
            loss = sft_loss(model, batch, tokenizer.pad_token_id)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            progress.set_postfix(loss=f"{loss.item():.3f}")


def episode_metrics(batch, tokenizer) -> dict:
    """Turns and tool calls per episode (``<tool_call>`` blocks in what the model sampled), the share of
    episodes that called the tool, and the mean reward of those that did and of those that did not."""
    full = batch.ragged("tokens/full").to_list()
    assistant = batch.ragged("masks/all_assistant_mask").to_list()
    calls = torch.tensor([tokenizer.decode(ids[mask]).count("<tool_call>") for ids, mask in zip(full, assistant)])
    turns = batch.ragged("turns/policy_versions").lengths.float()
    score = batch["score"].float()
    used = calls > 0
    return {"turns_per_episode": turns.mean().item(), "tool_calls_per_episode": calls.float().mean().item(),
            "tool_call_rate": used.float().mean().item(),
            "reward_with_tool": score[used].mean().item() if used.any() else None,
            "reward_without_tool": score[~used].mean().item() if (~used).any() else None}


def plot(metrics: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]

    def series(key: str) -> list[float]:  # a step without such episodes has None: a gap in the line
        return [float("nan") if m[key] is None else m[key] for m in metrics]

    fig, (ax_reward, ax_tools) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_reward.plot(steps, series("reward_mean"), marker=".", label="all episodes")
    ax_reward.plot(steps, series("reward_with_tool"), marker=".", alpha=0.5, label="calling the tool")
    ax_reward.plot(steps, series("reward_without_tool"), marker=".", alpha=0.5, label="answering at once")
    ax_reward.set_ylabel("reward (product right)")
    ax_reward.legend(loc="center right")
    ax_reward.grid(alpha=0.3)
    ax_reward.set_title("rlfleet agentic demo: GRPO with the python tool")
    ax_tools.plot(steps, series("tool_call_rate"), color="tab:green", marker=".",
                  label="episodes calling the tool")
    ax_tools.plot(steps, series("tool_calls_per_episode"), color="tab:olive", marker=".", alpha=0.6,
                  label="tool calls per episode")
    ax_tools.set_ylabel("tool use")
    ax_tools.set_xlabel("GRPO step (each pushes a policy version; the warm start was version 1)")
    ax_tools.legend(loc="center right")
    ax_tools.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = training_parser(__doc__.splitlines()[0], steps=30, groups_per_step=4, group_size=8, lr=2e-4,
                             kl_coef=0.0, out=Path("runs") / "agentic")
    parser.add_argument("--warm-start-steps", type=int, default=400, help="supervised steps before GRPO (0: none)")
    parser.add_argument("--warm-start-lr", type=float, default=3e-3)
    parser.add_argument("--warm-start-batch", type=int, default=16)
    # The suite's vLLM engine, reference and environment share a small host's cores with the trainer;
    # torch's threads spinning on contended cores made a warm-start step 5x slower than one thread here.
    parser.set_defaults(torch_threads=1)
    ns = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfleet.client import connect

    rng = prepare_run(ns)
    tokenizer = AutoTokenizer.from_pretrained(ns.model_dir)
    model = AutoModelForCausalLM.from_pretrained(ns.model_dir, dtype=torch.float32)
    model.train()
    started = time.monotonic()
    warm_start(model, tokenizer, rng, steps=ns.warm_start_steps, lr=ns.warm_start_lr, batch_size=ns.warm_start_batch)
    print(f"[agentic] warm start: {ns.warm_start_steps} steps in {time.monotonic() - started:.0f} s", file=sys.stderr)

    with connect(ns.collector, **connection(ns)) as client:
        client.wait_ready(timeout=300)
        join_run(client)
        client.push_weights(model, progress=False, transport=ns.transport)  # episodes start from the warm start
        metrics = train(client, model, ns, lambda count: task_prompts(count, rng),
                        lambda batch: episode_metrics(batch, tokenizer))
    (ns.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    plot(metrics, ns.out / "metrics.png")
    summary = [f"{key} {first:.2f} -> {last:.2f}" for key in ("reward_mean", "tool_call_rate", "tool_calls_per_episode")
               for first, last in [first_and_last(metrics, key)]]
    print(f"[agentic] first 5 steps -> last 5: {', '.join(summary)}; "
          f"metrics in {ns.out / 'metrics.json'}, plot in {ns.out / 'metrics.png'}", file=sys.stderr)
    return {"metrics": metrics}


if __name__ == "__main__":
    main()
