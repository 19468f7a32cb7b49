"""One prompt to generate (``PromptItem``) and the one set of rules that makes it, whether it was
submitted by a trainer (a ``PromptSpec``) or read from a dataset row: prompt kinds, chat roles,
size bound, sampling overrides (checked by the generation service's own rules, merged with the
collector's configured sampling). Nothing here knows gRPC beyond reading the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.common.sampling_spec import sampling_from_fields
from rlfleet.v1 import collector_pb2

MAX_PROMPT_ID_BYTES = 256
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class PromptItem:
    """One prompt and how to score it."""

    prompt_id: str
    text: str | None = None
    """Raw text prompt (tokenized by generation without a chat template)."""
    chat: list[dict[str, str]] | None = None
    """Chat messages (generation applies the model's chat template)."""
    token_ids: list[int] | None = None
    """Pre-tokenized prompt."""
    ground_truth: str = ""
    reward_fn: str = ""
    reward_args: dict[str, str] = field(default_factory=dict)
    sampling: dict[str, Any] | None = None
    """Overrides of the configured sampling parameters (plain values: JSON-serializable)."""
    environment: str = ""
    """The environment running it as a multi-turn episode; "" = the collector's default (which may be
    none: a single-turn prompt)."""
    dataset_key: str = ""
    """A dataset prompt's id without its epoch (its pass rate spans epochs); "" for a submitted one."""
    ledger_seq: int | None = None
    """Its row in the prompt ledger (set when it is written there)."""
    attempts: int = 0
    """Transient failures so far (persisted in the ledger)."""

    @property
    def append_key(self) -> str:
        """The idempotency key of its group's Append: one group per ledger row, even when a
        collector restarted after the Append and generates the prompt again."""
        return f"{self.prompt_id}#{self.ledger_seq}"

    @property
    def pass_key(self) -> str:
        """Whose pass rate its groups count toward: the dataset row's id, or the submitted prompt id."""
        return self.dataset_key or self.prompt_id

    @property
    def query(self) -> str:
        """The prompt as text, as TorchRL names it: the raw text, or a chat's last user message
        ("" for token ids, which the collector never detokenizes)."""
        if self.text is not None:
            return self.text
        users = [message["content"] for message in self.chat or () if message.get("role") == "user"]
        return users[-1] if users else ""

    def episode_prompt(self, where: str) -> list[dict[str, str]]:
        """The chat messages an episode opens with: the chat, or the text as one user message (token
        ids are refused: an environment reads messages; InvalidArgument naming ``where``)."""
        if self.chat is not None:
            return self.chat
        if self.text is not None:
            return [{"role": "user", "content": self.text}]
        raise InvalidArgument(f"{where}: a multi-turn episode needs a text or chat prompt, not token ids")

    def prompt_text(self) -> str:
        """Human-readable prompt for reward functions."""
        if self.text is not None:
            return self.text
        if self.chat:
            return self.chat[-1].get("content", "")
        return ""


def check_chat(messages: list[Any], where: str) -> list[dict[str, str]]:
    """Chat messages as plain dicts: a non-empty list of ``{"role", "content"}`` with a known role and
    string content (InvalidArgument naming ``where`` and the message)."""
    if not messages:
        raise InvalidArgument(f"{where}: empty")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidArgument(f"{where}[{i}]: a chat message must be an object with role and content, "
                                  f"got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise InvalidArgument(f"{where}[{i}].role: {role!r} is not one of {', '.join(CHAT_ROLES)}")
        if not isinstance(content, str):
            raise InvalidArgument(f"{where}[{i}].content: must be a string, got "
                                  f"{'nothing' if content is None else type(content).__name__}")
        chat.append({"role": role, "content": content})
    return chat


def sampling_fields(defaults: dict[str, Any], overrides: dict[str, Any] | None, group_size: int) -> dict[str, Any]:
    """The sampling fields a group is generated with: ``defaults`` (the collector's config), then the
    prompt's ``overrides``, ``n`` = the group size."""
    return {**defaults, **(overrides or {}), "n": group_size}


def check_sampling(defaults: dict[str, Any], overrides: dict[str, Any] | None, group_size: int,
                   where: str) -> dict[str, Any]:
    """``sampling_fields``, validated by the generation service's own rules (InvalidArgument naming
    ``where`` and the field)."""
    fields = sampling_fields(defaults, overrides, group_size)
    sampling_from_fields(fields, where)
    return fields


def from_spec(spec: collector_pb2.PromptSpec, where: str, *, max_prompt_bytes: int,
              sampling_defaults: dict[str, Any], group_size: int) -> PromptItem:
    """A submitted prompt, validated (INVALID_ARGUMENT naming ``where`` and the field)."""
    if len(spec.prompt_id.encode()) > MAX_PROMPT_ID_BYTES:
        raise InvalidArgument(f"{where}.prompt_id: longer than {MAX_PROMPT_ID_BYTES} bytes")
    size = spec.ByteSize() - (spec.sampling.ByteSize() if spec.HasField("sampling") else 0)
    if size > max_prompt_bytes:
        raise InvalidArgument(f"{where}: {size} bytes of prompt, ground truth and reward args exceed the "
                              f"collector's max_prompt_bytes ({max_prompt_bytes})")
    item = PromptItem(prompt_id=spec.prompt_id, ground_truth=spec.ground_truth, reward_fn=spec.reward_fn,
                      reward_args=dict(spec.reward_args), environment=spec.environment)
    kind = spec.prompt.WhichOneof("kind")
    if kind == "text":
        item.text = spec.prompt.text
    elif kind == "chat":
        item.chat = check_chat([{"role": m.role, "content": m.content} for m in spec.prompt.chat.messages],
                               f"{where}.prompt.chat.messages")
    elif kind == "token_ids":
        from rlfleet.wire import decode_tensor  # torch: not for a config check (check_sampling)

        ids = decode_tensor(spec.prompt.token_ids, f"{where}.prompt.token_ids")
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.numel() == 0:
            raise InvalidArgument(f"{where}.prompt.token_ids must be a non-empty 1-D integer tensor")
        item.token_ids = ids.tolist()
    else:
        raise InvalidArgument(f"{where}.prompt is empty: set text, chat or token_ids")
    if spec.HasField("sampling"):
        # Only the fields set (0 / empty: not overridden); repeated fields as lists (JSON in the ledger).
        overrides = {f.name: (v if isinstance(v, (str, bytes, int, float)) else list(v))
                     for f, v in spec.sampling.ListFields() if f.name != "n"}
        check_sampling(sampling_defaults, overrides, group_size, f"{where}.sampling")
        item.sampling = overrides
    return item


def from_row(record: Any, where: str, prompt_field: str, ground_truth_field: str, default_id: str) -> PromptItem:
    """A dataset row -> PromptItem (InvalidArgument naming ``where`` and what is wrong)."""
    if not isinstance(record, dict):
        raise InvalidArgument(f"{where}: a row must be an object, got {type(record).__name__}")
    if prompt_field not in record:
        raise InvalidArgument(f"{where}: no field {prompt_field!r} (the collector's prompt_field)")
    prompt = record[prompt_field]
    item = PromptItem(prompt_id=str(record.get("id", default_id)),
                      ground_truth=str(record.get(ground_truth_field, "") or ""),
                      reward_fn=str(record.get("reward_fn", "") or ""),
                      environment=str(record.get("environment", "") or ""))
    if isinstance(prompt, str) and prompt:
        item.text = prompt
    elif isinstance(prompt, list):
        item.chat = check_chat(prompt, f"{where}.{prompt_field}")
    else:
        raise InvalidArgument(f"{where}.{prompt_field}: must be a non-empty string or a list of chat messages, "
                              f"got {type(prompt).__name__}")
    return item
