"""``push_weights``: hand a state dict to the collector, by shared memory or as ~1 MiB chunks.

Transports (``transport=``; ``nccl``, for GPU trainers, is in ``rlfleet.client.nccl``): ``shm`` writes every tensor once into a
shared-memory segment (``/dev/shm``) and sends only the manifest naming it;
the collector and the generation replicas map the same pages. It works when
the collector runs on the trainer's host and IPC namespace; a collector that
cannot open the segment answers FAILED_PRECONDITION "shm transport
unavailable". ``grpc`` streams the bytes as chunks. ``auto`` (the default)
tries shm first and falls back to grpc for good once refused (or when no
segment can be created here). The client keeps its segment for its next
push, which rewrites it in place if no receiver holds it any more (a new
segment costs CPU in page allocation and faults: see the weights benchmark
page, docs/benchmarks/weights.md);
``close()`` unlinks it, and if the trainer is killed the services sweep it.

Memory: chunks are cut straight out of each tensor's memory by
``iter_push_messages`` and written one at a time under gRPC flow control, so
no second copy of the state dict ever exists (a few chunks are in flight).
The manifest's checksum pass runs on a worker thread; chunks are cut on the
event loop (~0.1 ms per MiB; a tensor on an accelerator is copied to the host
one tensor at a time as its turn comes).

Retries: the contract makes a failed push a no-op (version and weights
unchanged), so re-sending is safe whenever the collector cannot have
committed. A push is therefore retried on UNAVAILABLE (bounded, with backoff)
only if the error arrived before the last chunk was handed to gRPC: until then
the collector does not hold every byte and cannot have committed. Any error
after that (e.g. UNAVAILABLE "no replica applied it", or a reply lost on the
way back) is raised, never replayed, since the push may have been committed.
DEADLINE_EXCEEDED is never retried: the deadline covers the whole push.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from typing import Any, Iterable, Iterator, Mapping

import grpc
import torch

from rlfleet.choices import SWAP_MODES, UPDATE_STRATEGIES, WEIGHT_TRANSPORTS
from rlfleet.rpc.channel import STREAM_WRITE_ERRORS, ChannelSettings, StatusWatch, backoff, stream_error
from rlfleet.client.delta import DeltaBase
from rlfleet.rpc.errors import FailedPreconditionError, UnavailableError
from rlfleet.rpc.records import PushResult
from rlfleet.v1 import collector_pb2, weights_pb2
from rlfleet.wire import shm
from rlfleet.wire.dtypes import SUPPORTED_DTYPES
from rlfleet.wire.push_rules import check_kind
from rlfleet.wire.push_messages import DEFAULT_CHUNK_BYTES, iter_push_messages

METHOD = "PushWeights"
MODES = SWAP_MODES
STRATEGIES = {"": weights_pb2.UPDATE_STRATEGY_UNSPECIFIED, **UPDATE_STRATEGIES}
"""How the collector rolls a push out (``WeightManifest.strategy``): "" leaves it to its ``update_strategy``."""
PROGRESS_MIN_BYTES = 8 << 20
"""Pushes smaller than this never show a progress bar."""
TRANSPORTS = ("auto", *WEIGHT_TRANSPORTS)
DEADLINE_BYTES_PER_SECOND = 10 << 20
"""Default push deadline: the client's timeout plus one second per 10 MiB."""
ROLLING_DEADLINE_SECONDS = 330.0
"""Added to a rolling push's default deadline: the replicas switch one batch at a time, for up to the
collector's ``rolling_max_seconds`` (300 by default) plus a drain (``rolling_drain_seconds``, 30)."""


def named_tensors(weights: Any) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of an ``nn.Module``, a ``{name: tensor}`` mapping or an iterable of pairs.

    Only references are collected: no tensor is copied here.
    """
    if isinstance(weights, torch.nn.Module):
        items: Iterable = weights.state_dict().items()
    elif isinstance(weights, Mapping):
        items = weights.items()
    elif isinstance(weights, Iterable) and not isinstance(weights, (str, bytes, torch.Tensor)):
        items = weights
    else:
        raise TypeError(f"push_weights takes an nn.Module, a {{name: tensor}} mapping or (name, tensor) "
                        f"pairs, got {type(weights).__name__}")
    pairs, seen = [], set()
    for item in items:
        name, tensor = item
        if not isinstance(name, str) or not name:
            raise TypeError(f"weights: names must be non-empty strings, got {name!r}")
        if name in seen:
            raise ValueError(f"weights[{name}]: duplicate name")
        if not isinstance(tensor, torch.Tensor) or tensor.is_nested or tensor.layout != torch.strided:
            raise TypeError(f"weights[{name}]: expected a dense torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"weights[{name}]: unsupported dtype {tensor.dtype}")
        seen.add(name)
        pairs.append((name, tensor))
    if not pairs:
        raise ValueError("weights: nothing to push (empty state dict)")
    return pairs


class TransportMemo:
    """What a client learned about its collector (shm refused once means grpc from then on), the
    segment it keeps for its next shm push (``shm.SegmentCache``; ``close`` removes it), and the
    last committed push's bytes for delta pushes (``DeltaBase``)."""

    def __init__(self) -> None:
        self.shm_refused = False
        self.segments = shm.SegmentCache()
        self.delta = DeltaBase()

    def refuse_shm(self) -> None:
        self.shm_refused = True
        self.segments.close()

    def close(self) -> None:
        self.segments.close()


def check_options(*, transport: str, strategy: str, lora: weights_pb2.LoraAdapter | None, delta: bool) -> None:
    """ValueError for a push's options that cannot go together, before anything is sent."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    check_kind(source="nccl" if transport == "nccl" else None, delta=delta, adapter=lora is not None,
               rolling=strategy == "rolling")  # the rules the collector and the replicas check again


async def push_weights(
    call_factory, pairs: list[tuple[str, torch.Tensor]], *, version: int | None, mode: str,
    chunk_bytes: int, progress: bool, timeout: float | None, settings: ChannelSettings,
    checksum: str | None = "crc32", transport: str = "auto", memo: TransportMemo | None = None,
    status_call=None, nccl_address: str | None = None, delta: bool = False,
    lora: weights_pb2.LoraAdapter | None = None, strategy: str = "",
) -> PushResult:
    """Push ``pairs`` through ``call_factory(timeout=, metadata=)`` (a PushWeights stub); see the module
    doc. ``transport="nccl"`` also needs ``status_call`` (a GetStatus stub); see ``rlfleet.client.nccl``.
    ``delta``: send only the tensors that changed since the last push committed (``rlfleet.client.delta``).
    ``lora``: ``pairs`` are a LoRA adapter's factors (``rlfleet.client.lora``), served on top of the
    model's weights as they are. ``strategy``: how the collector rolls it out (``STRATEGIES``; "": its
    setting ``update_strategy``)."""
    check_options(transport=transport, strategy=strategy, lora=lora, delta=delta)
    options = dict(version=version, mode=mode, chunk_bytes=chunk_bytes, progress=progress, timeout=timeout,
                   settings=settings, checksum=checksum, transport=transport, strategy=strategy)
    if delta:
        memo = memo or TransportMemo()
        return await _push_delta(call_factory, pairs, memo, **options)
    if memo is not None and memo.delta.in_use and lora is None and transport != "nccl":
        return await _push_base(call_factory, pairs, memo, **options)  # full weights: the next delta's base
    if memo is not None:
        # An adapter push commits a version whose spooled push is the adapter, and an nccl push is not
        # spooled: the collector takes no delta on either (fanout._spooled_manifests), so nothing kept
        # would serve as a base any more.
        memo.delta.forget()
    result = await _push(call_factory, pairs, version=version, mode=mode, chunk_bytes=chunk_bytes,
                         progress=progress, timeout=timeout, settings=settings, checksum=checksum,
                         transport=transport, memo=memo, status_call=status_call, nccl_address=nccl_address,
                         lora=lora, strategy=strategy)
    return result if lora is None else dataclasses.replace(result, adapter_rank=lora.rank)


async def _push_delta(call_factory, pairs, memo: TransportMemo, **options) -> PushResult:
    """A delta on the last committed push when one is kept and the collector takes it, else a full push;
    what is kept follows every push that committed and is forgotten by one that failed."""
    base = memo.delta
    base.in_use = True
    changed = await asyncio.to_thread(base.changed, pairs)
    if changed is not None:
        base_version = base.version
        try:
            result = await _push(call_factory, changed, memo=memo, base_version=base_version, **options)
        except FailedPreconditionError as error:
            base.forget()
            if "delta push on version" not in error.details:
                raise
            # The collector moved on (another pusher, a restart without its spool): a full push.
        except BaseException:
            base.forget()  # it may have committed: nothing is known any more
            raise
        else:
            await asyncio.to_thread(base.record, pairs, changed, result.version)
            return dataclasses.replace(result, base_version=base_version, tensors=len(changed))
    return await _push_base(call_factory, pairs, memo, **options)


async def _push_base(call_factory, pairs, memo: TransportMemo, **options) -> PushResult:
    """A full push whose bytes, once committed, are what the next delta is compared with and patches."""
    try:
        result = await _push(call_factory, pairs, memo=memo, **options)
    except BaseException:
        memo.delta.forget()  # it may have committed: nothing is known any more
        raise
    await asyncio.to_thread(memo.delta.record, pairs, None, result.version)
    return result


async def _push(
    call_factory, pairs: list[tuple[str, torch.Tensor]], *, version: int | None, mode: str,
    chunk_bytes: int, progress: bool, timeout: float | None, settings: ChannelSettings,
    checksum: str | None = "crc32", transport: str = "auto", memo: TransportMemo | None = None,
    status_call=None, nccl_address: str | None = None, base_version: int | None = None,
    lora: weights_pb2.LoraAdapter | None = None, strategy: str = "",
) -> PushResult:
    if transport == "nccl":
        from rlfleet.client.nccl import push_nccl

        manifest = _bare_manifest(pairs, version, mode, strategy=strategy)
        return await push_nccl(call_factory, status_call, pairs, manifest,
                               timeout=_bare_deadline(timeout, settings, manifest), settings=settings,
                               address=nccl_address)
    memo = memo or TransportMemo()
    if transport == "shm" or (transport == "auto" and not memo.shm_refused):
        try:
            return await _push_shm(call_factory, pairs, version=version, mode=mode, timeout=timeout,
                                   settings=settings, segments=memo.segments, base_version=base_version,
                                   lora=lora, strategy=strategy)
        except FailedPreconditionError as error:
            if transport == "shm" or shm.SHM_UNAVAILABLE not in error.details:
                raise
            memo.refuse_shm()
        except OSError:
            if transport == "shm":
                raise
            memo.refuse_shm()  # no usable /dev/shm here
    return await _push_grpc(call_factory, pairs, version=version, mode=mode, chunk_bytes=chunk_bytes,
                            progress=progress, timeout=timeout, settings=settings, checksum=checksum,
                            base_version=base_version, lora=lora, strategy=strategy)


def _bare_manifest(pairs, version: int | None, mode: str, base_version: int | None = None,
                   lora: weights_pb2.LoraAdapter | None = None, strategy: str = "") -> weights_pb2.WeightManifest:
    """The manifest of a push whose bytes never cross gRPC (shm, nccl): no checksum."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    return next(iter_push_messages(pairs, version=version or 0, mode=MODES[mode], checksum_algo=None,
                                   base_version=base_version, lora=lora, strategy=STRATEGIES[strategy]))[1]


def _rolling_allowance(manifest: weights_pb2.WeightManifest) -> float:
    """What a push's default deadline allows for the collector's rollout (a rolling update's bound)."""
    return ROLLING_DEADLINE_SECONDS if manifest.strategy == weights_pb2.UPDATE_STRATEGY_ROLLING else 0.0


def _bare_deadline(timeout: float | None, settings: ChannelSettings, manifest) -> float:
    """Default deadline of such a push: the client's timeout plus one second per 1000 MiB (100x grpc's)."""
    return timeout if timeout is not None else settings.timeout + _rolling_allowance(manifest) + \
        manifest.total_bytes / (100 * DEADLINE_BYTES_PER_SECOND)


async def _push_shm(call_factory, pairs, *, version, mode, timeout, settings, segments: shm.SegmentCache,
                    base_version: int | None = None, lora: weights_pb2.LoraAdapter | None = None,
                    strategy: str = "") -> PushResult:
    """Write the tensors once into a segment (the one kept from the last push when nobody holds it
    any more) and send only the manifest naming it."""
    started = time.perf_counter()
    manifest = _bare_manifest(pairs, version, mode, base_version, lora, strategy)
    await asyncio.to_thread(shm.sweep_stale)
    segment = segments.take(manifest.total_bytes)
    try:
        await asyncio.to_thread(shm.write_tensors, segment, [tensor for _, tensor in pairs])
        manifest.shm.path = segment.path
        call = call_factory(timeout=_bare_deadline(timeout, settings, manifest), metadata=settings.metadata())
        watch = StatusWatch(call)
        try:
            await call.write(collector_pb2.PushWeightsRequest(manifest=manifest))
            await call.done_writing()
        except STREAM_WRITE_ERRORS:
            pass  # the reply below carries the real status
        try:
            reply = await call
        except grpc.RpcError as exc:
            raise await stream_error(call, exc, METHOD, watch) from None
        finally:
            if not call.done():
                call.cancel()
        return PushResult.from_proto(reply, time.perf_counter() - started, 1, "shm", tensors=len(pairs))
    finally:
        segments.keep(segment)  # the receivers have mapped it or fell back to grpc


async def _push_grpc(
    call_factory, pairs: list[tuple[str, torch.Tensor]], *, version: int | None, mode: str,
    chunk_bytes: int, progress: bool, timeout: float | None, settings: ChannelSettings,
    checksum: str | None = "crc32", base_version: int | None = None, lora: weights_pb2.LoraAdapter | None = None,
    strategy: str = "",
) -> PushResult:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    if checksum not in ("crc32", "sha256", None):
        raise ValueError(f"checksum must be 'crc32', 'sha256' or None, got {checksum!r}")
    if version is not None and version <= 0:
        raise ValueError(f"version must be > 0 (or None to let the collector assign it), got {version}")
    started = time.perf_counter()
    attempt = 0
    while True:
        messages = iter_push_messages(pairs, version=version or 0, mode=MODES[mode], chunk_bytes=chunk_bytes,
                                      checksum_algo=checksum, base_version=base_version, lora=lora,
                                      strategy=STRATEGIES[strategy])
        try:
            reply = await _push_once(call_factory, messages, chunk_bytes=chunk_bytes, progress=progress,
                                     timeout=timeout, settings=settings)
            return PushResult.from_proto(reply, time.perf_counter() - started, attempt + 1, "grpc",
                                         tensors=len(pairs))
        except _EarlyUnavailable as early:
            if attempt >= settings.retries:
                raise early.error from None
        await asyncio.sleep(backoff(attempt, settings.backoff_seconds))
        attempt += 1


class _EarlyUnavailable(Exception):
    """UNAVAILABLE before the collector could hold the whole push: safe to resend."""

    def __init__(self, error: UnavailableError):
        self.error = error


async def _push_once(call_factory, messages: Iterator[tuple[str, Any]], *, chunk_bytes: int, progress: bool,
                     timeout: float | None, settings: ChannelSettings) -> collector_pb2.PushWeightsResponse:
    # The checksum pass reads every byte: keep it off the event loop.
    _, manifest = await asyncio.to_thread(next, messages)
    total = manifest.total_bytes
    deadline = timeout if timeout is not None else \
        settings.timeout + _rolling_allowance(manifest) + total / DEADLINE_BYTES_PER_SECOND
    call = call_factory(timeout=deadline, metadata=settings.metadata())
    watch = StatusWatch(call)
    bar = _progress_bar(total, progress, manifest.version)
    may_have_committed = total == 0  # an empty delta is whole with its manifest
    try:
        try:
            await call.write(collector_pb2.PushWeightsRequest(manifest=manifest))
            # Chunks are cut inline (~0.1 ms per MiB): measured faster than handing them
            # over from a worker thread, which only adds GIL contention.
            for _, chunk in messages:
                request = collector_pb2.PushWeightsRequest()
                request.chunk.CopyFrom(chunk)  # ~4x cheaper than PushWeightsRequest(chunk=chunk) under upb
                size = min(chunk_bytes, total - chunk.offset)  # every chunk but the last is full
                may_have_committed = chunk.offset + size >= total
                await call.write(request)
                if bar is not None:
                    bar.update(size)
            await call.done_writing()
        except STREAM_WRITE_ERRORS:
            # A write fails once the call has ended (the collector refused or answered early);
            # the write's own error is a generic INTERNAL, the reply below carries the real status.
            pass
        try:
            return await call
        except grpc.RpcError as exc:
            error = await stream_error(call, exc, METHOD, watch)
        if isinstance(error, UnavailableError) and not may_have_committed:
            raise _EarlyUnavailable(error)
        raise error
    finally:
        if bar is not None:
            bar.close()
        if not call.done():
            call.cancel()  # e.g. the caller was cancelled mid-push: the collector discards it


def _progress_bar(total: int, enabled: bool, version: int):
    if not enabled or total < PROGRESS_MIN_BYTES:
        return None
    try:
        from tqdm import tqdm  # optional: no bar without it
    except ImportError:
        return None
    desc = f"push weights v{version}" if version else "push weights"
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                leave=False, dynamic_ncols=True)


__all__ = ["DEFAULT_CHUNK_BYTES", "MODES", "STRATEGIES", "TRANSPORTS", "PushResult", "TransportMemo", "named_tensors",
           "push_weights"]
