"""Text and chat prompts -> token ids, through the served model's tokenizer.

Bounded before any work: text longer than ``PROMPT_CHARS_PER_TOKEN`` characters
per allowed prompt token is refused untokenized. Tokenizing runs in one worker
thread, off the event loop (17 MB of text took 28 s here: the replica's
streams and health checks would all wait).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlfleet.services.common.errors import InvalidArgument, Unavailable

PROMPT_CHARS_PER_TOKEN = 32
"""Characters a text or chat prompt may have per allowed prompt token (real text has about 4)."""


class PromptTokenizer:
    """The model's tokenizer and chat template. Call :meth:`load` (blocking) before use."""

    def __init__(self, tokenizer_path: str) -> None:
        self.tokenizer_path = tokenizer_path
        self._tokenizer: Any = None
        self._executor: ThreadPoolExecutor | None = None

    def load(self) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)

    def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def _require(self) -> Any:
        if self._tokenizer is None:
            raise Unavailable("generation engine is not started")
        return self._tokenizer

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` through the model's chat template."""
        tokenizer = self._require()
        try:
            encoded = tokenizer.apply_chat_template(
                list(messages), tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True)
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(f"messages: cannot apply chat template: {e}") from e
        return list(encoded["input_ids"])

    def tokenize(self, text: str) -> list[int]:
        """Token ids of raw ``text`` (no chat template, no special tokens added)."""
        tokenizer = self._require()
        if not text:
            raise InvalidArgument("prompt.text is empty")
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    async def encode_text(self, text: str, max_tokens: int) -> list[int]:
        """``tokenize`` off the event loop; text too long for ``max_tokens`` is refused untokenized
        (the engine checks the token count)."""
        _check_chars("prompt.text", len(text), max_tokens)
        return await self._run(self.tokenize, text)

    async def encode_chat(self, messages: Sequence[dict[str, str]], max_tokens: int) -> list[int]:
        """``render_chat`` off the event loop, refusing messages too long for ``max_tokens`` unrendered."""
        chars = sum(len(m["role"]) + len(m["content"]) for m in messages)
        _check_chars("prompt.chat.messages", chars, max_tokens)
        return await self._run(self.render_chat, messages)

    async def _run(self, fn, *args) -> list[int]:
        self._require()
        if self._executor is None:
            # One thread: calls never overlap on the (not thread-safe) fast tokenizer.
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


def _check_chars(field: str, chars: int, max_tokens: int) -> None:
    if chars > PROMPT_CHARS_PER_TOKEN * max_tokens:
        raise InvalidArgument(f"{field} has {chars} characters, more than {PROMPT_CHARS_PER_TOKEN} per allowed "
                              f"prompt token (max_prompt_tokens={max_tokens})")

