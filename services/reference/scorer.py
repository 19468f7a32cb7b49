"""Per-token log-probs of given sequences under a frozen causal LM.

``score`` returns, for every sample, ``log p(x_t | x_<t)`` for each response
token ``t in [response_start, len)`` — the numbers the reward service needs to
compare with the behaviour log-probs. Sequences are token ids end to end:
nothing is decoded or re-tokenized.

Batching packs length-sorted sequences under a padded-token budget. Padding is
described by lengths, never by a pad token id: the attention mask and position
ids come from the true lengths, so left and right padding give the same
numbers as scoring each sequence alone.
"""

from __future__ import annotations

import inspect
import numbers
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlfleet.services.common.errors import InvalidArgument, Unavailable
from rlfleet.services.reference.config import ReferenceConfig
from rlfleet.wire.dtypes import dtype_from_name

TokenSequence = Sequence[int] | Tensor


@dataclass(frozen=True)
class ReferenceScores:
    """Per-sample results, each a 1-D float32 tensor over the sample's response tokens."""

    log_probs: list[Tensor]
    """``log p(token_t | tokens_<t)`` for ``t`` in ``[response_start, len)``."""
    entropies: list[Tensor] | None = None
    """Entropy of the model's next-token distribution at the same positions, if asked for."""


def plan_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices into batches with ``len(batch) * max_len(batch) <= token_budget``.

    Longest first, so each batch is padded to its first member. A sequence longer
    than the budget on its own still gets a (single-sample) batch.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    batches: list[list[int]] = []
    for index in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= token_budget:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


class ReferenceScorer:
    """A frozen HF causal LM that scores token sequences. Call :meth:`load` before use."""

    def __init__(self, config: ReferenceConfig) -> None:
        self.config = config
        self.model: Any = None
        self.vocab_size = 0
        self.max_len = 0
        self._accepts_logits_to_keep = False
        self._forward_lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self.model is not None

    def load(self) -> None:
        """Load and freeze the model (idempotent)."""
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        model = AutoModelForCausalLM.from_pretrained(
            self.config.model_path,
            dtype=dtype_from_name(self.config.dtype),
            attn_implementation=self.config.attn_implementation,
            trust_remote_code=self.config.trust_remote_code,
        )
        model.to(self.config.device).eval().requires_grad_(False)
        # The input embedding is what token ids index: its size is the real bound.
        self.vocab_size = model.get_input_embeddings().num_embeddings
        model_max = getattr(model.config, "max_position_embeddings", None) or self.config.token_budget
        self.max_len = self.config.max_len or min(model_max, self.config.token_budget)
        self._accepts_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.model = model

    # ------------------------------------------------------------- validation

    def check_size(self, sequences: int, tokens: int) -> None:
        """InvalidArgument unless a request of this many sequences and tokens is accepted
        (``max_request_tokens``); cheap, so callers run it before splitting the request."""
        limit = self.config.max_request_tokens
        if tokens > limit:
            raise InvalidArgument(f"token_ids: the request holds {tokens} tokens, max_request_tokens is {limit}")
        if sequences > limit // 2:
            raise InvalidArgument(f"token_ids: the request holds {sequences} sequences, at most {limit // 2} fit "
                                  f"in max_request_tokens={limit} (each needs two tokens)")

    def validate(
        self, sequences: Sequence[TokenSequence], response_starts: Sequence[int]
    ) -> list[Tensor]:
        """Check every sample; return the sequences as 1-D CPU LongTensors."""
        if not self.loaded:
            raise Unavailable("reference model is not loaded yet")
        if len(sequences) != len(response_starts):
            raise InvalidArgument(
                f"{len(sequences)} sequences but {len(response_starts)} response_starts"
            )
        self.check_size(len(sequences), 0)
        tokens = [
            self._validate_one(index, sequence, start)
            for index, (sequence, start) in enumerate(zip(sequences, response_starts))
        ]
        self.check_size(len(tokens), sum(sequence.numel() for sequence in tokens))
        return tokens

    def _validate_one(self, index: int, sequence: TokenSequence, start: int) -> Tensor:
        try:
            tokens = torch.as_tensor(sequence).cpu()
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise InvalidArgument(f"sample {index}: sequence is not a list of token ids: {exc}") from exc
        if tokens.ndim != 1:
            raise InvalidArgument(f"sample {index}: sequence must be 1-D, got shape {tuple(tokens.shape)}")
        length = tokens.numel()
        if length == 0:
            raise InvalidArgument(f"sample {index}: sequence is empty")
        if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
            raise InvalidArgument(f"sample {index}: token ids must be integers, got {tokens.dtype}")
        if length == 1:
            raise InvalidArgument(
                f"sample {index}: sequence has 1 token; scoring needs at least one prompt "
                "token and one response token"
            )
        if length > self.max_len:
            raise InvalidArgument(f"sample {index}: sequence has {length} tokens, max_len is {self.max_len}")
        if isinstance(start, bool) or not isinstance(start, numbers.Integral) or not 1 <= start < length:
            raise InvalidArgument(
                f"sample {index}: response_start {start!r} must be an int in [1, {length - 1}] "
                f"for a sequence of {length} tokens"
            )
        bad = ((tokens < 0) | (tokens >= self.vocab_size)).nonzero()
        if bad.numel():
            position = int(bad[0, 0])
            raise InvalidArgument(
                f"sample {index}, token {position}: id {int(tokens[position])} is outside the "
                f"vocabulary [0, {self.vocab_size})"
            )
        return tokens.long()

    # ---------------------------------------------------------------- scoring

    def score(
        self,
        sequences: Sequence[TokenSequence],
        response_starts: Sequence[int],
        with_entropy: bool = False,
    ) -> ReferenceScores:
        """Validate, then score. Results are in the order of ``sequences``."""
        tokens = self.validate(sequences, response_starts)
        return self.score_validated(tokens, [int(start) for start in response_starts], with_entropy)

    def score_validated(
        self, sequences: list[Tensor], response_starts: list[int], with_entropy: bool = False
    ) -> ReferenceScores:
        """Score sequences already returned by :meth:`validate` (no checks repeated)."""
        log_probs: list[Tensor] = [torch.empty(0)] * len(sequences)
        entropies: list[Tensor] = [torch.empty(0)] * len(sequences)
        lengths = [sequence.numel() for sequence in sequences]
        with self._forward_lock, torch.inference_mode():
            for batch in plan_batches(lengths, self.config.token_budget):
                results = self._forward(
                    [sequences[i] for i in batch], [response_starts[i] for i in batch], with_entropy
                )
                for index, (row_log_probs, row_entropy) in zip(batch, results):
                    log_probs[index] = row_log_probs
                    entropies[index] = row_entropy
        return ReferenceScores(log_probs, entropies if with_entropy else None)

    def _forward(
        self, sequences: list[Tensor], starts: list[int], with_entropy: bool
    ) -> list[tuple[Tensor, Tensor]]:
        device = self.model.device
        lengths = [sequence.numel() for sequence in sequences]
        width = max(lengths)
        # Where each row starts inside the padded batch.
        offsets = [width - n if self.config.padding_side == "left" else 0 for n in lengths]

        # Pad value 0 is an arbitrary valid id: the mask, not the id, marks padding.
        input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
        attention_mask = torch.zeros(len(sequences), width, dtype=torch.long)
        for row, (sequence, offset) in enumerate(zip(sequences, offsets)):
            input_ids[row, offset : offset + sequence.numel()] = sequence
            attention_mask[row, offset : offset + sequence.numel()] = 1
        position_ids = (torch.arange(width) - torch.tensor(offsets).unsqueeze(-1)).clamp_min(0)

        # Logits at padded position p predict the token at p + 1. Only positions that
        # predict a response token are needed: [first, last) over the batch.
        first = min(offset + start - 1 for offset, start in zip(offsets, starts))
        last = max(offset + n - 1 for offset, n in zip(offsets, lengths))
        kwargs: dict[str, Any] = {}
        if self._accepts_logits_to_keep:
            kwargs["logits_to_keep"] = torch.arange(first, last, device=device)
        logits = self.model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            use_cache=False,
            **kwargs,
        ).logits
        kept_from = first if self._accepts_logits_to_keep else 0

        results = []
        for row, (sequence, offset, start) in enumerate(zip(sequences, offsets, starts)):
            begin = offset + start - 1 - kept_from
            end = offset + sequence.numel() - 1 - kept_from
            # float32 log-softmax one row at a time bounds the memory to one row's vocab.
            row_log_probs = logits[row, begin:end].float().log_softmax(dim=-1)
            targets = sequence[start:].to(device)
            chosen = row_log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            if with_entropy:
                probs = row_log_probs.exp()
                entropy = torch.where(probs > 0, -probs * row_log_probs, 0.0).sum(dim=-1)
            else:
                entropy = torch.empty(0)
            results.append((chosen.cpu(), entropy.cpu()))
        return results
