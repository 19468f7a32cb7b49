"""The sending side of a relayed push (``services/common/relay.py``) against in-process RelayWeights
servers that hold some bytes already, die mid-call or refuse: resumed from what each holds, cut out
and routed around, nothing sent twice to the replica that takes it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.common.relay import Relay, name_downstream, tls_names_of
from rlfleet.services.common.weight_stream import WeightPush
from rlfleet.rpc.channel import ChannelSettings
from rlfleet.v1 import generation_pb2, generation_pb2_grpc

CHUNK = 1000
TOTAL = 10 * CHUNK + 123


class FakeReplica(generation_pb2_grpc.GenerationServiceServicer):
    """RelayWeights only: holds ``held`` bytes at the start; ``die_after`` chunks, it aborts the call."""

    def __init__(self, held: bytes = b"", die_after: int | None = None, refuse: bool = False, not_yet: int = 0,
                 cut_after: tuple[str, ...] = ()):
        self.received = bytearray(held)
        self.die_after, self.refuse, self.not_yet = die_after, refuse, not_yet
        self.cut_after = list(cut_after)
        """What it reports cut out after it (it could not reach them)."""
        self.headers: list[generation_pb2.RelayHeader] = []
        self.chunks = 0

    async def RelayWeights(self, request_iterator, context):
        requests = request_iterator.__aiter__()
        self.headers.append((await requests.__anext__()).header)
        if self.refuse:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the push was refused here")
        if len(self.headers) <= self.not_yet:  # the collector's own call has not staged it here yet
            await context.abort(grpc.StatusCode.NOT_FOUND, "no relayed push staged here")
        yield generation_pb2.RelayWeightsResponse(received_bytes=len(self.received))
        async for request in requests:
            chunk = request.chunk
            assert chunk.offset == len(self.received), "a chunk out of order, or one held already"
            self.received += chunk.data
            self.chunks += 1
            if self.die_after is not None and self.chunks >= self.die_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica died")
        yield generation_pb2.RelayWeightsResponse(received_bytes=len(self.received), done=True, cut=self.cut_after)


async def serve(replica: FakeReplica, tls: tuple[bytes, bytes] | None = None) -> tuple[grpc.aio.Server, str]:
    """``replica`` on a loopback port; ``tls`` (key, certificate): over TLS, on 127.0.0.2, an address its
    certificate (``make_credentials``: its name, localhost, 127.0.0.1) does not hold."""
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(replica, server)
    host = "127.0.0.1" if tls is None else "127.0.0.2"
    port = server.add_insecure_port(f"{host}:0") if tls is None else \
        server.add_secure_port(f"{host}:0", grpc.ssl_server_credentials([tls]))
    await server.start()
    return server, f"{host}:{port}"


def push_of(data: bytes) -> WeightPush:
    return WeightPush(version=7, mode="keep", names=["w"], dtypes=[torch.uint8], shapes=[(len(data),)],
                      sizes=[len(data)], total_bytes=len(data), checksum_spec="")


async def relay_through(replicas: list[FakeReplica], data: bytes, arriving: bool, run=Relay.run,
                        servers: list | None = None, settings: ChannelSettings = ChannelSettings(),
                        tls_names: dict[str, str] | None = None) -> Relay:
    """``data`` relayed to ``replicas``: all there from the start, or (``arriving``) a chunk at a time."""
    servers = servers or [await serve(replica) for replica in replicas]
    try:
        push = push_of(data)
        relay = Relay("p1", push, memoryview(data), [address for _, address in servers], settings,
                      chunk_bytes=CHUNK, tls_names=tls_names)
        task = asyncio.ensure_future(run(relay))
        if arriving:
            for end in range(CHUNK, len(data) + CHUNK, CHUNK):
                await asyncio.sleep(0)
                push.received = min(end, len(data))
                relay.moved()
        else:
            push.received = len(data)
            relay.moved()
        await asyncio.wait_for(task, 60)
        return relay
    finally:
        for server, _ in servers:
            await server.stop(None)


DATA = bytes(i % 251 for i in range(TOTAL))


@pytest.mark.parametrize("arriving", [False, True], ids=["all there", "as they arrive"])
async def test_the_first_replica_that_answers_takes_the_bytes_and_the_rest_of_the_chain(arriving):
    first, second = FakeReplica(), FakeReplica()
    relay = await relay_through([first, second], DATA, arriving)
    assert bytes(first.received) == DATA and second.headers == []
    assert [list(h.downstream) for h in first.headers] == [[relay.downstream[1]]]
    assert (relay.reached, relay.cut, relay.sent_bytes) == (relay.downstream[0], [], TOTAL)


@pytest.mark.parametrize("arriving", [False, True], ids=["all there", "as they arrive"])
async def test_a_replica_that_dies_mid_relay_is_cut_out_and_the_next_resumes_from_what_it_holds(arriving):
    """The first dies after 3 chunks; the second already got 2 chunks from it (as the first forwarded
    them): it gets the rest from here, from its offset, none of its bytes again."""
    first, second, third = FakeReplica(die_after=3), FakeReplica(held=DATA[:2 * CHUNK]), FakeReplica()
    relay = await relay_through([first, second, third], DATA, arriving)
    assert bytes(second.received) == DATA and third.headers == []
    assert [address for address, _ in relay.cut] == [relay.downstream[0]]
    assert "UNAVAILABLE: the replica died" in relay.cut[0][1]
    assert [list(h.downstream) for h in second.headers] == [[relay.downstream[2]]]
    assert relay.reached == relay.downstream[1]
    assert relay.sent[relay.downstream[0]] >= 3 * CHUNK  # and what was written before its end was read
    assert relay.sent[relay.downstream[1]] == TOTAL - 2 * CHUNK and relay.downstream[2] not in relay.sent


async def test_every_replica_refusing_ends_the_relay_with_each_cut_out():
    refusing = [FakeReplica(refuse=True), FakeReplica(refuse=True)]
    relay = await relay_through(refusing, DATA, arriving=False)
    assert relay.reached is None and relay.sent_bytes == 0
    assert [why for _, why in relay.cut] == ["FAILED_PRECONDITION: the push was refused here"] * 2


async def test_a_replica_that_has_not_staged_the_push_yet_is_asked_again():
    """NOT_FOUND: the replica's own call from the collector (which stages the push) came second."""
    late = FakeReplica(not_yet=3)
    relay = await relay_through([late], DATA, arriving=False)
    assert (len(late.headers), relay.reached, relay.cut) == (4, relay.downstream[0], [])
    assert bytes(late.received) == DATA


async def test_the_replicas_a_peer_cut_out_get_the_bytes_from_the_collector():
    """The first replica could not reach the second (it says so with its ``done``): the collector's relay
    (``fanout._relay_and_retry``) sends the second the bytes itself, once the relay ended."""
    from rlfleet.services.collector.fanout import _relay_and_retry

    second = FakeReplica()
    second_server = await serve(second)
    first = FakeReplica(cut_after=(second_server[1],))
    first_server = await serve(first)
    try:
        relay = await relay_through([first], DATA, arriving=True, run=_relay_and_retry, servers=[first_server])
    finally:
        await second_server[0].stop(None)
    assert relay.cut_after == [second_server[1]]
    assert bytes(first.received) == DATA and bytes(second.received) == DATA
    assert relay.sent == {first_server[1]: TOTAL, second_server[1]: TOTAL}


async def test_the_replicas_the_bytes_never_reached_fail_their_stage_at_once():
    """A live replica the relay could not reach (compose: its TLS name is not its address) waited for bytes
    that never came, and held the push until its deadline. The collector's relay returns the replicas it
    never reached, and each of their stages fails then (``fanout._fail_unreached``)."""
    from types import SimpleNamespace

    from rlfleet.services.collector.fanout import _fail_unreached

    refusing, taking = FakeReplica(refuse=True), FakeReplica()
    servers = [await serve(refusing), await serve(taking)]
    unreached = []
    relay = await relay_through([refusing, taking], DATA, arriving=False, servers=servers,
                                run=lambda relay: _collect(relay, unreached))
    assert unreached == [servers[0][1]] and relay.reached == servers[1][1]
    failed = []
    streams = [SimpleNamespace(replica=SimpleNamespace(address=address),
                               fail=lambda error, code, address=address: failed.append((address, code, error)))
               for address in (servers[0][1], servers[1][1])]
    done = asyncio.get_running_loop().create_future()
    done.set_result(unreached)
    _fail_unreached(streams)(done)
    assert failed == [(servers[0][1], "UNAVAILABLE", "the relay could not reach it (see the relay's log)")]


async def _collect(relay, unreached: list) -> None:
    from rlfleet.services.collector.fanout import _relay_and_retry

    unreached.extend(await _relay_and_retry(relay))


async def test_each_replica_is_checked_against_its_tls_name_and_the_names_go_down_the_relay(tmp_path):
    """Replicas a name resolved to one address each (compose's service names, a headless Service): their
    certificates hold the name, not the address they are called by. The relay checks each one against
    its name and passes the names of the replicas after it down with their addresses (and the collector's
    retry of a replica a peer cut out checks it against its name too); without the names no replica can be
    verified, and every one is cut out."""
    from rlfleet.services.collector.fanout import _relay_and_retry
    from rlfleet.services.credentials import make_credentials

    credentials = make_credentials(tmp_path / "credentials", names=("generation-a", "generation-b", "collector"))
    own = {name: ((credentials / f"{name}.key").read_bytes(), (credentials / f"{name}.pem").read_bytes())
           for name in ("generation-a", "generation-b")}
    settings = ChannelSettings(tls=True, root_certificates=(credentials / "ca.pem").read_bytes(),
                               certificate_chain=(credentials / "collector.pem").read_bytes(),
                               private_key=(credentials / "collector.key").read_bytes(), retries=0)
    for named in (True, False):
        first, second = FakeReplica(), FakeReplica()
        servers = [await serve(first, own["generation-a"]), await serve(second, own["generation-b"])]
        names = {servers[0][1]: "generation-a", servers[1][1]: "generation-b"} if named else None
        first.cut_after = [servers[1][1]]  # it could not reach the second: the collector sends it the bytes
        relay = await relay_through([first, second], DATA, arriving=True, servers=servers, settings=settings,
                                    tls_names=names, run=_relay_and_retry)
        if named:
            assert relay.reached == servers[0][1] and bytes(first.received) == DATA and relay.cut == []
            assert [tls_names_of(header) for header in first.headers] == [{servers[1][1]: "generation-b"}]
            assert bytes(second.received) == DATA and relay.sent == {address: TOTAL for _, address in servers}
        else:
            assert relay.reached is None and first.headers == second.headers == []
            assert [address for address, _ in relay.cut] == [address for _, address in servers]
            assert all(why.startswith("UNAVAILABLE") for _, why in relay.cut), relay.cut


def test_tls_names_match_the_downstream_one_for_one_or_are_absent():
    header = generation_pb2.RelayHeader()
    name_downstream(header, ["10.0.0.1:1", "10.0.0.2:1", "b:1"], {"10.0.0.2:1": "generation"})
    assert list(header.downstream_tls_names) == ["", "generation", ""]
    assert tls_names_of(header) == {"10.0.0.2:1": "generation"}
    plain = generation_pb2.ShareWeightsRequest()
    name_downstream(plain, ["10.0.0.1:1"], {})
    assert list(plain.downstream_tls_names) == [] and tls_names_of(plain) == {}
    header.downstream_tls_names.append("one-too-many")
    with pytest.raises(InvalidArgument, match="downstream_tls_names has 4 names for the 3 replicas of downstream"):
        tls_names_of(header)
