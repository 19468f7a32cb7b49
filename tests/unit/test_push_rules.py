"""The weight push protocol: what a manifest may be (``rlfleet.wire.push_rules``) and the order a receiver
reads a push in (``PushReceiver``), for every sender."""

import asyncio

import pytest
import torch

from rlfleet.services.common.errors import Aborted, InvalidArgument
from rlfleet.services.common.weight_stream import PushReceiver, WeightPush
from rlfleet.v1 import weights_pb2
from rlfleet.wire import WireError
from rlfleet.wire.push_messages import iter_push_messages
from rlfleet.wire.push_rules import check_kind, check_manifest, is_rolling

STATE = [("a", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(3, dtype=torch.int64))]
ROLLING, PAUSE_ALL = weights_pb2.UPDATE_STRATEGY_ROLLING, weights_pb2.UPDATE_STRATEGY_PAUSE_ALL


def manifest(version=3, **fields) -> weights_pb2.WeightManifest:
    _, built = next(iter_push_messages(STATE, version=version, checksum_algo=None))
    for name, value in fields.items():
        if name == "nccl":
            built.nccl.CopyFrom(weights_pb2.NcclRendezvous(**value))
        elif name == "shm":
            built.shm.path = value
        elif name == "lora":
            built.lora.CopyFrom(weights_pb2.LoraAdapter(rank=2, alpha=4, target_modules=["q_proj"]))
        elif name == "delta":
            built.delta.base_version = value
        else:
            setattr(built, name, value)
    return built


RENDEZVOUS = dict(master_address="10.0.0.1", master_port=29500)


@pytest.mark.parametrize("source", [None, "shm", "nccl"])
@pytest.mark.parametrize("delta", [False, True])
@pytest.mark.parametrize("adapter", [False, True])
@pytest.mark.parametrize("rolling", [False, True])
def test_every_combination_of_kind_road_and_rollout(source, delta, adapter, rolling):
    # Allowed: anything by grpc or shm except an adapter that is a delta; by nccl, only full weights
    # pushed to every replica at once.
    allowed = not (adapter and delta) and (source != "nccl" or not (delta or adapter or rolling))
    if allowed:
        check_kind(source=source, delta=delta, adapter=adapter, rolling=rolling)
        return
    with pytest.raises(WireError) as raised:
        check_kind(source=source, delta=delta, adapter=adapter, rolling=rolling)
    field = ("manifest.lora" if adapter and (delta or source == "nccl") else
             "manifest.delta" if delta else "manifest.strategy")
    assert raised.value.field == field


def test_the_strategy_is_the_pushs_else_the_receivers():
    assert is_rolling(manifest(strategy=ROLLING))
    assert is_rolling(manifest(strategy=ROLLING), default=PAUSE_ALL)  # the push's own wins
    assert not is_rolling(manifest(strategy=PAUSE_ALL), default=ROLLING)
    assert is_rolling(manifest(), default=ROLLING) and not is_rolling(manifest())
    nccl = manifest(nccl=RENDEZVOUS)
    check_manifest(nccl, "trainer")
    with pytest.raises(WireError, match="cannot roll out"):  # rolling by the collector's setting
        check_manifest(nccl, "trainer", default_strategy=ROLLING)


def test_what_each_sender_may_set():
    check_manifest(manifest(version=0), "trainer")  # 0: the collector names the next version
    with pytest.raises(WireError, match=r"manifest.version: must be set"):
        check_manifest(manifest(version=0), "collector")
    for field in ("resync", "two_phase"):
        with pytest.raises(WireError, match="set by the collector, not the trainer"):
            check_manifest(manifest(**{field: True}), "trainer")
        check_manifest(manifest(**{field: True}), "collector")


@pytest.mark.parametrize("rendezvous, trainer_ok, collector_ok", [
    (dict(master_address="", master_port=29500), False, False),
    (dict(master_address="h", master_port=0), False, False),
    (dict(RENDEZVOUS), True, False),  # the trainer leaves the ranks to the collector
    (dict(RENDEZVOUS, world_size=3, rank_offset=0), True, False),  # rank 0 is the trainer's
    (dict(RENDEZVOUS, world_size=3, rank_offset=3), True, False),
    (dict(RENDEZVOUS, world_size=1, rank_offset=1), True, False),
    (dict(RENDEZVOUS, world_size=3, rank_offset=2), True, True),
])
def test_an_nccl_rendezvous(rendezvous, trainer_ok, collector_ok):
    for sender, ok in (("trainer", trainer_ok), ("collector", collector_ok)):
        if ok:
            check_manifest(manifest(nccl=rendezvous), sender)
        else:
            with pytest.raises(WireError, match="manifest.nccl: "):
                check_manifest(manifest(nccl=rendezvous), sender)


def test_the_sdk_refuses_what_the_collector_would_before_sending():
    from rlfleet.client.push import check_options

    lora = weights_pb2.LoraAdapter(rank=2)
    for options, message in ((dict(transport="nccl", strategy="rolling", lora=None, delta=False), "cannot roll out"),
                             (dict(transport="nccl", strategy="", lora=None, delta=True), "a delta push travels"),
                             (dict(transport="auto", strategy="", lora=lora, delta=True), "is whole")):
        with pytest.raises(ValueError, match=message):
            check_options(**options)
    check_options(transport="shm", strategy="rolling", lora=lora, delta=False)


# --- the receiver: the protocol's order ---------------------------------------------------------------------
def run(coroutine):
    return asyncio.run(coroutine)


async def stream(*pairs):
    for pair in pairs:
        yield pair


def pairs(version=3, chunk_bytes=8):
    return list(iter_push_messages(STATE, version=version, chunk_bytes=chunk_bytes, checksum_algo="crc32"))


async def receive(messages, then=None):
    receiver = PushReceiver(stream(*messages))
    got = await receiver.manifest()
    push = WeightPush.from_manifest(got, 1 << 20)
    push.attach_sink(memoryview(bytearray(push.total_bytes)))
    forwarded = []

    async def forward(chunk):
        forwarded.append(chunk.offset)

    await receiver.chunks(push, forward)
    if then == "end":
        await receiver.end()
    elif then is not None:
        await receiver.commit(then)
    return push, forwarded


def test_a_push_in_order_is_received_and_each_chunk_forwarded_once_checked():
    messages = pairs()
    push, forwarded = run(receive(messages, "end"))
    assert push.complete and bytes(push.sink) == b"".join(m.data for k, m in messages if k == "chunk")
    assert forwarded == [m.offset for k, m in messages if k == "chunk"]
    push, _ = run(receive([*messages, ("commit", weights_pb2.WeightCommit(version=3))], then=3))
    assert push.complete


def test_the_manifest_copy_is_the_receivers_own():
    first = pairs()[0][1]
    got = run(PushReceiver(stream(("manifest", first))).manifest())
    got.version = 99
    assert first.version == 3


@pytest.mark.parametrize("case, error, match", [
    ("empty", InvalidArgument, "empty push: the first message must be the manifest"),
    ("chunk first", InvalidArgument, "the first message of a push must be the manifest"),
    ("manifest twice", InvalidArgument, "got the manifest again"),
    ("cut", Aborted, r"ended after 8 of 48 bytes; nothing applied"),
    ("after the last byte", InvalidArgument, "a chunk after the push's last byte"),
    ("no commit", Aborted, "ended before the commit"),
    ("commit of another version", InvalidArgument, "expected the commit of version 3"),
])
def test_a_push_out_of_order(case, error, match):
    messages = pairs()
    manifest_pair, chunks = messages[0], messages[1:]
    then = {"after the last byte": "end", "no commit": 3, "commit of another version": 3}.get(case)
    sent = {"empty": [], "chunk first": chunks, "manifest twice": [manifest_pair, manifest_pair, *chunks],
            "cut": messages[:2], "after the last byte": [*messages, chunks[0]], "no commit": messages,
            "commit of another version": [*messages, ("commit", weights_pb2.WeightCommit(version=4))]}[case]
    with pytest.raises(error, match=match):
        run(receive(sent, then))
