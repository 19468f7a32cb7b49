"""GenerationEngine: a vLLM AsyncLLM with admission control, GRPO groups and
behaviour log-probs; its weight pushes are ``weights`` (``weight_swaps.WeightSwaps``).

Knows nothing of gRPC; a servicer adapts it. Errors are domain exceptions
from ``rlfleet.services.common.errors``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from rlfleet.services.common import host
from rlfleet.services.common.errors import Aborted, FailedPrecondition, InvalidArgument, ResourceExhausted
from rlfleet.services.common.run_ids import MAX_SHARE_WEIGHT
from rlfleet.services.common.sampling_spec import SamplingSpec
from rlfleet.services.generation import queue_poll
from rlfleet.services.generation.config import GenerationEngineConfig
from rlfleet.services.generation.fair_share import FairShare
from rlfleet.services.generation.prompt_tokens import PromptTokenizer
from rlfleet.services.generation.push_validation import read_checkpoint_specs
from rlfleet.services.generation.rollout import Rollout
from rlfleet.services.generation.sampling import SampleResult
from rlfleet.services.generation.served_adapters import held_while_read
from rlfleet.services.generation.run_streams import RunHost
from rlfleet.services.generation.status import EngineState, EngineStatus, ReplicaState, RunStatus, TokenRate
from rlfleet.services.generation.transfer import WEIGHT_TRANSFER_CONFIG
from rlfleet.services.generation.weight_swaps import WeightSwaps

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)
T = TypeVar("T")

ENGINE_CORE_MAX_CPUS = 2
"""On a CPU host of at most this many CPUs the model runs in vLLM's engine-core process
(``GenerationEngine._worker_in_engine_core``)."""


def without_sigint(build: Callable[..., T], *args: Any) -> T:
    """``build(*args)`` with SIGINT blocked in the calling thread, so that the processes it starts (vLLM's
    engine core, its workers, their compilers) start with SIGINT blocked, and keep it so.

    A terminal's Ctrl-C signals the whole foreground process group, the engine core included, and vLLM's
    engine core exits on SIGINT (``EngineCoreProc.run_engine_core`` installs its own handler: a disposition
    of SIG_IGN set here would be overridden, a blocked signal is not). It then died before the service
    shut it down, and the service logged an EngineDeadError traceback for a plain Ctrl-C. With SIGINT
    blocked there, the service's own handler (graceful stop) is the only one that acts, and it stops the
    engine as SIGTERM does; vLLM still stops its engine core with SIGTERM, and any other death still
    logs. Signal handlers run in the main thread: blocking SIGINT in this one changes nothing here.

    multiprocessing's resource tracker is started first: the thread that starts it has SIGINT unblocked
    afterwards (``resource_tracker.ensure_running``), and vLLM's spawn would start it here."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return build(*args)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class GenerationEngine:
    """One vLLM engine serving GRPO groups and accepting weight pushes."""

    def __init__(self, config: GenerationEngineConfig) -> None:
        self.config = config
        self.replica = ReplicaState(config.initial_policy_version, config.max_model_len)
        self.weights = WeightSwaps(config, self.replica)
        """Weight pushes: staged, then swapped in as a new policy version."""
        self.prompts = PromptTokenizer(config.tokenizer_path)
        self._requests_running = 0
        self._request_ids_in_flight: set[str] = set()
        self._token_rate = TokenRate(config.tokens_per_second_window_s)
        self._resumed_samples = 0
        self._resumed_tokens = 0
        self.share = FairShare(config.engine_kwargs.get("max_num_seqs", config.max_num_seqs))
        """The batch's sequences, shared between the runs' calls by weight (``fair_share``)."""

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Build the vLLM engine (tens of seconds) and load tokenizer + checkpoint specs."""
        replica = self.replica
        if replica.state is not EngineState.STOPPED:
            raise FailedPrecondition(f"engine is {replica.state.value}, cannot start")
        replica.move_to(EngineState.STARTING)
        try:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self.weights.checkpoint_specs = await asyncio.to_thread(read_checkpoint_specs, self.config.model)
            await asyncio.to_thread(self.prompts.load)
            self._install_queue_poll()
            self._worker_in_engine_core()
            engine_args = AsyncEngineArgs(**self._engine_kwargs())
            # Construction blocks until the engine process is up; a thread keeps
            # the event loop (and a health endpoint on it) responsive meanwhile.
            replica.vllm = await asyncio.to_thread(without_sigint, AsyncLLM.from_engine_args, engine_args)
            replica.vocab_size = replica.vllm.model_config.get_vocab_size()
            replica.max_model_len = replica.vllm.model_config.max_model_len
            # vLLM labels every output token with the engine's weight version;
            # samples read their start/end policy version from those labels.
            # (Also the first call on this loop: it starts the client's output task.)
            await replica.vllm.update_weight_version(str(replica.policy_version))
            from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

            await replica.vllm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
            if self.config.verify_weights:
                await self._calibrate_load_check()
        except BaseException:
            replica.move_to(EngineState.STOPPED)
            if replica.vllm is not None:
                replica.vllm.shutdown()
                replica.vllm = None
            raise
        replica.admission_open.set()
        replica.move_to(EngineState.SERVING)
        logger.info("generation engine ready: %s (policy version %d)",
                    self.config.model, replica.policy_version)

    async def _calibrate_load_check(self) -> None:
        """Each worker learns which of its parameters a push's load copies as they are, from the checkpoint
        it just loaded (``transfer.LoadCheck``): those are checked after every push's load."""
        skipped = await self.replica.vllm.collective_rpc("rlfleet_calibrate_load_check")
        if any(names is None for names in skipped):
            logger.info("weights check: tensor parallel workers hold slices of the parameters; each push's bytes "
                        "are checked against the trainer's fingerprints, not the engine's parameters")
        elif any(skipped):
            names = sorted({name for names in skipped for name in names})
            logger.info("weights check: %d parameters are transformed as they load (%s); their pushed bytes are "
                        "checked, not their values in the engine", len(names), ", ".join(names[:8]))

    def _install_queue_poll(self) -> None:
        """How the engine's processes wait on their queues (``queue_poll``), set before vLLM loads its
        plugins or spawns anything: a spawned engine core or worker reads the variable when it loads
        the plugin, a forked one inherits this process's module already patched."""
        from vllm.platforms import current_platform

        micros = queue_poll.resolve(self.config.queue_poll_us, current_platform.is_cpu())
        os.environ[queue_poll.ENV] = str(micros)
        queue_poll.install()
        logger.info("vLLM queue readers: %s", f"sleep {micros} us between checks" if micros else "vLLM's spin")

    def _worker_in_engine_core(self) -> None:
        """On a CPU host of at most 2 CPUs, the model runs in the engine-core process, as it does on a
        GPU host with one device, instead of in a worker process of its own.

        vLLM's CPU platform turns a one-worker engine's in-process executor ("uni") into a worker
        process ("mp") whenever ``VLLM_ENABLE_V1_MULTIPROCESSING`` is 1, its default
        (``vllm/platforms/cpu.py``), so that the worker can own a team of OpenMP threads bound to the
        host's cores, one core kept for the engine core. With 2 CPUs that team is one thread on CPU 0:
        the worker buys nothing, and costs a third vLLM import (~8 s of CPU) per replica start, its
        memory, a shared-memory queue that every step crosses twice, and the pinning (two replicas
        of the host share CPU 0). ``AsyncLLM`` runs its engine core as a process whatever the
        variable says.

        In the engine core (spawned: nothing has run OpenMP in it before the model loads) the model
        runs the same one torch thread, unpinned: ``OMP_NUM_THREADS=1``, read by the spawned process
        when it imports torch. vLLM does not get there by itself: its CPU worker disables
        ``torch.set_num_threads`` before vLLM's runtime setting of one thread, which leaves torch's
        default of a thread per CPU, spin-waiting between parallel regions (under load from the
        services beside it, generation took several times as long).

        A larger host, a variable already set, an explicit ``VLLM_CPU_OMP_THREADS_BIND`` or a tensor-
        or pipeline-parallel engine keep vLLM's own layout."""
        from vllm.platforms import current_platform

        if (current_platform.is_cpu() and host.cpus() <= ENGINE_CORE_MAX_CPUS
                and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto"
                and all(self.config.engine_kwargs.get(f"{kind}_parallel_size", 1) == 1
                        for kind in ("tensor", "pipeline"))
                and os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") == "0"):
            os.environ.setdefault("OMP_NUM_THREADS", "1")

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
            stream_interval=cfg.stream_interval,
        )
        if cfg.block_size is not None:
            kwargs["block_size"] = cfg.block_size
        if cfg.max_lora_rank is not None:
            # Adapter versions: max_loras in a batch; two more cached on the CPU for the pinned ones.
            # Named runs: each one's current adapter besides those.
            max_loras = cfg.max_loras + cfg.max_runs
            kwargs.update(enable_lora=True, max_lora_rank=cfg.max_lora_rank, max_loras=max_loras,
                          max_cpu_loras=max_loras + 2)
        kwargs.update(cfg.engine_kwargs)
        # Owned keys last: behaviour log-probs must be those of the sampling
        # distribution, and weight pushes go through rlfleet's transfer engine.
        kwargs["logprobs_mode"] = "processed_logprobs"
        kwargs["weight_transfer_config"] = dict(WEIGHT_TRANSFER_CONFIG)
        return kwargs

    async def shutdown(self) -> None:
        """Abort everything in flight and stop the engine process."""
        engine, self.replica.vllm = self.replica.vllm, None
        self.replica.move_to(EngineState.STOPPED)
        self.replica.admission_open.set()  # release callers held by a swap; they see STOPPED
        self.prompts.close()
        self.weights.close()
        if engine is not None:
            # vLLM's shutdown, run in a thread, closes its output queue and then cancels its output
            # handler from there: a handler that reads the closed queue first logs "AsyncLLM
            # output_handler failed" with an EngineDeadError traceback, as if the engine had crashed.
            # Cancelled here first, it reads nothing; a real engine death (no shutdown of ours) still logs.
            handler = getattr(engine, "output_handler", None)
            if handler is not None:
                handler.cancel()
            await asyncio.to_thread(engine.shutdown)

    @property
    def ready(self) -> bool:
        """The engine is up and its weights are well-defined."""
        return self.replica.ready

    @property
    def swapping(self) -> bool:
        """A wait/abort weight swap is running: report NOT_SERVING."""
        return self.replica.state is EngineState.SWAPPING

    @property
    def serving(self) -> bool:
        """Health: SERVING iff this is true."""
        self.replica.check_alive()
        return self.replica.state is EngineState.SERVING

    @property
    def policy_version(self) -> int:
        return self.replica.policy_version

    @property
    def vllm(self) -> AsyncLLM:
        """The vLLM engine itself, for what only vLLM can say (its unfinished requests, its LoRA adapters,
        its prefix cache); Unavailable unless this engine serves."""
        return self.replica.require()

    # ------------------------------------------------------------------ prompts

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt accepted: ``max_prompt_tokens`` if set, at most ``max_model_len - 1``."""
        room = self.replica.max_model_len - 1
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

    def check_sampling(self, sampling: SamplingSpec) -> None:
        """InvalidArgument naming the field unless this replica can serve ``sampling``
        (cheap: run before the prompt is even read, and again by ``generate``)."""
        sampling.validate()
        vocab_size, max_model_len = self.replica.vocab_size, self.replica.max_model_len
        if sampling.n > self.config.max_n:
            raise InvalidArgument(f"sampling.n is {sampling.n}, this replica serves at most max_n={self.config.max_n} "
                                  f"samples per request")
        if sampling.max_tokens >= max_model_len:
            raise InvalidArgument(f"sampling.max_tokens is {sampling.max_tokens}, it must be below max_model_len "
                                  f"{max_model_len} (the prompt takes at least one token)")
        bad = next((t for t in sampling.stop_token_ids if t >= vocab_size), None) if vocab_size else None
        if bad is not None:
            raise InvalidArgument(f"sampling.stop_token_ids: token id {bad} outside vocabulary [0, {vocab_size})")

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
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.replica.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"prompt_token_ids: token id {bad} outside vocabulary [0, {self.replica.vocab_size})"
            )
        if len(prompt_token_ids) + sampling.max_tokens > self.replica.max_model_len:
            raise InvalidArgument(
                f"prompt length {len(prompt_token_ids)} + sampling.max_tokens "
                f"{sampling.max_tokens} exceeds max_model_len {self.replica.max_model_len}"
            )

    # ------------------------------------------------------------------ generation

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingSpec, request_id: str,
        required_version: int | None = None, run_id: str = "", share_weight: float = 0.0,
        run_name: str = "", policy_run: str = "",
    ) -> AsyncIterator[SampleResult]:
        """Sample ``sampling.n`` responses; yield each one as soon as it finishes.

        ``required_version`` (a rolling update's pin; None: any): Aborted unless this replica serves
        it when the request starts, and a swap while it runs ends its samples with "abort" (never
        continued on other weights, whatever the swap's mode).

        ``run_id`` (empty: the replica's own run) names the run whose policy samples: a named run samples
        on the base weights with its own adapter, at its own versions (``served_runs``). The call then
        waits for its run's fair share of the batch (``share_weight``, 0 meaning 1: ``fair_share``).
        ``run_name`` names the run (``ServedRuns.take``); ``policy_run`` has the run of that name sample the
        call instead (``ServedRuns.named``): its adapter and versions, while the call counts as ``run_id``'s.

        Admission is checked at the first iteration: beyond
        ``max_queued_requests`` calls in flight it raises ResourceExhausted.
        A ``resume`` swap in flight is invisible here: the samples it aborted
        are continued on the new weights (``rollout.py``, ``resume.py``).
        Cancelling the consumer or closing the iterator aborts the vLLM
        requests of the call.
        """
        self.replica.require()
        self._validate_request(prompt_token_ids, sampling, request_id)
        weight = _share_weight(share_weight)
        if self.replica.requests_in_flight >= self.config.max_queued_requests:
            raise ResourceExhausted(
                f"generation queue full ({self.replica.requests_in_flight} requests in flight, "
                f"max_queued_requests={self.config.max_queued_requests})"
            )
        runs = self.weights.runs
        run = runs.take(run_id, self.replica.vllm, run_name) if run_id else None
        if policy_run and run is None:
            raise InvalidArgument("policy_run: only a named run's call (run_id set) may sample on another run's policy")
        policy = runs.named(policy_run) if policy_run else run
        host = self if policy is None else RunHost(self, policy)
        rollout = Rollout(host, prompt_token_ids, sampling, request_id, time.monotonic(), required_version)
        samples = rollout.samples()
        self.replica.requests_in_flight += 1
        self.replica.version_bound_requests += required_version is not None
        self._request_ids_in_flight.add(request_id)
        users = [r for r in dict.fromkeys((run, policy)) if r is not None]  # the same run once
        for user in users:  # neither leaves (EndRun, idle) while the call runs
            user.calls += 1
        computed = sampling.computed_samples
        lease = None
        try:
            lease = await self.share.acquire(run_id, weight, computed, computed * sampling.max_tokens)
            yielded = 0
            async for sample in samples:
                yielded += 1  # a finished sample's sequence goes back to the batch
                lease.release(lease.held - (computed - yielded * computed // sampling.n))
                yield sample
        except _vllm_validation_error() as err:
            # Everything vLLM checks is checked above; should a check be missed, the
            # caller still learns that its request, not the replica, is at fault.
            raise InvalidArgument(f"vLLM refused request {request_id}: {err}") from None
        finally:
            await samples.aclose()
            if lease is not None:
                lease.close()
            self.replica.requests_in_flight -= 1
            self.replica.version_bound_requests -= required_version is not None
            self._request_ids_in_flight.discard(request_id)
            if rollout.running:
                self._requests_running -= 1
            for user in users:
                user.calls -= 1
                runs.release(user, self.replica.vllm)

    async def open_stream(self, prompt_token_ids: list[int], params: Any, request_id: str,
                          required_version: int | None = None) -> tuple[AsyncGenerator[Any, None], int, int | None]:
        """One vLLM request of a ``generate`` call, submitted once no swap holds admission (so it
        runs on the weights of the latest swap): its output stream (the request reaches vLLM at the
        first read), the swap serial before it waited (``resumes``), and the version of the LoRA
        adapter it is pinned to (None: none; its tokens are then labelled by vLLM). Unavailable if
        the engine cannot serve."""
        # Read before waiting: a swap may start between the wait's end and the request reaching
        # vLLM, and abort it; counting that swap as "since" lets the request resume.
        swap_serial = self.weights.serial
        # Held here, not inside vLLM, while a swap runs: the request then
        # starts on the new weights and does not delay the drain.
        await self.replica.admission_open.wait()
        engine = self.replica.require()
        if required_version is not None and required_version != self.replica.policy_version:
            raise Aborted(f"request {request_id} is pinned to policy version {required_version}; this replica "
                          f"serves version {self.replica.policy_version}")
        adapter = self.weights.adapters.pin()
        if adapter is None:
            return engine.generate({"prompt_token_ids": prompt_token_ids}, params, request_id), swap_serial, None
        stream = engine.generate({"prompt_token_ids": prompt_token_ids}, params, request_id,
                                 lora_request=adapter.request)
        return held_while_read(stream, lambda: self.weights.adapters.unpin(engine, adapter)), swap_serial, adapter.version

    def end_run(self, run_id: str) -> int:
        """``run_id`` ended (``served_runs.ServedRuns.end``): its calls still in flight."""
        return self.weights.runs.end(run_id, self.replica.vllm).calls

    def resumes(self, swap_serial: int) -> bool:
        """Whether an abort of a request opened at ``swap_serial`` is a ``resume`` swap's (``WeightSwaps.resumes``)."""
        return self.weights.resumes(swap_serial)

    def count_tokens(self, num_tokens: int, now: float, first: bool) -> None:
        """Tokens a call received; ``first``: its first ones (it now counts as running)."""
        self._token_rate.add(num_tokens, now)
        if first:
            self._requests_running += 1

    def count_resume(self, carried_tokens: int) -> None:
        """A sample continued after a ``resume`` swap, carrying ``carried_tokens`` sampled tokens."""
        self._resumed_samples += 1
        self._resumed_tokens += carried_tokens

    # ------------------------------------------------------------------ status

    def status(self) -> EngineStatus:
        return EngineStatus(
            model=self.config.model,
            state=self.replica.state,
            policy_version=self.replica.policy_version,
            requests_in_flight=self.replica.requests_in_flight,
            requests_waiting=self.replica.requests_in_flight - self._requests_running,
            requests_running=self._requests_running,
            max_queued_requests=self.config.max_queued_requests,
            tokens_per_second=self._token_rate.per_second(),
            resumed_samples=self._resumed_samples,
            resumed_tokens=self._resumed_tokens,
            runs=tuple(RunStatus(run.run_id, run.version, run.calls, self.share.waiting_by_run.get(run.run_id, 0),
                                 run.generated_tokens, run.name) for run in self.weights.runs),
            max_runs=self.config.max_runs,
        )


def _share_weight(weight: float) -> float:
    """A request's ``share_weight`` (0 means 1); InvalidArgument outside (0, MAX_SHARE_WEIGHT]."""
    if weight == 0:
        return 1.0
    if not 0 < weight <= MAX_SHARE_WEIGHT:  # NaN fails both
        raise InvalidArgument(f"share_weight is {weight}; it must be in (0, {MAX_SHARE_WEIGHT:g}] (0 means 1)")
    return float(weight)


def _vllm_validation_error() -> type[Exception]:
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError
