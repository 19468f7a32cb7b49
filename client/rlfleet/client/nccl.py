"""``push_weights(..., transport="nccl")``: the trainer broadcasts over NCCL to every inference worker.

GPU hosts. The trainer is rank 0 of a group made for the push: it hosts the
rendezvous (a TCPStore at ``nccl_address`` and a free port), sends the
collector a manifest naming it, and broadcasts every tensor with vLLM's own
trainer-side helpers (``packed_nccl_broadcast_producer``, or tensor by
tensor). The collector gives each healthy replica its rank offset (its
workers follow the trainer and the replicas before it); each replica's
workers join with vLLM's ``NCCLWeightTransferEngine`` and receive into a
segment of their own: that is their stage. The collector then commits as for
any push, and each replica applies from its segment, like shm. The group is
torn down after the push (one group per push: a replica that went away never
wedges the next one).

Needs vLLM in the trainer's environment (``pip install 'rlfleet[nccl]'``)
and the weights on a CUDA device. The world size is read from the
collector's ``GetStatus`` just before the push; a collector whose replica set
changed meanwhile answers FAILED_PRECONDITION, and the push can be retried.

**Unverified**: no GPU vLLM runs where this was written. What runs here is
the orchestration (rank offsets, manifests, the staging and the apply from
the segment) and the sender/receiver pair over a stand-in group in unit tests.
A trainer killed mid-broadcast leaves the replicas' workers inside the NCCL
call until NCCL gives up; they are not applied (nothing was committed).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

import grpc
import torch

from rlfleet.rpc.channel import STREAM_WRITE_ERRORS, ChannelSettings, StatusWatch, stream_error
from rlfleet.rpc.records import PushResult
from rlfleet.v1 import collector_pb2

NCCL_ADDRESS_ENV = "RLFLEET_NCCL_ADDRESS"
"""The trainer's address as the replicas reach it (default: this host's name, resolved)."""


def world_size(replicas: list[collector_pb2.ReplicaStatus]) -> int:
    """The trainer (rank 0) plus every worker of every healthy replica."""
    return 1 + sum(r.weight_transfer_world_size for r in replicas if r.healthy)


def send_broadcast(group, pairs: list[tuple[str, torch.Tensor]], *, packed: bool,
                   packed_buffer_size_bytes: int | None = None, packed_num_buffers: int | None = None) -> None:
    """Broadcast ``pairs`` from rank 0 in manifest order, as vLLM's receivers expect them."""
    if packed:
        from vllm.distributed.weight_transfer.packed_tensor import (
            DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS, packed_nccl_broadcast_producer)

        packed_nccl_broadcast_producer(
            iterator=iter(pairs), group=group, src=0, post_iter_func=lambda item: item[1],
            buffer_size_bytes=packed_buffer_size_bytes or DEFAULT_PACKED_BUFFER_SIZE_BYTES,
            num_buffers=packed_num_buffers or DEFAULT_PACKED_NUM_BUFFERS)
        return
    for _, tensor in pairs:
        stream = torch.cuda.current_stream() if tensor.is_cuda else None
        group.broadcast(tensor.detach().contiguous(), src=0, stream=stream)


def _trainer_address(address: str | None) -> str:
    if address:
        return address
    return os.environ.get(NCCL_ADDRESS_ENV) or socket.gethostbyname(socket.gethostname())


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _send(rendezvous: collector_pb2.PushWeightsRequest, pairs, packed: bool) -> None:
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    nccl = rendezvous.manifest.nccl
    group = trainer_init(dict(master_address=nccl.master_address, master_port=nccl.master_port,
                              world_size=nccl.world_size))
    try:
        send_broadcast(group, pairs, packed=packed)
        torch.cuda.synchronize()
    finally:
        group.destroy()


async def push_nccl(call_factory, status_call, pairs: list[tuple[str, torch.Tensor]], manifest, *,
                    timeout: float, settings: ChannelSettings, address: str | None,
                    packed: bool = True) -> PushResult:
    """Push ``pairs`` (CUDA tensors) with the manifest ``manifest`` (no checksum) over NCCL."""
    try:
        import vllm.distributed.weight_transfer.nccl_common  # noqa: F401
    except ImportError as err:
        raise RuntimeError("transport='nccl' needs vLLM in the trainer's environment: "
                           "pip install 'rlfleet[nccl]'") from err
    off_device = [name for name, tensor in pairs if not tensor.is_cuda]
    if off_device:
        raise ValueError(f"transport='nccl' broadcasts from a CUDA device; not on one: {off_device[:3]}")
    started = time.perf_counter()
    status = await status_call(collector_pb2.GetStatusRequest(), timeout=settings.timeout,
                               metadata=settings.metadata())
    host = _trainer_address(address)
    manifest.nccl.master_address = host
    manifest.nccl.master_port = _free_port(host)
    manifest.nccl.world_size = world_size(list(status.replicas))
    manifest.nccl.packed = packed
    request = collector_pb2.PushWeightsRequest(manifest=manifest)
    call = call_factory(timeout=timeout, metadata=settings.metadata())
    watch = StatusWatch(call)
    try:
        try:
            await call.write(request)
            await call.done_writing()
        except STREAM_WRITE_ERRORS:
            pass  # the reply below carries the real status
        # Rank 0 hosts the rendezvous; the replicas join as the collector hands them the manifest.
        # If the collector refuses first, the sender thread stays in the rendezvous until its
        # store times out (it cannot be interrupted); the error is raised now.
        sender = asyncio.ensure_future(asyncio.to_thread(_send, request, pairs, packed))
        reply = asyncio.ensure_future(_reply(call))
        done, _ = await asyncio.wait({sender, reply}, return_when=asyncio.FIRST_COMPLETED)
        if sender in done:
            sender.result()  # a failed broadcast raises here
        try:
            response = await reply
        except grpc.RpcError as exc:
            raise await stream_error(call, exc, "PushWeights", watch) from None
        return PushResult.from_proto(response, time.perf_counter() - started, 1, "nccl")
    finally:
        if not call.done():
            call.cancel()


async def _reply(call) -> Any:
    return await call
