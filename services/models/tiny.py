"""Build a deterministic tiny causal LM with a locally trained BPE tokenizer.

Nothing is downloaded: the tokenizer is trained on a generated corpus and the
weights come from a seeded initialisation, so the same arguments always give
bit-identical files. The shape (Qwen2, head_dim 64) is the smallest that
vLLM's CPU attention accepts.

    python -m rlfleet.services.models.tiny /tmp/tiny-model
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import random
from pathlib import Path

# ChatML, with Qwen2.5's way of offering tools. Hugging Face compiles templates with trim_blocks, so a
# newline must never follow a block tag ("%}") directly: it would vanish from the output.
CHAT_TEMPLATE = (
    # Tools: a system block listing them, one JSON object a line, that takes in the conversation's
    # leading system message.
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"  # already in the tools block
    # Only with tools: without them every conversation renders as plain ChatML did before tools.
    "{% elif tools and message['role'] == 'assistant' and message['tool_calls'] and not message['content'] %}"
    "<|im_start|>assistant\n"
    "{% for call in message['tool_calls'] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": {{ function[\'name\'] | tojson }}, "arguments": '
    # OpenAI's form carries the arguments as a JSON string; a mapping is encoded here.
    "{% if function['arguments'] is string %}{{ function['arguments'] }}"
    "{% else %}{{ function['arguments'] | default({}, true) | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    # Content exactly as given, the assistant's included: re-rendering a past turn must give back
    # what the model sampled (services/environment/rendering.py relies on it).
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_WORDS = (
    "the a one two three four five six seven eight nine ten answer is what plus minus "
    "times equals question user assistant system count add sum number yes no please "
    "compute result value cat dog red blue green fast slow up down left right"
).split()
# Bump when the builder's output changes, so cached model directories rebuild.
BUILDER_VERSION = 2


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        out.append(f"{words} {a} plus {b} equals {a + b}. {a}+{b}={a + b}")
    return out


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """Train a byte-level BPE tokenizer on a generated corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a tiny Qwen2 model + tokenizer into ``out_dir`` and return it.

    Skips the work when ``out_dir`` already holds a model built with the same
    arguments (a fingerprint file records them).
    """
    out = Path(out_dir)
    args = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, seed=seed,
        builder_version=BUILDER_VERSION,
    )
    fingerprint = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()
    stamp = out / "rlfleet-tiny.json"
    out.mkdir(parents=True, exist_ok=True)
    # Processes building into one directory at once (parallel test workers) take turns: the first builds,
    # the others find its stamp; none reads files another is writing.
    with open(out / ".rlfleet-tiny.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == fingerprint):
            _build(out, **{k: v for k, v in args.items() if k != "builder_version"})
            stamp.write_text(json.dumps({"fingerprint": fingerprint, "args": args}, indent=2))
    return out


def _build(out: Path, *, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
           intermediate_size: int, max_position_embeddings: int, seed: int) -> None:
    """The model and tokenizer files (the caller writes the stamp after them)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(vocab_size, seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    # Larger-than-default init so sampling at T=1 is far from uniform.
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    path = build_tiny_model(ns.out_dir, num_layers=ns.layers, seed=ns.seed)
    print(path)


if __name__ == "__main__":
    main()
