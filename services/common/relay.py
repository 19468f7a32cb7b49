"""A push relayed from replica to replica: the collector sends its bytes once.

The replicas a push reaches over the network (another host: they cannot map the collector's
segment) form a chain. The collector sends the bytes to the first (``GenerationService.RelayWeights``)
as they arrive from the trainer; each replica writes them into its staging segment and forwards them
to the next as they arrive, so the collector's egress is one copy of the push, whatever the number of
replicas, and the push's time grows with the chain's per-hop latency, not with its length.

``Relay`` is the sending side, the same at the collector and at each replica: it sends to the first
replica of its ``downstream`` list that answers, passing on the rest of the list, and stays
responsible for all of them until that replica answers ``done`` (it and every replica after it hold
every byte). A replica that fails (SIGKILLed, unreachable, refusing) is cut out and the next one gets
the bytes from here, from the offset it answers (what it already holds, from the replica that died).

The control plane is unchanged: each replica stages, verifies (the manifest's checksum) and commits on
its own UpdateWeights call from the collector, which commits the version only on the replicas that
staged, and re-syncs the rest from its spool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc

from rlfleet.rpc.channel import STREAM_WRITE_ERRORS, ChannelSettings, StatusWatch, aio_channel, stream_error
from rlfleet.rpc.errors import RlfleetClientError
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.common.weight_stream import WeightPush
from rlfleet.v1 import generation_pb2, generation_pb2_grpc
from rlfleet.wire.push_messages import DEFAULT_CHUNK_BYTES

log = logging.getLogger("rlfleet.relay")


FIND_SECONDS = 30.0
"""How long a replica that answers NOT_FOUND is asked again: the collector opens each replica's own call
(which stages the push there) and the relay at once, and the relay may come first."""
FIND_RETRY_SECONDS = 0.05


class RelayBroken(Exception):
    """The replica sent to ended its call before it said ``done``."""


class Arrivals:
    """Wakes whoever waits (``wait``) for more of a push's bytes when ``moved`` is called (in the event loop)."""

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future] = []

    def moved(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter


def tls_names_of(message) -> dict[str, str]:
    """The TLS names a RelayHeader or ShareWeightsRequest gives the replicas of its ``downstream``, by
    address (those it names); InvalidArgument where its two lists do not match one for one."""
    names = list(message.downstream_tls_names)
    if names and len(names) != len(message.downstream):
        raise InvalidArgument(f"downstream_tls_names has {len(names)} names for the {len(message.downstream)} "
                              f"replicas of downstream: give one per replica (empty: checked against its address) "
                              f"or none")
    return {address: name for address, name in zip(message.downstream, names) if name}


def name_downstream(message, downstream: list[str], tls_names: dict[str, str]) -> None:
    """``downstream`` into a RelayHeader or ShareWeightsRequest, with the TLS names of those that have one
    (an empty name: checked against its address)."""
    message.downstream.extend(downstream)
    if any(tls_names.get(address) for address in downstream):
        message.downstream_tls_names.extend(tls_names.get(address, "") for address in downstream)


class Relay:
    """Sends one push's bytes, as they arrive in ``push`` (``data``: where they land), down ``downstream``
    (host:port, in order). ``moved()`` is called (in the event loop) whenever ``push.received`` grew.
    ``tls_names``: the name a replica's certificate is checked against, by address, where it is not its
    address (a name resolved to one address per replica); passed down the relay with the addresses."""

    def __init__(self, push_id: str, push: WeightPush, data: memoryview, downstream: list[str],
                 settings: ChannelSettings, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 tls_names: dict[str, str] | None = None):
        self.push_id, self.push, self.data = push_id, push, data
        self.downstream = list(downstream)
        self.settings, self.chunk_bytes = settings, chunk_bytes
        self.tls_names = dict(tls_names or {})
        self.sent: dict[str, int] = {}
        """Bytes this relay sent, by replica."""
        self.cut: list[tuple[str, str]] = []
        """The replicas this relay cut out (address, why), in order."""
        self.cut_after: list[str] = []
        """The replicas the one that answered ``done`` reported cut out after it (by it or further on)."""
        self.reached: str | None = None
        """The replica that answered ``done``; None while none did (or none could)."""
        self._arrivals = Arrivals()

    @property
    def all_cut(self) -> list[str]:
        """Every replica of ``downstream`` that did not get the bytes through this relay."""
        return [address for address, _ in self.cut] + self.cut_after

    @property
    def sent_bytes(self) -> int:
        """Bytes this relay sent, to every replica it sent to."""
        return sum(self.sent.values())

    def moved(self) -> None:
        """More bytes arrived (or the push ended): wake the sender."""
        self._arrivals.moved()

    async def run(self) -> None:
        """Until a replica of ``downstream`` answered ``done``, or every one was cut out."""
        loop = asyncio.get_running_loop()
        rest = self.downstream
        while rest:
            target, after = rest[0], rest[1:]
            staged_by = loop.time() + FIND_SECONDS
            while True:
                try:
                    await self._send(target, after)
                    self.reached = target
                    return
                except RelayBroken as err:
                    why = str(err)
                except RlfleetClientError as err:
                    why = f"{err.code}: {err.details}"
                    if err.code == "NOT_FOUND" and loop.time() < staged_by:
                        await asyncio.sleep(FIND_RETRY_SECONDS)  # its own call from the collector is not there yet
                        continue
                break
            self.cut.append((target, why))
            log.warning("relay of version %d: replica %s cut out (%s); %s", self.push.version, target, why,
                        f"its bytes go to {after[0]}" if after else "none after it")
            rest = after

    async def _send(self, target: str, after: list[str]) -> None:
        """The bytes to ``target`` (from the offset it holds), until it answers ``done``; RelayBroken or
        the call's error (the replica's own status) otherwise."""
        name = self.tls_names.get(target)
        channel = aio_channel(target, dataclasses.replace(self.settings, server_name=name) if name else self.settings)
        try:
            call = generation_pb2_grpc.GenerationServiceStub(channel).RelayWeights(metadata=self.settings.metadata())
            watch = StatusWatch(call)  # the replica's status, not grpc.aio's INTERNAL for a write that raced it
            try:
                await self._stream(call, target, after)
            except STREAM_WRITE_ERRORS as err:
                if not isinstance(err, grpc.RpcError):  # a write after the call ended: its status says why
                    try:
                        await call.read()
                    except grpc.RpcError as status:
                        err = status
                    else:
                        raise RelayBroken("its call ended") from None
                raise await stream_error(call, err, "RelayWeights", watch) from None
        finally:
            await channel.close()

    async def _stream(self, call, target: str, after: list[str]) -> None:
        header = generation_pb2.RelayWeightsRequest()
        header.header.push_id = self.push_id
        header.header.version = self.push.version
        name_downstream(header.header, after, self.tls_names)
        await call.write(header)
        offset = (await self._reply(call)).received_bytes
        total = self.push.total_bytes
        while offset < total:
            while self.push.received <= offset:
                await self._arrivals.wait()
            end = min(self.push.received, offset + self.chunk_bytes)
            request = generation_pb2.RelayWeightsRequest()
            request.chunk.offset = offset
            request.chunk.data = self.data[offset:end].tobytes()
            await call.write(request)
            self.sent[target] = self.sent.get(target, 0) + end - offset
            offset = end
        await call.done_writing()
        while not (reply := await self._reply(call)).done:
            pass
        self.cut_after = list(reply.cut)

    @staticmethod
    async def _reply(call) -> generation_pb2.RelayWeightsResponse:
        reply = await call.read()
        if reply is grpc.aio.EOF:
            raise RelayBroken("it ended the relay before it held every byte")
        return reply


__all__ = ["FIND_SECONDS", "Arrivals", "Relay", "RelayBroken", "name_downstream", "tls_names_of"]
