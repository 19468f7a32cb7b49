"""GenerationEngine: a vLLM AsyncLLM with admission control, GRPO groups,
behaviour log-probs and versioned in-place weight swaps.

Knows nothing of gRPC; a servicer adapts it. Errors are domain exceptions
from ``rlfleet.services.common.errors``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from rlfleet.choices import SWAP_MODES, SwapModeName
from rlfleet.services.common.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from rlfleet.services.common.sampling_spec import SamplingSpec
from rlfleet.services.generation import queue_poll
from rlfleet.services.generation.config import GenerationEngineConfig
from rlfleet.services.generation.kept_weights import WeightKeeper
from rlfleet.services.generation.served_adapters import AdapterSet, ServedAdapter
from rlfleet.services.generation.prompt_tokens import PromptTokenizer
from rlfleet.services.generation.rollout import Rollout
from rlfleet.services.generation.sampling import SampleResult
from rlfleet.services.generation.status import EngineState, EngineStatus, TokenRate
from rlfleet.services.generation.staging import StagedPush
from rlfleet.services.generation.transfer import WEIGHT_TRANSFER_CONFIG
from rlfleet.services.generation.push_validation import TensorSpec, checkpoint_bytes, read_checkpoint_specs
from rlfleet.v1 import weights_pb2
from rlfleet.wire import WireError, shm, weight_delta
from rlfleet.wire.push_rules import check_manifest

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

SwapMode = SwapModeName


class GenerationEngine:
    """One vLLM engine serving GRPO groups and accepting weight pushes."""

    def __init__(self, config: GenerationEngineConfig) -> None:
        self.config = config
        self._engine: AsyncLLM | None = None
        self.prompts = PromptTokenizer(config.tokenizer_path)
        self._checkpoint_specs: dict[str, TensorSpec] = {}
        self._vocab_size = 0
        self._max_model_len = config.max_model_len
        self._state = EngineState.STOPPED
        self._policy_version = config.initial_policy_version
        # Set while requests may enter vLLM; cleared for the whole of a swap.
        self._admission_open = asyncio.Event()
        self._swap_lock = asyncio.Lock()
        self._requests_in_flight = 0
        self._version_bound_requests = 0
        """Calls in flight with a ``required_version``: a ``keep`` swap runs as ``resume`` (which ends them)."""
        self._requests_running = 0
        self._request_ids_in_flight: set[str] = set()
        self._token_rate = TokenRate(config.tokens_per_second_window_s)
        # Swaps started, and the mode of the latest: tells a resume swap's aborts from others.
        self._swap_serial = 0
        self._swap_mode: SwapMode | None = None
        self._resumed_samples = 0
        self._resumed_tokens = 0
        self._kept = WeightKeeper(config.delta_pushes)  # the served weights, for delta pushes
        self._adapters = AdapterSet()  # LoRA adapters served (max_lora_rank)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Build the vLLM engine (tens of seconds) and load tokenizer + checkpoint specs."""
        if self._state is not EngineState.STOPPED:
            raise FailedPrecondition(f"engine is {self._state.value}, cannot start")
        self._state = EngineState.STARTING
        try:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self._checkpoint_specs = await asyncio.to_thread(
                read_checkpoint_specs, self.config.model
            )
            await asyncio.to_thread(self.prompts.load)
            self._install_queue_poll()
            engine_args = AsyncEngineArgs(**self._engine_kwargs())
            # Construction blocks until the engine process is up; a thread keeps
            # the event loop (and a health endpoint on it) responsive meanwhile.
            self._engine = await asyncio.to_thread(AsyncLLM.from_engine_args, engine_args)
            self._vocab_size = self._engine.model_config.get_vocab_size()
            self._max_model_len = self._engine.model_config.max_model_len
            # vLLM labels every output token with the engine's weight version;
            # samples read their start/end policy version from those labels.
            # (Also the first call on this loop: it starts the client's output task.)
            await self._engine.update_weight_version(str(self._policy_version))
            from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

            await self._engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        except BaseException:
            self._state = EngineState.STOPPED
            if self._engine is not None:
                self._engine.shutdown()
                self._engine = None
            raise
        self._admission_open.set()
        self._state = EngineState.SERVING
        logger.info("generation engine ready: %s (policy version %d)",
                    self.config.model, self._policy_version)

    def _install_queue_poll(self) -> None:
        """How the engine's processes wait on their queues (``queue_poll``), set before vLLM loads its
        plugins or spawns anything: a spawned engine core or worker reads the variable when it loads
        the plugin, a forked one inherits this process's module already patched."""
        from vllm.platforms import current_platform

        micros = queue_poll.resolve(self.config.queue_poll_us, current_platform.is_cpu())
        os.environ[queue_poll.ENV] = str(micros)
        queue_poll.install()
        logger.info("vLLM queue readers: %s", f"sleep {micros} us between checks" if micros else "vLLM's spin")

    def _engine_kwargs(self) -> dict[str, Any]:
        cfg = self.config
        kwargs: dict[str, Any] = dict(
            model=cfg.model,
            tokenizer=cfg.tokenizer_path,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            seed=cfg.seed,
            max_num_seqs=cfg.max_num_seqs,
            enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        )
        if cfg.block_size is not None:
            kwargs["block_size"] = cfg.block_size
        if cfg.max_lora_rank is not None:
            # Adapter versions: max_loras in a batch; two more cached on the CPU for the pinned ones.
            kwargs.update(enable_lora=True, max_lora_rank=cfg.max_lora_rank, max_loras=cfg.max_loras,
                          max_cpu_loras=cfg.max_loras + 2)
        kwargs.update(cfg.engine_kwargs)
        # Owned keys last: behaviour log-probs must be those of the sampling
        # distribution, and weight pushes go through rlfleet's transfer engine.
        kwargs["logprobs_mode"] = "processed_logprobs"
        kwargs["weight_transfer_config"] = dict(WEIGHT_TRANSFER_CONFIG)
        return kwargs

    async def shutdown(self) -> None:
        """Abort everything in flight and stop the engine process."""
        engine, self._engine = self._engine, None
        self._state = EngineState.STOPPED
        self._admission_open.set()  # release callers held by a swap; they see STOPPED
        self.prompts.close()
        self._kept.drop()
        self._adapters.close()
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)

    @property
    def ready(self) -> bool:
        """The engine is up and its weights are well-defined."""
        return self._state in (EngineState.SERVING, EngineState.SWAPPING)

    @property
    def swapping(self) -> bool:
        """A wait/abort weight swap is running: report NOT_SERVING."""
        return self._state is EngineState.SWAPPING

    @property
    def serving(self) -> bool:
        """Health: SERVING iff this is true."""
        self._check_engine_alive()
        return self._state is EngineState.SERVING

    def _check_engine_alive(self) -> None:
        """An engine core that died (crash, OOM kill) fails the engine for good: health goes NOT_SERVING."""
        if self._engine is not None and self._state in (EngineState.SERVING, EngineState.SWAPPING) \
                and self._engine.errored:
            logger.error("vLLM engine core is dead; this replica stops serving")
            self._state = EngineState.FAILED

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def vllm(self) -> AsyncLLM:
        """The vLLM engine itself, for what only vLLM can say (its unfinished requests, its LoRA adapters,
        its prefix cache); Unavailable unless this engine serves."""
        return self._require_engine()

    def _require_engine(self) -> AsyncLLM:
        self._check_engine_alive()
        if self._engine is None or not self.ready:
            raise Unavailable(f"generation engine is {self._state.value}")
        return self._engine

    # ------------------------------------------------------------------ prompts

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt accepted: ``max_prompt_tokens`` if set, at most ``max_model_len - 1``."""
        room = self._max_model_len - 1
        return min(self.config.max_prompt_tokens or room, room)

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` through the model's chat template."""
        return self.prompts.render_chat(messages, add_generation_prompt)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of raw ``text`` (no chat template, no special tokens added)."""
        return self.prompts.tokenize(text)

    async def encode_text(self, text: str) -> list[int]:
        """``tokenize``, bounded and off the event loop."""
        return await self.prompts.encode_text(text, self.max_prompt_tokens)

    async def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """``render_chat``, bounded and off the event loop."""
        return await self.prompts.encode_chat(messages, self.max_prompt_tokens)

    def check_version(self, version: int) -> None:
        """FailedPrecondition unless ``version`` is newer than the serving one (checked
        before a push's bytes arrive; ``update_weights`` checks again under its lock)."""
        if version <= self._policy_version:
            raise FailedPrecondition(
                f"weights version {version} is not newer than current {self._policy_version}"
            )

    def check_sampling(self, sampling: SamplingSpec) -> None:
        """InvalidArgument naming the field unless this replica can serve ``sampling``
        (cheap: run before the prompt is even read, and again by ``generate``)."""
        sampling.validate()
        if sampling.n > self.config.max_n:
            raise InvalidArgument(f"sampling.n is {sampling.n}, this replica serves at most max_n={self.config.max_n} "
                                  f"samples per request")
        if sampling.max_tokens >= self._max_model_len:
            raise InvalidArgument(f"sampling.max_tokens is {sampling.max_tokens}, it must be below max_model_len "
                                  f"{self._max_model_len} (the prompt takes at least one token)")
        bad = next((t for t in sampling.stop_token_ids if t >= self._vocab_size), None) if self._vocab_size else None
        if bad is not None:
            raise InvalidArgument(f"sampling.stop_token_ids: token id {bad} outside vocabulary [0, {self._vocab_size})")

    def _validate_request(
        self, prompt_token_ids: Sequence[int], sampling: SamplingSpec, request_id: str
    ) -> None:
        if not request_id:
            raise InvalidArgument("request_id must not be empty")
        if request_id in self._request_ids_in_flight:
            raise InvalidArgument(f"request_id {request_id!r} is already in flight")
        self.check_sampling(sampling)
        if not prompt_token_ids:
            raise InvalidArgument("prompt_token_ids must not be empty")
        if len(prompt_token_ids) > self.max_prompt_tokens:
            raise InvalidArgument(f"prompt is {len(prompt_token_ids)} tokens long, this replica accepts at most "
                                  f"max_prompt_tokens={self.max_prompt_tokens}")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self._vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"prompt_token_ids: token id {bad} outside vocabulary [0, {self._vocab_size})"
            )
        if len(prompt_token_ids) + sampling.max_tokens > self._max_model_len:
            raise InvalidArgument(
                f"prompt length {len(prompt_token_ids)} + sampling.max_tokens "
                f"{sampling.max_tokens} exceeds max_model_len {self._max_model_len}"
            )

    # ------------------------------------------------------------------ generation

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingSpec, request_id: str,
        required_version: int | None = None,
    ) -> AsyncIterator[SampleResult]:
        """Sample ``sampling.n`` responses; yield each one as soon as it finishes.

        ``required_version`` (a rolling update's pin; None: any): Aborted unless this replica serves
        it when the request starts, and a swap while it runs ends its samples with "abort" (never
        continued on other weights, whatever the swap's mode).

        Admission is checked at the first iteration: beyond
        ``max_queued_requests`` calls in flight it raises ResourceExhausted.
        A ``resume`` swap in flight is invisible here: the samples it aborted
        are continued on the new weights (``rollout.py``, ``resume.py``).
        Cancelling the consumer or closing the iterator aborts the vLLM
        requests of the call.
        """
        self._require_engine()
        self._validate_request(prompt_token_ids, sampling, request_id)
        if self._requests_in_flight >= self.config.max_queued_requests:
            raise ResourceExhausted(
                f"generation queue full ({self._requests_in_flight} requests in flight, "
                f"max_queued_requests={self.config.max_queued_requests})"
            )
        rollout = Rollout(self, prompt_token_ids, sampling, request_id, time.monotonic(), required_version)
        samples = rollout.samples()
        self._requests_in_flight += 1
        self._version_bound_requests += required_version is not None
        self._request_ids_in_flight.add(request_id)
        try:
            async for sample in samples:
                yield sample
        except _vllm_validation_error() as err:
            # Everything vLLM checks is checked above; should a check be missed, the
            # caller still learns that its request, not the replica, is at fault.
            raise InvalidArgument(f"vLLM refused request {request_id}: {err}") from None
        finally:
            await samples.aclose()
            self._requests_in_flight -= 1
            self._version_bound_requests -= required_version is not None
            self._request_ids_in_flight.discard(request_id)
            if rollout.running:
                self._requests_running -= 1

    async def open_stream(self, prompt_token_ids: list[int], params: Any, request_id: str,
                          required_version: int | None = None) -> tuple[AsyncGenerator[Any, None], int, int | None]:
        """One vLLM request of a ``generate`` call, submitted once no swap holds admission (so it
        runs on the weights of the latest swap): its output stream (the request reaches vLLM at the
        first read), the swap serial before it waited (``resumes``), and the version of the LoRA
        adapter it is pinned to (None: none; its tokens are then labelled by vLLM). Unavailable if
        the engine cannot serve."""
        # Read before waiting: a swap may start between the wait's end and the request reaching
        # vLLM, and abort it; counting that swap as "since" lets the request resume.
        swap_serial = self._swap_serial
        # Held here, not inside vLLM, while a swap runs: the request then
        # starts on the new weights and does not delay the drain.
        await self._admission_open.wait()
        engine = self._require_engine()
        if required_version is not None and required_version != self._policy_version:
            raise Aborted(f"request {request_id} is pinned to policy version {required_version}; this replica "
                          f"serves version {self._policy_version}")
        adapter = self._adapters.pin()
        if adapter is None:
            return engine.generate({"prompt_token_ids": prompt_token_ids}, params, request_id), swap_serial, None
        stream = self._pinned(engine, engine.generate({"prompt_token_ids": prompt_token_ids}, params, request_id,
                                                      lora_request=adapter.request), adapter)
        return stream, swap_serial, adapter.version

    async def _pinned(self, engine: AsyncLLM, stream: AsyncGenerator[Any, None],
                      adapter: ServedAdapter) -> AsyncGenerator[Any, None]:
        """``stream``, counting as a user of ``adapter`` until it ends or is closed."""
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()
            self._adapters.unpin(engine, adapter)

    def resumes(self, swap_serial: int) -> bool:
        """Whether an abort of a vLLM request opened at ``swap_serial`` is a ``resume`` swap's (one
        started since, and it is the latest swap; should an ``abort`` swap start before the abort is
        read, the sample finishes with "abort"): its unfinished samples are continued."""
        return self._swap_serial > swap_serial and self._swap_mode == "resume"

    def count_tokens(self, num_tokens: int, now: float, first: bool) -> None:
        """Tokens a call received; ``first``: its first ones (it now counts as running)."""
        self._token_rate.add(num_tokens, now)
        if first:
            self._requests_running += 1

    def count_resume(self, carried_tokens: int) -> None:
        """A sample continued after a ``resume`` swap, carrying ``carried_tokens`` sampled tokens."""
        self._resumed_samples += 1
        self._resumed_tokens += carried_tokens

    # ------------------------------------------------------------------ weights

    @property
    def max_push_bytes(self) -> int:
        """Largest weight push accepted: ``max_push_bytes``, or ``max_push_factor`` x the checkpoint's bytes."""
        if self.config.max_push_bytes is not None:
            return self.config.max_push_bytes
        return int(self.config.max_push_factor * checkpoint_bytes(self._checkpoint_specs))

    def stage(self, manifest: weights_pb2.WeightManifest, max_bytes: int | None = None) -> StagedPush:
        """First phase of a push: check version and manifest, prepare where the bytes go.

        The manifest is checked against the served model and ``max_bytes``
        (default ``max_push_bytes``) before any memory is given to it. Nothing
        touches the engine; the caller fills a grpc push's segment, then
        ``apply``s or ``close``s the staged push."""
        if self._engine is None or self._state in (EngineState.STOPPED, EngineState.STARTING):
            raise Unavailable(f"generation engine is {self._state.value}")
        if not manifest.resync:
            self.check_version(manifest.version)
        try:
            check_manifest(manifest, "collector")
        except WireError as err:
            raise InvalidArgument(str(err)) from None
        kept = None
        if manifest.HasField("lora"):
            self._check_adapter(manifest)
        elif weight_delta.is_delta(manifest):
            kept = self._delta_base(manifest)
        return StagedPush.begin(manifest, self._checkpoint_specs,
                                self.max_push_bytes if max_bytes is None else max_bytes, kept)

    def _check_adapter(self, manifest: weights_pb2.WeightManifest) -> None:
        """FAILED_PRECONDITION for an adapter push this replica cannot serve (started without LoRA, or
        with a smaller ``max_lora_rank``)."""
        if self.config.max_lora_rank is None:
            raise FailedPrecondition("adapter push refused: this replica serves no LoRA adapters (start it with "
                                     "max_lora_rank)")
        if manifest.lora.rank > self.config.max_lora_rank:
            raise FailedPrecondition(f"adapter push refused: its rank {manifest.lora.rank} is above this replica's "
                                     f"max_lora_rank {self.config.max_lora_rank}")

    def _delta_base(self, manifest: weights_pb2.WeightManifest) -> weights_pb2.WeightManifest:
        """The full manifest of the kept weights a delta push patches; FAILED_PRECONDITION (the
        collector then re-syncs this replica with a full push) unless they are its base version's."""
        base = manifest.delta.base_version
        if not self.config.delta_pushes:
            raise FailedPrecondition(f"delta push on version {base} refused: this replica keeps no weights to "
                                     f"patch (delta_pushes is off); it takes full pushes")
        kept = self._kept.manifest
        if base != self._policy_version or kept is None or kept.version != base:
            held = f"keeps the weights of version {kept.version}" if kept is not None else "keeps no weights"
            raise FailedPrecondition(f"delta push on version {base}: this replica serves version "
                                     f"{self._policy_version} and {held}; it needs a full push")
        return kept

    async def apply(self, staged: StagedPush) -> None:
        """Second phase: swap the staged weights in as policy ``staged.version``.

        - ``wait``: hold new requests, let in-flight ones finish, swap, resume.
        - ``abort``: abort in-flight requests (they finish with "abort"), swap.
        - ``keep``: freeze in-flight requests, swap, resume them; their KV is
          recomputed with the new weights (vLLM preempts them:
          ``clear_cache=True``) and their samples report
          ``policy_version_start != policy_version_end``.
        - ``resume``: abort in-flight requests, swap, and let each ``generate``
          call continue its unfinished samples as new requests (prompt + the
          tokens sampled so far, the budget left) on the new weights; callers
          see them finish normally with spans split at the swap. Requests with
          stop strings finish with "abort" instead (see ``resume.py``).

        ``keep`` and ``resume`` swaps leave the engine SERVING (new requests
        wait for the swap); ``wait`` and ``abort`` ones report SWAPPING.

        Once started the swap runs to completion even if the caller goes away
        (a half-done pause/load/resume would wedge the engine). The version
        moves only after vLLM loaded the weights and reports their version; if
        loading fails inside vLLM the engine turns FAILED (not serving) until
        a later push succeeds.
        """
        engine = self._engine
        # A FAILED engine accepts pushes: a push is a complete replacement, so
        # one that applies makes the weights well-defined again.
        if engine is None or self._state in (EngineState.STOPPED, EngineState.STARTING):
            raise Unavailable(f"generation engine is {self._state.value}")
        staged.push.finish()
        async with self._swap_lock:
            if not staged.resync:
                self.check_version(staged.version)
            if staged.adapter is not None:
                await asyncio.shield(self._apply_adapter(engine, staged))
                return
            if staged.delta is not None:
                await self._patch_kept(staged)
            # Requests pinned to an adapter cannot go on with other weights under it: "keep" resumes them;
            # requests bound to a version are never continued (resume ends them with "abort").
            bound = self._adapters.current is not None or self._version_bound_requests
            mode = "resume" if staged.mode == "keep" and bound else staged.mode
            await asyncio.shield(self._swap(engine, staged.version, mode, staged.transport,
                                            lambda: self._load_weights(engine, staged)))
            if staged.delta is None:
                segment, staged.segment = staged.segment, None
                self._kept.keep(staged.version, staged.manifest, segment)

    async def _apply_adapter(self, engine: AsyncLLM, staged: StagedPush) -> None:
        """An adapter push's commit: added to vLLM, then current. ``keep``: nothing pauses (requests
        running go on with the adapter they started on); other modes as for weights."""
        config, names = staged.adapter
        try:
            adapter = await self._adapters.load(engine, staged.version, config, names, staged.push.dtypes,
                                                staged.push.shapes, staged.segment.buffer)
        except (InvalidArgument, FailedPrecondition):
            raise
        except Exception as err:  # vLLM refused it: nothing changed, the replica serves on
            raise InvalidArgument(f"vLLM refused the adapter of version {staged.version}: {err}") from None
        if staged.mode == "keep":
            self._adapters.switch(engine, adapter)
            self._policy_version = staged.version
            logger.info("serving adapter version %d (rank %d, keep: nothing paused)", staged.version, config.rank)
            return

        async def switch() -> None:
            self._adapters.switch(engine, adapter)
        try:
            await self._swap(engine, staged.version, staged.mode, staged.transport, switch)
        except BaseException:
            if self._adapters.current is not adapter:
                await self._adapters.discard(adapter, engine)
            raise

    async def _patch_kept(self, staged: StagedPush) -> None:
        """A delta's commit: its bytes into the kept weights, which the swap then loads from."""
        kept = await self._kept.current()
        base = staged.manifest.delta.base_version
        if kept is None or kept.version != base or self._policy_version != base:
            raise FailedPrecondition(f"delta push on version {base}: this replica now serves version "
                                     f"{self._policy_version}; it needs a full push")
        await asyncio.to_thread(self._kept.patch, kept, staged.version, staged.delta, staged.segment.buffer)
        staged.loads_from = kept

    async def receive_nccl(self, staged: StagedPush) -> None:
        """Stage an nccl push: join the trainer's NCCL group (a collective: the trainer and every
        other replica join at the same time), receive its broadcast into the staged segment, leave.

        One group per push: a replica that went away never wedges the next one. Unverified: no
        GPU vLLM runs where this was written (see docs/guides/weight-sync.md)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        from rlfleet.services.generation.transfer import stage_nccl_push

        engine = self._require_engine()
        await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={"nccl": staged.nccl}))
        try:
            written = await engine.collective_rpc(stage_nccl_push, args=(staged.update_info(),))
        finally:
            await engine.shutdown_weight_transfer_engine()
        if max(written, default=0) != staged.push.total_bytes:
            raise Aborted(f"nccl push: {max(written, default=0)} of {staged.push.total_bytes} bytes staged; "
                          f"nothing applied")
        staged.push.received = staged.push.total_bytes

    async def update_weights(self, version: int, named_tensors, mode: SwapMode = "wait",
                             base_version: int | None = None, lora: weights_pb2.LoraAdapter | None = None) -> None:
        """Stage ``(name, tensor)`` pairs in a segment and apply them (in-process callers and tests);
        ``base_version`` set: a delta push on that version (only the tensors that changed); ``lora``: an
        adapter push (the pairs are its factors)."""
        if mode not in SWAP_MODES:
            raise InvalidArgument(f"mode must be one of {', '.join(SWAP_MODES)}, got {mode!r}")
        from rlfleet.wire.push_messages import iter_push_messages

        pairs = list(named_tensors)
        _, manifest = next(iter_push_messages(pairs, version=version, checksum_algo=None,
                                              mode=SWAP_MODES[mode]))
        if base_version is not None:
            manifest.delta.base_version = base_version
        if lora is not None:
            manifest.lora.CopyFrom(lora)
        staged = self.stage(manifest)
        try:
            shm.write_tensors(staged.segment, [tensor for _, tensor in pairs])
            staged.push.received = staged.push.total_bytes
            await self.apply(staged)
        finally:
            staged.close()

    async def _load_weights(self, engine: AsyncLLM, staged: StagedPush) -> None:
        """A weight push's part of a swap: vLLM loads it, and reports its version; any adapter goes."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        version = staged.version
        await engine.start_weight_update()
        await engine.update_weights(WeightTransferUpdateRequest(update_info=staged.update_info()))
        await engine.finish_weight_update(weight_version=str(version))
        if not await engine.reset_prefix_cache():
            raise RuntimeError("prefix cache reset failed after the swap")
        engine_version = await engine.get_weight_version()
        if engine_version != str(version):
            raise RuntimeError(f"engine reports weight version {engine_version!r} after applying {version}")
        self._adapters.switch(engine, None)

    async def _swap(self, engine: AsyncLLM, version: int, mode: SwapMode, transport: str, load) -> None:
        """Pause, ``load()`` (weights or an adapter), move the version, resume (see ``apply``)."""
        self._admission_open.clear()
        self._swap_serial += 1
        self._swap_mode = mode
        if mode not in ("keep", "resume"):
            self._state = EngineState.SWAPPING
        started = time.monotonic()
        try:
            # clear_cache=True also preempts kept requests so their KV is
            # rebuilt with the new weights when they resume. A resume swap
            # aborts in vLLM; the generate calls continue their samples.
            await engine.pause_generation(mode="abort" if mode == "resume" else mode, clear_cache=True)
            await load()
            self._policy_version = version
            await engine.resume_generation()
        except BaseException:
            # The weights may be half-written: never serve from them (nor patch what was kept).
            self._kept.drop()
            self._state = EngineState.FAILED
            logger.exception("weight swap to version %d failed; engine marked failed", version)
            raise
        finally:
            self._admission_open.set()
        self._state = EngineState.SERVING
        logger.info("swapped to policy version %d (%s, %s) in %.3fs",
                    version, mode, transport, time.monotonic() - started)

    @property
    def transfer_world_size(self) -> int:
        """Inference workers of this engine (NCCL ranks it takes in an nccl push)."""
        if self._engine is None:
            return 0
        parallel = self._engine.vllm_config.parallel_config
        return parallel.tensor_parallel_size * parallel.pipeline_parallel_size

    async def engine_weight_version(self) -> str:
        """The weight version vLLM itself reports (``get_weight_version``)."""
        return await self._require_engine().get_weight_version()

    # ------------------------------------------------------------------ status

    def status(self) -> EngineStatus:
        return EngineStatus(
            model=self.config.model,
            state=self._state,
            policy_version=self._policy_version,
            requests_in_flight=self._requests_in_flight,
            requests_waiting=self._requests_in_flight - self._requests_running,
            requests_running=self._requests_running,
            max_queued_requests=self.config.max_queued_requests,
            tokens_per_second=self._token_rate.per_second(),
            resumed_samples=self._resumed_samples,
            resumed_tokens=self._resumed_tokens,
        )


def _vllm_validation_error() -> type[Exception]:
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError
