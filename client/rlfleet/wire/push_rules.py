"""What a weight push may be: the rules the SDK, the collector and every replica check, written once.

A push (``weights.proto``) is one ``WeightManifest``, then, over grpc, its bytes as ``WeightChunk``s in
order; a two-phase push (collector to replica) then waits for a ``WeightCommit`` naming the staged
version. Three things about a push combine, and not freely (``check_kind``):

- its kind: full weights, a delta on a base version (``manifest.delta``), or a LoRA adapter
  (``manifest.lora``); an adapter is always whole;
- its road (``manifest.source``): grpc chunks, an shm segment, or an NCCL broadcast; deltas and
  adapters are not broadcast (the replicas patch or load them from bytes they hold). A replica may also
  get the bytes relayed by its peers (``manifest.relay``: the collector's choice, never the trainer's);
- its rollout (``manifest.strategy``): every replica at once, or rolling, a few at a time; an NCCL
  broadcast is one collective across every replica, so it cannot roll.

Who may set what is ``check_manifest``'s, by the sender: the trainer never sets ``resync``,
``two_phase`` or ``run_id`` (the collector does), and may leave ``version`` 0 ("the next one"); the collector names
the version and each replica's NCCL rank. What depends on state (the committed version, what a replica
keeps, its LoRA rank) is the receiver's. The services answer a ``WireError`` with INVALID_ARGUMENT; the
SDK raises it before anything is sent.
"""

from __future__ import annotations

from typing import Literal

from rlfleet.v1 import weights_pb2
from rlfleet.wire.errors import WireError

Sender = Literal["trainer", "collector"]


def is_rolling(manifest: weights_pb2.WeightManifest, default: int = weights_pb2.UPDATE_STRATEGY_UNSPECIFIED) -> bool:
    """Whether the push rolls out a few replicas at a time: its ``strategy``, else the receiver's
    ``default`` (the collector's ``update_strategy``)."""
    strategy = manifest.strategy or default
    return strategy == weights_pb2.UPDATE_STRATEGY_ROLLING


def check_kind(*, source: str | None, delta: bool, adapter: bool, rolling: bool) -> None:
    """WireError for a kind, road and rollout that cannot go together (``source`` None: grpc)."""
    if adapter and delta:
        raise WireError("manifest.lora", "an adapter push is whole, never a delta (manifest.delta)")
    if source != "nccl":
        return
    if adapter:
        raise WireError("manifest.lora", "an adapter push travels by shm or grpc, not nccl")
    if delta:
        raise WireError("manifest.delta", "a delta push travels by shm or grpc, not nccl")
    if rolling:
        raise WireError("manifest.strategy", "an nccl push is one collective across every replica; it cannot roll "
                                             "out a few replicas at a time (push it by shm or grpc)")


def check_manifest(manifest: weights_pb2.WeightManifest, sender: Sender,
                   default_strategy: int = weights_pb2.UPDATE_STRATEGY_UNSPECIFIED) -> None:
    """WireError for a manifest ``sender`` may not send: the fields that sender sets, the combination
    (``check_kind``; ``default_strategy``: the receiver's when the push names none) and an NCCL push's
    rendezvous. The tensors themselves are ``WeightPush.from_manifest``'s."""
    if sender == "trainer":
        if manifest.resync or manifest.two_phase:
            raise WireError("manifest.resync", "manifest.resync and manifest.two_phase are set by the collector, "
                                               "not the trainer")
        if manifest.run_id:
            raise WireError("manifest.run_id", "set by the collector (the run the trainer joined), not the trainer")
        if manifest.HasField("relay"):
            raise WireError("manifest.relay", "set by the collector (a push relayed between replicas), not the "
                                              "trainer: send chunks (grpc) or a segment (shm)")
    elif manifest.version == 0:
        raise WireError("manifest.version", "must be set (> current version)")
    source = manifest.WhichOneof("source")
    if source == "relay" and not manifest.relay.push_id:
        raise WireError("manifest.relay.push_id", "is empty: it names the push in the RelayWeights calls")
    check_kind(source=source, delta=manifest.HasField("delta"), adapter=manifest.HasField("lora"),
               rolling=is_rolling(manifest, default_strategy))
    if source == "nccl":
        rendezvous = manifest.nccl
        if not rendezvous.master_address or not rendezvous.master_port:
            raise WireError("manifest.nccl", "master_address and master_port are required")
        if sender == "collector" and (rendezvous.world_size < 2
                                      or not 1 <= rendezvous.rank_offset < rendezvous.world_size):
            raise WireError("manifest.nccl", "world_size >= 2 and 1 <= rank_offset < world_size are required "
                                             "(rank 0 is the trainer's)")


__all__ = ["Sender", "check_kind", "check_manifest", "is_rolling"]
