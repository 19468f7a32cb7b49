"""``AsyncClient``: the one implementation of the trainer-side SDK (``grpc.aio``).

The sync ``Client`` runs these same coroutines on a private event loop.
A trainer needs only the collector's address: it serves CollectorService and
forwards TrajectoryService.StreamBatches / GetStats (not DropStale: an operator
call, made at the trajectory service's own address).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
import weakref
from typing import Any, Iterable, Mapping, Sequence, Union

from rlfleet.client.batches import DEFAULT_IDLE_TIMEOUT, DEFAULT_RECONNECT_SECONDS, BatchStream
from rlfleet.rpc.channel import ChannelSettings, aio_channel, call_with_retry
from rlfleet.rpc.errors import FailedPreconditionError, RlfleetClientError, UnavailableError, UnimplementedError
from rlfleet.client.lora import adapter_tensors
from rlfleet.client.prompts import PromptInput, to_prompt_specs
from rlfleet.client.push import DEFAULT_CHUNK_BYTES, TransportMemo, check_options, named_tensors, push_weights
from rlfleet.rpc.records import (BufferStats, DroppedStale, MismatchStatus, PassRate, PromptFailure, PushResult,
                                   Run, Status)
from rlfleet.v1 import collector_pb2, collector_pb2_grpc, trajectory_pb2, trajectory_pb2_grpc

log = logging.getLogger("rlfleet.client")

DEFAULT_MAX_MESSAGE_BYTES = ChannelSettings.max_message_bytes
RunClaim = Union[str, Run, None]
"""What a trainer says of its run at ``connect``: "new", a ``Run`` / "RUN_ID@VERSION" (resume), None (follow)."""


def make_settings(*, auth_token: str | None, tls: bool, root_certificates: bytes | None, timeout: float,
                  retries: int, max_message_bytes: int, backoff_seconds: float, certificate_chain: bytes | None = None,
                  private_key: bytes | None = None, server_name: str | None = None) -> ChannelSettings:
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 (every call has a deadline), got {timeout}")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    if bool(certificate_chain) != bool(private_key):
        raise ValueError("certificate_chain and private_key go together (a client certificate and its key)")
    return ChannelSettings(max_message_bytes=max_message_bytes, timeout=timeout, retries=retries,
                           backoff_seconds=backoff_seconds, auth_token=auth_token,
                           tls=tls or bool(root_certificates) or bool(certificate_chain),
                           root_certificates=root_certificates, certificate_chain=certificate_chain,
                           private_key=private_key, server_name=server_name)


def connect_async(address: str, *, auth_token: str | None = None, tls: bool = False,
                  root_certificates: bytes | None = None, timeout: float = 60.0, retries: int = 4,
                  max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, backoff_seconds: float = 0.2,
                  certificate_chain: bytes | None = None, private_key: bytes | None = None,
                  server_name: str | None = None, run: RunClaim = None) -> "AsyncClient":
    """An ``AsyncClient`` for the collector at ``address`` (``host:port`` or a gRPC target).

    Nothing is dialled until the first call (see ``wait_ready``). ``timeout`` is the
    deadline of each unary call; ``retries`` bounds the retries of UNAVAILABLE /
    DEADLINE_EXCEEDED; ``auth_token`` is sent as ``authorization: Bearer <token>`` on
    every call, streams included; ``root_certificates`` (PEM) implies ``tls``, and so does a client
    certificate (``certificate_chain`` + ``private_key``, PEM) for a collector that requires one (mTLS);
    ``server_name`` is the name the server's certificate holds when the address does not (an IP).

    ``run`` says which training run this trainer belongs to (docs/concepts/runs.md): ``"new"`` (it starts
    one: its weights are the initial ones, version 0), a ``Run`` or ``"RUN_ID@VERSION"`` (it resumes that
    run holding the weights of that version: ``str(client.run)`` kept with a checkpoint), or None (a
    reader or a tool: it claims nothing and follows whatever run the collector holds). The client joins at its first push,
    submission, report or batch stream; a collector holding another run refuses with
    ``FailedPreconditionError`` naming both, and so does every later call once the collector holds
    another run (its state was started anew).
    """
    return AsyncClient(address, make_settings(
        auth_token=auth_token, tls=tls, root_certificates=root_certificates, timeout=timeout, retries=retries,
        max_message_bytes=max_message_bytes, backoff_seconds=backoff_seconds, certificate_chain=certificate_chain,
        private_key=private_key, server_name=server_name), run=run)


def run_claim(run: RunClaim) -> Run | str | None:
    """``run`` as ``connect`` takes it, checked: "new", a ``Run`` (from "RUN_ID@VERSION" too) or None."""
    if run is None or run == "new" or isinstance(run, Run):
        return run
    if isinstance(run, str):
        return Run.parse(run)
    raise TypeError(f"run must be 'new', a Run, 'RUN_ID@VERSION' or None, got {run!r}")


class AsyncClient:
    """Async trainer client. Every ``grpc.RpcError`` surfaces as a typed ``RlfleetClientError``."""

    def __init__(self, address: str, settings: ChannelSettings = ChannelSettings(), run: RunClaim = None):
        self.address = address
        self.settings = settings
        self._claim = run_claim(run)
        self.run: Run | None = None
        """The run joined (at the first push, submission, report or batch stream); its ``version``
        follows this client's pushes. None before, and always when following (``run=None``)."""
        self._joining = asyncio.Lock()
        self._transport_memo = TransportMemo()
        self._channel = None
        self._collector: collector_pb2_grpc.CollectorServiceStub | None = None
        self._trajectory: trajectory_pb2_grpc.TrajectoryServiceStub | None = None
        self._streams: weakref.WeakSet[BatchStream] = weakref.WeakSet()
        self._closed = False

    def _stubs(self) -> tuple[collector_pb2_grpc.CollectorServiceStub, trajectory_pb2_grpc.TrajectoryServiceStub]:
        # The channel is made on first use, inside the event loop that will drive it.
        if self._closed:
            raise RuntimeError(f"the rlfleet client for {self.address} is closed")
        if self._channel is None:
            self._channel = aio_channel(self.address, self.settings)
            self._collector = collector_pb2_grpc.CollectorServiceStub(self._channel)
            self._trajectory = trajectory_pb2_grpc.TrajectoryServiceStub(self._channel)
        return self._collector, self._trajectory

    async def _unary(self, stub_method, request, method: str, timeout: float | None, *, idempotent: bool = True):
        return await call_with_retry(stub_method, request, method=method, settings=self.settings,
                                     timeout=timeout, idempotent=idempotent)

    async def join(self) -> Run:
        """Join the run now (as the first push, submission, report or batch stream would); the run joined.
        ``FailedPreconditionError`` naming both runs when the collector holds another (see ``connect_async``).
        A client following (run=None) joins nothing: the collector's run as ``status()`` shows it."""
        await self._joined()
        if self.run is None:
            status = await self.status()
            if status.run is None:
                raise FailedPreconditionError(f"{self.address} names no run (older than run ids)", method="JoinRun")
            return status.run
        return self.run

    async def _joined(self) -> ChannelSettings:
        """Join the run (once, unless following: run=None claims nothing), then the settings whose calls
        carry its id."""
        async with self._joining:
            if self.run is None and self._claim is not None:
                self.run = await self._join()
                self.settings = dataclasses.replace(self.settings, run_id=self.run.run_id)
        return self.settings

    async def _join(self) -> Run:
        collector, _ = self._stubs()
        claim = self._claim if isinstance(self._claim, Run) else Run("", 0)
        reply = await self._unary(collector.JoinRun, collector_pb2.JoinRunRequest(
            run_id=claim.run_id, policy_version=claim.version), "JoinRun", None)
        run = Run.from_proto(reply.run)
        log.info("joined %s run %s at version %d", "the new" if self._claim == "new" else "resumed", run.run_id,
                 run.version)
        return run

    # --- calls --------------------------------------------------------------------------------
    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the collector serves: reachable, its upstream services answered, its replicas
        probed and the policy version agreed (``Status.serving``). ``UnavailableError`` after
        ``timeout``, saying what it still waited for (e.g. "waiting for reference at host:port")."""
        collector, _ = self._stubs()
        loop = asyncio.get_running_loop()
        limit = self.settings.timeout if timeout is None else timeout
        deadline = loop.time() + limit
        waiting_for = "not reachable"
        while True:
            remaining = deadline - loop.time()
            try:
                reply = await asyncio.wait_for(
                    self._unary(collector.GetStatus, collector_pb2.GetStatusRequest(), "GetStatus",
                                max(0.1, min(remaining, self.settings.timeout))), max(0.1, remaining))
                if reply.serving:
                    return
                if reply.failed:  # it will not serve until restarted: no point waiting
                    raise FailedPreconditionError(reply.not_serving_reason, method="wait_ready")
                waiting_for = reply.not_serving_reason or "not serving"
            except (RlfleetClientError, TimeoutError) as exc:
                if isinstance(exc, RlfleetClientError) and not exc.retryable:
                    raise
                waiting_for = str(exc) or "no answer"
            if loop.time() >= deadline:
                raise UnavailableError(f"{self.address} not serving within {limit:g} s: {waiting_for}",
                                       method="wait_ready")
            await asyncio.sleep(min(0.5, max(0.0, deadline - loop.time())))

    async def policy_version(self, *, timeout: float | None = None) -> int:
        """The collector's current committed policy version."""
        collector, _ = self._stubs()
        reply = await self._unary(collector.GetPolicyVersion, collector_pb2.GetPolicyVersionRequest(),
                                  "GetPolicyVersion", timeout)
        return reply.version

    async def push_weights(self, weights: Any, version: int | None = None, *, mode: str = "keep",
                           chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: bool = True,
                           timeout: float | None = None, checksum: str | None = "crc32",
                           transport: str = "auto", nccl_address: str | None = None,
                           delta: bool = False, strategy: str = "") -> PushResult:
        """Stream new weights to the collector, which fans them out and commits a new policy version.

        ``weights``: an ``nn.Module`` (its ``state_dict()``), a ``{name: tensor}`` mapping or
        ``(name, tensor)`` pairs, named as in the Hugging Face checkpoint; full (unsharded)
        tensors, any device. ``version`` None lets the collector assign current + 1; an explicit
        version not greater than the current one is ``FailedPreconditionError``. ``mode``:
        "keep" (in-flight samples continue on the new weights), "wait" (they finish on the
        old ones first), "abort", or "resume" (they are aborted and continued as new requests,
        prompt + the tokens sampled so far, on the new weights; see docs/guides/off-policy.md). A
        progress bar (tqdm, stderr) shows for pushes of 8 MiB or more when ``progress`` and tqdm
        is installed. ``timeout`` defaults to the client's
        timeout plus one second per 10 MiB. Retried only on an UNAVAILABLE that arrives before
        the last chunk is sent (see ``rlfleet.client.push``). ``transport``: "shm" (shared memory,
        the collector on this host), "grpc" (chunks; ``chunk_bytes`` and ``checksum`` apply),
        "auto" (shm, falling back to grpc for good once the collector cannot open the segment) or
        "nccl" (GPU trainers: CUDA tensors broadcast to every inference worker; needs
        ``rlfleet[nccl]``; ``nccl_address`` is this host's address as the replicas reach it,
        default ``$RLFLEET_NCCL_ADDRESS`` or the host name; unverified, see ``rlfleet.client.nccl``).
        ``delta``: send only the tensors whose bytes changed since the last push of full weights this
        client saw committed (from its first delta push on, a plain push too), as a delta on that version
        (its first delta push, and any after a failed or adapter push, is full; keeps a host copy of the
        weights; not with "nccl"; see ``rlfleet.client.delta``). The result's
        ``base_version`` says whether it went as a delta. ``strategy``: how the collector rolls it
        out to its replicas, "pause_all" (every replica swaps at once under ``mode``) or "rolling" (a
        few at a time, each drained first, while the others serve; ``mode`` is not used); "" leaves
        it to the collector's ``update_strategy`` (docs/guides/weight-sync.md, Rolling updates). The
        call returns once every replica switched: a "rolling" push's default ``timeout`` allows 330 s
        more (the collector's default bound on a rolling update and a drain); pass ``timeout`` when its
        ``rolling_max_seconds`` is higher, or when its own ``update_strategy`` is rolling.
        """
        check_options(transport=transport, strategy=strategy, lora=None, delta=delta)  # refused before joining
        settings = await self._joined()
        collector, _ = self._stubs()
        return self._pushed(await push_weights(
            collector.PushWeights, named_tensors(weights), version=version, mode=mode, chunk_bytes=chunk_bytes,
            progress=progress, timeout=timeout, settings=settings, checksum=checksum, transport=transport,
            memo=self._transport_memo, status_call=collector.GetStatus, nccl_address=nccl_address, delta=delta,
            strategy=strategy))

    def _pushed(self, result: PushResult) -> PushResult:
        if self.run is not None:
            self.run = dataclasses.replace(self.run, version=result.version)  # the trainer now holds these weights
        return result

    async def push_adapter(self, adapter: Any, version: int | None = None, *, rank: int | None = None,
                           alpha: float | None = None, target_modules: Iterable[str] | None = None,
                           mode: str = "keep", chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: bool = True,
                           timeout: float | None = None, checksum: str | None = "crc32",
                           transport: str = "auto", strategy: str = "") -> PushResult:
        """Push a LoRA adapter: only its factors travel, and a new policy version is committed.

        ``adapter``: a ``peft.PeftModel`` (its active LoRA adapter's tensors, ``r`` and ``lora_alpha``
        from its ``LoraConfig``), or a ``{name: tensor}`` mapping / ``(name, tensor)`` pairs of its
        ``lora_A`` / ``lora_B`` factors (named as ``peft.get_peft_model_state_dict`` names them; the
        ``base_model.model.`` prefix may be left out) with ``rank``, ``alpha`` (peft's ``lora_alpha``) and
        ``target_modules`` given; full tensors, any floating dtype, any device (see
        ``rlfleet.client.lora.adapter_tensors``: ValueError for what vLLM cannot serve, e.g. DoRA).
        From the returned version on, the replicas serve the model's weights as they are plus this
        adapter (scaled by alpha / rank); the next adapter push replaces it, and a later full or delta
        ``push_weights`` drops it (push ``merge_and_unload()``'s weights to keep its effect). ``version``,
        ``mode``, ``chunk_bytes``, ``progress``, ``timeout``, ``checksum``, ``strategy`` and retries as in
        ``push_weights``; ``transport`` "auto", "shm" or "grpc" (not "nccl"). It forgets what a
        ``delta=True`` push kept (the collector takes no delta on an adapter's version): the next such
        push is full. The replicas must be started with LoRA
        enabled (generation setting ``max_lora_rank`` at least the adapter's rank), else
        ``FailedPreconditionError``. The result's ``adapter_rank`` is the adapter's rank.
        """
        pairs, lora = adapter_tensors(adapter, rank=rank, alpha=alpha, target_modules=target_modules)
        check_options(transport=transport, strategy=strategy, lora=lora, delta=False)  # refused before joining
        settings = await self._joined()
        collector, _ = self._stubs()
        return self._pushed(await push_weights(
            collector.PushWeights, pairs, version=version, mode=mode, chunk_bytes=chunk_bytes, progress=progress,
            timeout=timeout, settings=settings, checksum=checksum, transport=transport, memo=self._transport_memo,
            lora=lora, strategy=strategy))

    async def submit_prompts(self, prompts: PromptInput | Iterable[PromptInput], *,
                             timeout: float | None = None) -> list[str]:
        """Queue prompts ahead of the collector's dataset; returns their ids in order.

        Each prompt is text (``str``), a chat (list of ``{"role", "content"}`` dicts), token ids
        (list of ints or 1-D integer tensor), or a dict ``{"prompt": ..., "prompt_id", "ground_truth",
        "reward_fn", "reward_args": {str: str}, "sampling": {SamplingParams fields}}``.
        The collector answers once the prompts are durable; each then ends as exactly one group or
        one dead letter (``failures()``). Prompts without an id get one here, so a retried call is
        harmless (an id already pending is not queued again). ``ResourceExhaustedError`` when the
        queue is full; ``InvalidArgumentError`` naming the prompt for a malformed one.
        """
        request = collector_pb2.SubmitPromptsRequest(prompts=to_prompt_specs(prompts))
        await self._joined()
        collector, _ = self._stubs()
        reply = await self._unary(collector.SubmitPrompts, request, "SubmitPrompts", timeout)
        return list(reply.prompt_ids)

    async def status(self, *, timeout: float | None = None) -> Status:
        """The collector's pipeline state: version, mode, stages, replicas, staleness histogram."""
        collector, _ = self._stubs()
        return Status.from_proto(await self._unary(collector.GetStatus, collector_pb2.GetStatusRequest(),
                                                   "GetStatus", timeout))

    async def report_mismatch(self, by_lag: Mapping[int, Mapping[str, float]], policy_version: int, *,
                              timeout: float | None = None) -> MismatchStatus:
        """Report the train/inference mismatch measured on a batch: ``by_lag`` as
        ``rlfleet.client.offpolicy.importance_weights(..., versions=, trainer_version=).by_lag`` gives it
        (lag -> ``kl_k3``, ``kl_k1``, ``ess_token``, ``tokens``), ``policy_version`` the version the
        trainer's weights are. The collector shows it in ``status()``; with a threshold set, reports
        over it in a row open its mismatch breaker. Returns the breaker's state after this report.
        A retry (the call is retried on UNAVAILABLE) carries this report's id: the collector counts it once."""
        await self._joined()
        collector, _ = self._stubs()
        lags = [collector_pb2.LagMismatch(lag=int(lag), kl_k3=values["kl_k3"], kl_k1=values["kl_k1"],
                                          ess_token=values["ess_token"], tokens=int(values["tokens"]))
                for lag, values in sorted(by_lag.items())]
        request = collector_pb2.ReportMismatchRequest(policy_version=policy_version, lags=lags,
                                                      report_id=uuid.uuid4().hex)
        reply = await self._unary(collector.ReportMismatch, request, "ReportMismatch", timeout)
        return MismatchStatus.from_proto(reply.status)

    async def close_mismatch_breaker(self, *, timeout: float | None = None) -> bool:
        """Operator role: close the collector's mismatch breaker (admission and trainer calls resume);
        whether it was open."""
        collector, _ = self._stubs()
        reply = await self._unary(collector.CloseMismatchBreaker, collector_pb2.CloseMismatchBreakerRequest(),
                                  "CloseMismatchBreaker", timeout)
        return reply.was_open

    async def failures(self, *, after_seq: int = 0, limit: int = 100,
                       timeout: float | None = None) -> tuple[list[PromptFailure], int]:
        """Prompts that failed for good (dead letters), oldest first, after ``after_seq``; and how many
        there were in all. A dead prompt is never retried; pass the last ``seq`` seen to page on."""
        collector, _ = self._stubs()
        reply = await self._unary(collector.ListFailures,
                                  collector_pb2.ListFailuresRequest(after_seq=after_seq, limit=limit),
                                  "ListFailures", timeout)
        return [PromptFailure.from_proto(f) for f in reply.failures], reply.total

    async def pass_rates(self, prompt_keys: Sequence[str] = (), *, after_key: str = "", limit: int = 100,
                         timeout: float | None = None) -> tuple[list[PassRate], int]:
        """Per-prompt pass rates: of ``prompt_keys`` (a dataset row's id, a submitted prompt id; at most
        1000, unknown ones left out), or without them a page of every prompt after ``after_key`` in key
        order; and how many prompts have one in all."""
        collector, _ = self._stubs()
        reply = await self._unary(collector.GetPassRates, collector_pb2.GetPassRatesRequest(
            prompt_keys=list(prompt_keys), after_key=after_key, limit=limit), "GetPassRates", timeout)
        return [PassRate.from_proto(rate) for rate in reply.pass_rates], reply.total

    async def buffer_stats(self, *, timeout: float | None = None) -> BufferStats:
        """Trajectory buffer occupancy and counters (forwarded by the collector)."""
        _, trajectory = self._stubs()
        return BufferStats.from_proto(await self._unary(trajectory.GetStats, trajectory_pb2.GetStatsRequest(),
                                                        "GetStats", timeout))

    async def drop_stale(self, below_policy_version: int, *, timeout: float | None = None) -> DroppedStale:
        """Delete, for good, the ready trajectories of every group whose policy_version_start is below
        ``below_policy_version``; returns what was deleted. Leased batches are untouched.

        An operator / owner call: connect this client to the trajectory service's own address (the
        collector does not forward DropStale; through it this raises ``UnimplementedError``).
        Retried on UNAVAILABLE only: after DEADLINE_EXCEEDED the rows may already be gone, and a
        repeat would answer with nothing dropped, losing the ids.
        """
        if below_policy_version < 0:
            raise ValueError(f"below_policy_version must be >= 0, got {below_policy_version}")
        _, trajectory = self._stubs()
        request = trajectory_pb2.DropStaleRequest(below_policy_version=below_policy_version)
        try:
            reply = await self._unary(trajectory.DropStale, request, "DropStale", timeout, idempotent=False)
        except UnimplementedError as exc:
            raise UnimplementedError(
                f"{exc.details} ({self.address} does not serve DropStale: the collector does not forward it; "
                "connect a client to the trajectory service's own address)", method=exc.method) from None
        return DroppedStale.from_proto(reply)

    def batches(self, batch_size: int, *, whole_groups: bool = True, min_policy_version: int = 0,
                lease_seconds: float = 0.0, prefetch: int = 1, consumer: str = "", auto_ack: bool = True,
                max_batches: int | None = None, idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
                reconnect_seconds: float = DEFAULT_RECONNECT_SECONDS) -> BatchStream:
        """Stream leased batches of ``batch_size`` trajectories (see ``rlfleet.client.batches``).

        ``whole_groups`` keeps every GRPO group in one batch (batch_size must be a multiple of the
        group size); ``min_policy_version`` skips groups that started at an older version (they stay
        buffered for other readers; ``drop_stale`` deletes them); ``lease_seconds``
        (0 = server default) is how long a batch may stay un-acked before redelivery; ``prefetch``
        batches are delivered ahead of acks; ``consumer`` names the reader in server logs;
        ``auto_ack`` acks each batch when the next is requested; ``max_batches`` ends the stream.
        ``idle_timeout``: seconds to wait for a batch before ``DeadlineExceededError`` ends the stream
        (None waits forever; the acks already sent, such as the auto-ack of the batch moved past, are
        answered first, and it is not reopened); a stream that breaks (UNAVAILABLE: the collector restarted, the
        connection dropped) is reopened for up to ``reconnect_seconds``, with a WARNING; what the
        old stream delivered and was not acked is delivered again.
        """
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if max_batches is not None and max_batches < 0:
            raise ValueError(f"max_batches must be >= 0 or None, got {max_batches}")
        if idle_timeout is not None and idle_timeout <= 0:
            raise ValueError(f"idle_timeout must be > 0 or None, got {idle_timeout}")
        _, trajectory = self._stubs()
        open_request = trajectory_pb2.OpenBatchStream(
            batch_size=batch_size, whole_groups=whole_groups, min_policy_version=min_policy_version,
            lease_seconds=lease_seconds, prefetch=prefetch, consumer=consumer)
        stream = BatchStream(trajectory.StreamBatches, self.settings, open_request,
                             auto_ack=auto_ack, max_batches=max_batches, idle_timeout=idle_timeout,
                             reconnect_seconds=reconnect_seconds, prepare=self._joined)
        self._streams.add(stream)
        return stream

    # --- lifecycle ------------------------------------------------------------------------------
    async def close(self) -> None:
        """Close open batch streams (un-acked batches are redelivered) and the channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._transport_memo.close()
        for stream in list(self._streams):
            stream.abandon()
        if self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncClient({self.address!r}{', closed' if self._closed else ''})"
