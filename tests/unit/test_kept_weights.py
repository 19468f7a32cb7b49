"""The weights a replica keeps (``services/generation/kept_weights.py``), shared with a joining peer."""

import asyncio

import pytest

from rlfleet.services.common.errors import FailedPrecondition
from rlfleet.services.generation.kept_weights import WeightKeeper
from rlfleet.v1 import weights_pb2
from rlfleet.wire import shm


def keeper_with(version: int, size: int = 64) -> tuple[WeightKeeper, shm.Segment]:
    keeper = WeightKeeper(enabled=True)
    segment = shm.create_segment(size)
    segment.buffer[:] = bytes(range(size))
    keeper.keep(version, weights_pb2.WeightManifest(version=version, total_bytes=size), segment)
    return keeper, segment


def test_a_share_holds_the_kept_weights_until_it_ends_even_if_they_are_dropped_meanwhile():
    async def run():
        keeper, segment = keeper_with(3)
        async with keeper.shared(3) as kept:
            keeper.drop()  # a failed swap, or a full push replacing them, while a peer is sent them
            assert bytes(kept.segment.buffer[:4]) == bytes(range(4))  # still readable
            with pytest.raises(FailedPrecondition, match="keeps no weights"):
                async with keeper.shared(3):
                    pass
        assert kept.segment is None  # closed once the share ended
        with pytest.raises(FailedPrecondition, match="keeps no weights"):
            async with keeper.shared(3):
                pass
        return segment.path
    path = asyncio.run(run())
    assert path not in shm.list_segments()


def test_a_share_of_another_version_than_the_kept_one_is_refused_naming_both():
    async def run():
        keeper, _ = keeper_with(5)
        with pytest.raises(FailedPrecondition, match="cannot share version 4: this replica keeps the weights of "
                                                     "version 5"):
            async with keeper.shared(4):
                pass
        async with keeper.shared(5) as kept:
            assert kept.version == 5
        assert kept.segment is not None  # not dropped: still kept
        keeper.drop()
        assert kept.segment is None
        off = WeightKeeper(enabled=False)
        with pytest.raises(FailedPrecondition, match=r"keeps no weights \(delta_pushes is off\)"):
            async with off.shared(1):
                pass
    asyncio.run(run())
