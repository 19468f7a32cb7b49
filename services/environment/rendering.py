"""Token-exact rendering of a multi-turn conversation.

The trainer's sequence is prompt tokens + sampled tokens + observation tokens + sampled tokens ...
exactly as they were fed to and produced by the model: nothing is re-tokenized from text. The chat
template is only asked for *text*: the observation's text is what the template renders after the
assistant turn as the model produced it, i.e. ``render(conversation + observation)`` minus
``render(conversation so far) + sampled text``. That difference exists only when the template is
prefix-stable (re-rendering a past assistant turn gives back what the model wrote, as ChatML does);
a template that rewrites past turns (drops reasoning, reformats tool calls) is refused, since its
sequence would not be the one the model saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rlfleet.services.common.errors import FailedPrecondition

# End-of-turn markers that some chat templates use in place of (or next to) the tokenizer's EOS.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>")

Messages = list[dict[str, Any]]


class TemplateNotPrefixStable(FailedPrecondition):
    """The chat template re-renders an assistant turn differently from what the model produced."""


@dataclass(frozen=True)
class Observation:
    """The tokens that follow a sampled turn, and the assistant message the turn became."""

    assistant_message: dict[str, Any]
    """The turn as a chat message: its text without the end-of-turn marker (the template re-adds it)."""
    text: str
    """The template's text after the sampled text: the observation and the next generation prompt."""
    token_ids: list[int]
    """``text`` tokenized alone, without special tokens added."""


class ChatRenderer:
    """A Hugging Face tokenizer's chat template, used to render text and tokenize pieces of it."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        vocabulary = tokenizer.get_vocab()
        end_tokens = {token for token in _END_OF_TURN_TOKENS if token in vocabulary}
        if tokenizer.eos_token:
            end_tokens.add(tokenizer.eos_token)
        self.end_of_turn_ids = frozenset(vocabulary[token] for token in end_tokens if token in vocabulary)
        """Token ids that end a turn; one sampled last is dropped from the assistant message."""

    @classmethod
    def from_pretrained(cls, path: str) -> ChatRenderer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def render(self, messages: Messages, tools: Sequence[dict[str, Any]] = ()) -> str:
        """``messages`` rendered with the generation prompt appended."""
        return self.tokenizer.apply_chat_template(
            messages, tools=list(tools) or None, tokenize=False, add_generation_prompt=True
        )

    def encode(self, text: str) -> list[int]:
        """``text`` tokenized alone: no BOS or other special token added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """``token_ids`` as text, special tokens kept (an EOS sampled is part of what the model wrote)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def prompt(self, messages: Messages, tools: Sequence[dict[str, Any]] = ()) -> tuple[str, list[int]]:
        """The opening text and tokens to sample the first turn from."""
        text = self.render(messages, tools)
        return text, self.encode(text)

    def assistant_message(self, sampled_ids: Sequence[int]) -> tuple[str, dict[str, Any]]:
        """The sampled text (special tokens kept) and the assistant message it becomes."""
        sampled_text = self.decode(sampled_ids)
        content_ids = list(sampled_ids)
        if content_ids and content_ids[-1] in self.end_of_turn_ids:
            content_ids = content_ids[:-1]
        return sampled_text, {"role": "assistant", "content": self.decode(content_ids)}

    def observation(
        self,
        messages: Messages,
        sampled_ids: Sequence[int],
        observation: Messages,
        tools: Sequence[dict[str, Any]] = (),
    ) -> Observation:
        """The tokens to append after ``sampled_ids`` (sampled from ``render(messages)``) so that the
        sequence renders ``messages + [assistant turn] + observation`` and the next generation prompt.
        Raises ``TemplateNotPrefixStable`` when the template rewrites the turn."""
        sampled_text, assistant = self.assistant_message(sampled_ids)
        before = self.render(messages, tools) + sampled_text
        after = self.render([*messages, assistant, *observation], tools)
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
            raise TemplateNotPrefixStable(
                "the chat template is not prefix-stable: re-rendering the conversation with the sampled turn "
                f"differs from what the model was given at character {at} "
                f"(given {before[at:at + 40]!r}, re-rendered {after[at:at + 40]!r}); "
                "token-exact episodes need a template that renders past assistant turns as sampled"
            )
        text = after[len(before):]
        return Observation(assistant_message=assistant, text=text, token_ids=self.encode(text))
