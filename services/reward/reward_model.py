"""A learned reward model as a scorer: HF ``AutoModelForSequenceClassification``.

Loaded on first use (so building the scorer at startup is cheap and a service
can report NOT_SERVING until :meth:`RewardModelScorer.load` has run), frozen,
and run in length-sorted batches.

Inputs are tokenized and padded the way HF reward models are trained and
evaluated (TRL's RewardTrainer): ``tokenizer(prompt + response)``, **right**
padding, and HF's own pooling (the last token that is not ``pad_token_id``).
Right padding keeps position ids correct without passing them, so a sample's
score does not depend on what it is batched with. If a tokenizer uses the same
id for padding and EOS, HF pools the token before a trailing EOS — at training
time too, so we keep that behaviour rather than diverge from it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from rlfleet.services.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.services.reward.scores import ScoreInput
from rlfleet.wire.dtypes import MODEL_DTYPE_NAMES, dtype_from_name


class RewardModelScorer:
    """Score ``prompt + response`` with a sequence-classification head (one label)."""

    def __init__(
        self,
        path: str,
        *,
        batch_size: int = 8,
        device: str = "cpu",
        dtype: str = "float32",
        max_length: int | None = None,
        label_index: int = 0,
    ) -> None:
        if batch_size < 1:
            raise InvalidArgument(f"reward_model: batch_size must be >= 1, got {batch_size}")
        if dtype not in MODEL_DTYPE_NAMES:
            raise InvalidArgument(f"reward_model: dtype must be one of {sorted(MODEL_DTYPE_NAMES)}, got {dtype!r}")
        self.path = path
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.dtype = dtype_from_name(dtype)
        self.max_length = max_length
        self.label_index = label_index
        self.model: Any = None
        self.tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self.model is not None

    def load(self) -> None:
        """Load tokenizer and model (idempotent, thread-safe)."""
        with self._lock:
            if self.model is not None:
                return
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.path)
            tokenizer.padding_side = "right"
            # Keep the end of an over-long text: that is where the answer is.
            tokenizer.truncation_side = "left"
            model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=self.dtype)
            if not 0 <= self.label_index < model.config.num_labels:
                raise FailedPrecondition(
                    f"reward model {self.path!r} has {model.config.num_labels} labels; "
                    f"label_index {self.label_index} is out of range"
                )
            if tokenizer.pad_token_id is None or model.config.pad_token_id is None:
                raise FailedPrecondition(f"reward model {self.path!r} defines no pad token")
            model.to(self.device).eval().requires_grad_(False)
            self.tokenizer = tokenizer
            self.model = model

    def __call__(self, samples: Sequence[ScoreInput]) -> list[float]:
        self.load()
        if not samples:
            return []
        texts = [sample.prompt + sample.response for sample in samples]
        encoded = self.tokenizer(
            texts,
            truncation=self.max_length is not None,
            max_length=self.max_length,
        )["input_ids"]
        # Length-sorted batches waste little compute on padding.
        order = sorted(range(len(texts)), key=lambda i: len(encoded[i]))
        scores = [0.0] * len(texts)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                batch = self.tokenizer.pad(
                    {"input_ids": [encoded[i] for i in chunk]}, padding=True, return_tensors="pt"
                ).to(self.device)
                logits = self.model(**batch).logits[:, self.label_index].float()
                for index, value in zip(chunk, logits.tolist()):
                    scores[index] = value
        return scores
