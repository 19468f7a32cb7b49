"""A push whose call goes at the worst instants, over a stand-in for vLLM's engine (the real one runs in
``test_generation_service``): a streamed push (``WeightSwaps.stream``) cancelled while its load ends rolls
back and generation resumes on the kept weights; cancelled during its commit, the commit completes; a push
loaded at its commit, cancelled mid-swap, swaps in and is kept. Each time the replica serves again, its
admission open and the swap lock free: nothing is left paused."""

from __future__ import annotations

import asyncio
import os

import torch

from rlfleet.services.generation.config import GenerationEngineConfig
from rlfleet.services.generation.push_validation import TensorSpec
from rlfleet.services.generation.status import EngineState, ReplicaState
from rlfleet.services.generation.weight_swaps import WeightSwaps
from rlfleet.v1 import weights_pb2
from rlfleet.wire import shm
from rlfleet.wire.push_messages import iter_push_messages

PAIRS = [("a", torch.randn(64, 32)), ("b", torch.randn(128))]
DEADLINE = 30.0


class Engine:
    """What ``WeightSwaps`` calls of vLLM's AsyncLLM, each call a round trip to the engine core (a cancel
    can land in any of them). ``update_weights`` waits for ``load_ends`` (a worker loading a streamed push's
    bytes), so a test can cut the call while the load is still running."""

    errored = False

    def __init__(self):
        self.paused = False
        self.weight_version = "1"
        self.loading = asyncio.Event()
        self.load_ends = asyncio.Event()

    async def pause_generation(self, mode, clear_cache):
        await asyncio.sleep(0.001)
        self.paused = True

    async def resume_generation(self):
        await asyncio.sleep(0.001)
        self.paused = False

    async def start_weight_update(self):
        await asyncio.sleep(0.001)

    async def update_weights(self, request):
        self.loading.set()
        await self.load_ends.wait()
        os.close(os.open(request.update_info["shm_path"], os.O_RDONLY))  # the workers read the segment

    async def finish_weight_update(self, weight_version):
        await asyncio.sleep(0.001)
        self.weight_version = weight_version

    async def reset_prefix_cache(self):
        await asyncio.sleep(0.001)
        return True

    async def get_weight_version(self):
        await asyncio.sleep(0.001)
        return self.weight_version

    async def collective_rpc(self, method, args=()):
        await asyncio.sleep(0.001)
        return []  # the workers' load check: nothing wrong


async def until(condition, what: str) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.001)
    try:
        await asyncio.wait_for(poll(), DEADLINE)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def replica_serving_version_1(**settings) -> tuple[WeightSwaps, ReplicaState, Engine]:
    replica = ReplicaState(policy_version=1, max_model_len=64)
    replica.vllm = engine = Engine()
    replica.move_to(EngineState.STARTING)
    replica.move_to(EngineState.SERVING)
    replica.admission_open.set()
    swaps = WeightSwaps(GenerationEngineConfig(model="stand-in", **settings), replica)
    swaps.checkpoint_specs = {name: TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape))
                              for name, t in PAIRS}
    _, manifest = next(iter_push_messages(PAIRS, version=1, checksum_algo=None))
    segment = shm.create_segment(manifest.total_bytes)
    shm.write_tensors(segment, [tensor for _, tensor in PAIRS])
    swaps._kept.keep(1, manifest, segment)  # what vLLM holds: a rollback loads it again
    return swaps, replica, engine


def staged_version_2(swaps: WeightSwaps):
    """Version 2, abort mode, two-phase, over grpc: staged, and the chunks its bytes come in."""
    pairs = [(name, tensor + 1) for name, tensor in PAIRS]
    messages = list(iter_push_messages(pairs, version=2, mode=weights_pb2.UPDATE_MODE_ABORT, chunk_bytes=4096))
    manifest = messages[0][1]
    manifest.two_phase = True
    return swaps.stage(manifest), [chunk for _, chunk in messages[1:]]


async def streamed_push_with_every_byte_in(swaps: WeightSwaps, engine: Engine):
    """``staged_version_2``, its streamed load begun, every chunk in: the call then waits in ``loaded`` while
    the workers still load."""
    staged, chunks = staged_version_2(swaps)
    assert await swaps.stream(staged) is not None, "the push is not streamed"
    for chunk in chunks:
        staged.push.add_chunk(chunk)
    await until(engine.loading.is_set, "the streamed load to begin")
    call = asyncio.ensure_future(swaps.loaded(staged))
    await asyncio.sleep(0.05)
    assert not call.done() and engine.paused
    return staged, call


async def call_goes(swaps: WeightSwaps, staged, call: asyncio.Future) -> None:
    """The push's call cancelled (its collector gave up, or went), then what the servicer's ``finally`` does."""
    call.cancel()
    try:
        await call
    except asyncio.CancelledError:
        pass
    swaps.end(staged)
    staged.close()


def serves(replica: ReplicaState, engine: Engine, swaps: WeightSwaps) -> bool:
    return (replica.state == EngineState.SERVING and replica.admission_open.is_set() and not engine.paused
            and not swaps._lock.locked())


def test_a_call_cancelled_while_its_streamed_load_ends_rolls_back_and_resumes():
    async def main():
        swaps, replica, engine = replica_serving_version_1()
        staged, call = await streamed_push_with_every_byte_in(swaps, engine)
        await call_goes(swaps, staged, call)  # while the workers load
        engine.load_ends.set()  # the workers stop loading
        await until(lambda: serves(replica, engine, swaps), "the rollback to resume generation")
        assert replica.policy_version == 1 and engine.weight_version == "1"
        assert swaps._kept.kept.manifest.version == 1
        swaps.close()

    asyncio.run(main())


def test_a_call_cancelled_during_its_streamed_commit_commits():
    async def main():
        swaps, replica, engine = replica_serving_version_1()
        staged, call = await streamed_push_with_every_byte_in(swaps, engine)
        engine.load_ends.set()
        await asyncio.wait_for(call, DEADLINE)  # loaded and checked: the engine paused until the decision
        assert engine.paused and replica.policy_version == 1
        commit = asyncio.ensure_future(swaps.apply(staged))
        await asyncio.sleep(0.002)  # the commit begun: in its first call to the engine
        await call_goes(swaps, staged, commit)
        await until(lambda: replica.policy_version == 2 and serves(replica, engine, swaps), "the commit to end")
        assert engine.weight_version == "2" and swaps._kept.kept.manifest.version == 2
        swaps.close()

    asyncio.run(main())


def test_a_call_cancelled_during_a_swap_at_the_commit_swaps_and_keeps_what_the_engine_holds():
    """A push loaded at its commit (``streamed_apply: off``) whose call goes mid-swap: the swap ends, the
    segment the workers read stays open until it has, and the kept weights are the new version's (a later
    streamed push's rollback loads them: had they stayed at the old version, it would serve those weights
    as the new one)."""
    async def main():
        swaps, replica, engine = replica_serving_version_1(streamed_apply="off")
        staged, chunks = staged_version_2(swaps)
        assert await swaps.stream(staged) is None
        for chunk in chunks:
            staged.push.add_chunk(chunk)
        call = asyncio.ensure_future(swaps.apply(staged))
        await until(engine.loading.is_set, "the swap's load to begin")
        await call_goes(swaps, staged, call)  # the collector SIGKILLed after its commit, mid-swap
        engine.load_ends.set()
        await until(lambda: replica.policy_version == 2 and serves(replica, engine, swaps), "the swap to end")
        assert engine.weight_version == "2" and swaps._kept.kept.manifest.version == 2
        swaps.close()

    asyncio.run(main())
