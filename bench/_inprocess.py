"""The in-process vLLM baseline of ``bench/pipeline.py`` (part c): plain ``AsyncLLM`` in the bench's process.

Built from the generation service's own config (the flags the suite passes it), with the kwargs
the service builds its engine from, so both sides run the same engine settings (dtype,
max_model_len, max_num_seqs, KV-cache bytes, prefix caching, seed, eager mode,
``logprobs_mode="processed_logprobs"``). Only the weight-transfer config is left out: it decides
how pushes arrive, not how tokens are computed, and this engine is never pushed to.

Prompts are token ids made by the same tokenizer call the service makes for a text prompt
(``PromptTokenizer.tokenize``: no chat template, no special tokens), so both sides feed vLLM the
same ids; ``pipeline.py`` checks that against the prompts the trainer receives. Sampling asks for
what the pipeline delivers, as a plain user would: ``n`` samples, the sampled token's log-prob
(``logprobs=0``), token ids only (no detokenizing), the final output only.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any


def engine_kwargs(service_args: list[str], layout: str = "plain") -> dict[str, Any]:
    """The ``AsyncEngineArgs`` kwargs the generation service builds from ``service_args``.

    ``layout="service"`` also gives this process's engine the service's process layout and queue
    readers (set in the environment its engine core is spawned with, and in this process's vLLM
    modules): on a host of at most 2 CPUs the model in the engine-core process, one torch thread, and
    readers that sleep between checks. ``"plain"`` leaves vLLM's own: a worker process, spinning readers."""
    from rlfleet.services.generation.config import GenerationConfig, GenerationEngineConfig
    from rlfleet.services.generation.vllm_engine import GenerationEngine

    config = GenerationConfig.load(service_args, environ={})
    engine_config = GenerationEngineConfig(**{name: getattr(config, name)
                                              for name in GenerationEngineConfig.model_fields})
    # Private on purpose: the baseline must build exactly what the service builds, today and after
    # the service's settings change.
    engine = GenerationEngine(engine_config)
    if layout == "service":
        engine._install_queue_poll()
        engine._worker_in_engine_core()
    kwargs = engine._engine_kwargs()
    kwargs.pop("weight_transfer_config", None)
    return kwargs


def prompt_token_ids(tokenizer_path: str, texts: list[str]) -> list[list[int]]:
    """Token ids of text prompts, as the generation service tokenizes a ``Prompt.text``."""
    from rlfleet.services.generation.prompt_tokens import PromptTokenizer

    tokenizer = PromptTokenizer(tokenizer_path)
    tokenizer.load()
    return [tokenizer.tokenize(text) for text in texts]


class InProcessEngine:
    """A plain vLLM ``AsyncLLM`` (its engine core is a child process, as in the service)."""

    def __init__(self, kwargs: dict[str, Any]):
        self.kwargs = kwargs
        self.engine = None

    async def start(self) -> "InProcessEngine":
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # Built off the loop (tens of seconds); the engine binds to the running loop on first use.
        self.engine = await asyncio.to_thread(AsyncLLM.from_engine_args, AsyncEngineArgs(**self.kwargs))
        return self

    async def shutdown(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await asyncio.to_thread(engine.shutdown)

    async def generate_groups(self, prompts: list[list[int]], group_size: int, max_tokens: int) -> tuple[float, int]:
        """Seconds to sample ``group_size`` responses of every prompt, all submitted at once (vLLM's
        ``max_num_seqs`` bounds the batch, as in the service); and the samples made."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(n=group_size, temperature=1.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)

        async def one(ids: list[int]) -> int:
            samples = 0
            async for output in self.engine.generate({"prompt_token_ids": ids}, params, uuid.uuid4().hex):
                samples = sum(len(c.token_ids) == max_tokens and c.logprobs is not None for c in output.outputs)
            return samples

        started = time.perf_counter()
        samples = await asyncio.gather(*(one(ids) for ids in prompts))
        return time.perf_counter() - started, sum(samples)
