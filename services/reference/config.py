"""Configuration of the reference scorer (the frozen model and how it is batched)
and of the reference service (those fields plus the common server fields)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlfleet.choices import ModelDtypeName
from rlfleet.services.common.config import ServiceConfig


class ReferenceConfig(BaseModel):
    """The frozen reference model and its batching. Every field is documented."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    model_path: str
    """Hugging Face model directory or hub name of the frozen reference policy."""

    dtype: ModelDtypeName = "float32"
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

    max_wait_ms: float = Field(default=0.0, ge=0)
    """How long the micro-batcher waits for more concurrent requests before it runs a
    forward pass that is not yet full. Requests that arrive while a forward pass runs
    are batched into the next one anyway, so under load batches fill without waiting;
    the default 0 adds no latency when the model is idle (a wait costs a lone caller
    that much per request; see the reference benchmark page, docs/benchmarks/reference.md)."""

    micro_batch_tokens: int | None = Field(default=None, ge=1)
    """Most tokens the micro-batcher gathers from waiting requests into one scoring call,
    which sorts them by length and splits them into forward passes under ``token_budget``.
    More means less padding (similar lengths end up together) but the first callers of a
    call wait for all of its passes. ``None``: ``4 * token_budget`` (its effect on the padding:
    see the reference benchmark page, docs/benchmarks/reference.md)."""

    max_request_tokens: int = Field(default=262_144, ge=2)
    """Most tokens one ``ScoreLogProbs`` request may carry, all its sequences together
    (so at most half as many sequences: each needs two tokens). Larger is INVALID_ARGUMENT
    naming ``token_ids``, refused before the request is split or copied. The default is a
    GRPO group of 64 sequences of 4096 tokens."""

    max_queued_requests: int = Field(default=1024, ge=1)
    """Requests waiting for a forward pass (the pass running is not counted). Beyond it a
    request is RESOURCE_EXHAUSTED, to be retried later or sent to another replica."""

    max_queued_tokens: int = Field(default=1_048_576, ge=2)
    """Tokens of the requests waiting for a forward pass; a request that would pass it is
    RESOURCE_EXHAUSTED (unless nothing waits: one request up to ``max_request_tokens``
    is always accepted). Bounds the memory held by the queue."""

    torch_threads: int = Field(default=0, ge=0)
    """Intra-op CPU threads of the forward pass (``torch.set_num_threads``); 0 keeps torch's
    default of one per core. On a host shared with a vLLM CPU engine, 1 avoids OpenMP
    oversubscription (see the pipeline benchmark page, docs/benchmarks/pipeline.md, 2026-11-22)."""

    attn_implementation: str | None = None
    """Passed to ``from_pretrained`` (``eager``, ``sdpa`` ...); ``None`` lets HF choose."""

    trust_remote_code: bool = False
    """Allow model code shipped with the checkpoint. Off unless you trust the source."""

    @property
    def micro_batch_token_limit(self) -> int:
        """``micro_batch_tokens`` with its default applied."""
        return self.micro_batch_tokens or 4 * self.token_budget

    @model_validator(mode="after")
    def _budget_fits_one_sequence(self) -> ReferenceConfig:
        if self.max_len is not None and self.max_len > self.token_budget:
            raise ValueError(
                f"token_budget ({self.token_budget}) must be >= max_len ({self.max_len}) "
                "or the longest accepted sequence could never be scored"
            )
        if self.max_len is not None and self.max_len > self.max_request_tokens:
            raise ValueError(f"max_request_tokens ({self.max_request_tokens}) must be >= max_len ({self.max_len}) "
                             "or the longest accepted sequence could never be sent")
        return self


class ReferenceServiceConfig(ServiceConfig, ReferenceConfig):
    """The reference service: a frozen HF causal LM scoring log-probs over gRPC.

    The reference-model fields plus the common service fields; env vars are
    ``RLFLEET_REFERENCE_<FIELD>`` (e.g. ``RLFLEET_REFERENCE_MODEL_PATH``).
    """

    service_name = "reference"

    port: int = Field(50052, ge=0, le=65535)
    """gRPC port; 0 picks a free port (written to ``port_file``)."""
