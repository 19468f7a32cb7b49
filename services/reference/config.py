"""Configuration of the reference scorer (the frozen model and how it is batched)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ReferenceConfig(BaseModel):
    """The frozen reference model and its batching. Every field is documented."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    model_path: str
    """Hugging Face model directory or hub name of the frozen reference policy."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations dtype. Log-probs are always returned as float32."""

    device: str = "cpu"
    """Torch device the model runs on (``cpu``, ``cuda``, ``cuda:1`` ...)."""

    padding_side: Literal["left", "right"] = "right"
    """Where padding goes inside a batch. Both give the same log-probs: position ids
    and the attention mask are built from the true lengths, never from pad tokens."""

    token_budget: int = Field(default=16384, ge=1)
    """Upper bound on padded tokens per forward pass: ``batch_size * longest_sequence``."""

    max_len: int | None = Field(default=None, ge=1)
    """Longest accepted sequence (prompt + response). ``None``: the model's
    ``max_position_embeddings``, capped at ``token_budget``."""

    max_wait_ms: float = Field(default=5.0, ge=0)
    """How long the micro-batcher waits for more concurrent requests before it runs a
    forward pass that is not yet full."""

    attn_implementation: str | None = None
    """Passed to ``from_pretrained`` (``eager``, ``sdpa`` ...); ``None`` lets HF choose."""

    trust_remote_code: bool = False
    """Allow model code shipped with the checkpoint. Off unless you trust the source."""

    @model_validator(mode="after")
    def _budget_fits_one_sequence(self) -> ReferenceConfig:
        if self.max_len is not None and self.max_len > self.token_budget:
            raise ValueError(
                f"token_budget ({self.token_budget}) must be >= max_len ({self.max_len}) "
                "or the longest accepted sequence could never be scored"
            )
        return self
