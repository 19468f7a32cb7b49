"""The batch schema: every key of a trajectory batch on the wire, in one machine-readable table.

This table is the single source for the batch part of the contract:
``python -m rlfleet.wire.batch_schema`` (run by ``scripts/gen-protos``) renders it into
``docs/batch-schema.md`` and into the comment block of ``protos/rlfleet/v1/trajectory.proto``;
``--check`` fails when either is stale. ``tests/unit/test_batch_schema.py`` fails when the
collector's batches and this table differ in any key, kind, dtype or trailing shape.

On the wire a batch is a ``TensorDict`` message with batch size ``[B]``. A key ``a/b`` is the entry
``b`` of the nested ``TensorDict`` held by entry ``a`` (whose batch size is also ``[B]``). Kinds:
``tensor`` (a dense tensor ``[B, *trailing]``), ``ragged`` (a ``RaggedTensor``: sample ``i`` holds
``lengths[i]`` rows of shape ``trailing``, flat in ``values``), ``strings`` (``B`` strings).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOC_PATH = ROOT / "docs" / "batch-schema.md"
PROTO_PATH = ROOT / "protos" / "rlfleet" / "v1" / "trajectory.proto"
PROTO_BEGIN = "// Batch schema (generated from rlfleet/wire/batch_schema.py: do not edit by hand)."
PROTO_END = "// End of the batch schema."


@dataclass(frozen=True)
class BatchField:
    """One key of a trajectory batch."""

    key: str
    kind: str
    """"tensor", "ragged" or "strings"."""
    dtype: str
    """The ``rlfleet.v1.Dtype`` name without ``DTYPE_`` ("" for strings)."""
    trailing: tuple[int, ...]
    """Dims after ``[B]`` (tensor) or after the sample's length (ragged)."""
    meaning: str
    unit: str = ""
    over: str = ""
    """For ragged keys: what the rows are (prompt, response or full = prompt + response tokens; turns)."""


def _tensor(key: str, dtype: str, meaning: str, unit: str = "", trailing: tuple[int, ...] = ()) -> BatchField:
    return BatchField(key, "tensor", dtype, trailing, meaning, unit)


def _ragged(key: str, dtype: str, over: str, meaning: str, unit: str = "", trailing: tuple[int, ...] = ()) -> BatchField:
    return BatchField(key, "ragged", dtype, trailing, meaning, unit, over)


def _strings(key: str, meaning: str) -> BatchField:
    return BatchField(key, "strings", "", (), meaning)


BATCH_FIELDS: tuple[BatchField, ...] = (
    _ragged("tokens/prompt", "INT64", "prompt", "Prompt token ids (after the chat template)."),
    _ragged("tokens/response", "INT64", "response",
            "Everything after the prompt: the sampled token ids; in a multi-turn episode, each turn's sampled "
            "tokens followed by the environment's observation tokens (as the chat template rendered them), up "
            "to the last turn's sampled tokens. Never re-tokenized text."),
    _ragged("tokens/full", "INT64", "full", "prompt followed by response."),
    _ragged("masks/all_attention_mask", "BOOL", "full", "All true (no padding inside a sample)."),
    _ragged("masks/all_assistant_mask", "BOOL", "full",
            "True over the sampled tokens (the response of a single turn; the assistant turns of an episode), "
            "false over the prompt and observation tokens: the tokens trained on."),
    _ragged("log_probs/response", "FLOAT32", "response",
            "Behaviour log-probability of each response token under the generating engine, of "
            "logits / temperature (the distribution sampled from); 0 over observation tokens (not sampled).",
            "nats"),
    _ragged("versions/response", "INT64", "response",
            "The policy version whose weights sampled each response token (a keep-mode push during "
            "generation changes it mid-sample, at the token where the engine applied it); -1 over "
            "observation tokens (not sampled)."),
    _ragged("ref_log_probs/response", "FLOAT32", "response",
            "Log-probability of each response token (observation tokens included) under the frozen reference "
            "model (temperature 1).", "nats"),
    _ragged("kl", "FLOAT32", "response",
            "Per-token KL estimate, behaviour vs reference (the reward service's estimator: k1, k2 or k3); 0 "
            "over observation tokens.",
            "nats"),
    _ragged("next/reward", "FLOAT32", "response",
            "Shaped per-token reward: -kl_coef * kl on every token, plus clipped_score on the last.", "reward"),
    _tensor("next/done", "BOOL", "True: every sample is a finished episode (single- or multi-turn).",
            trailing=(1,)),
    _tensor("next/terminated", "BOOL",
            "The sample ended on its own: a stop condition (EOS or a stop string) for a single turn; the "
            "environment said done for an episode.", trailing=(1,)),
    _tensor("next/truncated", "BOOL",
            "The sample was cut: at max_tokens for a single turn; by the environment, max_turns or "
            "max_episode_tokens for an episode.", trailing=(1,)),
    _tensor("score", "FLOAT32",
            "The task score: the reward function's score plus environment_reward.", "reward"),
    _tensor("clipped_score", "FLOAT32",
            "score clipped to [-score_clip, score_clip] (equal to score when no clip is set); the "
            "advantage and next/reward are computed from it.", "reward"),
    _tensor("advantage", "FLOAT32",
            "Group-relative advantage of clipped_score within the sample's group: GRPO (s - mean) / "
            "(std + eps) with the unbiased std, grpo_no_std (s - mean), or RLOO (leave-one-out mean).", "reward"),
    _tensor("kl_mean", "FLOAT32", "Mean of kl over the sample's sampled response tokens.", "nats per token"),
    _tensor("kl_coef", "FLOAT32", "The KL coefficient used in next/reward (the KL controller's value then)."),
    _tensor("policy_version_start", "INT64",
            "Policy version of the weights that sampled the sample's first response token (an episode's: the "
            "lowest of its turns'): the generating replica's version, which during a rolling update is the "
            "version being rolled out, ahead of the committed one (such a group reaches the trainer only once "
            "that version commits)."),
    _tensor("policy_version_end", "INT64",
            "Policy version of the weights that produced the sample's last token (differs from start after "
            "a keep-mode push during generation)."),
    _tensor("group_id", "INT64",
            "The group (one prompt's samples) the sample belongs to; 64-bit, may exceed 2^53 (use BigInt in "
            "JavaScript)."),
    _tensor("group_size", "INT64", "Samples in the sample's group."),
    _tensor("sample_index", "INT64", "Index of the sample within its group, 0 .. group_size - 1."),
    _tensor("generation_seconds", "FLOAT32",
            "From the generation request's arrival at the engine to the sample's last token (summed over an "
            "episode's turns).", "seconds"),
    _ragged("turns/policy_versions", "INT64", "turns",
            "Per assistant turn (one for a single turn), the policy versions that sampled its first and last "
            "token: (start, end).", trailing=(2,)),
    _tensor("environment_reward", "FLOAT32",
            "The episode's reward from its environment (per-turn rewards plus the final one); 0 without an "
            "environment.", "reward"),
    _tensor("sampling/temperature", "FLOAT32", "Sampling temperature used."),
    _tensor("sampling/top_p", "FLOAT32", "Nucleus sampling threshold used (1 = off)."),
    _tensor("sampling/top_k", "INT64", "Top-k used (0 or -1 = off)."),
    _tensor("sampling/max_tokens", "INT64", "Response length cap used (an episode's first turn's).", "tokens"),
    _strings("trajectory_id", "Unique id of the sample: '<group_id in hex>-<sample_index>'."),
    _strings("prompt_id", "Id of the prompt (as submitted, or assigned by SubmitPrompts)."),
    _strings("query", "The prompt as text: the raw text, or a chat's last user message; '' for token-id prompts."),
    _strings("reward_fn", "The reward function that scored the sample: the prompt's, else the collector's reward_fn "
             "('none': the environment's rewards only)."),
    _strings("ground_truth", "The ground truth the reward function was given (the prompt's; '' when it has none)."),
)


def row_schema(fields: tuple[BatchField, ...] = BATCH_FIELDS) -> dict:
    """The table in the trajectory service's schema form (``services/trajectory/rows.py``)."""
    from rlfleet.v1 import tensor_pb2

    schema: dict = {}
    for field in fields:
        *parents, name = field.key.split("/")
        node = schema
        for parent in parents:
            node = node.setdefault(parent, ["nested", [], {}])[2]
        if field.kind == "strings":
            node[name] = ["strings"]
        else:
            node[name] = [field.kind, tensor_pb2.Dtype.Value(f"DTYPE_{field.dtype}"), list(field.trailing)]
    return schema


def _dims(field: BatchField) -> str:
    return "".join(f", {d}" for d in field.trailing)


def _shape(field: BatchField) -> str:
    if field.kind == "strings":
        return "`[B]` strings"
    if field.kind == "ragged":
        return f"ragged `[B, n_i{_dims(field)}]`, n_i = {field.over}" + ("" if field.over == "turns" else " tokens")
    return f"`[B{_dims(field)}]`"


def render_markdown(fields: tuple[BatchField, ...] = BATCH_FIELDS) -> str:
    lines = ["# Trajectory batch schema", "",
             "<!-- Generated by `python -m rlfleet.wire.batch_schema` from client/rlfleet/wire/batch_schema.py;"
             " do not edit. -->", "",
             "Every key of a batch delivered by `StreamBatches` (and appended by the collector). "
             "`B` = samples in the batch; a key `a/b` is entry `b` of the nested TensorDict at entry `a`. "
             "Ragged entries are `RaggedTensor`s: sample `i` owns `lengths[i]` consecutive rows of `values`. "
             "String entries are one string per sample: the SDK's `batch[key]` gives them as a `list[str]`. "
             "Log-probabilities are natural logs. The TorchRL view of the same batch "
             "(`rlfleet.client.torchrl.to_torchrl`) is tabled in `client/rlfleet/client/torchrl/layout.py`. "
             "The trajectory service refuses an Append holding a key not listed here, or a key in another "
             "kind, dtype or trailing shape (its config `batch_schema`).", "",
             "| key | kind, shape | dtype | unit | meaning |", "|---|---|---|---|---|"]
    for field in fields:
        lines.append(f"| `{field.key}` | {_shape(field)} | {field.dtype.lower() or 'string'} | "
                     f"{field.unit} | {field.meaning} |")
    return "\n".join(lines) + "\n"


def render_proto_comment(fields: tuple[BatchField, ...] = BATCH_FIELDS) -> str:
    width = max(len(f.key) for f in fields)
    lines = [PROTO_BEGIN, "// Keys of the trajectory TensorDicts below (docs/batch-schema.md has units and meanings):"]
    for field in fields:
        kind = f"{field.kind} {field.dtype.lower()}".strip()
        shape = f" [B{_dims(field)}]" if field.kind == "tensor" else ""
        over = f" over {field.over}" if field.over else ""
        lines.append(f"//   {field.key.ljust(width)}  {kind}{shape}{over}")
    lines.append(PROTO_END)
    return "\n".join(lines)


def _with_proto_comment(text: str) -> str:
    start, end = text.index(PROTO_BEGIN), text.index(PROTO_END) + len(PROTO_END)
    return text[:start] + render_proto_comment() + text[end:]


def main(argv: list[str]) -> int:
    check = argv[1:] == ["--check"]
    wanted = {DOC_PATH: render_markdown(), PROTO_PATH: _with_proto_comment(PROTO_PATH.read_text())}
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    if check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run scripts/gen-protos and commit", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
