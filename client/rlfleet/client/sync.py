"""``Client``: the blocking twin of ``AsyncClient``.

It runs the async client's coroutines on the SDK's private event loop, on a
daemon thread (``run_coroutine_threadsafe``): one implementation, two APIs.
The sync batch iterator pulls from the same async ``BatchStream``.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Coroutine, Iterable, Sequence, TypeVar

from rlfleet.client.aio import DEFAULT_MAX_MESSAGE_BYTES, AsyncClient, RunClaim, make_settings
from rlfleet.client.batches import DEFAULT_IDLE_TIMEOUT, DEFAULT_RECONNECT_SECONDS, Batch, BatchStream
from rlfleet.rpc.channel import ChannelSettings
from rlfleet.client.lora import adapter_tensors
from rlfleet.client.prompts import PromptInput
from rlfleet.client.push import DEFAULT_CHUNK_BYTES, named_tensors
from rlfleet.rpc.records import (BufferStats, DroppedStale, MismatchStatus, PassRate, PromptFailure, PushResult,
                                   Run, Status)

T = TypeVar("T")


class _LoopThread:
    """An event loop running forever on a daemon thread, shared by every sync ``Client`` of the process.

    Shared and never closed on purpose: gRPC's asyncio poller may still deliver a
    completion (e.g. of a cancelled call) to a loop after its client closed, and
    delivering to a closed loop fails. One idle loop costs nothing.
    """

    _lock = threading.Lock()
    _instance: "_LoopThread | None" = None

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rlfleet-client-loop", daemon=True)
        self.thread.start()

    @classmethod
    def shared(cls) -> "_LoopThread":
        with cls._lock:
            if cls._instance is None or cls._instance.pid != os.getpid():  # threads do not survive fork
                cls._instance = cls()
            return cls._instance

    def usable(self) -> bool:
        """True if ``run`` may be called from the current thread."""
        return self.thread.is_alive() and threading.current_thread() is not self.thread

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self.usable():
            coro.close()
            raise RuntimeError("a sync rlfleet Client cannot be called from its own event-loop thread"
                               if threading.current_thread() is self.thread else
                               "the rlfleet client event loop is gone (interpreter shutting down?)")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: stop the call instead of leaving it running
            raise


def connect(address: str, *, auth_token: str | None = None, tls: bool = False,
            root_certificates: bytes | None = None, timeout: float = 60.0, retries: int = 4,
            max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, backoff_seconds: float = 0.2,
            certificate_chain: bytes | None = None, private_key: bytes | None = None,
            server_name: str | None = None, run: RunClaim = None) -> "Client":
    """A blocking ``Client`` for the collector at ``address``; arguments as in ``connect_async``."""
    return Client(address, make_settings(
        auth_token=auth_token, tls=tls, root_certificates=root_certificates, timeout=timeout, retries=retries,
        max_message_bytes=max_message_bytes, backoff_seconds=backoff_seconds, certificate_chain=certificate_chain,
        private_key=private_key, server_name=server_name), run=run)


class BatchIterator:
    """Blocking iterator of ``Batch``; the sync view of ``BatchStream`` (same semantics).

    Use ``with client.batches(...) as batches: for batch in batches: ...`` or call ``close()``.
    """

    def __init__(self, runner: _LoopThread, stream: BatchStream):
        self._runner = runner
        self._stream = stream

    @property
    def closed(self) -> bool:
        return self._stream.closed

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> Batch:
        if self._stream.closed:
            raise StopIteration
        batch = self._runner.run(self._stream.next())
        if batch is None:
            raise StopIteration
        return batch

    def close(self, *, ack_last: bool | None = None) -> None:
        """End the stream cleanly; see ``BatchStream.close``."""
        if self._stream.closed:
            return
        if self._runner.usable():
            self._runner.run(self._stream.close(ack_last=ack_last))
        else:
            self._stream.abandon()

    def __enter__(self) -> "BatchIterator":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ack_last=False if exc_type is not None else None)

    def __del__(self):
        # Dropped without close() (e.g. `break` out of a bare for loop): end the stream
        # without acking, so the last batch is delivered again rather than lost.
        stream = getattr(self, "_stream", None)
        if stream is not None and not stream.closed:
            try:
                self.close(ack_last=False)
            except Exception:  # never raise from a finalizer; the server releases the leases anyway
                stream.abandon()


class Client:
    """Blocking trainer client: the same calls as ``AsyncClient`` without ``await``.

    Every ``grpc.RpcError`` surfaces as a typed ``RlfleetClientError``.
    """

    def __init__(self, address: str, settings: ChannelSettings = ChannelSettings(), run: RunClaim = None):
        self._runner = _LoopThread.shared()
        self._async = AsyncClient(address, settings, run=run)
        self._closed = False
        self._runner.run(self._make_channel())

    async def _make_channel(self) -> None:
        self._async._stubs()  # a grpc.aio channel belongs to the loop it is made in

    @property
    def address(self) -> str:
        return self._async.address

    @property
    def settings(self) -> ChannelSettings:
        return self._async.settings

    @property
    def run(self) -> Run | None:
        """See ``AsyncClient.run``: the run joined, its version following this client's pushes."""
        return self._async.run

    def join(self) -> Run:
        """Join the run now (as the first push, submission or batch stream would); the run joined."""
        return self._runner.run(self._async.join())

    def wait_ready(self, timeout: float | None = None) -> None:
        """See ``AsyncClient.wait_ready``."""
        self._runner.run(self._async.wait_ready(timeout))

    @property
    def policy_version(self) -> int:
        """The collector's current committed policy version (one GetPolicyVersion call)."""
        return self._runner.run(self._async.policy_version())

    def push_weights(self, weights: Any, version: int | None = None, *, mode: str = "keep",
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: bool = True,
                     timeout: float | None = None, checksum: str | None = "crc32",
                     transport: str = "auto", nccl_address: str | None = None,
                     delta: bool = False, strategy: str = "") -> PushResult:
        """See ``AsyncClient.push_weights``."""
        pairs = named_tensors(weights)  # state_dict() runs on the caller's thread, not the loop's
        return self._runner.run(self._async.push_weights(
            pairs, version, mode=mode, chunk_bytes=chunk_bytes, progress=progress, timeout=timeout,
            checksum=checksum, transport=transport, nccl_address=nccl_address, delta=delta, strategy=strategy))

    def push_adapter(self, adapter: Any, version: int | None = None, *, rank: int | None = None,
                     alpha: float | None = None, target_modules: Iterable[str] | None = None,
                     mode: str = "keep", chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: bool = True,
                     timeout: float | None = None, checksum: str | None = "crc32",
                     transport: str = "auto", strategy: str = "") -> PushResult:
        """See ``AsyncClient.push_adapter``."""
        # The adapter's tensors are collected on the caller's thread, not the loop's.
        pairs, lora = adapter_tensors(adapter, rank=rank, alpha=alpha, target_modules=target_modules)
        return self._runner.run(self._async.push_adapter(
            pairs, version, rank=lora.rank, alpha=lora.alpha, target_modules=list(lora.target_modules), mode=mode,
            chunk_bytes=chunk_bytes, progress=progress, timeout=timeout, checksum=checksum, transport=transport,
            strategy=strategy))

    def submit_prompts(self, prompts: PromptInput | Iterable[PromptInput], *,
                       timeout: float | None = None) -> list[str]:
        """See ``AsyncClient.submit_prompts``."""
        return self._runner.run(self._async.submit_prompts(prompts, timeout=timeout))

    def status(self, *, timeout: float | None = None) -> Status:
        """See ``AsyncClient.status``."""
        return self._runner.run(self._async.status(timeout=timeout))

    def report_mismatch(self, by_lag, policy_version: int, *, timeout: float | None = None) -> MismatchStatus:
        """See ``AsyncClient.report_mismatch``."""
        return self._runner.run(self._async.report_mismatch(by_lag, policy_version, timeout=timeout))

    def close_mismatch_breaker(self, *, timeout: float | None = None) -> bool:
        """See ``AsyncClient.close_mismatch_breaker``."""
        return self._runner.run(self._async.close_mismatch_breaker(timeout=timeout))

    def pass_rates(self, prompt_keys: Sequence[str] = (), *, after_key: str = "", limit: int = 100,
                   timeout: float | None = None) -> tuple[list[PassRate], int]:
        """See ``AsyncClient.pass_rates``."""
        return self._runner.run(self._async.pass_rates(prompt_keys, after_key=after_key, limit=limit,
                                                       timeout=timeout))

    def buffer_stats(self, *, timeout: float | None = None) -> BufferStats:
        """See ``AsyncClient.buffer_stats``."""
        return self._runner.run(self._async.buffer_stats(timeout=timeout))

    def failures(self, *, after_seq: int = 0, limit: int = 100,
                 timeout: float | None = None) -> tuple[list[PromptFailure], int]:
        """See ``AsyncClient.failures``."""
        return self._runner.run(self._async.failures(after_seq=after_seq, limit=limit, timeout=timeout))

    def drop_stale(self, below_policy_version: int, *, timeout: float | None = None) -> DroppedStale:
        """See ``AsyncClient.drop_stale`` (needs a client connected to the trajectory service's address)."""
        return self._runner.run(self._async.drop_stale(below_policy_version, timeout=timeout))

    def batches(self, batch_size: int, *, whole_groups: bool = True, min_policy_version: int = 0,
                lease_seconds: float = 0.0, prefetch: int = 1, consumer: str = "", auto_ack: bool = True,
                max_batches: int | None = None, idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
                reconnect_seconds: float = DEFAULT_RECONNECT_SECONDS) -> BatchIterator:
        """See ``AsyncClient.batches``; returns a blocking iterator."""
        stream = self._async.batches(batch_size, whole_groups=whole_groups, min_policy_version=min_policy_version,
                                     lease_seconds=lease_seconds, prefetch=prefetch, consumer=consumer,
                                     auto_ack=auto_ack, max_batches=max_batches, idle_timeout=idle_timeout,
                                     reconnect_seconds=reconnect_seconds)
        return BatchIterator(self._runner, stream)

    def close(self) -> None:
        """Close open streams (un-acked batches are redelivered) and the channel. Idempotent."""
        if not self._closed:
            self._closed = True
            if self._runner.usable():
                self._runner.run(self._async.close())

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __del__(self):
        runner = getattr(self, "_runner", None)
        if runner is not None and runner.usable() and not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # never raise from a finalizer
                pass

    def __repr__(self) -> str:
        return f"Client({self.address!r})"
